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
from enum import Enum

from tide.config import CollectConfig
from tide.control.decision import Decision


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
