"""Speculation gate (paper Eq. 5): speculate at batch size b only where the acceptance pays for the draft.

Plain decoding emits one token per sequence per target pass over b tokens, in T(b). One speculative
step runs gamma draft steps (D0 each) and one target pass over b*(gamma+1) tokens and emits E[l]
tokens per sequence (E[l] = acceptance length, 1 + mean accepted drafts). So

    speedup(E[l], b) = E[l] / (gamma * D0 / T(b) + T(b*(gamma+1)) / T(b))

and speculation breaks even at E[l]* = (gamma * D0 + T(b*(gamma+1))) / T(b) (`min_acceptance`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum

from tide.config import SpeculationConfig, check
from tide.control.decision import Decision
from tide.draft.acceptance import AcceptanceHistogram


@dataclass(frozen=True)
class LatencyProfile:
    """Latencies profiled at start-up (a runtime measurement, not configuration).

    `points`: measured (n_tokens, seconds) of one target forward pass over n tokens, any order;
    `draft_step_s`: D0, one draft step; `gamma`: draft tokens per speculative step.
    T(n) is piecewise-linear through the points, flat below the first point (a pass never gets cheaper
    than the smallest one measured) and the last segment extended above the last (compute-bound, linear).
    """

    points: tuple[tuple[int, float], ...]
    draft_step_s: float
    gamma: int

    def __post_init__(self) -> None:
        pts = tuple(sorted((int(n), float(t)) for n, t in self.points))
        ns = [n for n, _ in pts]
        check(len(pts) > 0, "LatencyProfile", "points", self.points, "at least one (n_tokens, seconds) pair")
        check(len(set(ns)) == len(ns), "LatencyProfile", "points", ns, "measured at distinct token counts")
        check(ns[0] >= 1, "LatencyProfile", "points", ns, "token counts >= 1")
        check(all(t > 0 for _, t in pts), "LatencyProfile", "points", pts, "latencies > 0 seconds")
        check(self.draft_step_s >= 0, "LatencyProfile", "draft_step_s", self.draft_step_s, ">= 0 seconds")
        check(self.gamma >= 1, "LatencyProfile", "gamma", self.gamma, ">= 1 draft token")
        object.__setattr__(self, "points", pts)

    def target_latency(self, n: float) -> float:
        """T(n) in seconds. Example: points ((1, .030), (16, .036)) -> T(8.5) = .033, T(31) = .042."""
        ns = [p[0] for p in self.points]
        i = bisect.bisect_right(ns, n)
        if i == 0:
            return self.points[0][1]
        if i == len(ns):  # above the grid: extend the last segment (never downwards)
            if len(ns) == 1:
                return self.points[0][1]
            (n0, t0), (n1, t1) = self.points[-2], self.points[-1]
            return t1 + max(t1 - t0, 0.0) / (n1 - n0) * (n - n1)
        (n0, t0), (n1, t1) = self.points[i - 1], self.points[i]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)

    def step_cost(self, b: float) -> float:
        """Cost of one speculative step in units of one plain step: gamma*D0/T(b) + T(b(gamma+1))/T(b)."""
        assert b >= 1, b
        t_b = self.target_latency(b)
        return (self.gamma * self.draft_step_s + self.target_latency(b * (self.gamma + 1))) / t_b

    def predicted_speedup(self, al: float, b: float) -> float:
        """Eq. 5. Example: T flat 30 ms, D0 2.5 ms, gamma 3: cost 1 + 7.5/30 = 1.25, AL 1.8 -> 1.44x."""
        return al / self.step_cost(b)

    def min_acceptance(self, b: float) -> float:
        """The AL at which speculation exactly breaks even (speedup 1); above gamma+1 it never pays.

        T flat: 1 + gamma*D0/T. T(n) = 20 ms + n ms, D0 2 ms, gamma 3, b 4: (6 + 36) / 24 = 1.75 —
        verifying 16 tokens costs more than decoding 4, so a linear T raises the bar.
        """
        return self.step_cost(b)

    def to_json(self) -> dict:
        return {"points": [list(p) for p in self.points], "draft_step_s": self.draft_step_s, "gamma": self.gamma}

    @classmethod
    def from_json(cls, d: dict) -> LatencyProfile:
        return cls(tuple((int(n), float(t)) for n, t in d["points"]), float(d["draft_step_s"]), int(d["gamma"]))


class SpecAction(str, Enum):
    ENABLE = "enable"
    DISABLE = "disable"
    STAY = "stay"


@dataclass(frozen=True)
class SpeculationObservation:
    """What the gate sees at one engine step.

    `live`: drafting steps of the recent window while speculating (None or empty while off);
    `estimate`: simulated acceptance of the current (or newly trained) draft on freshly captured data,
    the evidence used while off (`live` stands in if there is no estimate). `batch_size`: mean running
    sequences over the window. `step`, `time_s`: engine step counter and monotonic clock, for dwell.
    A trainer reports only the mean AL of its held-out walk: `estimate_al` carries it (the held-out
    set is thousands of drafting steps, so it counts as enough evidence) and wins over `estimate`.
    """

    step: int
    time_s: float
    batch_size: float
    live: AcceptanceHistogram | None = None
    estimate: AcceptanceHistogram | None = None
    estimate_al: float | None = None


class SpeculationGate:
    """Eq. 5 with hysteresis and dwell. Holds only whether speculation is on and since when."""

    def __init__(self, cfg: SpeculationConfig, profile: LatencyProfile, step: int = 0, time_s: float = 0.0) -> None:
        self.cfg, self.profile = cfg, profile
        self.enabled = cfg.start_enabled
        self._since = (step, time_s)  # the last switch (or construction)

    def decide(self, obs: SpeculationObservation) -> Decision[SpecAction]:
        """ENABLE / DISABLE (and record the switch) or STAY, with the numbers behind it.

        Example (T flat 30 ms, D0 2.5 ms, gamma 3 -> break-even 1.25): while on, a live AL of 1.15
        over 256 steps is below 0.95 x 1.25 = 1.19: DISABLE; while off, an estimate of 1.30 is not
        above 1.10 x 1.25 = 1.375: STAY; an estimate of 1.60 is: ENABLE (once the dwell has passed).
        """
        b = max(obs.batch_size, 1.0)  # an idle engine still has the batch-1 bar
        cfg, need = self.cfg, self.profile.min_acceptance(b)
        if self.enabled:
            hist, src, bar = obs.live, "live", need * (1 - cfg.margin_off)
        else:
            est = obs.estimate if obs.estimate is not None else obs.live
            hist, src, bar = est, "estimated", need * (1 + cfg.margin_on)
        where = f"break-even {need:.2f} at batch {b:.1f}"
        if not self.enabled and obs.estimate_al is not None:
            al, steps, src = obs.estimate_al, cfg.min_steps, "held-out"
        else:
            steps = hist.steps if hist is not None else 0
            al = hist.acceptance_length if hist is not None else 1.0
            if steps < cfg.min_steps and not (steps >= cfg.early_steps and _clear(hist, bar, cfg.z)):
                why = f"{src} AL over {steps} < {cfg.min_steps} steps: not enough evidence ({where})"
                return Decision(SpecAction.STAY, why)
        speedup = f"predicted {self.profile.predicted_speedup(al, b):.2f}x"
        certain_loss = self.enabled and al < need and _clear(hist, need, cfg.z)
        if self.enabled and al >= bar and not certain_loss:
            return Decision(SpecAction.STAY, f"live AL {al:.2f} >= {bar:.2f} (off bar, {where}; {speedup})")
        if not self.enabled and al <= bar:
            return Decision(SpecAction.STAY, f"estimated AL {al:.2f} <= {bar:.2f} (on bar, {where}; {speedup})")
        cmp, sign = ("<", "-") if self.enabled else (">", "+")
        margin = cfg.margin_off if self.enabled else cfg.margin_on
        if self.enabled and al >= bar:  # inside the band, but surely below break-even: a loss, however small
            why = f"live AL {al:.2f} < {where} by more than {cfg.z:g} standard errors over {steps} steps ({speedup})"
        else:
            why = (f"{src} AL {al:.2f} {cmp} {bar:.2f} = (1 {sign} {margin:.2f}) x {where} over {steps} steps "
                   f"({speedup})")
        dwell_steps, dwell_s = obs.step - self._since[0], obs.time_s - self._since[1]
        if dwell_steps < cfg.min_dwell_steps or dwell_s < cfg.min_dwell_s:
            return Decision(SpecAction.STAY, f"{why}, but only {dwell_steps} steps / {dwell_s:.1f} s since the "
                                             f"last switch (dwell {cfg.min_dwell_steps} steps, {cfg.min_dwell_s:g} s)")
        self.enabled, self._since = not self.enabled, (obs.step, obs.time_s)
        return Decision(SpecAction.ENABLE if self.enabled else SpecAction.DISABLE, why)


def _clear(hist: AcceptanceHistogram | None, bar: float, z: float) -> bool:
    """The AL is more than `z` standard errors from `bar`. The per-step variance comes from the
    histogram, at least 1/steps (a pseudo-observation), so that n steps that all accepted the same
    count, e.g. the zero drafts of an untrained head, still leave a bound about 1/n wide."""
    if hist is None or hist.steps < 2:
        return False
    al, n = hist.acceptance_length, hist.steps
    var = sum(c * (1 + k - al) ** 2 for k, c in enumerate(hist.counts)) / (n - 1)
    return abs(al - bar) > z * (max(var, 1 / n) / n) ** 0.5
