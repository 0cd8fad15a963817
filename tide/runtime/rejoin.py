"""A training component that comes back: a trainer step started again inside the same Slurm job.

One MPI_COMM_WORLD spans the job's first step, and a rank that died cannot rejoin it. So the serving
rank also listens on a TCP port, written with a key to the run dir (`join.json`, readable by the
job's user only), and a training component started again (`python -m tide.runtime --rejoin`, a new
srun step the step guard launches) connects there. Its leader relays the coordinator's messages to
the other ranks of its own step over that step's MPI world. The first frame on a connection must be
a `Join` with the key; anything else closes it.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from tide.runtime.messages import Join, Message
from tide.runtime.transport import MPITransport, SocketTransport

log = logging.getLogger(__name__)
JOIN_FILE = "join.json"  # in the run dir: host, port and key of the coordinator's listener
HELLO_S = 10.0  # a connection that sends no Join within this is closed


def _hosts() -> list[str]:
    """Names a trainer on another node can reach this one by: the host name first, then its address."""
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        return [name, socket.gethostbyname(name)]
    return [name]


class JoinableTransport:
    """Rank 0's transport: MPI for the job's first step, and the connection of a returned training
    component once one has joined. Its leader stands for every trainer rank: messages to the
    first trainer rank go to it, those to the others are dropped (the leader relays)."""

    def __init__(self, mpi: MPITransport, trainer_ranks: list[int], run_dir: Path) -> None:
        self.mpi, self.trainer_ranks, self.rank = mpi, list(trainer_ranks), mpi.rank
        self.joined: SocketTransport | None = None
        self._early: list[tuple[int, Message]] = []
        self._key = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._server = socket.create_server(("", 0))
        self._server.settimeout(0.5)
        port = self._server.getsockname()[1]
        self._path = path = Path(run_dir) / JOIN_FILE
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"hosts": _hosts(), "port": port, "key": self._key}, f)
        os.replace(path.with_suffix(".tmp"), path)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tide-join", daemon=True)
        self._thread.start()
        log.info("coordinator: a returning training component can join on port %d (%s)", port, path)

    def _accept(self) -> None:
        while not self._halt.is_set():
            try:
                conn, addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setblocking(True)
            peer = SocketTransport(conn, rank=self.rank, peer=self.trainer_ranks[0])
            hello, deadline = [], time.monotonic() + HELLO_S
            while not hello and not peer.closed and time.monotonic() < deadline:
                hello = peer.poll(timeout=deadline - time.monotonic())
            if not (hello and isinstance(hello[0][1], Join) and hmac.compare_digest(hello[0][1].key, self._key)):
                log.warning("coordinator: a connection from %s sent no valid Join: closed", addr[0])
                peer.close()
                continue
            log.warning("coordinator: a training component joined from %s", addr[0])
            with self._lock:
                if self.joined is not None:
                    self.joined.close()
                self.joined, self._early = peer, hello[1:]  # what came with the Join

    def send(self, dest: int, msg: Message) -> None:
        joined = self.joined
        if joined is None or dest not in self.trainer_ranks:
            self.mpi.send(dest, msg)
        elif dest == self.trainer_ranks[0]:
            joined.send(dest, msg)

    def poll(self) -> list[tuple[int, Message]]:
        out = self.mpi.poll()
        with self._lock:
            joined, early, self._early = self.joined, self._early, []
        if joined is not None:
            out += early + joined.poll()
            if joined.closed:
                log.warning("coordinator: the joined training component's connection closed")
                with self._lock:
                    if self.joined is joined:
                        self.joined = None
        return out

    def close(self) -> None:
        self._halt.set()
        self._server.close()
        self._path.unlink(missing_ok=True)
        self._thread.join(timeout=2)
        if self.joined is not None:
            self.joined.close()
        self.mpi.close()


class RelayTransport:
    """The returned component's leader: the coordinator over the joined connection, and every message
    from it passed on to the other ranks of the leader's own step (their coordinator is rank 0)."""

    def __init__(self, coordinator: SocketTransport, group: MPITransport) -> None:
        self.coordinator, self.group, self.rank = coordinator, group, group.rank

    @property
    def closed(self) -> bool:
        return self.coordinator.closed

    def send(self, dest: int, msg: Message) -> None:
        self.coordinator.send(self.coordinator.peer, msg)

    def poll(self) -> list[tuple[int, Message]]:
        got = self.coordinator.poll()
        for _, msg in got:
            for r in range(1, self.group.size):
                self.group.send(r, msg)
        return [(0, msg) for _, msg in got]

    def close(self) -> None:
        self.coordinator.close()
        self.group.close()


def join(run_dir: Path, timeout_s: float = 120.0) -> SocketTransport:
    """Connect to the coordinator of the run in `run_dir` and say Join; OSError after `timeout_s`."""
    deadline, err = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            info = json.loads((Path(run_dir) / JOIN_FILE).read_text())
            for host in info["hosts"]:
                with contextlib.suppress(OSError):
                    sock = socket.create_connection((host, info["port"]), timeout=10)
                    sock.settimeout(None)
                    t = SocketTransport(sock, rank=1, peer=0)
                    t.send(0, Join(info["key"]))
                    return t
            err = f"no answer from {info['hosts']} port {info['port']}"
        except (OSError, ValueError, KeyError) as e:
            err = str(e)
        time.sleep(2)
    raise OSError(f"{Path(run_dir) / JOIN_FILE}: cannot join the coordinator: {err}")
