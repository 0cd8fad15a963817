"""Where a run keeps its files (one dir, shared by every role): the store, drafts, logs, results."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from tide.config import StoreConfig, TideConfig
from tide.model.target import Target

log = logging.getLogger(__name__)
MIN_FREE_CHUNKS = 2  # start-up refuses a store without room for this many chunks
# what a serving run writes to its dir (rank 0's, or an instance's instances/<rank>/), kept on a restart
RESULT_FILES = ("summary.json", "events.json", "windows.jsonl", "requests.jsonl", "acceptance.png", "endpoint.json")


@dataclass(frozen=True)
class RunLayout:
    out: Path
    target: Target
    store: Path
    drafts: Path

    @classmethod
    def open(cls, cfg: TideConfig, out: Path, fetch: bool = True) -> RunLayout:
        """Resolve the target model (fetching a registered asset if needed) and the run's dirs, and
        check the store (see `check_store`)."""
        from tide.model.assets import resolve_model

        out = Path(out)
        target = Target.open(resolve_model(cfg.model.target) if fetch else Path(cfg.model.target),
                             cfg.model.aux_layer_ids)
        store = Path(cfg.store.path)
        run = cls(out, target, store if store.is_absolute() else out / store, out / "drafts")
        run.check_store(cfg.store)
        return run

    def check_store(self, cfg: StoreConfig) -> None:
        """A ValueError naming store.path when the store cannot be created or written, or has no room
        for MIN_FREE_CHUNKS chunks: a clear error at start-up rather than every chunk lost later. A
        retention window larger than the free space only warns: capture pauses when the disk fills."""
        probe = self.store / f".tide-write-test-{socket.gethostname()}-{os.getpid()}"
        try:
            self.store.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"tide")
            probe.unlink()
            free = shutil.disk_usage(self.store).free
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            raise ValueError(f"store.path: cannot write to {self.store}: {e.strerror or e}; "
                             "give a writable directory on the shared filesystem") from None
        row = self.target.chunk_meta().row_bytes
        need = MIN_FREE_CHUNKS * cfg.chunk_tokens * row
        if free < need:
            raise ValueError(f"store.path: {self.store} has {free / 2**20:.1f} MiB free; {MIN_FREE_CHUNKS} chunks "
                             f"of {cfg.chunk_tokens} tokens need {need / 2**20:.1f} MiB: free some space or move "
                             "the store")
        if free < cfg.retention_tokens * row:
            log.warning("store.path: %s has %.2f GiB free, the retention window of %d tokens needs %.2f GiB: "
                        "capture will pause whenever the disk is full", self.store, free / 2**30,
                        cfg.retention_tokens, cfg.retention_tokens * row / 2**30)


def keep_previous_results(out: Path) -> Path | None:
    """A run started again on its dir (a restart, a requeued Slurm job) writes its results where the
    last one wrote its own: those move to `out`/previous/<k>/ first (k = 1, 2, ...), and the store and
    drafts stay where they are, to resume from. Each serving instance keeps its own dir's. The dir
    they went to, or None."""
    found = [out / name for name in RESULT_FILES if (out / name).exists()]
    if not found:
        return None
    earlier = [int(p.name) for p in (out / "previous").glob("*") if p.name.isdigit()]
    dest = out / "previous" / str(max(earlier, default=0) + 1)
    dest.mkdir(parents=True)
    for path in found:
        path.rename(dest / path.name)
    log.info("the last run's results (%s) moved to %s", ", ".join(p.name for p in found), dest)
    return dest
