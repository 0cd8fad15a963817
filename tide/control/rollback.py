"""Deploy gate and rollback: after a hot-swap, check that the live acceptance holds up.

A draft is evaluated offline (simulated chained drafting on held-out captured data) before it is
deployed; a bad load (wrong tensor names, a stale vocabulary map, a corrupt file) shows only live,
where it collapses the acceptance length to about 1.0. After the swap the gate watches the next
`window_steps` drafting steps and either CONFIRMs the draft or ROLLs BACK to the previous one.

The comparison is on the gain over plain decoding, AL - 1 (mean accepted drafts per step), not on
the AL itself: `live - 1 < fraction * (eval - 1)`. On a small target a good draft reaches AL ~1.5,
and `live < 0.6 * 1.5 = 0.9` could never fire even for a dead draft (AL 1.0); on the gain it fires
below 1 + 0.6 * 0.5 = 1.30.
"""

from __future__ import annotations

from enum import Enum

from tide.config import RollbackConfig
from tide.control.decision import Decision
from tide.draft.acceptance import AcceptanceHistogram


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
        self.eval_al = 0.0
        self.live = AcceptanceHistogram(gamma)

    @property
    def watching(self) -> bool:
        return self.version is not None

    def watch(self, version: int, eval_al: float, previous: int | None) -> None:
        """Start watching draft `version` (evaluated at `eval_al`) just swapped in over `previous`."""
        self.version, self.previous, self.eval_al = version, previous, eval_al
        self.live = AcceptanceHistogram(self.gamma)

    def decide(self, new_steps: AcceptanceHistogram) -> Decision[RollbackAction]:
        """Add the drafting steps served since the last call; judge once `window_steps` are in.

        Example (fraction 0.6): eval 2.10 -> bar 1 + 0.6 * 1.10 = 1.66. Live 1.02 over 256 steps:
        ROLLBACK; live 1.90: CONFIRM; 1.02 over 100 steps: WAIT.
        """
        if self.version is None:
            return Decision(RollbackAction.WAIT, "no deployment under watch")
        self.live.merge(new_steps)
        n, need = self.live.steps, self.cfg.window_steps
        if n < need:
            return Decision(RollbackAction.WAIT, f"v{self.version}: {n}/{need} steps since the swap", self.version)
        al, bar = self.live.acceptance_length, 1 + self.cfg.fraction * (self.eval_al - 1)
        figures = (f"live AL {al:.2f} {{}} {bar:.2f} = 1 + {self.cfg.fraction:.2f} x (eval {self.eval_al:.2f} - 1)"
                   f" over {n} steps")
        version, previous = self.version, self.previous
        self.version = self.previous = None  # judged: stop watching
        if al >= bar:
            return Decision(RollbackAction.CONFIRM, figures.format(">="), version)
        back = f"back to v{previous}" if previous is not None else "no earlier draft: speculation off"
        return Decision(RollbackAction.ROLLBACK, f"{figures.format('<')}: v{version} {back}", previous)
