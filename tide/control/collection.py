"""Collection gate (paper Algorithm 1): collect and train after the workload shifts, and keep
training while that pays.

Two EMAs of each request's first-draft acceptance (the share of its drafting steps whose first
draft was accepted: a per-token measure that does not move when the draft length per step does),
started at the mean of the first `n_init` requests:

    short <- short + lambda_short * (a - short)        long <- long + lambda_long * (a - long)

A drop of the short below the long by epsilon means the acceptance fell faster than noise explains:
the workload shifted, start collecting (a regime: every cycle of it trains on all rows stored since
it started). A shift also ends a regime still running (a new one starts at the shift, after the
cycle in flight answers), and the EMAs re-learn their baseline from the next `n_init` requests.
Once `n_threshold` rows are stored: TRAIN. A draft whose held-out AL beats the live
draft's on the same data by more than `min_gain` is deployed and the regime goes on: the next cycle
starts at once (`next_cycle`), from the new draft, on every row stored so far, newer rows included.
A cycle that does not beat the live draft by `min_gain` keeps the live draft. If its draft still
beats the one it started from by `min_rise` (the same held-out requests: more epochs still raise
held-out AL), CHAIN: the next cycle starts at once from that draft, on every row of the regime, so
the trainer works while the draft learns and the epochs add up until one beats the live draft.
Otherwise it is a miss, and HOLD: the live draft stays, and the next cycle trains on all of the
regime's rows as soon as rows the missed cycle did not see are stored (the next chunk, or at once if
one landed while it trained): the trainer never waits while rows it has not trained on wait. A miss
counts towards `patience` only once its cycle saw `n_threshold` rows more than the last counted
miss's (the first miss of a streak always counts): a plateau is `patience` counted misses in a row,
so no gain over `(patience - 1) * n_threshold` more rows, whatever number of cycles the trainer
ran on them. It ends the regime: REJECT, collection stops, and the gate re-learns its baseline from
the next `n_init` requests, so the draft now serving is what a later shift is measured against.

A failed cycle (the trainer died or gave up) keeps the regime collecting and retries after
`n_threshold` more rows, twice as many after each further failure in a row (at most MAX_BACKOFF
times as many): a trainer that fails at once on every cycle does not spin.

A shift also shows when live drafting steps turn speculation off at a first-draft acceptance below
the long EMA by epsilon (`on_speculation_off`): with speculation off, no request moves the EMAs.

States: IDLE -(shift)-> COLLECTING -(n_threshold stored)-> TRAINING -(better, or still rising)-> COLLECTING
-> TRAINING ... -(no gain, patience left)-> COLLECTING -(new rows)-> TRAINING ... -(plateau)-> IDLE.
Collection stays on while TRAINING; `collecting` says whether to capture.
"""

from __future__ import annotations

import math
from enum import Enum

from tide.config import CollectConfig
from tide.control.decision import Decision

MAX_BACKOFF = 16  # after failed cycles in a row, at most this many n_threshold of new rows before a retry


class CollectState(str, Enum):
    IDLE = "idle"
    COLLECTING = "collecting"
    TRAINING = "training"  # TRAIN was emitted; waiting for the result (still collecting)


class CollectAction(str, Enum):
    WAIT = "wait"  # nothing to change
    COLLECT = "collect"  # start capturing hidden states
    TRAIN = "train"  # train a draft on what was collected
    DEPLOY = "deploy"  # swap in the new draft; stop collecting
    CHAIN = "chain"  # keep the live draft; the new one still learns: train on from it at once
    HOLD = "hold"  # keep the live draft; collect more rows, then train again
    REJECT = "reject"  # keep the live draft; stop collecting


class CollectionGate:
    """Algorithm 1 as a state machine fed by three events: a finished request, stored tokens, a
    training result. Feed `on_request` only requests served with speculation (a live AL)."""

    def __init__(self, cfg: CollectConfig) -> None:
        self.cfg = cfg
        self.state = CollectState.IDLE
        self.stored_tokens = 0  # since collection started
        self.trained_tokens = 0  # stored_tokens when the last cycle started: the rows it trained on
        self.misses = 0  # counted misses in a row (cycles without min_gain, n_threshold rows apart)
        self.missed_at = 0  # trained_tokens of the last counted miss
        self.shifted = ""  # a shift seen while a cycle trained: why (a new regime after its answer)
        self.failures = 0  # failed cycles in a row
        self.train_at = 0  # stored_tokens before the next TRAIN after a failure or a HOLD
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
        """Update the EMAs with one request's live acceptance; COLLECT when IDLE and the workload shifted.

        Example (lambdas 0.05 / 0.01, epsilon 0.2): baseline 2.00, then requests at 1.00. After k of
        them short = 1 + 0.95^k, long = 1 + 0.99^k; k = 5: 1.774 vs 1.951, gap 0.177: WAIT;
        k = 6: 1.735 vs 1.942, gap 0.206 > 0.2: COLLECT.
        """
        cfg = self.cfg
        if not math.isfinite(al):  # served without speculation (the store records NaN): no evidence
            return Decision(CollectAction.WAIT, f"request acceptance {al} ignored")
        if self.short is None or self.long is None or self.baseline is None:
            self._first.append(al)
            if len(self._first) < cfg.n_init:
                return Decision(CollectAction.WAIT, f"warming up: {len(self._first)}/{cfg.n_init} requests")
            self.short = self.long = self.baseline = sum(self._first) / len(self._first)
            return Decision(CollectAction.WAIT, f"baseline {self.baseline:.2f} from {cfg.n_init} requests")
        self.short += cfg.lambda_short * (al - self.short)
        self.long += cfg.lambda_long * (al - self.long)
        emas = f"short {self.short:.2f}, long {self.long:.2f}, baseline {self.baseline:.2f}"
        if self.short < self.long - cfg.epsilon:
            why = f"short EMA {self.short:.2f} < long {self.long:.2f} - {cfg.epsilon:g}: workload shifted"
        elif cfg.drift_epsilon and self.long < self.baseline - cfg.drift_epsilon:
            why = f"long EMA {self.long:.2f} < baseline {self.baseline:.2f} - {cfg.drift_epsilon:g}: slow drift"
        else:
            return Decision(CollectAction.WAIT, f"{self.state.value}, stable ({emas})")
        return self._shifted(why)

    def on_speculation_off(self, first: float) -> Decision[CollectAction]:
        """Live drafting steps turned speculation off at first-draft acceptance `first` (over the
        speculation gate's `min_steps`, so within ~0.03). Below the long EMA by epsilon, that is a
        shift the EMAs would catch only after a dozen or more requests drafted at the new level, and
        with speculation off no request drafts.

        Example (epsilon 0.1): long 0.27, speculation off at 0.04: a shift; off at 0.22: WAIT (the
        draft no longer pays at this batch size, but the workload is the one it was learning)."""
        if self.long is None:
            return Decision(CollectAction.WAIT, f"speculation off at first-draft acceptance {first:.2f}: no "
                                                "baseline yet")
        if first >= self.long - self.cfg.epsilon:
            return Decision(CollectAction.WAIT, f"speculation off at first-draft acceptance {first:.2f} >= long "
                                                f"EMA {self.long:.2f} - {self.cfg.epsilon:g}: no shift")
        return self._shifted(f"speculation off at live first-draft acceptance {first:.2f} < long EMA "
                             f"{self.long:.2f} - {self.cfg.epsilon:g}: workload shifted")

    def _shifted(self, why: str) -> Decision[CollectAction]:
        self._rebaseline()  # the new level is learnt from the next n_init requests
        if self.state is CollectState.TRAINING:  # the cycle in flight answers first (`on_trained`)
            self.shifted = why
            return Decision(CollectAction.WAIT, f"{why} while a cycle trains: a new regime starts when it answers")
        return self._start(why)

    def _start(self, why: str) -> Decision[CollectAction]:
        """A regime from now: the rows stored from here on, none from before (a shift during a
        regime starts a new one, so its cycles learn the new workload only)."""
        self.state, self.stored_tokens, self.trained_tokens, self.misses, self.shifted = \
            CollectState.COLLECTING, 0, 0, 0, ""
        self.train_at = self.backoff() if self.failures else 0
        return Decision(CollectAction.COLLECT, why)

    def backoff(self) -> int:
        """Rows to collect before retrying after `failures` failed cycles in a row."""
        return self.cfg.n_threshold * min(2 ** max(self.failures - 1, 0), MAX_BACKOFF)

    def collect_now(self, why: str) -> Decision[CollectAction]:
        """COLLECT without a detected shift, e.g. at start-up with an untrained draft: its AL ~1.0 is
        flat, so no shift will ever show, and speculation will be off, so no AL will even be fed."""
        if self.state is not CollectState.IDLE:
            return Decision(CollectAction.WAIT, f"already {self.state.value} ({why})")
        return self._start(why)

    def restart(self, why: str) -> Decision[CollectAction]:
        """COLLECT anew from any state (policy always: every deploy starts the next collection)."""
        return self._start(why)

    def on_stored(self, tokens: int) -> Decision[CollectAction]:
        """Count tokens written to the store; TRAIN once when `n_threshold` are stored since COLLECT
        (after a HOLD: once any the last cycle did not see are; `on_stored(0)` checks without new ones)."""
        if self.state is CollectState.IDLE:
            return Decision(CollectAction.WAIT, f"{tokens} tokens stored while idle: not counted")
        self.stored_tokens += tokens
        need = max(self.cfg.n_threshold, self.train_at)
        progress = f"{self.stored_tokens}/{need} tokens stored since collection started"
        if self.state is CollectState.TRAINING or self.stored_tokens < need:
            return Decision(CollectAction.WAIT, f"{self.state.value}: {progress}")
        return self._train(progress)

    def _train(self, why: str) -> Decision[CollectAction]:
        self.state, self.trained_tokens = CollectState.TRAINING, self.stored_tokens
        return Decision(CollectAction.TRAIN, why)

    def on_trained(self, version: int, new_al: float, live_al: float,
                   base_al: float | None = None) -> Decision[CollectAction]:
        """DEPLOY draft `version` if its eval AL beats the live draft's on the same data by more than
        `min_gain` (the regime goes on: `next_cycle`); else CHAIN if it beats `base_al`, the draft the
        cycle started from (default: the live one), by more than `min_rise`; else a miss: HOLD while
        patience lasts, then REJECT: a plateau, collection stops and the baseline is re-learnt. A
        result nobody waits for is ignored.

        Example (min_gain 0.02, min_rise 0.005, patience 1): live 1.40; v1 1.41 from 1.40: CHAIN; v2
        1.418 from v1's 1.41: CHAIN; v3 1.43 > 1.40 + 0.02: DEPLOY; v4 1.43 from 1.43: REJECT.
        """
        if self.state is not CollectState.TRAINING:
            return Decision(CollectAction.WAIT, f"result for v{version} ignored: {self.state.value}, not training",
                            version)
        self.failures, self.train_at = 0, 0
        figures = f"eval AL {new_al:.2f} {{}} live draft {live_al:.2f} + {self.cfg.min_gain:g} on the same data"
        if new_al > live_al + self.cfg.min_gain:
            self.state, self.misses = CollectState.COLLECTING, 0
            return Decision(CollectAction.DEPLOY, figures.format(">") + ": deploy, train on", version)
        if self.shifted:  # keep the live draft; the regime of the new workload starts now
            return self._start(figures.format("<=") + f"; {self.shifted} during the cycle")
        base_al = live_al if base_al is None else base_al
        if new_al > base_al + self.cfg.min_rise:
            self.state = CollectState.COLLECTING
            return Decision(CollectAction.CHAIN, figures.format("<=") + f", but {new_al:.3f} > {base_al:.3f} + "
                            f"{self.cfg.min_rise:g} from its start: still learning, train on from v{version}", version)
        if self.misses == 0 or self.trained_tokens - self.missed_at >= self.cfg.n_threshold:
            self.misses, self.missed_at = self.misses + 1, self.trained_tokens  # a counted miss
        if self.misses < self.cfg.patience:
            self.state, self.train_at = CollectState.COLLECTING, self.trained_tokens + 1
            left = self.missed_at + self.cfg.n_threshold - self.trained_tokens
            return Decision(CollectAction.HOLD, figures.format("<=") + f" ({self.misses} of {self.cfg.patience} in a "
                            f"row; the next counts after {left} more rows): keep the live draft, train again on "
                            "the next rows", version)
        self.state, self.stored_tokens, self.misses = CollectState.IDLE, 0, 0
        self._rebaseline()
        return Decision(CollectAction.REJECT, figures.format("<=") + ": a plateau; keep the live draft, stop "
                                                                     "collecting", version)

    def next_cycle(self) -> Decision[CollectAction]:
        """After a DEPLOY or a CHAIN: TRAIN again at once, from the newest draft, on every row of the
        regime (more epochs on them, and whatever arrived since), until a cycle no longer gains."""
        if self.state is not CollectState.COLLECTING:
            return Decision(CollectAction.WAIT, f"no regime to train on: {self.state.value}")
        if self.shifted:  # the deployed draft learnt the old workload: collect the new one first
            return self._start(f"{self.shifted} during the cycle")
        return self._train(f"the last cycle gained: train again on the regime's {self.stored_tokens} rows and "
                           "whatever arrived since")

    def on_training_failed(self, why: str) -> Decision[CollectAction]:
        """The trainer died or gave up: keep collecting; TRAIN again after `backoff()` more rows."""
        if self.state is not CollectState.TRAINING:
            return Decision(CollectAction.WAIT, f"training failure ignored ({why}): {self.state.value}")
        self.state, self.failures = CollectState.COLLECTING, self.failures + 1
        self.train_at = self.stored_tokens + self.backoff()
        return Decision(CollectAction.WAIT, f"training failed ({why}; {self.failures} in a row): still collecting, "
                                            f"will retry after {self.backoff()} more rows")
