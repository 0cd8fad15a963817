"""Submitting TIDE as one Slurm het job and waiting for it: `python -m tide.cluster`.

Two ways to submit the same job, both waited on by `wait`:
  * "sbatch": the script `tide.cluster.script.render_hetjob_script` makes, submitted with sbatch;
    logs in OUTDIR/slurm-<id>.{out,err}.
  * "slurm":  `tide.cluster.submitit_het.HetSlurmExecutor`, submitit's SlurmExecutor plus hetjob
    sections, running the command through submitit's CommandFunction, so the only pickle is
    submitit's own (an argv list); logs and per-rank results in OUTDIR/submitit.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tide.cli import parser, run
from tide.cluster.commands import ACTIVE, cancel, job_states, sbatch
from tide.cluster.script import JobSpec, load_slurm_config, render_hetjob_script
from tide.model.files import write_text

if TYPE_CHECKING:  # submitit (the `hpc` extra) is imported only by executor "slurm", in tide.cluster.submitit_het
    import submitit


class SlurmError(RuntimeError):
    """A job that did not complete. The message is the evidence: job id, state, log path, the batch
    stderr's last lines (srun's per-task errors; rank-labelled output for "sbatch") and, for submitit,
    the last line of each rank's stderr (its exception)."""

    def __init__(self, job: Job, state: str, why: str, tail_lines: int = 20) -> None:
        self.job, self.state = job, state
        lines = [f"Slurm job {job.job_id} {why}: state {state}; log {job.stderr}",
                 f"--- last {tail_lines} lines of {job.stderr}:", _tail(job.stderr, tail_lines) or "(empty)"]
        ranks = job.rank_stderr()
        if ranks:
            lines.append(f"--- last line of each rank's stderr ({job.stderr.parent}/{job.job_id}_RANK_log.err):")
            lines += [f"rank {r}: {_tail(p, 1) or '(empty)'}" for r, p in ranks.items()]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Job:
    """A submitted job: its id, its batch logs and outputs (`submitit_job` when submitted through submitit)."""

    job_id: str
    stdout: Path
    stderr: Path
    output_dir: Path
    submitit_job: submitit.Job[Any] | None = None

    def rank_stderr(self) -> dict[int, Path]:
        """rank -> its stderr file (submitit only; with "sbatch" all ranks write to the batch log)."""
        if self.submitit_job is None:
            return {}
        files = self.stderr.parent.glob(f"{self.job_id}_*_log.err")
        return dict(sorted((int(p.name.split("_")[1]), p) for p in files))


@dataclass(frozen=True)
class JobResult:
    job_id: str
    state: str
    elapsed_s: float
    stdout: Path
    stderr: Path
    output_dir: Path


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def submit(spec: JobSpec, executor: Literal["slurm", "sbatch"] = "slurm") -> Job:
    """Submit `spec` through submitit ("slurm", HetSlurmExecutor) or as the rendered script ("sbatch")."""
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)  # Slurm does not create log directories
    if executor == "sbatch":
        script = out / "tide_hetjob.sbatch"
        write_text(script, render_hetjob_script(spec))
        jid = sbatch(script)
        return Job(jid, out / f"slurm-{jid}.out", out / f"slurm-{jid}.err", out)
    if executor != "slurm":
        raise ValueError(f"executor: expected 'slurm' or 'sbatch', got {executor!r}")
    from tide.cluster.submitit_het import submit_command

    sjob = submit_command(spec, out / "submitit")
    return Job(sjob.job_id, sjob.paths.stdout, sjob.paths.stderr, out, sjob)


def dry_run(spec: JobSpec, executor: Literal["slurm", "sbatch"] = "slurm") -> str:
    """The batch script `submit` would send, without submitting. For "slurm" it is submitit's, whose
    srun runs submitit's runner on the pickled command (and submitit insists on finding srun)."""
    if executor == "sbatch":
        return render_hetjob_script(spec)
    from tide.cluster.submitit_het import HetSlurmExecutor

    ex = HetSlurmExecutor.from_spec(spec, Path(spec.output_dir) / "submitit")
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def wait(job: Job, timeout: float, progress: bool = True, poll_s: float = 1.0) -> JobResult:
    """Poll until `job` ends; show state and elapsed time. A job that is not COMPLETED raises SlurmError;
    one still running after `timeout` seconds is cancelled and raises too."""
    t0, last, shown, known = time.monotonic(), "", 0.0, time.monotonic()
    while True:
        state = job_states([job.job_id])[job.job_id]
        elapsed = time.monotonic() - t0
        if state != "UNKNOWN":
            known = time.monotonic()
        if progress and (state != last or elapsed - shown >= 30):
            print(f"tide.cluster: job {job.job_id} {state} {int(elapsed) // 60}:{int(elapsed) % 60:02d}"
                  f" (log {job.stdout})", file=sys.stderr, flush=True)
            last, shown = state, elapsed
        if state not in ACTIVE or time.monotonic() - known > 30:  # forgotten, no accounting
            break
        if elapsed > timeout:
            cancel(job.job_id)
            raise SlurmError(job, state, f"still {state} after {timeout:.0f} s, cancelled")
        time.sleep(poll_s)
    if state != "COMPLETED":
        raise SlurmError(job, state, "did not complete")
    return JobResult(job.job_id, state, elapsed, job.stdout, job.stderr, job.output_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m tide.cluster --config C --out O [--executor slurm|sbatch] [--dry-run] [--timeout S]`."""
    p = parser("python -m tide.cluster", "Submit TIDE as one Slurm het job, sized by the config's `slurm:` section.")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--executor", choices=["slurm", "sbatch"], default="slurm")
    p.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    p.add_argument("--timeout", type=float, default=0, help="seconds to wait; 0 = submit and return")

    def body(args: argparse.Namespace) -> int:
        spec = JobSpec.for_runtime(load_slurm_config(args.config), args.config, args.out)
        if args.dry_run:
            print(dry_run(spec, args.executor))
            return 0
        job = submit(spec, args.executor)
        print(f"tide.cluster: submitted job {job.job_id}; log {job.stdout}")
        if args.timeout:
            try:
                print(wait(job, args.timeout))
            except SlurmError as e:
                print(e, file=sys.stderr)
                return 1
        return 0

    return run(p, body, argv)
