"""Faults, each with a test: what TIDE does when a part of it breaks.

  * a message of an unknown kind or protocol version: logged and dropped (socket and MPI transports);
  * the store path is not writable, or too full to start: one clear error line at start-up;
  * the disk fills while serving: capture pauses, serving goes on, nothing partial is visible, and
    capture resumes once there is room;
  * a trainer rank killed mid-training (on the test cluster): serving goes on with the last good
    draft, the job completes and reports training as degraded;
  * an inference rank dies (on the test cluster): the job fails with a clear error, every visible
    chunk is whole, and no process of the job is left behind.
A restarted trainer resuming from the newest draft is tested on a real run's files in
tests/test_slurm.py (test_a_restarted_trainer_resumes_from_the_newest_draft).
Filesystems are real: small tmpfs mounts (root only, like the test cluster).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from cluster.jobs import ci_config, job_processes, rank_pid, run_results, submit_run, wait_for_line

from tide.cluster import submit
from tide.cluster.submit import SlurmError
from tide.config import load_config
from tide.draft import DraftRegistry
from tide.runtime.messages import PROTOCOL, Heartbeat, Join, Shutdown
from tide.runtime.rejoin import JoinableTransport, join
from tide.runtime.transport import SocketTransport
from tide.store import ChunkMeta, ChunkReader, ChunkWriter, Run, read_chunk
from tide.store.chunk import chunk_time_ns
from tide.store.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]
RUN_WAIT_S = 540  # > ci.yaml's srun_timeout_s (480 s) + 30 s to KILL
BAD_FRAMES = [
    msgpack.packb({"protocol": PROTOCOL, "type": "Gossip", "text": "hi"}),  # a kind from a newer release
    msgpack.packb({"protocol": PROTOCOL + 1, "type": "Heartbeat", "role": "trainer", "rank": 1, "t": 0.0}),
    b"\xc1 not msgpack",
]


# ---- messages -------------------------------------------------------------------------------------


def test_socket_transport_logs_and_drops_messages_it_does_not_understand(caplog: pytest.LogCaptureFixture) -> None:
    a, b = socket.socketpair()
    ours, theirs = SocketTransport(a, rank=0, peer=1), SocketTransport(b, rank=1, peer=0)
    for frame in BAD_FRAMES:
        b.sendall(len(frame).to_bytes(4, "big") + frame)
    theirs.send(0, Heartbeat("trainer", 1, 0.0))
    with caplog.at_level(logging.WARNING, "tide.runtime.transport"):
        got = ours.poll(timeout=5.0)
    assert got == [(1, Heartbeat("trainer", 1, 0.0))] and not ours.closed
    dropped = [r.getMessage() for r in caplog.records]
    assert len(dropped) == 3 and all(m.startswith("transport: dropped a message from rank 1: ") for m in dropped)
    assert "unknown kind 'Gossip'" in dropped[0] and f"protocol version {PROTOCOL + 1}" in dropped[1]
    ours.close()
    theirs.close()


class LoopbackMPI:
    """Stands in for rank 0's MPI world and records what it was sent: this test is about the join
    port and the routing. The real MPI ranks are test_a_lost_training_component_comes_back_and_trains_again's."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send(self, dest: int, msg: object) -> None:
        self.sent.append((dest, msg))

    def poll(self) -> list:
        return []

    def close(self) -> None:
        pass


def poll_until(transport: Any, timeout_s: float = 10.0) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := transport.poll():
            return got
        time.sleep(0.05)
    return []


def test_a_returned_training_component_joins_with_the_runs_key_and_nothing_else_does(tmp_path: Path) -> None:
    """Rank 0 listens for a training component started again (its own step: a new MPI world). The key
    is in join.json, readable by the job's user only; a connection without it is closed. Once joined,
    the first trainer rank's messages go over the connection (the others' are the leader's to relay)."""
    mpi = LoopbackMPI()
    rank0 = JoinableTransport(mpi, [1, 2], tmp_path)  # type: ignore[arg-type]
    try:
        assert stat.S_IMODE((tmp_path / "join.json").stat().st_mode) == 0o600
        port = json.loads((tmp_path / "join.json").read_text())["port"]
        for hello in (Join("not-the-key"), Heartbeat("trainer", 1, 0.0)):
            intruder = SocketTransport(socket.create_connection(("127.0.0.1", port)), rank=1, peer=0)
            intruder.send(0, hello)
            assert intruder.poll(timeout=15) == [] and intruder.closed  # closed by rank 0
        rank0.send(1, Shutdown("before anyone joined"))
        assert mpi.sent == [(1, Shutdown("before anyone joined"))]
        trainer = join(tmp_path, timeout_s=10)
        trainer.send(0, Heartbeat("trainer", 0, 1.0))
        assert poll_until(rank0) == [(1, Heartbeat("trainer", 0, 1.0))]
        rank0.send(1, Shutdown("done"))
        rank0.send(2, Shutdown("done"))  # the leader relays to its step's other ranks
        assert poll_until(trainer) == [(0, Shutdown("done"))] and len(mpi.sent) == 1
        trainer.close()
        assert poll_until(rank0, 2) == [] and rank0.joined is None  # gone: MPI again (and down, by its beats)
        rank0.send(1, Shutdown("again"))
        assert mpi.sent[-1] == (1, Shutdown("again"))
    finally:
        rank0.close()


MPI_SCRIPT = """
import json, logging, sys, time
from tide.runtime.messages import Heartbeat
from tide.runtime.transport import TAG, MPITransport
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
t = MPITransport()
if t.rank == 1:
    for frame in sys.argv[1:]:  # hex
        t.comm.Send([bytes.fromhex(frame), t.MPI.BYTE], dest=0, tag=TAG)
    t.send(0, Heartbeat("trainer", 1, 0.0))
else:
    got, t0 = [], time.monotonic()
    while not got and time.monotonic() - t0 < 30:
        got = t.poll()
        time.sleep(0.01)
    print("GOT " + json.dumps([[src, type(m).__name__] for src, m in got]), flush=True)
t.close()
"""


def test_mpi_transport_logs_and_drops_messages_it_does_not_understand() -> None:
    """Two ranks under mpirun: rank 1 sends three bad frames and a heartbeat, rank 0 gets the heartbeat."""
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    p = subprocess.run([*mpirun, sys.executable, "-c", MPI_SCRIPT, *(f.hex() for f in BAD_FRAMES)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [line for line in p.stdout.splitlines() if line.startswith("GOT ")] == ['GOT [[1, "Heartbeat"]]']
    assert p.stdout.count("LOG transport: dropped a message from rank 1: ") == 3, p.stdout


# ---- the store's filesystem -----------------------------------------------------------------------


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """mount(size, read_only=False) -> a fresh tmpfs of that size under tmp_path, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mounted: list[Path] = []

    def make(size: str, read_only: bool = False) -> Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True, capture_output=True)


@pytest.mark.parametrize("module", ["tide.runtime", "tide.launch"])
def test_a_read_only_store_is_one_clear_error_at_start_up(mount: Callable[..., Path], tmp_path: Path,
                                                          module: str) -> None:
    """Every rank (tide.runtime) and the local launcher stop before serving, naming the key to fix."""
    store = mount("1m", read_only=True)
    config = ci_config(tmp_path / "ci.yaml", store={"path": str(store)})
    p = subprocess.run([sys.executable, "-m", module, "--config", str(config), "--out", str(tmp_path / "out")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (f"{module}: error: store.path: cannot write to {store}: Read-only "
                                                 "file system; give a writable directory on the shared filesystem")


def test_a_store_without_room_for_two_chunks_is_a_clear_error_at_start_up(mount: Callable[..., Path],
                                                                         tmp_path: Path) -> None:
    store = mount("64k")
    cfg = load_config(ci_config(tmp_path / "ci.yaml", store={"path": str(store)}))
    with pytest.raises(ValueError, match=rf"^store.path: {store} has 0.1 MiB free; 2 chunks of 512 tokens need "
                                         r"0.4 MiB: free some space or move the store$"):
        RunLayout.open(cfg, tmp_path / "out")
    assert not list(store.iterdir())  # not even the write test is left


def test_a_full_disk_pauses_capture_while_serving_goes_on(mount: Callable[..., Path],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A 1 MiB store takes about ten chunks of 128 rows (100 KB). The writer's `add` (serving's hot path) neither
    raises nor waits while the disk is full; capture pauses, then resumes once there is room."""
    store = mount("1m")
    meta = ChunkMeta("tiny", "abc", hidden_size=128, layer_ids=(1, 2, 3))  # 777 bytes a row
    rows = np.random.default_rng(0).integers(0, 1 << 16, (128, meta.row_dim), dtype=np.uint16)

    def run(i: int) -> Run:
        return Run(f"r{i}", np.zeros(128, np.int32), np.arange(128, dtype=np.int32), rows, np.ones(128, bool))

    accepted, slowest = [], 0.0
    with caplog.at_level(logging.WARNING, "tide.store.writer"):
        w = ChunkWriter(store, meta, chunk_tokens=128, max_pending_chunks=1, pause_s=1.0)
        for i in range(20):
            t0 = time.monotonic()
            accepted.append(w.add(run(i)))
            slowest = max(slowest, time.monotonic() - t0)
            w.flush()  # the test waits for each write; serving never does
        full = w.stats()
        assert slowest < 0.05 and 5 <= full["files"] < 20 and full["pauses"] >= 1, full
        assert not all(accepted) and full["dropped_tokens"] == 128 * accepted.count(False)
        assert "chunk writer: ENOSPC: capture paused for 1 s; serving goes on" in caplog.text
        reader = ChunkReader(store, expect=meta)  # every visible chunk is whole; no temporary file is left
        assert len(reader.load()) == full["files"] and reader.skipped == {} and not list(store.glob("*.tmp"))

        for path in sorted(store.glob("*.h5"))[:4]:  # room again (retention, an operator)
            path.unlink()
        time.sleep(1.1)
        assert w.add(run(99))
        w.close()
    assert w.stats()["files"] == full["files"] + 1
    assert "chunk writer: capture resumed" in caplog.text


def test_a_trainer_whose_coordinator_falls_silent_exits(tmp_path: Path) -> None:
    """Heartbeats both ways: the trainer process (`python -m tide.runtime --fd`, as started locally)
    hears the coordinator once, then nothing for trainer_timeout_s: it exits 1 instead of waiting for
    ever (under mpirun nothing else would end it)."""
    from tide.runtime.processes import local_trainer

    config = ci_config(tmp_path / "ci.yaml", runtime={"heartbeat_s": 0.5, "trainer_timeout_s": 5.0})
    out = tmp_path / "out"
    with local_trainer(config, out, "") as transport:
        t0 = time.monotonic()
        while not any(isinstance(m, Heartbeat) for _, m in transport.poll(timeout=1.0)):
            assert time.monotonic() - t0 < 300, (out / "trainer.log").read_text()[-2000:]
        transport.send(1, Heartbeat("coordinator", 0, time.time()))
        line = wait_for_line(out / "trainer.log", "nothing from the coordinator for 5 s", 120)
    assert "exiting" in line


# ---- signals ----------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_sigterm_ends_the_main_job_with_its_results_and_a_restart_resumes_from_the_newest_draft(
        tmp_path: Path) -> None:
    """SIGTERM to `tide.launch` mid-run (a trained draft published, the workload not done): no new
    requests, those in flight finish, the store is flushed and the trainer stopped, and summary.json,
    events.json, windows and requests are written (`stopped: SIGTERM`, no no-speculation baseline).
    Started again on the same run dir, it serves the newest draft from its first window on (its first
    collection starting after that draft's training read: tests/test_coordinator.py), and the first
    run's results move to previous/1/."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tide.launch", "--config", "configs/ci.yaml", "--out", str(out)]

    def run_until(pattern: str, log: Path) -> subprocess.CompletedProcess[str]:
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for_line(log, pattern, 600)
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
        return p

    run_until(r"draft v1 ", out.parent / "first.log")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "SIGTERM" and summary["nospec_tokens_per_s"] is None
    assert summary["requests"] > 0 and (out / "requests.jsonl").exists()
    assert "stop" in [e["kind"] for e in json.loads((out / "events.json").read_text())]
    assert "SIGTERM: no new requests" in (out.parent / "first.log").read_text()
    newest = DraftRegistry(out / "drafts").latest()
    chunks = {p.name for p in (out / "store").glob("*.h5")}
    assert newest >= 1 and chunks

    run_until(r"\] AL .* draft v\d", out.parent / "second.log")
    first_window = json.loads((out / "windows.jsonl").read_text().splitlines()[0])
    assert first_window["draft_version"] == newest
    assert json.loads((out / "summary.json").read_text())["stopped"] == "SIGTERM"
    assert json.loads((out / "previous" / "1" / "summary.json").read_text()) == summary  # the first run's, kept


# ---- ranks dying on the test cluster ---------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_a_trainer_killed_mid_training_degrades_training_not_serving(cluster: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """SIGKILL to the training rank while rank 0 shows its steps (a cycle of 2000 steps: far from done),
    in a job that does not start a lost training component again (`slurm.train_restarts: 0`). The job
    completes (serving decides), the log and summary.json say training is degraded, every request is
    served, by v0: the last good draft. Serving goes on until 16 requests after the trainer was
    marked down, however long the trainer took to start its steps."""
    until = {"event": "trainer-down", "event_requests": 16, "max_s": 300}
    job, _, out = submit_run(tmp_path, control={"policy": "always"}, runtime={"trainer_timeout_s": 5.0},
                             train={"max_steps": 2000}, slurm={"train_restarts": 0},
                             workload={"max_tokens": 64, "nospec_baseline": False, "until": until})
    wait_for_line(job.stderr, r"^0: .* train c1 [1-9]\d*/2000 ", 300)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    err = job.stderr.read_bytes().decode()
    assert "tide: training rank 1 exited 137: training degraded, serving goes on" in err
    down = err.index("decision: trainer-down")
    assert err.find("tide.runtime.serve_role: [", down) > 0  # serving reported windows after it
    s, reqs = run_results(out)
    kinds = [e["kind"] for e in s["events"]]
    assert s["training"] == "degraded" and "swap" not in kinds, s["events"]
    assert len(reqs) == s["requests"] >= 128 and {r["draft_version"] for r in reqs} == {0}
    assert s["workload"][0]["until_met"], s["workload"]
    assert DraftRegistry(out / "drafts").latest() == 0


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_a_lost_training_component_comes_back_and_trains_again(cluster: dict[str, str], tmp_path: Path) -> None:
    """SIGKILL to the training rank in a cycle: serving goes on and training is marked down;
    5 s later the step guard starts the training component again, a step of its own (`--rejoin`), which
    joins the coordinator through the run dir. The trainer is back, its next cycle trains from the live
    draft and is deployed, and the summary says training recovered."""
    until = {"event": "deploy", "event_requests": 16, "max_s": 400}
    job, _, out = submit_run(tmp_path, control={"policy": "always"}, runtime={"trainer_timeout_s": 5.0},
                             train={"max_steps": 300}, slurm={"env": {"TIDE_TRAIN_RESTART_S": "5"}},
                             workload={"max_tokens": 64, "nospec_baseline": False, "until": until})
    wait_for_line(job.stderr, r"^0: .* train c\d+ [1-9]\d*/300 ", 300)  # cycles long enough to be seen
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    err = job.stderr.read_bytes().decode()
    assert "tide: training rank 1 exited 137: training degraded, serving goes on" in err
    assert "tide: starting the training component again" in err and "a training component joined" in err
    s, reqs = run_results(out)
    kinds = [e["kind"] for e in s["events"]]
    down, up = kinds.index("trainer-down"), kinds.index("trainer-up")
    assert down < up < kinds.index("deploy", up), s["events"]
    assert s["training"] == "recovered" and s["workload"][0]["until_met"]
    assert DraftRegistry(out / "drafts").latest() >= 1 and max(r["draft_version"] for r in reqs) >= 1


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_a_serving_instance_dying_ends_only_itself(cluster: dict[str, str], tmp_path: Path) -> None:
    """Two serving ranks on two nodes and a trainer; SIGKILL to rank 1 (an instance, not the
    coordinator) once it serves: the step guard lets the others go on, the coordinator marks the
    instance down and serves its share until 16 requests after that, and the job completes with the
    coordinator's code. The summary names the dead instance."""
    serve = {"partition": "gpu_infer", "nodes": 2, "ntasks_per_node": 1, "gpus_per_node": 1, "cpus_per_task": 1}
    until = {"event": "instance-down", "event_requests": 16, "max_s": 300}
    job, _, out = submit_run(tmp_path, slurm={"serve": serve}, runtime={"instance_timeout_s": 5.0},
                             workload={"max_tokens": 64, "nospec_baseline": False, "until": until})
    wait_for_line(job.stderr, r"^1: .* tide.runtime.serve_role: \[ *\d+s\] AL ", 300)
    wait_for_line(job.stderr, r"^0: .* coordinator: instance 1 is up ", 300)  # else it is still "starting"
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    err = job.stderr.read_bytes().decode()
    assert "tide: serving instance 1 exited 137: the other instances go on" in err
    s, reqs = run_results(out)
    assert [(i["rank"], i["state"]) for i in s["instances"]] == [(0, "coordinator"), (1, "down")]
    down = [e for e in s["events"] if e["kind"] == "instance-down"]
    assert len(down) == 1 and down[0]["data"]["instance"] == 1
    assert s["workload"][0]["until_met"] and len(reqs) == s["requests"] > 0
    assert sum(r["finish"] > down[0]["t"] for r in reqs) >= 16  # rank 0 served on after the loss
    assert not (out / "instances" / "1" / "summary.json").exists()


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_with_a_coordinator_of_its_own_an_instance_dying_ends_only_itself(cluster: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """`slurm.coordinator`: rank 0 coordinates only, ranks 1 and 2 serve, rank 3 trains. SIGKILL to rank 1
    once it serves: rank 2 serves on until 16 of its requests finished after the coordinator marked
    rank 1 down (the coordinator's `until`, over the instances' reports), and the job completes with
    the coordinator's code. The summary names the dead instance."""
    serve = {"partition": "gpu_infer", "nodes": 2, "ntasks_per_node": 1, "gpus_per_node": 1, "cpus_per_task": 1}
    until = {"event": "instance-down", "event_requests": 16, "max_s": 300}
    job, _, out = submit_run(tmp_path, slurm={"serve": serve, "coordinator": {"partition": "gpu_train",
                                                                               "cpus_per_task": 1}},
                             runtime={"instance_timeout_s": 5.0},
                             workload={"max_tokens": 64, "nospec_baseline": False, "until": until})
    wait_for_line(job.stderr, r"^1: .* tide.runtime.serve_role: \[ *\d+s\] AL ", 300)
    wait_for_line(job.stderr, r"^0: .* coordinator: instance 1 is up ", 300)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    assert "tide: serving instance 1 exited 137: the other instances go on" in job.stderr.read_bytes().decode()
    s = json.loads((out / "summary.json").read_text())
    assert [(i["rank"], i["state"]) for i in s["instances"]] == [(1, "down"), (2, "done")]
    (down,) = [e for e in s["events"] if e["kind"] == "instance-down"]
    assert down["data"]["instance"] == 1 and s["until_met"] and s["coordinator"] == "dedicated"
    # 16 requests finished after the loss (the coordinator's count, in its `until`); rank 2 served them
    assert s["instances"][1]["requests"] >= 16 and s["total"]["requests"] == s["instances"][1]["requests"]
    assert not (out / "instances" / "1" / "summary.json").exists()


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_an_inference_rank_dying_ends_the_job_without_partial_chunks(cluster: dict[str, str],
                                                                      tmp_path: Path) -> None:
    """SIGKILL to rank 0's Python while it serves and captures: the trainer is stopped, the job fails
    naming the rank, the store holds only whole chunks, and nothing of the job lives on (no vLLM
    process either)."""
    job, config, out = submit_run(tmp_path, workload={"nospec_baseline": False})
    wait_for_line(job.stderr, r"^0: .* stored +(?!0\.0k)[0-9.]+k ", 300)
    os.kill(rank_pid(out, 0), signal.SIGKILL)
    with pytest.raises(SlurmError) as e:
        submit.wait(job, 120)
    assert e.value.state == "FAILED"
    # the whole log: MPI's help messages and the step guard's later lines can push it out of the error's tail
    assert "tide: rank 0 (the coordinator) exited 137: stopping the job" in job.stderr.read_bytes().decode()
    reader = ChunkReader(out / "store", expect=RunLayout.open(load_config(config), out).target.chunk_meta())
    assert reader.list_chunks() and reader.load() and reader.skipped == {}
    for _ in range(30):  # slurmstepd ends the step's processes after srun is gone
        left = job_processes(job.job_id)
        if not left:
            break
        time.sleep(1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of job {job.job_id} left running: {left}"


@pytest.mark.slurm
@pytest.mark.timeout(2 * RUN_WAIT_S)
def test_a_requeued_job_resumes_from_its_newest_draft_and_rows(cluster: dict[str, str], tmp_path: Path) -> None:
    """`scontrol requeue` once a trained draft serves: Slurm ends the run (TERM, KILL after KillWait) and
    runs the same script again, same job id and run dir. The first run's results move to previous/1/;
    the second serves the newest draft from its first window, and its first cycle trains from that
    draft on the rows stored since that draft's training, before the requeue too, each row once (the
    workload starts again from its first request, under the same ids: tide.train.data.sequences
    keeps the newest copy of a request's position)."""
    until = {"trained_requests": 96, "max_s": 400}
    job, config, out = submit_run(tmp_path, control={"policy": "always"}, train={"max_steps": 60},
                                  workload={"max_tokens": 64, "nospec_baseline": False, "until": until})
    assert "#SBATCH --requeue" in (out / "tide_hetjob.sbatch").read_text()
    wait_for_line(job.stderr, r"^0: .* decision: deploy v1: ", RUN_WAIT_S)
    requeued_ns = time.time_ns()
    subprocess.run(["scontrol", "requeue", job.job_id], check=True, capture_output=True, text=True)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    assert job.stdout.read_text().count(f"tide: job {job.job_id}: ") == 2  # both runs' logs kept
    first = json.loads((out / "previous" / "1" / "summary.json").read_text())
    assert first["requests"] > 0 and "deploy" in [e["kind"] for e in first["events"]]
    s, reqs = run_results(out)
    assert s["stopped"] is None and s["workload"][0]["until_met"] and len(reqs) == s["requests"]
    trained = [e["version"] for e in s["events"] if e["kind"] == "trained"]
    assert trained, s["events"]
    reg = DraftRegistry(out / "drafts")
    new = reg.meta(trained[0])
    resumed = new["base_version"]
    assert resumed == trained[0] - 1 >= 1  # the newest draft when the second run started ...
    assert json.loads((out / "windows.jsonl").read_text().splitlines()[0])["draft_version"] == resumed  # ... served
    window = new["source_chunks"]
    assert not set(window) & set(reg.meta(resumed)["source_chunks"])  # nothing the resumed draft trained on
    assert any(chunk_time_ns(Path(name)) < requeued_ns for name in window)  # rows stored before the requeue
    meta = RunLayout.open(load_config(config), out).target.chunk_meta()
    rows = {(r.request_id, int(p)) for name in window for r in read_chunk(out / "store" / name, meta)
            for p in r.positions}
    assert 0 < new["rows"] <= len(rows)  # each row once, however often it was stored


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_near_its_time_limit_drains_and_writes_its_results(cluster: dict[str, str], tmp_path: Path) -> None:
    """A 4-minute job whose workload would run on for 15: the script's `--signal=TERM@60` (a quarter
    of the limit; the step guard would stop srun at 216 s) reaches every rank before the limit.
    Serving takes no new requests, finishes those in flight and writes its summary; the trainer keeps
    running until the coordinator's Shutdown. The job completes before Slurm's limit would kill it."""
    until = {"trained_requests": 1_000_000, "max_s": 900}
    job, _, out = submit_run(tmp_path, slurm={"time": 4, "srun_timeout_s": 0},
                             workload={"nospec_baseline": False, "until": until})
    assert "#SBATCH --signal=TERM@60" in (out / "tide_hetjob.sbatch").read_text()
    result = submit.wait(job, 330)
    assert result.state == "COMPLETED" and result.elapsed_s < 240, result
    s, reqs = run_results(out)
    assert s["stopped"] == "SIGTERM" and "stop" in [e["kind"] for e in s["events"]]
    assert s["training"] == "ok" and len(reqs) == s["requests"] > 0
    err = job.stderr.read_bytes().decode()
    assert "SIGTERM: no new requests" in err and "going on until the coordinator says Shutdown" in err
