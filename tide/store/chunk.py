"""One HDF5 chunk file of captured hidden states: the schema, its writer and its verifying reader.

A chunk holds whole token runs of many requests. Per row: the input token, its position, the
EAGLE-3 hidden state of `len(layer_ids)` target layers ([len(layer_ids)*H] bf16, stored as the
uint16 bit pattern because HDF5 has no bfloat16) and whether it is a prompt or an output row.
Per run: request id, workload tag, live acceptance and the draft version that served it.

Files are write-once: written to `NAME.h5.tmp`, fsynced, then renamed to `NAME.h5`, so a reader
never sees half a file. A crc32 over the rows and each run's metadata catches silent corruption; any problem is a
`ChunkError` naming the file and the field.
"""

from __future__ import annotations

import contextlib
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import h5py
import numpy as np
import torch

from tide.model.target import ChunkMeta

FORMAT_VERSION = 2  # 2: the checksum covers each run's metadata too
READABLE_VERSIONS = (1, 2)
SUFFIX = ".h5"
_HIDDEN_CHUNK_BYTES = 1 << 20  # HDF5 storage chunk of the hidden dataset: about 1 MiB of rows
_STR = h5py.string_dtype("utf-8")


class ChunkError(ValueError):
    """A chunk file that cannot be used; `reason` is one of
    missing, corrupt, format, foreign, shape, checksum."""

    def __init__(self, path: Path | str, field: str, what: str, reason: str = "corrupt"):
        super().__init__(f"{path}: {field}: {what}")
        self.path, self.field, self.reason = Path(path), field, reason


@dataclass
class Run:
    """One request's contiguous token rows inside a chunk (n rows)."""

    request_id: str
    tokens: np.ndarray  # int32 [n]: input token of each row
    positions: np.ndarray  # int32 [n]
    hidden: np.ndarray  # uint16 [n, D]: bf16 bit pattern
    is_output: np.ndarray  # bool [n]: False for prompt rows, True for output rows
    workload: str = ""
    acceptance: float = float("nan")  # the request's live acceptance length when captured
    draft_version: int = -1  # draft that served it (-1: none / speculation off)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, start: int, stop: int) -> Run:
        """Rows [start, stop) as a new run of the same request (views, no copy)."""
        s = slice(start, stop)
        return Run(self.request_id, self.tokens[s], self.positions[s], self.hidden[s],
                   self.is_output[s], self.workload, self.acceptance, self.draft_version)


def bf16_to_u16(t: torch.Tensor) -> np.ndarray:
    """The bf16 bit pattern of `t` as uint16 (exact for bf16 input; other dtypes round once)."""
    return t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def u16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """Inverse of `bf16_to_u16`: a bf16 tensor with exactly these bits."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def chunk_name(seq: int) -> str:
    """A file name that sorts by creation time (and is unique across writer processes)."""
    return f"chunk-{time.time_ns():019d}-{os.getpid()}-{seq:06d}{SUFFIX}"


def chunk_time_ns(path: Path) -> int:
    """When `chunk_name` named this file (0 for a name it did not make)."""
    stamp = path.name.split("-")[1] if path.name.count("-") >= 3 else ""
    return int(stamp) if stamp.isdigit() else 0


def check_run(run: Run, meta: ChunkMeta) -> None:
    """Raise ValueError naming the field if `run` does not fit `meta` (shapes and dtypes only)."""
    n = len(run)
    want = {"tokens": ((n,), np.int32), "positions": ((n,), np.int32),
            "hidden": ((n, meta.row_dim), np.uint16), "is_output": ((n,), np.bool_)}
    for name, (shape, dtype) in want.items():
        a = getattr(run, name)
        if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype:
            got = (a.shape, a.dtype) if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"run {run.request_id!r}: {name}: expected {np.dtype(dtype)} {list(shape)}, "
                             f"got {got}")


def _crc(runs: list[Run], version: int = FORMAT_VERSION) -> int:
    """crc32 over tokens, positions, hidden, is_output (little-endian bytes, in that order), then, from
    format 2 on, each run's length, request id, workload, acceptance and draft version."""
    crc = 0
    for name, dtype in (("tokens", "<i4"), ("positions", "<i4"), ("hidden", "<u2"), ("is_output", "u1")):
        for r in runs:
            crc = zlib.crc32(np.ascontiguousarray(getattr(r, name), dtype=dtype).data, crc)
    if version >= 2:
        for r in runs:
            crc = zlib.crc32(f"{len(r)}\0{r.request_id}\0{r.workload}\0".encode(), crc)
            crc = zlib.crc32(np.array([r.acceptance], "<f4").tobytes() + np.array([r.draft_version], "<i4").tobytes(),
                             crc)
    return crc


def write_chunk(path: Path, meta: ChunkMeta, runs: list[Run]) -> int:
    """Atomically write `runs` to `path` (via `NAME.h5.tmp`, fsync, rename); returns bytes written.

    HDF5 builds the file in memory and plain file I/O writes it out: a full disk or a lost mount is
    then an OSError with its errno. (h5py 3.16 writing straight to a filesystem that fills up
    raises a RuntimeError without errno and then crashes the process in a destructor.)"""
    path = Path(path)
    for r in runs:
        check_run(r, meta)
    offsets = np.cumsum([0] + [len(r) for r in runs], dtype=np.int64)
    n, d = int(offsets[-1]), meta.row_dim
    if n == 0:
        raise ValueError(f"{path}: runs: a chunk needs at least one row")
    with h5py.File(path.name, "w", driver="core", backing_store=False) as f:
        f.create_dataset("tokens", data=np.concatenate([r.tokens for r in runs]).astype("<i4"))
        f.create_dataset("positions", data=np.concatenate([r.positions for r in runs]).astype("<i4"))
        f.create_dataset("is_output", data=np.concatenate([r.is_output for r in runs]).astype("u1"))
        rows = max(1, min(n, _HIDDEN_CHUNK_BYTES // (2 * d)))
        hidden = f.create_dataset("hidden", shape=(n, d), dtype="<u2", chunks=(rows, d))
        for r, lo in zip(runs, offsets):  # row slices: no [N, D] concatenation in memory
            if len(r):
                hidden[lo : lo + len(r)] = r.hidden
        f.create_dataset("run_offsets", data=offsets)
        f.create_dataset("run_request_id", data=[r.request_id for r in runs], dtype=_STR)
        f.create_dataset("run_workload", data=[r.workload for r in runs], dtype=_STR)
        f.create_dataset("run_acceptance", data=np.array([r.acceptance for r in runs], "<f4"))
        f.create_dataset("run_draft_version", data=np.array([r.draft_version for r in runs], "<i4"))
        f.attrs.update(format_version=FORMAT_VERSION, target_id=meta.target_id,
                       target_hash=meta.target_hash, hidden_size=meta.hidden_size,
                       layer_ids=np.array(meta.layer_ids, np.int64), num_tokens=n,
                       checksum=np.uint32(_crc(runs)))
        f.flush()
        image = f.id.get_file_image()
    tmp = path.with_name(path.name + ".tmp")  # NAME.h5.tmp: readers list only *.h5
    try:
        with open(tmp, "wb") as fh:
            fh.write(image)
            fh.flush()
            os.fsync(fh.fileno())  # the data must be on disk before the name that promises it is
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return len(image)


def _fsync_dir(d: Path) -> None:
    """Make the rename durable; best effort (some filesystems refuse fsync on a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _header(f: h5py.File, path: Path) -> tuple[ChunkMeta, int]:
    a = f.attrs
    for key in ("format_version", "target_id", "target_hash", "hidden_size", "layer_ids", "num_tokens",
                "checksum"):
        if key not in a:
            raise ChunkError(path, key, "attribute missing", "format")
    if int(a["format_version"]) not in READABLE_VERSIONS:
        raise ChunkError(path, "format_version", f"is {a['format_version']}, this reader knows "
                         f"{', '.join(map(str, READABLE_VERSIONS))}", "format")
    meta = ChunkMeta(str(a["target_id"]), str(a["target_hash"]), int(a["hidden_size"]),
                     tuple(int(i) for i in np.atleast_1d(a["layer_ids"])))
    return meta, int(a["num_tokens"])


def _check_meta(path: Path, meta: ChunkMeta, expect: ChunkMeta | None) -> None:
    if expect is None:
        return
    for fl in fields(ChunkMeta):
        got, want = getattr(meta, fl.name), getattr(expect, fl.name)
        if got != want:
            raise ChunkError(path, fl.name, f"chunk has {got!r}, expected {want!r} (foreign)", "foreign")


@contextlib.contextmanager
def _open(path: Path) -> Iterator[h5py.File]:
    """Open for reading; every h5py/HDF5 failure becomes a ChunkError naming the file.
    No file locking: chunks are write-once, and shared filesystems often lack flock."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            yield f
    except ChunkError:
        raise
    except FileNotFoundError as e:
        raise ChunkError(path, "file", f"gone ({e})", "missing") from e
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:  # truncated, garbage
        # (HDF5 raises RuntimeError for a damaged B-tree), a missing dataset, a name that a flipped bit turned
        # into a group or a named datatype (no .shape: found by tests/test_fuzz.py)
        raise ChunkError(path, "file", f"unreadable HDF5 ({type(e).__name__}: {e})") from e


def read_header(path: Path, expect: ChunkMeta | None = None) -> tuple[ChunkMeta, int]:
    """(meta, num_tokens) from the file attributes only: cheap, for listing and indexing."""
    path = Path(path)
    with _open(path) as f:
        meta, n = _header(f, path)
    _check_meta(path, meta, expect)
    return meta, n


def read_chunk(path: Path, expect: ChunkMeta | None = None) -> list[Run]:
    """Read and verify one chunk (format, meta if `expect` is given, shapes, checksum)."""
    path = Path(path)
    with _open(path) as f:
        meta, n = _header(f, path)
        _check_meta(path, meta, expect)
        want = {"tokens": (n,), "positions": (n,), "is_output": (n,), "hidden": (n, meta.row_dim)}
        for name, shape in want.items():
            if name not in f or f[name].shape != shape:
                got = f[name].shape if name in f else "missing"
                raise ChunkError(path, name, f"shape {got}, expected {shape}", "shape")
        if f["hidden"].dtype != np.uint16:
            raise ChunkError(path, "hidden", f"dtype {f['hidden'].dtype}, expected uint16", "shape")
        tokens = f["tokens"][()].astype(np.int32, copy=False)
        positions = f["positions"][()].astype(np.int32, copy=False)
        hidden = f["hidden"][()]  # [N, D] uint16
        is_output = f["is_output"][()].astype(bool)
        offsets = f["run_offsets"][()].astype(np.int64)  # [R+1]
        ids = list(f["run_request_id"].asstr()[()])
        workloads = list(f["run_workload"].asstr()[()])
        acc = f["run_acceptance"][()].astype(float)
        ver = f["run_draft_version"][()].astype(int)
        stored, version = int(f.attrs["checksum"]), int(f.attrs["format_version"])
    r = len(offsets) - 1
    if r < 1 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 0):
        raise ChunkError(path, "run_offsets", f"not a partition of {n} rows: {offsets[:8]}", "shape")
    if not len(ids) == len(workloads) == len(acc) == len(ver) == r:
        raise ChunkError(path, "run_*", f"per-run datasets disagree with {r} runs", "shape")
    runs = [Run(ids[i], tokens[lo:hi], positions[lo:hi], hidden[lo:hi], is_output[lo:hi],
                workloads[i], float(acc[i]), int(ver[i]))
            for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:]))]
    if any(not -(2**31) <= r.draft_version < 2**31 for r in runs):  # a flipped bit (tests/test_fuzz.py)
        raise ChunkError(path, "run_draft_version", "a value outside int32's range")
    if (crc := _crc(runs, version)) != stored:
        raise ChunkError(path, "checksum", f"crc32 of the rows is {crc:#010x}, the file says {stored:#010x}",
                         "checksum")
    return runs
