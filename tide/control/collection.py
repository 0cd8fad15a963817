"""Collection gate (paper Algorithm 1): collect and train only after the workload has shifted.

Two EMAs of per-request acceptance length, started at the mean of the first `n_init` requests:

    short <- short + lambda_short * (al - short)        long <- long + lambda_long * (al - long)

A drop of the short below the long by epsilon means the acceptance fell faster than noise explains:
the workload shifted, start collecting. Once `n_threshold` tokens are stored: TRAIN (once). The new
draft is deployed only if its eval AL beats what the live draft achieved on the same data; either
way the gate goes IDLE and re-learns its baseline from the next `n_init` requests, so the level of
the draft now serving (new or kept) is what a later shift is measured against.

States: IDLE -(shift)-> COLLECTING -(n_threshold stored)-> TRAINING -(result)-> IDLE.
Collection stays on while TRAINING (more data for a retry); `collecting` says whether to capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from tide.control.decision import Decision, check


@dataclass(frozen=True)
class CollectConfig:
    """Algorithm 1's constants (the paper gives none; these are ours, chosen by simulation).

    Per-request AL is noisy: requests of one domain differ by sigma ~0.2-0.4 AL. On a stable stream
    the gap long - short has std ~0.12 * sigma for lambdas 0.05 / 0.01, and epsilon 0.2 gave no false
    shift in 40 x 10,000 Gaussian requests at sigma 0.3 (1 in 40 runs at sigma 0.4). The constants
    first suggested (0.3 / 0.02 / 0.1: gap std ~0.39 * sigma, epsilon ~1 std) saw a false shift
    within ~30 requests of every run at sigma 0.2. The price is detection delay, which is small next
    to the ~100+ requests that collection takes: a drop of Delta is caught after k requests with
    Delta * (0.99^k - 0.95^k) > 0.2: k = 12 for 0.6 AL (calibration: GSM8K -> code, 1.75 -> 1.11),
    ~20 for 0.4. A linear drift of r AL per request opens a steady gap of r * (1/lambda_long -
    1/lambda_short) = 80 r, so drifts faster than 0.0025 AL/request trip the EMAs; slower ones trip
    `drift_epsilon`: the long EMA fell that far below the baseline (0 disables; > epsilon because the
    baseline is one draw, the mean of n_init requests). `n_init` 32: a baseline with std sigma/5.7.
    `n_threshold` 32768 stored tokens (16 chunks of 2048): the calibration's code draft went from AL
    1.00 to 1.45 on 16k output tokens, and prompt rows are stored too. `min_gain`: deploy when the new
    eval AL > live AL + min_gain; both come from the same held-out data, so any gain is real on it.
    """

    lambda_short: float = 0.05
    lambda_long: float = 0.01
    epsilon: float = 0.2  # AL units
    drift_epsilon: float = 0.25  # AL units; 0 = only the two-EMA test
    n_init: int = 32  # requests
    n_threshold: int = 32_768  # stored tokens (rows) since collection started
    min_gain: float = 0.0  # AL units

    def __post_init__(self) -> None:
        check(0 < self.lambda_long < self.lambda_short <= 1, "CollectConfig", "lambda_short/lambda_long",
              (self.lambda_short, self.lambda_long), "0 < lambda_long < lambda_short <= 1")
        check(self.epsilon > 0, "CollectConfig", "epsilon", self.epsilon, "> 0 (AL units)")
        check(self.drift_epsilon >= 0, "CollectConfig", "drift_epsilon", self.drift_epsilon, ">= 0 (0 disables)")
        check(self.n_init >= 1, "CollectConfig", "n_init", self.n_init, ">= 1 request")
        check(self.n_threshold >= 1, "CollectConfig", "n_threshold", self.n_threshold, ">= 1 token")
        check(self.min_gain >= 0, "CollectConfig", "min_gain", self.min_gain, ">= 0 (AL units)")


class CollectState(str, Enum):
    IDLE = "idle"
    COLLECTING = "collecting"
    TRAINING = "training"  # TRAIN was emitted; waiting for the result (still collecting)


class CollectAction(str, Enum):
    WAIT = "wait"  # nothing to change
    COLLECT = "collect"  # start capturing hidden states
    TRAIN = "train"  # train a draft on what was collected
    DEPLOY = "deploy"  # swap in the new draft; stop collecting
    REJECT = "reject"  # keep the live draft; stop collecting


class CollectionGate:
    """Algorithm 1 as a state machine fed by three events: a finished request, stored tokens, a
    training result. Feed `on_request` only requests served with speculation (a live AL)."""

    def __init__(self, cfg: CollectConfig) -> None:
        self.cfg = cfg
        self.state = CollectState.IDLE
        self.stored_tokens = 0  # since collection started
        self._rebaseline()

    @property
    def collecting(self) -> bool:
        return self.state is not CollectState.IDLE

    @property
    def warming_up(self) -> bool:
        return self.short is None

    def _rebaseline(self) -> None:
        self.short: float | None = None
        self.long: float | None = None
        self.baseline: float | None = None
        self._first: list[float] = []

    def on_request(self, al: float) -> Decision[CollectAction]:
        """Update the EMAs with one request's live AL; COLLECT when IDLE and the workload shifted.

        Example (lambdas 0.05 / 0.01, epsilon 0.2): baseline 2.00, then requests at 1.00. After k of
        them short = 1 + 0.95^k, long = 1 + 0.99^k; k = 5: 1.774 vs 1.951, gap 0.177: WAIT;
        k = 6: 1.735 vs 1.942, gap 0.206 > 0.2: COLLECT.
        """
        cfg = self.cfg
        if not math.isfinite(al):  # served without speculation (the store records NaN): no evidence
            return Decision(CollectAction.WAIT, f"request AL {al} ignored")
        if self.short is None or self.long is None or self.baseline is None:
            self._first.append(al)
            if len(self._first) < cfg.n_init:
                return Decision(CollectAction.WAIT, f"warming up: {len(self._first)}/{cfg.n_init} requests")
            self.short = self.long = self.baseline = sum(self._first) / len(self._first)
            return Decision(CollectAction.WAIT, f"baseline AL {self.baseline:.2f} from {cfg.n_init} requests")
        self.short += cfg.lambda_short * (al - self.short)
        self.long += cfg.lambda_long * (al - self.long)
        emas = f"short {self.short:.2f}, long {self.long:.2f}, baseline {self.baseline:.2f}"
        if self.state is not CollectState.IDLE:
            return Decision(CollectAction.WAIT, f"{self.state.value} ({emas})")
        if self.short < self.long - cfg.epsilon:
            why = f"short EMA {self.short:.2f} < long {self.long:.2f} - {cfg.epsilon:g}: workload shifted"
        elif cfg.drift_epsilon and self.long < self.baseline - cfg.drift_epsilon:
            why = f"long EMA {self.long:.2f} < baseline {self.baseline:.2f} - {cfg.drift_epsilon:g}: slow drift"
        else:
            return Decision(CollectAction.WAIT, f"stable ({emas})")
        self.state, self.stored_tokens = CollectState.COLLECTING, 0
        return Decision(CollectAction.COLLECT, why)

    def collect_now(self, why: str) -> Decision[CollectAction]:
        """COLLECT without a detected shift, e.g. at start-up with an untrained draft: its AL ~1.0 is
        flat, so no shift will ever show, and speculation will be off, so no AL will even be fed."""
        if self.state is not CollectState.IDLE:
            return Decision(CollectAction.WAIT, f"already {self.state.value} ({why})")
        self.state, self.stored_tokens = CollectState.COLLECTING, 0
        return Decision(CollectAction.COLLECT, why)

    def on_stored(self, tokens: int) -> Decision[CollectAction]:
        """Count tokens written to the store; TRAIN once when `n_threshold` are stored since COLLECT."""
        if self.state is CollectState.IDLE:
            return Decision(CollectAction.WAIT, f"{tokens} tokens stored while idle: not counted")
        self.stored_tokens += tokens
        progress = f"{self.stored_tokens}/{self.cfg.n_threshold} tokens stored since collection started"
        if self.state is CollectState.TRAINING or self.stored_tokens < self.cfg.n_threshold:
            return Decision(CollectAction.WAIT, f"{self.state.value}: {progress}")
        self.state = CollectState.TRAINING
        return Decision(CollectAction.TRAIN, progress)

    def on_trained(self, version: int, new_al: float, live_al: float) -> Decision[CollectAction]:
        """DEPLOY draft `version` if its eval AL beats the live draft's AL on the same data, else
        REJECT; both stop collection and re-learn the baseline. A result nobody waits for is ignored."""
        if self.state is not CollectState.TRAINING:
            return Decision(CollectAction.WAIT, f"result for v{version} ignored: {self.state.value}, not training",
                            version)
        self.state, self.stored_tokens = CollectState.IDLE, 0
        self._rebaseline()
        figures = f"eval AL {new_al:.2f} {{}} live draft {live_al:.2f} on the same data (+{self.cfg.min_gain:g})"
        if new_al > live_al + self.cfg.min_gain:
            return Decision(CollectAction.DEPLOY, figures.format(">"), version)
        return Decision(CollectAction.REJECT, figures.format("<=") + ": keep the live draft, stop collecting", version)

    def on_training_failed(self, why: str) -> Decision[CollectAction]:
        """The trainer died or gave up: keep collecting; the next stored chunk asks for TRAIN again."""
        if self.state is not CollectState.TRAINING:
            return Decision(CollectAction.WAIT, f"training failure ignored ({why}): {self.state.value}")
        self.state = CollectState.COLLECTING
        return Decision(CollectAction.WAIT, f"training failed ({why}): still collecting, will retry")
