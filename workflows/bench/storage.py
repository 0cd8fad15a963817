"""`storage`: bytes per stored token and the store's peak size under retention vs keeping all."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tide.store import ChunkMeta, ChunkWriter, Run


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.h5"))


def storage(work: Path, data: Path, quick: bool = False, hidden_size: int = 576) -> dict[str, Any]:
    """Write a long synthetic capture (SmolLM2 shape: H = 576, 3 layers) through the real writer,
    once with a retention window and once keeping everything; sample the store size per chunk."""
    rng = np.random.default_rng(0)
    meta = ChunkMeta("bench", "0" * 16, hidden_size, (2, 15, 27))
    total_tokens = 100_000 if quick else 1_000_000
    retention = total_tokens // 24  # the paper's 24x
    req_len = 400
    sizes: dict[str, list[int]] = {}
    for mode, keep in (("retention", retention), ("keep_all", None)):
        root = work / mode
        shutil.rmtree(root, ignore_errors=True)
        peak = []
        with ChunkWriter(root, meta, chunk_tokens=4096, max_pending_chunks=1 << 20, retention_tokens=keep,
                         on_chunk=lambda p, n, root=root, peak=peak: peak.append(_dir_bytes(root))) as w:
            for i in range(total_tokens // req_len):
                hid = rng.integers(0, 1 << 16, size=(req_len, meta.row_dim), dtype=np.uint16)
                w.add(Run(f"r{i}", np.arange(req_len, dtype=np.int32), np.arange(req_len, dtype=np.int32), hid,
                          np.arange(req_len) >= 100, "bench", 1.5, 1))
            w.flush()
            stats = w.stats()
        sizes[mode] = peak
        if mode == "keep_all":
            written_bytes, written_tokens = stats["bytes"], stats["tokens"]
    per_row_meta = 4 + 4 + 1  # token int32, position int32, is_output uint8
    expected = 2 * meta.row_dim + per_row_meta
    bpt = written_bytes / written_tokens
    return {
        "hidden_size": hidden_size, "tokens_written": written_tokens,
        "bytes_per_token": bpt, "expected_bytes_per_token": expected,
        "bytes_per_token_vs_expected": bpt / expected,
        "retention_tokens": retention, "peak_store_bytes_retention": max(sizes["retention"]),
        "peak_store_bytes_keep_all": max(sizes["keep_all"]),
        "keep_all_over_retention": max(sizes["keep_all"]) / max(sizes["retention"]),
    }
