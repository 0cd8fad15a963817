"""Every Slurm command call (sbatch, scontrol, sacct, scancel), with a deadline each.

Job state comes from `scontrol show job` (slurmctld keeps finished jobs MinJobAge seconds) and then
from sacct, whose het rows `<id>+0`, `<id>+1` are folded back into `<id>`; with neither it is UNKNOWN.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# every state squeue(1) lists that is not an end: SIGNALING shows while `--signal` reaches the ranks
# before the time limit, STAGE_OUT after them; the held ones wait for a release (or wait()'s deadline)
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SIGNALING", "COMPLETING", "STAGE_OUT", "SUSPENDED",
                    "STOPPED", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD",
                    "SPECIAL_EXIT", "UNKNOWN"})
CMD_TIMEOUT_S = 60  # a Slurm client call that takes longer means slurmctld is unreachable


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client; a hung one (slurmctld unreachable) reads as a failure, rc 124."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(cmd), 124, "", f"{cmd[0]}: no answer in {CMD_TIMEOUT_S} s")


def sbatch(script: str | Path, args: Sequence[str] = (), options: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> str:
    """`sbatch [options] script [args]` -> job id (the leader's for a het job). `options` may hold
    `:` between components; `env` is added to ours, which sbatch passes on to the job."""
    p = _run(["sbatch", "--parsable", *options, str(script), *args], env)
    if p.returncode:
        raise RuntimeError(f"sbatch {script} failed (rc {p.returncode}): {p.stderr.strip()}")
    return p.stdout.strip().split(";")[0]


def _fold(states: Sequence[str]) -> str:
    """One state for a het job's components: the first that is not COMPLETED, else COMPLETED."""
    return next((s for s in states if s != "COMPLETED"), "COMPLETED")


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """State of each job (het leader ids): scontrol while slurmctld holds it, else sacct, else UNKNOWN."""
    out: dict[str, str] = {}
    for jid in job_ids:
        p = _run(["scontrol", "show", "job", "-o", jid])
        if p.returncode == 0:  # one line per het component
            rows = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in p.stdout.splitlines()]
            out[jid] = _fold([r["JobState"] for r in rows if r.get("HetJobId", r["JobId"]) == jid] or ["UNKNOWN"])
    rest = [j for j in job_ids if j not in out]
    if rest:  # accounting: "CANCELLED by 0" -> CANCELLED; rows <id>+k -> <id>
        p = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", *[a for j in rest for a in ("-j", j)]])
        rows = [line.split("|") for line in p.stdout.splitlines() if "|" in line] if p.returncode == 0 else []
        for jid in rest:
            states = [st.split()[0] for rid, st in rows if rid.split("+")[0] == jid]
            out[jid] = _fold(states) if states else "UNKNOWN"
    return out


def cancel(job_id: str) -> None:
    """scancel the whole het job (the leader id cancels every component)."""
    _run(["scancel", job_id])
