"""Acceptance bookkeeping shared by evaluation and serving: one histogram, everything derived from it.

`counts[k]` = number of drafting steps in which exactly k of gamma draft tokens were accepted.
Example (gamma 3): counts [2, 1, 0, 1] -> 4 steps, accepted 0+1+0+3 = 4 drafts, so the mean
acceptance length (tokens emitted per target step) is 1 + 4/4 = 2.0; position rates
P(accepted > j) are [2/4, 1/4, 1/4].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class AcceptanceHistogram:
    gamma: int
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (self.gamma + 1)
        assert len(self.counts) == self.gamma + 1

    def add(self, accepted: int, n: int = 1) -> None:
        self.counts[accepted] += n

    def merge(self, other: AcceptanceHistogram) -> None:
        assert other.gamma == self.gamma
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]

    @property
    def steps(self) -> int:
        return sum(self.counts)

    @property
    def accepted(self) -> int:
        return sum(k * c for k, c in enumerate(self.counts))

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per target step (1 + mean accepted drafts); 1.0 with no steps."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    def position_rates(self) -> list[float]:
        """P(at least j+1 drafts accepted) for j < gamma; index 0 is the first-token acceptance."""
        n = self.steps or 1
        return [sum(self.counts[j + 1 :]) / n for j in range(self.gamma)]

    def to_json(self) -> dict:
        return {"gamma": self.gamma, "counts": list(self.counts), "acceptance_length": self.acceptance_length,
                "position_rates": self.position_rates()}


@dataclass
class PositionRates:
    """Per-position acceptance when the draft length varies from step to step.

    A step that drafts k tokens and has a accepted tried positions 1..min(a + 1, k) and accepted
    positions 1..a; the conditional rate of position j is accepted[j] / tried[j] (the chance that
    draft j is right given drafts 1..j-1 were). Example: steps (k=1, a=1), (k=3, a=0), (k=3, a=3):
    tried [3, 1, 1], accepted [2, 1, 1] -> rates [0.67, 1.0, 1.0]. The expected tokens of a step
    that drafts k is 1 + sum over i <= k of the product of the first i rates (`expected_length`).
    """

    gamma: int
    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tried = self.tried or [0] * self.gamma
        self.accepted = self.accepted or [0] * self.gamma
        assert len(self.tried) == len(self.accepted) == self.gamma

    def add(self, k: int, a: int, n: int = 1) -> None:
        for j in range(min(a + 1, k)):
            self.tried[j] += n
        for j in range(min(a, k)):
            self.accepted[j] += n

    def merge(self, other: PositionRates) -> None:
        assert other.gamma == self.gamma
        self.tried = [x + y for x, y in zip(self.tried, other.tried)]
        self.accepted = [x + y for x, y in zip(self.accepted, other.accepted)]

    @classmethod
    def from_histogram(cls, h: AcceptanceHistogram) -> PositionRates:
        """The rates of steps that all drafted h.gamma tokens (an evaluation's walk)."""
        r = cls(h.gamma)
        for a, n in enumerate(h.counts):
            r.add(h.gamma, a, n)
        return r

    @property
    def steps(self) -> int:
        """Drafting steps behind the rates (every one tried position 1)."""
        return self.tried[0]

    def rates(self, shift: float = 0.0) -> list[float]:
        """Conditional rates, each moved by `shift` standard errors (a bound, for decisions that must
        hold under noise) and kept in [0, 1]. An untried position gets the rate before it (a draft
        rarely does better further out); the error uses at least one pseudo-observation."""
        out, prev = [], 1.0
        for t, a in zip(self.tried, self.accepted):
            r = a / t if t else prev
            se = ((max(r * (1 - r), 0.25 / max(t, 1)) / max(t, 1)) ** 0.5) if t else 0.0
            out.append(min(1.0, max(0.0, r + shift * se)))
            prev = r
        return out

    def expected_length(self, k: int, shift: float = 0.0) -> float:
        """Tokens per step when drafting k: 1 + sum_i prod_{j <= i} rate_j."""
        total, run = 1.0, 1.0
        for r in self.rates(shift)[:k]:
            run *= r
            total += run
        return total

    def to_json(self) -> dict:
        return {"tried": list(self.tried), "accepted": list(self.accepted), "rates": self.rates()}


@dataclass
class RecentRates:
    """The drafting steps of the most recent windows, whole windows, the oldest dropped while the rest
    still hold `keep_steps`: the speculation gate's live evidence. One window is too few to decide on
    (a 2 s window at batch 4 drafts ~80 times, under speculation.min_steps), all of them too many to
    follow a shift."""

    gamma: int
    keep_steps: int
    windows: deque[PositionRates] = field(default_factory=deque)

    def add(self, rates: PositionRates) -> None:
        self.windows.append(rates)
        while len(self.windows) > 1 and self.steps - self.windows[0].steps >= self.keep_steps:
            self.windows.popleft()

    def clear(self) -> None:
        self.windows.clear()

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.windows)

    def merged(self) -> PositionRates:
        out = PositionRates(self.gamma)
        for r in self.windows:
            out.merge(r)
        return out
