"""Where a run keeps its files (one dir, shared by every role): the store, drafts, logs, results."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tide.config import TideConfig
from tide.target import Target


@dataclass(frozen=True)
class RunLayout:
    out: Path
    target: Target
    store: Path
    drafts: Path

    @classmethod
    def open(cls, cfg: TideConfig, out: Path, fetch: bool = True) -> "RunLayout":
        """Resolve the target model (fetching a registered asset if needed) and the run's dirs."""
        from tide.assets import resolve_model

        out = Path(out)
        target = Target.open(resolve_model(cfg.model.target) if fetch else Path(cfg.model.target),
                             cfg.model.aux_layer_ids)
        store = Path(cfg.store.path)
        return cls(out, target, store if store.is_absolute() else out / store, out / "drafts")
