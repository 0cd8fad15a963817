"""Reads the newest chunks of a store: a token window, verified, split by request into train/eval.

A bad chunk (truncated, corrupt, foreign target, wrong checksum) is skipped with one warning and
counted, never a crash: the trainer keeps training on what is good.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Literal

from tide.store.chunk import SUFFIX, ChunkError, ChunkMeta, Run, chunk_time_ns, read_chunk, read_header

log = logging.getLogger(__name__)


def is_eval(request_id: str, eval_fraction: float) -> bool:
    """Deterministic held-out test by request id, stable across processes and restarts.

    Every piece of a request (even one split across chunks) lands on the same side, and so does every
    serving of one prompt (`ID~k`, a workload served again): a held-out prompt is never trained on.
    E.g. eval_fraction 0.1: eval iff crc32(id) % 10000 < 1000.
    """
    return zlib.crc32(request_id.partition("~")[0].encode()) % 10000 < eval_fraction * 10000


class ChunkReader:
    """Lists and loads the chunks under `root`; with `expect`, chunks of another target are skipped.

    `skipped` maps a reason (missing, corrupt, format, foreign, shape, checksum) to the number of
    files skipped by the last `list_chunks`/`load`/`total_tokens` call.
    """

    def __init__(self, root: Path, expect: ChunkMeta | None = None):
        self.root, self.expect = Path(root), expect
        self.skipped: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()  # (file, reason): warn once per reader

    def _skip(self, e: ChunkError) -> None:
        self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
        if (key := (e.path.name, e.reason)) not in self._warned:
            self._warned.add(key)
            log.warning("skipping chunk (%s): %s", e.reason, e)

    def _window(self, window_tokens: int | None, since_ns: int = 0) -> list[tuple[Path, int]]:
        """(path, num_tokens) newest first, until the window's token total is reached or the chunks
        are older than `since_ns`."""
        out, total = [], 0
        for path in sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.name, reverse=True):
            if chunk_time_ns(path) < since_ns:  # by name only (a stray file must not end the listing)
                continue
            try:
                n = read_header(path, self.expect)[1]
            except ChunkError as e:
                self._skip(e)
                continue
            out.append((path, n))
            total += n
            if window_tokens is not None and total >= window_tokens:
                break
        return out

    def list_chunks(self, window_tokens: int | None = None, since_ns: int = 0) -> list[Path]:
        """Chunk files newest first (by name), only complete `*.h5`, covering `window_tokens` tokens
        (the oldest listed chunk may overshoot; None: all) and written from `since_ns` on. Checks
        attributes, not checksums."""
        self.skipped = {}
        return [p for p, _ in self._window(window_tokens, since_ns)]

    def total_tokens(self) -> int:
        """Tokens in all readable chunks of the expected target (from the attributes)."""
        self.skipped = {}
        return sum(n for _, n in self._window(None))

    def load(self, window_tokens: int | None = None, split: Literal["all", "train", "eval"] = "all",
             eval_fraction: float = 0.1, since_ns: int = 0) -> list[Run]:
        """Verified runs of the window (see `list_chunks`), newest chunk first (row order kept inside a chunk).

        A request split across chunks comes back as several runs with the same id (ordered by
        position within each); `split` keeps them all on one side (see `is_eval`).
        """
        if split not in ("all", "train", "eval"):
            raise ValueError(f"load: split must be 'all', 'train' or 'eval', got {split!r}")
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"load: eval_fraction must be in [0, 1], got {eval_fraction}")
        self.skipped = {}
        runs: list[Run] = []
        for path, _ in self._window(window_tokens, since_ns):
            try:
                got = read_chunk(path, self.expect)
            except ChunkError as e:
                self._skip(e)
                continue
            runs += got if split == "all" else [r for r in got
                                                if is_eval(r.request_id, eval_fraction) == (split == "eval")]
        return runs
