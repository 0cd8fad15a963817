"""This machine's processes: pinning a process to its cores, and the local trainer process.

Locally TIDE emulates the paper's disaggregation on one machine: serving on `runtime.serve_cores`,
the trainer, a process of its own joined by a socket pair, on `runtime.train_cores`. Under Slurm a
rank only runs as many threads as its task has CPUs; Slurm does the binding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tide.runtime.transport import SocketTransport

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_trainer(config: Path, out: Path, cores: str) -> Iterator[SocketTransport]:
    """A trainer process (`python -m tide.runtime --fd`) on `cores`, joined to this one by a socket
    pair; its log is out/trainer.log. On exit it gets two minutes to finish, then is killed."""
    out.mkdir(parents=True, exist_ok=True)
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "tide.runtime", "--config", str(config), "--out", str(out),
           "--fd", str(theirs.fileno()), "--cores", cores]
    with open(out / "trainer.log", "ab") as trainer_log:
        trainer = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdout=trainer_log, stderr=subprocess.STDOUT)
    theirs.close()
    log.info("trainer process %d (cores %s), log %s", trainer.pid, cores or "any", out / "trainer.log")
    transport = SocketTransport(ours, rank=0, peer=1)
    try:
        yield transport
    finally:
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
        transport.close()


def bind_cores(spec: str, threads: int = 0) -> None:
    """Pin this process (and the threads it starts) to `spec` cores, e.g. '1' or '0,2-3', with one
    OpenMP thread per core; without `spec`, only use `threads` threads (0: torch's default)."""
    import torch

    if not spec:
        if threads > 0:
            torch.set_num_threads(threads)
        return
    cores: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        cores.update(range(int(a), int(b or a) + 1))
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def bind_serving(cores: str, threads: int = 0, tensor_parallel_size: int = 1) -> None:
    """This process serves on `cores` (see `bind_cores`), with vLLM's engine core in-process (uniproc
    executor): with vLLM's default engine-core process next to a worker process, the core busy-waits
    on the worker and takes a second CPU core, the trainer's. In-process, vLLM ignores
    VLLM_CPU_OMP_THREADS_BIND (only its multiprocessing executor applies it), so the process pins
    itself; unpinned, its OpenMP team spreads over every core and a busy trainer core stalls each
    step. Only for a process that serves and nothing else: vLLM's process groups then live in it.
    A tensor-parallel instance's workers are vLLM's processes, on these cores and GPUs."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    own_gpu(tensor_parallel_size)
    bind_cores(cores, threads)


def node_local_id() -> int | None:
    """This rank's number among the ranks of its node (Slurm's, else Open MPI's), None outside both."""
    for var in ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def own_gpu(tensor_parallel_size: int = 1) -> None:
    """A serving rank's GPUs: with `--gpus-per-node` every task of a node sees all of the node's GPUs,
    and the rank with node-local id i keeps GPUs i*tp .. i*tp + tp - 1 (tp: its instance's
    `serve.tensor_parallel_size`); vLLM then numbers them from 0."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    local, tp = node_local_id(), tensor_parallel_size
    if len(visible) > tp and local is not None and (local + 1) * tp <= len(visible):
        mine = visible[local * tp:(local + 1) * tp]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        log.info("serving rank on node-local id %d: GPU %s of %s", local, ",".join(mine), ",".join(visible))
