"""Background chunk writer: the serving hot path hands runs over and never waits for the disk.

`add` appends to an in-memory buffer; every `chunk_tokens` rows become one batch on a queue that a
single thread writes out. When `max_pending_chunks` chunks are already waiting or being
written, a new run that would complete another chunk is dropped whole and counted: memory stays
bounded (about `chunk_tokens * (max_pending_chunks + 1)` rows) and serving never stalls on storage.
Disk errors are logged once per kind and counted, never raised into the caller. When the store
cannot take more (disk full, quota, read-only, permission), capture pauses for `pause_s`: runs are
dropped and counted instead of being buffered into chunks that would fail too; then it tries again.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tide.store.chunk import (
    SUFFIX,
    ChunkError,
    ChunkMeta,
    Run,
    check_run,
    chunk_name,
    chunk_time_ns,
    read_header,
    write_chunk,
)

log = logging.getLogger(__name__)
FULL = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}  # errnos that pause capture


class ChunkWriter:
    """Writes runs of one target (`meta`) into chunk files under `root`, keeping a token window.

    The writer keeps references to the arrays of each added run until they are written: pass arrays
    that the caller will not modify afterwards (copy out of reused capture buffers).
    """

    def __init__(self, root: Path, meta: ChunkMeta, chunk_tokens: int = 2048, max_pending_chunks: int = 4,
                 retention_tokens: int | None = None,
                 on_chunk: Callable[[Path, int], None] | None = None, pause_s: float = 30.0):
        if chunk_tokens < 1 or max_pending_chunks < 1:
            raise ValueError(f"ChunkWriter: chunk_tokens ({chunk_tokens}) and max_pending_chunks "
                             f"({max_pending_chunks}) must be >= 1")
        if retention_tokens is not None and retention_tokens < 1:
            raise ValueError(f"ChunkWriter: retention_tokens must be >= 1 or None, got {retention_tokens}")
        self.root, self.meta = Path(root), meta
        self.chunk_tokens, self.max_pending_chunks = chunk_tokens, max_pending_chunks
        self.retention_tokens, self.on_chunk, self.pause_s = retention_tokens, on_chunk, pause_s
        self.root.mkdir(parents=True, exist_ok=True)
        self._buf: list[Run] = []  # runs (or pieces) of the partial chunk, _buf_rows < chunk_tokens rows
        self._buf_rows = 0
        self._seq = 0
        self._pending = 0  # chunks handed over and not yet written (the bound; the queue is unbounded)
        self._lock = threading.Lock()  # guards buffer, _pending, stats; never held across disk I/O
        self._queue: queue.Queue[list[Run] | None] = queue.Queue()
        self._closed = False
        self._logged: set[str] = set()
        self._paused_until = 0.0  # time.monotonic() before which runs are dropped (store full)
        self._stats = dict(files=0, tokens=0, bytes=0, dropped_tokens=0, errors=0, deleted_files=0, pauses=0)
        self._index: dict[str, int] = {}  # file name -> num_tokens of the chunks in root
        self._mine: dict[str, int] = {}  # the same for this writer's own chunks still on disk (under the lock)
        self._refresh_index()
        self._thread = threading.Thread(target=self._loop, name="tide-chunk-writer", daemon=True)
        self._thread.start()

    # ---- hot path -------------------------------------------------------------------------------
    def add(self, run: Run) -> bool:
        """Buffer `run` (split across chunks if needed); False if it was dropped because the
        queue is full, capture is paused or the writer is closed. Never blocks on disk."""
        check_run(run, self.meta)
        n = len(run)
        with self._lock:
            handoffs = (self._buf_rows + n) // self.chunk_tokens  # full chunks this run completes
            if (self._closed or self._pending + handoffs > self.max_pending_chunks
                    or time.monotonic() < self._paused_until):
                self._stats["dropped_tokens"] += n
                return False
            start = 0
            while start < n:
                take = min(n - start, self.chunk_tokens - self._buf_rows)
                self._buf.append(run.rows(start, start + take) if take < n else run)
                self._buf_rows += take
                start += take
                if self._buf_rows == self.chunk_tokens:
                    self._handoff()
            return True

    def _handoff(self) -> None:
        """Move the buffer onto the queue (caller holds the lock; never blocks)."""
        self._queue.put_nowait(self._buf)
        self._pending += 1
        self._buf, self._buf_rows = [], 0

    # ---- control --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand over the partial chunk (even past the bound) and wait until everything queued is
        written (blocks; not for the hot path)."""
        with self._lock:
            if self._buf:
                self._handoff()
        self._queue.join()

    def close(self) -> None:
        """Flush and stop the thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokens_since(self, since_ns: int) -> int:
        """Rows in this writer's chunks on disk that were named at or after `since_ns` (time.time_ns()):
        exactly what a reader with the same `since_ns` finds of them (`chunk_time_ns`)."""
        with self._lock:
            return sum(n for name, n in self._mine.items() if chunk_time_ns(Path(name)) >= since_ns)

    def stats(self) -> dict[str, int]:
        """Counters since start: files/tokens/bytes written, dropped_tokens, errors, deleted_files,
        pauses (of capture, on a full or unwritable store)."""
        with self._lock:
            return dict(self._stats)

    # ---- writer thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while (runs := self._queue.get()) is not None:
            try:
                self._write(runs)
            except Exception as e:  # e.g. the root vanished: keep the thread (and serving) alive
                self._count_error(type(e).__name__, f"chunk writer: {e!r}")
            finally:
                with self._lock:
                    self._pending -= 1
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, runs: list[Run]) -> None:
        self._seq += 1
        path = self.root / chunk_name(self._seq)
        n = sum(len(r) for r in runs)
        try:
            size = write_chunk(path, self.meta, runs)
        except Exception as e:  # ENOSPC, EACCES, EIO, ...: serving goes on, the chunk is lost
            kind = errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) else type(e).__name__
            self._count_error(kind, f"chunk writer: cannot write {path} ({n} tokens lost): {e}")
            if isinstance(e, OSError) and e.errno in FULL:
                with self._lock:
                    self._paused_until = time.monotonic() + self.pause_s
                    self._stats["pauses"] += 1
                log.warning("chunk writer: %s: capture paused for %.0f s; serving goes on", kind, self.pause_s)
            return
        with self._lock:
            resumed, self._paused_until = self._paused_until > 0, 0.0
            self._stats["files"] += 1
            self._stats["tokens"] += n
            self._stats["bytes"] += size
            self._mine[path.name] = n
        if resumed:
            log.warning("chunk writer: capture resumed (%s written)", path.name)
        self._index[path.name] = n
        if self.on_chunk is not None:
            try:
                self.on_chunk(path, n)
            except Exception as e:
                self._count_error("on_chunk", f"chunk writer: on_chunk({path}) failed: {e!r}")
        self._apply_retention()

    def _count_error(self, kind: str, message: str) -> None:
        """Count every error, log each kind once (a full disk would otherwise flood the log)."""
        with self._lock:
            self._stats["errors"] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("%s [further %s errors are counted, not logged]", message, kind)

    def _refresh_index(self) -> None:
        """Sync the name -> tokens index with the directory; only new files are opened, so chunks
        written before start (or by another writer) count towards retention too."""
        names = {p.name for p in self.root.glob(f"*{SUFFIX}")}
        for name in set(self._index) - names:
            del self._index[name]
        for name in sorted(names - set(self._index)):
            try:
                self._index[name] = read_header(self.root / name)[1]
            except ChunkError as e:
                if e.reason != "missing":
                    log.warning("chunk writer: %s (not counted for retention)", e)
                    self._index[name] = 0  # never retried; deleted once outside the window

    def _apply_retention(self) -> None:
        """Keep the newest chunks whose token total is <= retention_tokens (at least the newest)."""
        if self.retention_tokens is None:
            return
        self._refresh_index()
        total, names = 0, sorted(self._index, reverse=True)  # names sort by creation time
        for i, name in enumerate(names):
            total += self._index[name]
            if i > 0 and total > self.retention_tokens:
                for old in names[i:]:
                    self._delete(old)
                return

    def _delete(self, name: str) -> None:
        try:
            (self.root / name).unlink(missing_ok=True)
        except OSError as e:
            kind = errno.errorcode.get(e.errno or 0, "OSError")
            self._count_error(f"delete-{kind}", f"chunk writer: cannot delete {self.root / name}: {e}")
            return
        self._index.pop(name, None)
        with self._lock:
            self._mine.pop(name, None)
            self._stats["deleted_files"] += 1
