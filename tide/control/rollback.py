"""Deploy gate and rollback: after a hot-swap, check that the live acceptance holds up.

A draft is evaluated offline (simulated chained drafting on held-out captured data) before it is
deployed; a bad load (wrong tensor names, a stale vocabulary map, a corrupt file) shows only live,
where it collapses acceptance to about 0. After the swap the gate watches the next `window_steps`
drafting steps and either CONFIRMs the draft or ROLLs BACK to the previous one.

It compares the first draft position's acceptance, live against held-out: `live < fraction *
held_out`, and against the draft it replaced, live just before the swap on the same traffic: `live
< previous_live - previous_margin`. That rate is what a dead draft loses first, and it does not
depend on how many tokens the speculation gate lets each step draft (a mean acceptance length
would drop when k does).
"""

from __future__ import annotations

from enum import Enum

from tide.config import RollbackConfig
from tide.control.decision import Decision
from tide.draft.acceptance import PositionRates


class RollbackAction(str, Enum):
    WAIT = "wait"  # not enough evidence yet, or nothing under watch
    CONFIRM = "confirm"  # the new draft holds up: stop watching
    ROLLBACK = "rollback"  # go back to the previous draft (version None: no earlier draft, speculation off)


class RollbackGate:
    """Watches one deployment at a time: `watch` after the swap, then `decide` on each new window."""

    def __init__(self, cfg: RollbackConfig, gamma: int) -> None:
        self.cfg, self.gamma = cfg, gamma
        self.version: int | None = None
        self.previous: int | None = None
        self.held_out = 0.0
        self.previous_live: float | None = None
        self.live = PositionRates(gamma)

    @property
    def watching(self) -> bool:
        return self.version is not None

    def watch(self, version: int, held_out: float, previous: int | None, previous_live: float | None = None) -> None:
        """Start watching draft `version` (first-draft acceptance `held_out` on its held-out walk), just
        swapped in over `previous` (live first-draft acceptance `previous_live`, None if unknown)."""
        self.version, self.previous, self.held_out, self.previous_live = version, previous, held_out, previous_live
        self.live = PositionRates(self.gamma)

    def decide(self, new_steps: PositionRates) -> Decision[RollbackAction]:
        """Add the drafting steps served since the last call; judge once `window_steps` are in.

        Example (fraction 0.6): held-out 0.55 -> bar 0.33. Live 0.02 over 256 steps: ROLLBACK;
        live 0.45: CONFIRM; 0.02 over 100 steps: WAIT.
        """
        if self.version is None:
            return Decision(RollbackAction.WAIT, "no deployment under watch")
        self.live.merge(new_steps)
        n, need = self.live.steps, self.cfg.window_steps
        if n < need:
            return Decision(RollbackAction.WAIT, f"v{self.version}: {n}/{need} steps since the swap", self.version)
        live, bar = self.live.rates()[0], self.cfg.fraction * self.held_out
        why = f"{self.cfg.fraction:.2f} x held-out {self.held_out:.2f}"
        if self.previous_live is not None and self.previous_live - self.cfg.previous_margin > bar:
            bar = self.previous_live - self.cfg.previous_margin
            why = f"v{self.previous}'s live {self.previous_live:.2f} - {self.cfg.previous_margin:g}"
        figures = f"live first-draft acceptance {live:.2f} {{}} {bar:.2f} = {why} over {n} steps"
        version, previous = self.version, self.previous
        self.version = self.previous = None  # judged: stop watching
        if live >= bar:
            return Decision(RollbackAction.CONFIRM, figures.format(">="), version)
        back = f"back to v{previous}" if previous is not None else "no earlier draft: speculation off"
        return Decision(RollbackAction.ROLLBACK, f"{figures.format('<')}: v{version} {back}", previous)
