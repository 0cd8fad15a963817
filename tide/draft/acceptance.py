"""Acceptance bookkeeping shared by evaluation and serving: one histogram, everything derived from it.

`counts[k]` = number of drafting steps in which exactly k of gamma draft tokens were accepted.
Example (gamma 3): counts [2, 1, 0, 1] -> 4 steps, accepted 0+1+0+3 = 4 drafts, so the mean
acceptance length (tokens emitted per target step) is 1 + 4/4 = 2.0; position rates
P(accepted > j) are [2/4, 1/4, 1/4].
"""

from __future__ import annotations

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
