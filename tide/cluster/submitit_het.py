"""submitit for TIDE's heterogeneous job (submitit 1.5.4 has no hetjob support: its issue #1741).

`tide.cluster.submit.submit(spec, executor="slurm")` comes here; this is the only module that imports submitit
(the `hpc` extra). What runs on every rank is `submitit.helpers.CommandFunction(spec.command)`: submitit
pickles that (its own class and an argv list), never TIDE code, so the serving and training roles share
no pickled objects - only the Python that runs submitit's runner must exist on both kinds of node.
Slurm itself is asked about job state through `tide.cluster.commands.job_states`, like every other caller.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import submitit
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from tide.cluster.commands import job_states
from tide.cluster.script import STEP_GUARD, JobSpec, exports, sbatch_lines, step_line


class HetInfoWatcher(SlurmInfoWatcher):
    """submitit's state poller, asking `job_states`: scontrol, then sacct with `<id>+k` rows folded
    into `<id>`. submitit's own sacct call yields UNKNOWN forever on a cluster without accounting, and
    it would key a het job's rows by `<id>+0`, `<id>+1`, never by the `<id>` the job holds."""

    def update(self) -> None:
        ids = sorted(self._registered - self._finished)
        if not ids:
            return
        self._num_calls += 1
        states = job_states(ids)
        self._info_dict.update({j: {"JobID": j, "State": st} for j, st in states.items()})
        self._last_status_check = time.time()
        self._finished.update(j for j in ids if self.is_done(j, mode="cache"))


class HetSlurmJob(SlurmJob):
    watcher = HetInfoWatcher(delay_s=60)


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor for a heterogeneous job.

    Component 0 is set with `update_parameters` as usual; `het_components` lists the sbatch options of
    components 1..N. The text gains `#SBATCH hetjob` sections; srun runs over every het group (one
    MPI_COMM_WORLD) through `tide_step` (tide.cluster.script.STEP_GUARD); the task count covers every
    component, so `results()` returns one result per rank. Ranks find their pickle because SLURM_JOB_ID is the
    leader's id on every rank.
    Per-rank logs cannot use srun's `--output F/%j_%t_log.out`: in a het step srun expands %j to the
    component's own job id (no such folder: "could not connect IO") and %t, for component 1, to the
    global rank + 1. Each rank appends to F/${SLURM_JOB_ID}_${SLURM_PROCID}_log.{out,err} instead,
    the names submitit's `job.stdout()`/`stderr()` read.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, het_components: Sequence[Mapping[str, Any]], mpi: str = "pmix",
                 srun_timeout_s: int = 3600, **kwargs: Any) -> None:
        super().__init__(folder, **kwargs)
        self.het_components = [dict(c) for c in het_components]
        self.mpi, self.srun_timeout_s = mpi, srun_timeout_s

    @classmethod
    def from_spec(cls, spec: JobSpec, folder: str | Path) -> HetSlurmExecutor:
        s, (first, *rest) = spec.slurm, spec.components
        ex = cls(folder, [{"time": s.time, **c.sbatch_options()} for c in rest], mpi=s.mpi,
                 srun_timeout_s=spec.srun_timeout_s)
        setup = ["export PYTHONUNBUFFERED=1", *exports({"TIDE_TRAIN_RESTARTS": s.train_restarts, **s.env})]
        # submitit's `--signal=USR2@90` (its preemption/timeout signal) reaches every rank; slurmctld
        # sends it once `now + delay + 30 s >= end` (it checks every 30 s), i.e. at once in a 2-minute
        # job. A quarter of the limit, at most 90 s, keeps it near the end.
        delay = min(90, s.time * 60 // 4)
        ex.update_parameters(job_name=s.job_name, time=s.time, setup=setup, signal_delay_s=delay,
                             **first.sbatch_options())
        return ex

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = super()._make_submission_file_text(command, uid).split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
        lines[last + 1:last + 1] = [x for c in self.het_components for x in ["#SBATCH hetjob", *sbatch_lines(c)]]
        return "\n".join(f"{STEP_GUARD}\n{self._het_srun(line, command)}" if line.startswith("srun ") else line
                         for line in lines)

    def _het_srun(self, line: str, command: str) -> str:
        """`srun [opts] --output O --error E CMD`
        -> `tide_step .. srun --het-group=.. [opts] -- bash -c 'exec "$@" >>O 2>>E' bash CMD`."""
        assert line.endswith(command), line
        args, opts = iter(shlex.split(line[:-len(command)])[1:]), []
        logs: dict[str, str] = {}
        for a in args:
            if a in ("--output", "--error"):
                logs[a] = next(args)
            else:
                opts.append(a)

        def per_rank(path: str) -> str:
            if any(c in path for c in '"$`\\'):
                raise ValueError(f"submitit folder {self.folder}: no quotes, $, ` or \\ in the path, please")
            return '"' + path.replace("%j", "${SLURM_JOB_ID}").replace("%t", "${SLURM_PROCID}") + '"'

        out = logs["--output"]
        redirect = f'exec "$@" >>{per_rank(out)} 2>>{per_rank(logs.get("--error", out))}'
        step_dir = per_rank(str(Path(self.folder) / ".step-%j"))[1:-1]
        return step_line(1 + len(self.het_components), self.mpi, self.srun_timeout_s, step_dir, opts,
                         f"bash -c {shlex.quote(redirect)} bash {command}")

    def _num_tasks(self) -> int:
        return super()._num_tasks() + sum(int(c.get("nodes", 1)) * int(c.get("ntasks_per_node", 1))
                                          for c in self.het_components)


def submit_command(spec: JobSpec, folder: Path) -> submitit.Job[str]:
    """Submit `spec.command` on every rank; each rank's result is the command's stdout."""
    ex = HetSlurmExecutor.from_spec(spec, folder)
    return ex.submit(submitit.helpers.CommandFunction(list(spec.command), verbose=True))
