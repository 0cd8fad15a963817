"""Start and stop the local test Slurm cluster (slurm_up.sh / slurm_down.sh) from Python.

    was_up = cluster_is_up(state_dir)
    env = start_cluster(state_dir)   # {"SLURM_CONF": ...}: merge into os.environ for sbatch & co.
    ...
    if not was_up:
        stop_cluster(state_dir)

The cluster lives entirely under `state_dir` (config, munge socket, spool, logs, PIDs) and is stopped
by the PIDs recorded there, so several state dirs do not interfere unless their ports do
(TIDE_SLURM_PORT). Test modules use the fixture `cluster` (import it from here).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEFAULT_STATE = Path(os.environ.get("TIDE_SLURM_STATE", "/tmp/tide-slurm-test"))  # munge must reach it
DAEMONS = ("munge/munged.pid", "run/slurmctld.pid", *(f"run/slurmd-n{i}.pid" for i in range(4)))
UP_TIMEOUT_S = 300  # first run installs packages (~15 s on Debian's mirror); a warm start takes ~1 s


class ClusterError(RuntimeError):
    """The cluster did not come up; the message has the script's output and where the logs are."""


def cluster_is_up(state_dir: str | Path) -> bool:
    """Whether every daemon recorded under state_dir runs (by PID, checked against its name)."""
    for rel in DAEMONS:
        try:
            pid = (Path(state_dir) / rel).read_text().strip()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return False
        if name != Path(rel).stem.split("-")[0]:
            return False
    return True


def start_cluster(state_dir: str | Path) -> dict[str, str]:
    """Bring the cluster up (idempotent) and return the environment its clients need."""
    if os.geteuid() != 0:
        raise ClusterError("the local Slurm cluster needs root (daemons, mknod, apt-get)")
    try:
        p = subprocess.run([str(HERE / "slurm_up.sh"), str(state_dir)], capture_output=True, text=True,
                           timeout=UP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"slurm_up.sh {state_dir}: no result in {UP_TIMEOUT_S} s; logs in {state_dir}/log") from e
    if p.returncode:
        raise ClusterError(f"slurm_up.sh {state_dir} failed (rc {p.returncode}); logs in {state_dir}/log\n"
                           f"{p.stdout}{p.stderr}")
    exports = [line.split("=", 1)[1] for line in p.stdout.splitlines() if line.startswith("export SLURM_CONF=")]
    assert exports, p.stdout
    return {"SLURM_CONF": exports[-1]}


def stop_cluster(state_dir: str | Path) -> None:
    """Cancel its jobs and stop its daemons by PID; logs stay in state_dir/log."""
    subprocess.run([str(HERE / "slurm_down.sh"), str(state_dir)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """The local 4-node cluster (state in $TIDE_SLURM_STATE, default /tmp/tide-slurm-test, logs kept
    there); its SLURM_CONF in os.environ while the tests run. Stopped at the end unless it was up before
    (a session fixture's, say). Without root it cannot start: the tests are skipped."""
    was_up = cluster_is_up(DEFAULT_STATE)
    try:
        env = start_cluster(DEFAULT_STATE)
    except ClusterError as e:
        if os.geteuid() != 0:
            pytest.skip(str(e))
        raise
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        mp.setenv("TIDE_STEP_GRACE", "5")  # sbatch passes it on: srun's het-step hang costs 5 s here
        yield env
    if not was_up:
        stop_cluster(DEFAULT_STATE)
