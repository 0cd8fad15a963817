"""Transports for role messages: MPI between Slurm het-job ranks, a socket between local processes.

Both are non-blocking: `poll()` returns what has arrived, `send()` never waits for the peer and may
be called from several threads (the trainer's heartbeat has its own). What cannot be decoded
(garbage, an unknown kind, another protocol version, a field of another type) is logged, counted
in `dropped` and dropped; a socket frame over `messages.MAX_BYTES` closes the connection.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from typing import Protocol

from tide.runtime.messages import MAX_BYTES, BadMessage, Message, decode, encode

TAG = 7  # MPI tag of TIDE messages
log = logging.getLogger(__name__)


class Transport(Protocol):
    rank: int

    def send(self, dest: int, msg: Message) -> None: ...

    def poll(self) -> list[tuple[int, Message]]: ...

    def close(self) -> None: ...


def _received(out: list[tuple[int, Message]], src: int, data: bytes) -> int:
    """Append the message in `data` to `out`, or log and drop it; 1 when dropped (a transport counts them)."""
    try:
        out.append((src, decode(data)))
        return 0
    except BadMessage as e:
        log.warning("transport: dropped a message from rank %d: %s", src, e)
        return 1


class MPITransport:
    """One MPI_COMM_WORLD over the whole het job; raw bytes with Isend/Iprobe (mpi4py's lowercase
    calls would pickle)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dropped = 0  # messages not understood, logged and dropped
        self._inflight: list[tuple[object, bytes]] = []
        self._lock = threading.Lock()  # guards _inflight; mpi4py initialises MPI_THREAD_MULTIPLE

    def send(self, dest: int, msg: Message) -> None:
        buf = encode(msg)
        with self._lock:
            self._inflight.append((self.comm.Isend([buf, self.MPI.BYTE], dest=dest, tag=TAG), buf))
            self._inflight = [(r, b) for r, b in self._inflight if not r.Test()]  # type: ignore[attr-defined]

    def poll(self) -> list[tuple[int, Message]]:
        out, st = [], self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=TAG, status=st):
            buf = bytearray(st.Get_count(self.MPI.BYTE))
            src = st.Get_source()
            self.comm.Recv([buf, self.MPI.BYTE], source=src, tag=TAG)
            self.dropped += _received(out, src, bytes(buf))
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait up to `timeout_s` for the sends in flight. One to a dead rank never completes (Open MPI
        has no notion of a dead peer): it is given up, its buffer kept until the process exits."""
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            with self._lock:
                self._inflight = [(r, b) for r, b in self._inflight if not r.Test()]  # type: ignore[attr-defined]
            time.sleep(0.01)
        if self._inflight:
            log.warning("transport: %d message(s) not delivered in %.0f s (a rank is gone?)",
                        len(self._inflight), timeout_s)


class SocketTransport:
    """Two local processes over a connected stream socket (e.g. `socket.socketpair()`); frames are
    a 4-byte length and a msgpack message. `rank` is this end's number, the peer is the other."""

    def __init__(self, sock: socket.socket, rank: int, peer: int) -> None:
        self.sock, self.rank, self.peer = sock, rank, peer
        self._buf = b""
        self._lock = threading.Lock()  # one frame at a time on the stream
        self.closed = False
        self.dropped = 0  # messages not understood, logged and dropped

    def send(self, dest: int, msg: Message) -> None:
        assert dest == self.peer, f"socket transport reaches only rank {self.peer}"
        data = encode(msg)
        try:
            with self._lock:
                self.sock.sendall(struct.pack("!I", len(data)) + data)
        except OSError:
            self.closed = True  # the peer is gone; the caller sees it through `closed`

    def poll(self, timeout: float = 0.0) -> list[tuple[int, Message]]:
        while not self.closed and select.select([self.sock], [], [], timeout)[0]:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            timeout = 0.0
        out: list[tuple[int, Message]] = []
        while len(self._buf) >= 4:
            n = struct.unpack("!I", self._buf[:4])[0]
            if n > MAX_BYTES:  # not a frame of ours: the stream cannot be resynchronised
                log.error("transport: a frame of %d bytes from rank %d (limit %d): closing the connection", n,
                          self.peer, MAX_BYTES)
                self.dropped += 1
                self.close()
                break
            if len(self._buf) < 4 + n:
                break
            self.dropped += _received(out, self.peer, self._buf[4 : 4 + n])
            self._buf = self._buf[4 + n :]
        return out

    def close(self) -> None:
        self.sock.close()
        self.closed = True
