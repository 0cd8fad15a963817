"""The trainer role for real over both transports: a cycle's progress reaches the coordinator's side.

A real `python -m tide.runtime` trainer (DeepSpeed, the tiny target) trains on a small store of
chunks, once joined by a socket pair (`tide.launch`'s local trainer) and once as rank 1 of an
`mpirun -np 2` world whose rank 0 plays the coordinator (the Slurm het job's transport).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster.jobs import ci_config

from tide.config import load_config
from tide.runtime.messages import DraftReady, Heartbeat, Message, Shutdown, Train, TrainFailed, TrainProgress
from tide.store import ChunkWriter, Run, bf16_to_u16
from tide.store.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, run dir) with 40 requests of random rows of the tiny target in the store."""
    tmp = tmp_path_factory.mktemp("runtime")
    config, out = ci_config(tmp / "ci.yaml", train={"max_steps": 30}), tmp / "run"
    run = RunLayout.open(load_config(config), out)
    g = torch.Generator().manual_seed(0)
    vocab = run.target.config["vocab_size"]
    with ChunkWriter(run.store, run.target.chunk_meta(), chunk_tokens=512) as w:
        for i in range(40):
            hidden = bf16_to_u16(torch.randn(64, 3 * run.target.hidden_size, generator=g))
            tokens = torch.randint(3, vocab, (64,), generator=g).numpy().astype(np.int32)
            w.add(Run(f"req-{i}", tokens, np.arange(64, dtype=np.int32), hidden, np.arange(64) >= 16))
    return config, out


def assert_progress_then_result(got: list[Message]) -> None:
    """Every phase of the cycle, in order, with training steps up to the last, then the draft."""
    progress = [m for m in got if isinstance(m, TrainProgress)]
    phases = [p.phase for p in progress]
    assert phases[:2] == ["read", "eval"] and phases[-1] == "publish", phases
    steps = [p.step for p in progress if p.phase == "train"]
    assert steps and steps == sorted(steps) and steps[-1] == 30 and all(p.cycle == 1 for p in progress), steps
    assert isinstance(got[-1], DraftReady) and got[-1].version >= 1, got[-1]


def test_progress_reaches_the_coordinator_over_the_socket(stored_run: tuple[Path, Path]) -> None:
    from tide.runtime.processes import local_trainer

    config, out = stored_run
    got: list[Message] = []
    with local_trainer(config, out, cores="") as transport:
        deadline = time.monotonic() + 300
        while not any(isinstance(m, Heartbeat) for m in got) and time.monotonic() < deadline:
            got += [m for _, m in transport.poll(timeout=0.5)]
        transport.send(1, Train(1, 0, 0, -1, -1, "test"))
        got = []
        while not (got and isinstance(got[-1], (DraftReady, TrainFailed))) and time.monotonic() < deadline:
            got += [m for _, m in transport.poll(timeout=0.5) if not isinstance(m, Heartbeat)]
        transport.send(1, Shutdown("test done"))
    assert_progress_then_result(got)


MPI_COORDINATOR = """
import json, sys, time
from tide.runtime.messages import DraftReady, Heartbeat, Shutdown, Train, TrainFailed
from tide.runtime.transport import MPITransport
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 1:
    from tide.runtime.__main__ import main
    sys.exit(main(sys.argv[1:]))
t, got, deadline = MPITransport(), [], time.monotonic() + 300
while not got and time.monotonic() < deadline:
    got = [m for _, m in t.poll() if isinstance(m, Heartbeat)]
    time.sleep(0.05)
t.send(1, Train(1, 0, 0, -1, -1, "test"))
got = []
while not (got and isinstance(got[-1], (DraftReady, TrainFailed))) and time.monotonic() < deadline:
    got += [m for _, m in t.poll() if not isinstance(m, Heartbeat)]
    time.sleep(0.05)
t.send(1, Shutdown("test done"))
print("GOT " + json.dumps([[type(m).__name__, m.__dict__] for m in got]), flush=True)
t.close()
"""


def test_progress_reaches_the_coordinator_over_mpi(stored_run: tuple[Path, Path]) -> None:
    from tide.runtime import messages

    config, out = stored_run
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c",
                        MPI_COORDINATOR, "--config", str(config), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("GOT ")]
    assert_progress_then_result([getattr(messages, kind)(**d) for kind, d in json.loads(line[4:])])


def test_the_summary_says_whether_training_is_degraded_or_recovered() -> None:
    from tide.runtime.coordinator import Event
    from tide.runtime.serve_role import training_state

    def state(*kinds: str) -> str:
        return training_state([Event(float(i), k, "") for i, k in enumerate(kinds)])

    assert state() == state("train", "trained", "deploy") == "ok"
    assert state("trained", "train-failed") == state("trainer-down") == "degraded"
    assert state("train-failed", "train", "trained") == state("trainer-down", "trainer-up") == "recovered"
    assert state("trainer-down", "trainer-up", "trainer-down") == "degraded"


@pytest.mark.parametrize("visible, local, tp, kept", [
    ("0,1,2,3,4,5,6,7", "3", 1, "3"),  # --gpus-per-node=8, 8 tasks: each rank its own
    ("4,5", "1", 1, "5"),  # the node's GPUs as Slurm numbered them
    ("2", "0", 1, "2"),  # one GPU per task already (--gpus-per-task=1): kept
    ("0,1", "", 1, "0,1"),  # not under Slurm: vLLM's choice
    ("0,1,2,3,4,5,6,7", "2", 2, "4,5"),  # 4 tasks of a tensor-parallel pair each
    ("0,1,2,3,4,5,6,7", "0", 8, "0,1,2,3,4,5,6,7"),  # one instance on the whole node
    ("4,5", "0", 2, "4,5"),  # --gpus-per-task=2: kept
])
def test_a_serving_rank_keeps_the_gpus_of_its_node_local_id(monkeypatch: pytest.MonkeyPatch, visible: str,
                                                             local: str, tp: int, kept: str) -> None:
    """The GPU only stands in here (no GPU on this machine): what is checked is the environment vLLM reads."""
    from tide.runtime.processes import own_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("SLURM_LOCALID", local)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    own_gpu(tp)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == kept


def test_a_stop_signal_delivered_twice_is_one_stop_and_a_later_one_acts_as_usual(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Slurm one stop arrives twice (slurmstepd signals the step's processes, the step guard the
    rank's process group): the echo must not kill the run before it writes its results (a requeued
    job's first summary was lost so in CI). A second stop later acts as usual (SIGINT here: a
    KeyboardInterrupt, where SIGTERM would end the test process). Each signal goes to the main thread,
    which handles it before `pthread_kill` returns: sent to the process, it may land on another
    thread of this pytest process, and the main thread then sees it only at some later bytecode (a
    CI run missed the KeyboardInterrupt so)."""
    import signal
    import threading

    from tide.runtime import serve_role
    from tide.workload import RequestSource

    def stop() -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    monkeypatch.setattr(serve_role, "ECHO_S", 0.5)
    # "as usual" is Python's own SIGINT handler: a module an earlier test imported may have set another
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    source = RequestSource([], [], learning=False)
    try:
        with serve_role.stop_on_signals(source.stop):
            stop()
            stop()
            assert source.stopped == "SIGINT"
            time.sleep(0.6)
            with pytest.raises(KeyboardInterrupt):
                stop()
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("groups, dedicated, serving, training", [
    ({}, False, range(1), range(1, 3)),  # mpirun without Slurm: rank 0 serves, the rest train
    ({0: 2, 1: 1}, False, range(2), range(2, 3)),  # rank 0 coordinates and serves, rank 1 serves too
    ({0: 1, 1: 2, 2: 1}, True, range(1, 3), range(3, 4)),  # a coordinator of its own: ranks 1, 2 serve
])
def test_the_het_groups_give_each_rank_its_role(monkeypatch: pytest.MonkeyPatch, groups: dict[int, int],
                                                dedicated: bool, serving: range, training: range) -> None:
    from tide.runtime.__main__ import het_layout

    for i in range(3):
        monkeypatch.delenv(f"SLURM_NTASKS_HET_GROUP_{i}", raising=False)
    for i, n in groups.items():
        monkeypatch.setenv(f"SLURM_NTASKS_HET_GROUP_{i}", str(n))
    assert het_layout(sum(groups.values()) or 3, dedicated) == (serving, training)


def test_a_dedicated_coordinator_needs_a_het_group_of_one_task(monkeypatch: pytest.MonkeyPatch) -> None:
    from tide.runtime.__main__ import het_layout

    monkeypatch.setenv("SLURM_NTASKS_HET_GROUP_0", "2")
    monkeypatch.setenv("SLURM_NTASKS_HET_GROUP_1", "1")
    monkeypatch.delenv("SLURM_NTASKS_HET_GROUP_2", raising=False)
    with pytest.raises(SystemExit, match=r"het group 0 must be one task \(the coordinator\).*\[2, 1\] tasks"):
        het_layout(3, dedicated=True)
