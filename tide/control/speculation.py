"""Speculation gate (paper Eq. 5, generalised): how many tokens to draft at each batch size, 0 = off.

Plain decoding emits one token per sequence per target step of b sequences over b tokens, in T(b, b).
Drafting k tokens a step costs C(b, k) = T(b, b (k + 1)) + D(b, k): the target verifies k + 1 tokens per sequence
and the draft runs its passes. It emits E_k tokens per sequence, E_k = 1 + sum_{i <= k} prod_{j <= i}
a_j, where a_j is the acceptance of draft position j given the ones before it were accepted. So

    speedup(b, k) = E_k * T(b, b) / C(b, k)

and the best draft length at batch b is the k in {0..K} that maximises it (k = 0 is plain decoding,
speedup 1). With one k = K and equal rates a this is Eq. 5: E_K / (K D0 / T(b, b) + T(b, b (K+1)) / T(b, b)).
T and D come from a `LatencyModel` that serving refits from its own steps; the rates come from live
drafting steps (`PositionRates`), or, while speculation is off, from the draft's held-out walk.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import Enum

from tide.config import SpeculationConfig, check
from tide.control.decision import Decision
from tide.draft.acceptance import PositionRates


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points: flat below the first, the last segment extended
    above the last (never downwards)."""
    xs = [p[0] for p in points]
    i = bisect.bisect_right(xs, x)
    if i == 0 or len(points) == 1:
        return points[0][1]
    if i == len(points):
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return y1 + max(y1 - y0, 0.0) / (x1 - x0) * (x - x1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class LatencyModel:
    """What a serving step costs, in seconds: `target[(b, n)]`, the step of b sequences over n tokens
    without the draft (forward, sampling, the engine's own work), and `draft[(b, k)]`, drafting k
    tokens for b sequences, both times `scale`. The start-up profile fills the tables (the prior,
    scale 1).

    Serving refits it from its own steps, a window at a time (`observe`), in two parts. `scale` is
    how fast the machine runs now against the tables: every step of a calibrated entry moves it
    (exponential average, `weight` per step), so a trainer that starts beside serving on the same
    cores, or stops, slows or speeds every entry at once, also those not served now (verify steps
    while speculation is off). Each entry's own figure is calibrated by the windows holding its first
    `calibration_steps` serving steps (their running mean at the window's speed, the profile counting
    as `prior_steps` of them); after that it moves by `shape_weight` a step, and a change is the
    machine's. The profile is a weak prior: a few steps at 64 tokens of context, at batch 1 it
    read T(1, 4) / T(1, 1) 0.84-0.95 where serving read 0.90-0.98 with HumanEval's contexts, and at
    0.84 three drafts look free. With the entries learning only as slowly as the machine's speed,
    the scale absorbed that error for hundreds of steps (a useless draft kept on for 574 s). The
    gate's probes (a plain step now and then while speculating, `SpeculationConfig.probe_every`)
    keep T(b, b) measured beside the verify steps.

    T is keyed by batch and tokens, because the shape sets the cost, not the token count: on a CPU a
    batch-1 verify of 3 drafts is not a batch-4 decode (oneDNN picks its kernels by shape, attention
    over one context differs from four). Within a measured batch T is piecewise-linear in n, as measured (a step
    over more tokens can cost less); between two measured batches it is linear in b at the same
    tokens per sequence; outside them the nearest batch's cost of n tokens. D(b, k) is
    piecewise-linear through the measured b at that k, and at a k never measured it scales the
    nearest measured k linearly (the draft runs one pass a token).
    Example: target {(1, 1): .030, (1, 4): .034, (4, 4): .031, (4, 16): .040}, draft {(1, 1): .002}:
    T(2, 2) = .030 + (.031 - .030) / 3 = .0303, drafting 3 at batch 1 costs T(1, 4) + D(1, 3) = .034
    + .006 against T(1, 1) = .030 for a plain step (break-even 1.33).
    """

    target: dict[tuple[int, int], float]
    draft: dict[tuple[int, int], float]
    gamma: int  # the most tokens a step may draft (vLLM's num_speculative_tokens)
    scale: float = 1.0
    weight: float = 0.01  # per step, of `scale`: a few hundred steps of memory
    shape_weight: float = 0.001  # per step, of an entry against the others, once calibrated
    prior_steps: int = 16  # the serving steps a profiled entry counts as
    calibration_steps: int = 64  # an entry's first serving steps: its figure, not the machine's speed
    seen: dict[tuple[str, int, int], int] = field(default_factory=dict, compare=False, repr=False)  # steps, by entry

    def __post_init__(self) -> None:
        check(bool(self.target), "LatencyModel", "target", self.target, "at least one (batch, tokens): seconds")
        check(all(n >= b >= 1 and t > 0 for (b, n), t in self.target.items()), "LatencyModel", "target",
              self.target, "(batch >= 1, tokens >= batch): seconds > 0")
        check(self.gamma >= 1, "LatencyModel", "gamma", self.gamma, ">= 1 draft token")
        check(all(b >= 1 and 1 <= k <= self.gamma and t >= 0 for (b, k), t in self.draft.items()), "LatencyModel",
              "draft", self.draft, "(batch >= 1, 1 <= k <= gamma): seconds >= 0")
        check(self.scale > 0, "LatencyModel", "scale", self.scale, "> 0")
        check(0 < self.shape_weight <= self.weight <= 1, "LatencyModel", "weight", (self.weight, self.shape_weight),
              "0 < shape_weight <= weight <= 1")
        check(self.prior_steps >= 1 and self.calibration_steps >= 0, "LatencyModel", "prior_steps",
              (self.prior_steps, self.calibration_steps), "prior_steps >= 1, calibration_steps >= 0")

    @classmethod
    def flat(cls, points: tuple[tuple[int, float], ...], draft_step_s: float, gamma: int) -> LatencyModel:
        """T by token count alone through (tokens, seconds) `points`, each draft pass `draft_step_s`
        whatever the batch (the textbook model: one batch row, which every batch then reads)."""
        return cls({(1, n): t for n, t in points}, {(1, k): k * draft_step_s for k in range(1, gamma + 1)}, gamma)

    @classmethod
    def profiled(cls, target: dict[str, float], draft: dict[str, float], gamma: int) -> LatencyModel:
        """The prior from a start-up profile's tables ("b,n" and "b,k" keys), each verify step priced at
        least like a plain step of its batch until serving measures it: a profile of a few steps once
        read T(1, 3) 16% below T(1, 1), which made two useless drafts look like a 5% gain."""
        m = cls.from_json({"target": target, "draft": draft, "gamma": gamma})
        for (b, n), t in m.target.items():
            m.target[(b, n)] = max(t, m.target.get((b, b), t))
        return m

    def target_latency(self, b: float, n: float | None = None) -> float:
        """T(b, n): b sequences over n tokens (default b: a plain decode step)."""
        return self.scale * self._target(b, b if n is None else n)

    def draft_latency(self, b: float, k: int) -> float:
        return self.scale * self._draft(b, k)

    def _target(self, b: float, n: float) -> float:
        rows: dict[int, list[tuple[float, float]]] = {}
        for (bb, nn), t in sorted(self.target.items()):
            rows.setdefault(bb, []).append((nn, t))
        batches = sorted(rows)
        i = bisect.bisect_left(batches, b)
        if i < len(batches) and batches[i] == b:
            return _interpolate(rows[batches[i]], n)
        if i == 0 or i == len(batches):  # outside the measured batches: the nearest one's cost of n tokens
            return _interpolate(rows[batches[min(i, len(batches) - 1)]], n)
        b0, b1 = batches[i - 1], batches[i]
        t0, t1 = (_interpolate(rows[bb], n * bb / b) for bb in (b0, b1))  # same tokens per sequence
        return t0 + (t1 - t0) * (b - b0) / (b1 - b0)

    def _draft(self, b: float, k: int) -> float:
        ks = sorted({kk for _, kk in self.draft})
        if k <= 0 or not ks:
            return 0.0
        near = k if k in ks else min(ks, key=lambda kk: (abs(kk - k), -kk))
        return _interpolate(sorted((bb, t) for (bb, kk), t in self.draft.items() if kk == near), b) * k / near

    def step_cost(self, b: float, k: int) -> float:
        """Seconds of one step at batch b drafting k (k = 0: a plain step)."""
        return self.target_latency(b, b * (k + 1)) + self.draft_latency(b, k)

    def break_even(self, b: float, k: int) -> float:
        """The tokens a step must emit per sequence for drafting k to pay at batch b: C(b, k) / T(b, b)."""
        return self.step_cost(b, k) / self.target_latency(b)

    def speedup(self, b: float, k: int, expected_length: float) -> float:
        return expected_length / self.break_even(b, k)

    def observe_target(self, b: int, n: int, seconds: float, steps: int = 1) -> None:
        self.observe([("target", (b, n), seconds, steps)])

    def observe_draft(self, b: int, k: int, seconds: float, steps: int = 1) -> None:
        self.observe([("draft", (b, k), seconds, steps)])

    def observe_costs(self, costs: dict[str, dict[str, list[float]]], most_tokens: int) -> None:
        """A window's steps as `tide.serve.engine.step_costs` sums them: target steps by (b, n) over at
        most `most_tokens` tokens (decode and verify; a prefill is another cost), draft passes by (b, k)."""
        self.observe([(part, cost_key(key), seconds / steps, int(steps))
                      for part in ("target", "draft") for key, (steps, seconds) in costs.get(part, {}).items()
                      if steps and (part == "draft" or cost_key(key)[1] <= most_tokens)])

    def observe(self, window: list[tuple[str, tuple[int, int], float, int]]) -> None:
        """One window's steps: (part "target" or "draft", key, seconds a step, steps). In three moves,
        so that the entries' order does not matter: the scale follows the entries calibrated before the
        window (the machine's speed now); entries still calibrating take the window's steps into their
        running mean at that speed; calibrated entries then move by `shape_weight`. The scale moving
        first matters: with entries taken in turn, a new verify entry calibrated at the speed before the
        window's plain steps moved it, and one calibrated entry's leftover error moved the scale of all
        (the refit read 0.64x where lockstep runs measured 0.72x, and the profile alone 0.75x).

        An entry first seen while serving starts from the model's reading there (its neighbours') and
        calibrates like a profiled one: a single slow first step once set T(3, 3) to 239 ms beside
        T(4, 4) at 90. With nothing to read (no draft entry yet) its first steps are taken as they are."""
        tables = {"target": self.target, "draft": self.draft}
        calibrated = [(part, key, secs, n) for part, key, secs, n in window
                      if self.seen.get((part, *key), 0) >= self.calibration_steps and tables[part].get(key, 0) > 0]
        if calibrated:
            steps = sum(n for *_, n in calibrated)
            speed = sum(secs * n for _, _, secs, n in calibrated) / sum(tables[part][key] * n
                                                                         for part, key, _, n in calibrated)
            self.scale += _share(self.weight, steps) * (speed - self.scale)
        for part, key, secs, n in window:
            table, seen = tables[part], (part, *key)
            if key not in table:
                table[key] = self._target(*key) if part == "target" else self._draft(*key)
            before = self.seen.get(seen, 0)
            self.seen[seen] = before + n
            if table[key] <= 0:
                table[key] = secs / self.scale
            elif before < self.calibration_steps:
                table[key] += n / (self.prior_steps + before + n) * (secs / self.scale - table[key])
            else:
                table[key] += _share(self.shape_weight, n) * (secs / self.scale - table[key])

    def to_json(self) -> dict:
        return {"target": {f"{b},{n}": t for (b, n), t in sorted(self.target.items())},
                "draft": {f"{b},{k}": t for (b, k), t in sorted(self.draft.items())}, "gamma": self.gamma,
                "scale": self.scale}

    @classmethod
    def from_json(cls, d: dict) -> LatencyModel:
        return cls({cost_key(key): float(t) for key, t in d["target"].items()},
                   {cost_key(key): float(t) for key, t in d["draft"].items()}, int(d["gamma"]),
                   float(d.get("scale", 1.0)))


def cost_key(key: str) -> tuple[int, int]:
    """(b, n) of a target entry's "b,n" or (b, k) of a draft entry's "b,k": the keys of the JSON tables
    and of `tide.serve.engine.step_costs`."""
    a, b = key.split(",")
    return int(a), int(b)


def _share(weight: float, steps: int) -> float:
    """The weight of `steps` observations at once in an exponential average of `weight` per step."""
    return 1 - (1 - weight) ** steps


class SpecAction(str, Enum):
    ENABLE = "enable"  # speculation comes on at the current batch size
    DISABLE = "disable"  # ... goes off
    RESIZE = "resize"  # a draft length changed, speculation stays on (or off) at the current batch size
    STAY = "stay"


@dataclass(frozen=True)
class SpeculationObservation:
    """What the gate sees at the end of a window.

    `live`: the drafting steps of the recent windows while speculating (None or empty while off);
    `estimate`: the serving draft's held-out walk (from its training cycle), the evidence while off.
    `batch_size`: mean running sequences over the window. `step`, `time_s`: engine step counter and
    clock, for the dwell.
    """

    step: int
    time_s: float
    batch_size: float
    live: PositionRates | None = None
    estimate: PositionRates | None = None


@dataclass
class SpeculationGate:
    """Holds the draft length of each batch size (`lengths[b]`, 0 = plain) and changes it where the
    predicted speedup says so, with hysteresis, an evidence rule and a dwell (SpeculationConfig)."""

    cfg: SpeculationConfig
    model: LatencyModel
    max_batch: int
    lengths: list[int] = field(default_factory=list)  # index = batch size; [0] unused
    _since: tuple[int, float] = (0, 0.0)  # the last change (or construction)
    _probed_since: int = 0  # the last change of the length at the batch size being served

    def __post_init__(self) -> None:
        if not self.lengths:
            self.lengths = [0] + [self.model.gamma if self.cfg.start_enabled else 0] * self.max_batch

    def length(self, batch: float) -> int:
        return self.lengths[self.batch(batch)]

    def batch(self, mean_batch: float) -> int:
        """The batch size whose draft length a window of this mean batch runs (and decides)."""
        return min(max(round(mean_batch), 1), self.max_batch)

    @property
    def enabled(self) -> bool:
        """Speculating at some batch size."""
        return any(self.lengths[1:])

    def probe_gap(self, step: int) -> int:
        """Engine steps between two probes now (0: no probes): `probe_every` after the length at the
        batch size served changes, twice that once it has stood for twice that, and so on up to
        `probe_max`. A change at another batch size (the refit moves those it has not served) does not
        make the served one's probes frequent again."""
        gap, since = self.cfg.probe_every, step - self._probed_since
        while gap and 2 * gap <= min(since, self.cfg.probe_max):
            gap *= 2
        return gap

    def speedups(self, b: float, rates: PositionRates, shift: float = 0.0) -> list[float]:
        """Predicted speedup at batch b of each draft length 0..K (rates moved by `shift` std errors)."""
        ks = range(1, self.model.gamma + 1)
        return [1.0] + [self.model.speedup(b, k, rates.expected_length(k, shift)) for k in ks]

    def decide(self, obs: SpeculationObservation) -> Decision[SpecAction]:
        """Recompute every batch size's draft length; report what that means at the current one.

        Example (T flat 30 ms, D(1, k) = 2.5 ms a token, K 3, max batch 1): live rates [0.6, 0.5, 0.4]
        over 300 steps give E = 1.6, 1.9, 2.02 for k = 1, 2, 3 and speedups 1.48, 1.63, 1.62: from k 3
        the gate moves down to k 2, the shortest within 3% (switch_margin) of the most paying: RESIZE;
        from k 1 it would move up only for 3% more, as here. Rates [0.05, 0, 0] give 0.97, 0.90, 0.84:
        from k 3, below 1 - margin_off, and plain (1.0) is the best: DISABLE.
        """
        cfg, b_now = self.cfg, self.batch(obs.batch_size)
        on_now = self.lengths[b_now] > 0
        live = obs.live if obs.live is not None and obs.live.steps else None
        rates, src = (live, "live") if on_now or obs.estimate is None else (obs.estimate, "held-out")
        if rates is None:
            return Decision(SpecAction.STAY, "no acceptance to go on yet")
        held_out = src == "held-out"
        enough = held_out or rates.steps >= cfg.min_steps
        early = not enough and rates.steps >= cfg.early_steps
        if not (enough or early):
            return Decision(SpecAction.STAY, f"{src} rates over {rates.steps} < {cfg.min_steps} steps: not enough "
                                             f"evidence")
        new = list(self.lengths)
        for b in range(1, self.max_batch + 1):
            new[b] = self._choose(b, self.lengths[b], rates, enough, held_out)
        point = self.speedups(b_now, rates)
        figures = (f"{src} rates [{', '.join(f'{r:.2f}' for r in rates.rates())}] over {rates.steps} steps, batch "
                   f"{obs.batch_size:.1f}: predicted {', '.join(f'k{k} {s:.2f}x' for k, s in enumerate(point))}; "
                   f"draft length by batch {self._table(new)}")
        if new == self.lengths:
            return Decision(SpecAction.STAY, figures)
        dwell_steps, dwell_s = obs.step - self._since[0], obs.time_s - self._since[1]
        if dwell_steps < cfg.min_dwell_steps or dwell_s < cfg.min_dwell_s:
            return Decision(SpecAction.STAY, f"{figures}, but only {dwell_steps} steps / {dwell_s:.1f} s since the "
                                             f"last change (dwell {cfg.min_dwell_steps} steps, {cfg.min_dwell_s:g} s)")
        was, self.lengths, self._since = self.lengths[b_now], new, (obs.step, obs.time_s)
        if new[b_now] != was:
            self._probed_since = obs.step
        if was == 0 and new[b_now] > 0:
            return Decision(SpecAction.ENABLE, figures)
        if was > 0 and new[b_now] == 0:
            return Decision(SpecAction.DISABLE, figures)
        return Decision(SpecAction.RESIZE, figures)

    def _choose(self, b: int, cur: int, rates: PositionRates, enough: bool, held_out: bool) -> int:
        """The draft length for batch b: the best one where the evidence carries the change.

        With `enough` steps (or a held-out walk) the point estimate decides; from `early_steps` on
        only a clear case does: the change must also hold at rates `z` standard errors against it.
        Off -> on needs 1 + margin_on; on -> off a best below 1 - margin_off, or a loss so clear
        that even rates z errors better cannot pay (a cheap useless draft inside the band); a longer
        length needs switch_margin more than the current one. The best is the shortest length within
        switch_margin of the most paying one, and the gate moves down to it without a margin: a deeper
        position's rate rests on fewer steps and its verify on more tokens (adaptive-k at batch 1
        measured k2 1-4% slower than k1 where the model put k2 0.9% above; held there by a margin, the
        gate served k2).
        """
        cfg = self.cfg
        point = self.speedups(b, rates)
        best = max(range(len(point)), key=lambda k: (point[k], -k))
        if best:
            best = min(k for k in range(1, best + 1) if point[k] * (1 + cfg.switch_margin) >= point[best])
        optimistic = self.speedups(b, rates, +cfg.z) if not held_out else point
        pessimistic = self.speedups(b, rates, -cfg.z) if not held_out else point
        if cur > 0 and max(optimistic[1:]) < 1.0:  # surely a loss at every length
            return 0
        if best == cur:
            return cur
        if cur == 0:
            gain = point[best] > 1 + cfg.margin_on
            return best if gain and (enough or pessimistic[best] > 1 + cfg.margin_on) else 0
        if best == 0:
            loss = point[cur] < 1 - cfg.margin_off
            return 0 if loss and (enough or optimistic[cur] < 1 - cfg.margin_off) else cur
        better = best < cur or point[best] > point[cur] * (1 + cfg.switch_margin)
        return best if better and (enough or pessimistic[best] > optimistic[cur]) else cur

    @staticmethod
    def _table(lengths: list[int]) -> str:
        return " ".join(f"{b}:{k}" for b, k in enumerate(lengths) if b)

