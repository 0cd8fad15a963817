"""TIDE on Slurm: one heterogeneous job, every Slurm command call (sbatch, scontrol, sacct, scancel).

Het group 0 serves (H100-class nodes), het group 1 trains the draft (MI250-class nodes); one
`srun --het-group=0,1 --mpi=pmix` step runs the same command on every rank of both, giving ONE
MPI_COMM_WORLD with group 0's ranks first. Nothing in a het step's environment names the rank's group:
derive it from SLURM_PROCID and SLURM_NTASKS_HET_GROUP_<i>; and SLURM_JOB_PARTITION holds the *last*
group's partition on every rank (use SLURM_JOB_PARTITION_HET_GROUP_<i>).

Two ways to submit the same job, both waited on by `wait`:
  * "sbatch": `render_hetjob_script(spec)`, one pure function of the spec (checked against
    tests/expected/hetjob.sbatch), submitted with sbatch; logs in OUTDIR/slurm-<id>.{out,err}.
  * "slurm":  `tide.launch_slurm.HetSlurmExecutor`, submitit's SlurmExecutor plus hetjob sections
    (submitit 1.5.4 has none, its issue #1741), running the command through submitit's CommandFunction,
    so the only pickle is submitit's own (an argv list); logs and per-rank results in OUTDIR/submitit.
This module imports no submitit, so tide.config can import SlurmConfig from it.

Every batch script runs its step through `tide_step` (STEP_GUARD): the serving ranks' exit codes
decide the job's (a failed serving rank ends the step, a failed training rank only degrades
training), srun of a het step sometimes does not return after all ranks have exited (Slurm 22.05
mpi/pmix) and is then killed, and srun gets a deadline.

Job state comes from `scontrol show job` (slurmctld keeps finished jobs MinJobAge seconds) and then
from sacct, whose het rows `<id>+0`, `<id>+1` are folded back into `<id>`; with neither it is UNKNOWN.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time as _time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

if TYPE_CHECKING:  # submitit (the `hpc` extra) is imported only by executor "slurm", in tide.launch_slurm
    import submitit

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "UNKNOWN"}
CMD_TIMEOUT_S = 60  # a Slurm client call that takes longer means slurmctld is unreachable


@dataclass(frozen=True)
class Component:
    """One het component's allocation; field names are sbatch's options (`gpus_per_node` -> --gpus-per-node)."""

    partition: str
    nodes: int = 1
    ntasks_per_node: int = 1  # one MPI rank per task; the runtime decides what a rank does with its GPUs
    gpus_per_node: int = 0  # 0 = no --gpus-per-node line
    cpus_per_task: int = 1

    def __post_init__(self) -> None:
        if not self.partition:
            raise ValueError("Component.partition: must name a Slurm partition (sinfo -s lists them)")
        for name in ("nodes", "ntasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"Component.{name}: must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"Component.gpus_per_node: must be >= 0, got {self.gpus_per_node}")

    def sbatch_options(self) -> dict[str, Any]:
        """sbatch options with underscores (submitit's convention); gpus_per_node left out when 0."""
        opts = {"partition": self.partition, "nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node,
                "gpus_per_node": self.gpus_per_node, "cpus_per_task": self.cpus_per_task}
        return {k: v for k, v in opts.items() if not (k == "gpus_per_node" and v == 0)}


# The paper's testbed, one rank per GPU: a node of 8 H100 serves, 4 MI250 train the draft. Separate
# classes so that a config giving only `serve: {partition: x}` keeps the other serving defaults.
@dataclass(frozen=True)
class ServeComponent(Component):
    """Het group 0: serving on H100-class nodes."""

    partition: str = "h100"
    ntasks_per_node: int = 8
    gpus_per_node: int = 8
    cpus_per_task: int = 8


@dataclass(frozen=True)
class TrainComponent(Component):
    """Het group 1: draft training on MI250-class nodes (sites that count each MI250 GCD as a GPU: 8)."""

    partition: str = "mi250"
    ntasks_per_node: int = 4
    gpus_per_node: int = 4
    cpus_per_task: int = 8


@dataclass(frozen=True)
class SlurmConfig:
    """The `slurm:` config section: what to ask Slurm for. Runtime values (command, output dir) are not here."""

    job_name: str = "tide"
    time: int = 120  # minutes, for both components (sbatch --time)
    serve: ServeComponent = ServeComponent()  # het group 0
    train: TrainComponent = TrainComponent()  # het group 1
    env: dict[str, str] = field(default_factory=dict)  # exported in the batch script, for every rank
    srun_timeout_s: int = 0  # srun is stopped after this; 0 = time minus a margin, for the script to report
    mpi: str = "pmix"  # Debian's Open MPI works only with pmix (MPICH only with pmi2)

    def __post_init__(self) -> None:
        if self.time < 1:
            raise ValueError(f"SlurmConfig.time: minutes, must be >= 1, got {self.time}")
        if not self.job_name or any(c.isspace() for c in self.job_name):
            raise ValueError(f"SlurmConfig.job_name: must be one word, got {self.job_name!r}")


@dataclass(frozen=True)
class JobSpec:
    """One submission: the config section plus the command every rank runs and the output dir."""

    slurm: SlurmConfig
    command: tuple[str, ...]
    output_dir: str  # absolute; must be on a filesystem shared by both components

    def __post_init__(self) -> None:
        if not Path(self.output_dir).is_absolute() or any(c in self.output_dir for c in ' \t\n"$`\\\''):
            raise ValueError(f"JobSpec.output_dir: an absolute path without spaces, quotes, $ or \\, "
                             f"got {self.output_dir!r}")
        if not self.command:
            raise ValueError("JobSpec.command: empty; JobSpec.for_runtime() makes the tide.runtime one")

    @classmethod
    def for_runtime(cls, slurm: SlurmConfig, config: str | Path, output_dir: str | Path,
                    python: str = sys.executable) -> JobSpec:
        """The real job: `python -m tide.runtime --config CONFIG --out OUTDIR` on every rank."""
        out = str(Path(output_dir).absolute())
        cmd = (python, "-m", "tide.runtime", "--config", str(Path(config).absolute()), "--out", out)
        return cls(slurm, cmd, out)

    @property
    def components(self) -> tuple[Component, ...]:
        return (self.slurm.serve, self.slurm.train)

    @property
    def srun_timeout_s(self) -> int:
        """Explicit value, else the time limit minus 10% (at most 5 min) so the script can still report."""
        limit = self.slurm.time * 60
        return self.slurm.srun_timeout_s or limit - min(300, limit // 10)


def exports(env: Mapping[str, Any]) -> list[str]:
    return [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]


def time_str(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def sbatch_lines(opts: Mapping[str, Any]) -> list[str]:
    return [f"#SBATCH --{k.replace('_', '-')}={shlex.quote(str(v))}" for k, v in opts.items()]


# The guard every batch script defines (slurm/tide_hetjob.sh holds a copy; a test keeps them equal).
STEP_GUARD = r'''# One srun step over every het group, guarded. Het group 0's ranks serve, the others train. Each
# rank leaves its exit code in DIR/<rank>. A serving rank that fails ends the step (srun gets TERM)
# and the job fails with its code; a training rank that fails only degrades training: serving goes
# on and decides the job's code. Once every serving rank has exited 0, training ranks still running
# get TIDE_TRAIN_GRACE (60) s, then TERM. Slurm 22.05's srun can hang after all tasks of a het
# step have exited (mpi/pmix: srun joins its PMIx abort-agent thread once per het component), and
# then ignores TERM: it gets TIDE_STEP_GRACE (10) s to return once every rank is done, 3 times that
# once it got TERM, and is then killed. After SECS seconds (0 = never) srun gets TERM.
tide_step() {  # tide_step SECS DIR SRUN [OPTIONS...] -- COMMAND...
  local secs=$1 grace=${TIDE_STEP_GRACE:-10} linger=${TIDE_TRAIN_GRACE:-60} t=0 n=0 n0 f r c v rc
  local all=-1 served=-1 stop=-1 srun=() code=()
  export TIDE_STEP_DIR=$2
  shift 2
  while [[ $1 != -- ]]; do srun+=("$1"); shift; done
  shift
  for v in ${!SLURM_NTASKS_HET_GROUP_*}; do n=$((n + ${!v})); done
  ((n)) || n=${SLURM_NTASKS:-1}
  n0=${SLURM_NTASKS_HET_GROUP_0:-$n}
  mkdir -p "$TIDE_STEP_DIR"
  # each rank in a session (process group) of its own, killed once the rank has exited: a child that
  # outlives it (a vLLM engine or worker process whose parent was killed) would run on, unseen
  "${srun[@]}" bash -c 'setsid "$@" & p=$!; wait $p; rc=$?; kill -KILL -- -$p 2>/dev/null
    f=$TIDE_STEP_DIR/$SLURM_PROCID; echo $rc >"$f.tmp"; mv "$f.tmp" "$f"; exit $rc' rank "$@" &
  local pid=$!
  while
    for f in "$TIDE_STEP_DIR"/*; do  # ranks that exited since the last look
      r=${f##*/}
      [[ $r =~ ^[0-9]+$ && -z ${code[r]:-} ]] || continue
      c=$(<"$f")
      code[r]=$c
      if ((c && r < n0)); then
        echo "tide: serving rank $r exited $c: stopping the job" >&2
        ((stop >= 0)) || { kill -TERM "$pid" 2>/dev/null; stop=$t; }
      elif ((c)); then
        echo "tide: training rank $r exited $c: training degraded, serving goes on" >&2
      fi
    done
    kill -0 "$pid" 2>/dev/null
  do
    ((all < 0 && ${#code[@]} >= n)) && all=$t
    for ((r = 0, c = 0; r < n0; r++)); do [[ ${code[r]:-} == 0 ]] && c=$((c + 1)); done
    ((served < 0 && c == n0)) && served=$t
    if ((all >= 0 && t - all >= grace)); then
      echo "tide: the ranks are done, srun did not return (Slurm het-step hang): killing it" >&2
      kill -KILL "$pid"
      break
    elif ((stop >= 0 && t - stop >= 3 * grace)); then
      echo "tide: srun still running $((3 * grace)) s after TERM: killing it" >&2
      kill -KILL "$pid"
      break
    elif ((stop < 0 && served >= 0 && t - served >= linger)); then
      echo "tide: serving is done, training ranks still running after $linger s: stopping them" >&2
      kill -TERM "$pid"
      stop=$t
    elif ((stop < 0 && secs > 0 && t >= secs)); then
      echo "tide: srun still running after $secs s: stopping it" >&2
      kill -TERM "$pid"
      stop=$t
    fi
    sleep 1
    t=$((t + 1))
  done
  wait "$pid" 2>/dev/null
  rc=$?
  for ((r = n0 - 1, c = 0; r >= 0; r--)); do  # serving decides: the lowest failed rank's code, else 0
    v=${code[r]:-}
    [[ $v == 0 ]] && c=$((c + 1))
    [[ -n $v && $v != 0 ]] && rc=$v
  done
  ((c == n0)) && rc=0
  rm -rf "$TIDE_STEP_DIR"
  return "$rc"
}
'''


def step_line(n_groups: int, mpi: str, timeout_s: int, step_dir: str, srun_opts: Sequence[str],
              command: str) -> str:
    """srun over all het groups (one MPI_COMM_WORLD) through `tide_step` (STEP_GUARD), which ends
    the step when a serving rank fails but not when a training rank does (so no --kill-on-bad-exit).
    `step_dir` may hold ${SLURM_JOB_ID}; `command` is shell text."""
    groups = ",".join(str(i) for i in range(n_groups))
    srun = ["srun", f"--het-group={groups}", f"--mpi={mpi}", *srun_opts]
    return f'tide_step {timeout_s} "{step_dir}" {shlex.join(srun)} -- {command}'


def render_hetjob_script(spec: JobSpec) -> str:
    """The sbatch text of `spec`: component 0's #SBATCH lines, `#SBATCH hetjob`, component 1's, then srun."""
    s = spec.slurm
    out = Path(spec.output_dir)
    lines = ["#!/bin/bash",
             "# TIDE heterogeneous job, made by tide.slurm.render_hetjob_script (edit the config, not this).",
             f"#SBATCH --job-name={s.job_name}",
             f"#SBATCH --output={out / 'slurm-%j.out'}",
             f"#SBATCH --error={out / 'slurm-%j.err'}"]
    roles = ("serving", "draft training")
    for i, comp in enumerate(spec.components):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het group {i}: {roles[i]}")
        lines += sbatch_lines({"time": time_str(s.time), **comp.sbatch_options()})
    lines += ["", "export PYTHONUNBUFFERED=1", *exports(s.env), "", *STEP_GUARD.splitlines(), ""]
    groups = ", ".join(f"group {i} ${{SLURM_JOB_NODELIST_HET_GROUP_{i}}}" for i in range(len(spec.components)))
    step_dir = f"{out}/.step-${{SLURM_JOB_ID}}"
    lines += [f'echo "tide: job ${{SLURM_JOB_ID}}: {groups}"',
              step_line(len(spec.components), s.mpi, spec.srun_timeout_s, step_dir, ["--label"],
                        shlex.join(spec.command)), ""]
    return "\n".join(lines)


# ---- submit, state, wait --------------------------------------------------------------------------


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


def _run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client; a hung one (slurmctld unreachable) reads as a failure, rc 124."""
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(cmd), 124, "", f"{cmd[0]}: no answer in {CMD_TIMEOUT_S} s")


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


def cancel(job: Job) -> None:
    """scancel the whole het job (the leader id cancels every component)."""
    _run(["scancel", job.job_id])


def submit(spec: JobSpec, executor: Literal["slurm", "sbatch"] = "slurm") -> Job:
    """Submit `spec` through submitit ("slurm", HetSlurmExecutor) or as the rendered script ("sbatch")."""
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)  # Slurm does not create log directories
    if executor == "sbatch":
        script = out / "tide_hetjob.sbatch"
        _write_atomic(script, render_hetjob_script(spec))
        jid = sbatch(script)
        return Job(jid, out / f"slurm-{jid}.out", out / f"slurm-{jid}.err", out)
    if executor != "slurm":
        raise ValueError(f"executor: expected 'slurm' or 'sbatch', got {executor!r}")
    from tide.launch_slurm import submit_command

    sjob = submit_command(spec, out / "submitit")
    return Job(sjob.job_id, sjob.paths.stdout, sjob.paths.stderr, out, sjob)


def dry_run(spec: JobSpec, executor: Literal["slurm", "sbatch"] = "slurm") -> str:
    """The batch script `submit` would send, without submitting. For "slurm" it is submitit's, whose
    srun runs submitit's runner on the pickled command (and submitit insists on finding srun)."""
    if executor == "sbatch":
        return render_hetjob_script(spec)
    from tide.launch_slurm import HetSlurmExecutor

    ex = HetSlurmExecutor.from_spec(spec, Path(spec.output_dir) / "submitit")
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def wait(job: Job, timeout: float, progress: bool = True, poll_s: float = 1.0) -> JobResult:
    """Poll until `job` ends; show state and elapsed time. A job that is not COMPLETED raises SlurmError;
    one still running after `timeout` seconds is cancelled and raises too."""
    t0, last, shown, known = _time.monotonic(), "", 0.0, _time.monotonic()
    while True:
        state = job_states([job.job_id])[job.job_id]
        elapsed = _time.monotonic() - t0
        if state != "UNKNOWN":
            known = _time.monotonic()
        if progress and (state != last or elapsed - shown >= 30):
            print(f"tide.slurm: job {job.job_id} {state} {int(elapsed) // 60}:{int(elapsed) % 60:02d}"
                  f" (log {job.stdout})", file=sys.stderr, flush=True)
            last, shown = state, elapsed
        if state not in ACTIVE or _time.monotonic() - known > 30:  # forgotten, no accounting
            break
        if elapsed > timeout:
            cancel(job)
            raise SlurmError(job, state, f"still {state} after {timeout:.0f} s, cancelled")
        _time.sleep(poll_s)
    if state != "COMPLETED":
        raise SlurmError(job, state, "did not complete")
    return JobResult(job.job_id, state, elapsed, job.stdout, job.stderr, job.output_dir)


def load_slurm_config(path: str | Path) -> SlurmConfig:
    """The `slurm:` section of a TIDE config file, checked like every other section (one-line ConfigError)."""
    import yaml

    from tide.config import ConfigError, from_dict

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: <top>: expected a mapping, got {type(raw).__name__}")
    try:
        return from_dict(SlurmConfig, raw.get("slurm", {}), source=str(path), prefix="slurm")
    except ConfigError:
        raise
    except ValueError as e:  # a value check in __post_init__
        raise ConfigError(f"{path}: slurm: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m tide.slurm --config C --out O [--executor slurm|sbatch] [--dry-run] [--timeout S]`."""
    ap = argparse.ArgumentParser(prog="python -m tide.slurm", description="Submit TIDE as one Slurm het job.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--executor", choices=["slurm", "sbatch"], default="slurm")
    ap.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    ap.add_argument("--timeout", type=float, default=0, help="seconds to wait; 0 = submit and return")
    args = ap.parse_args(argv)
    from tide.config import ConfigError

    try:
        spec = JobSpec.for_runtime(load_slurm_config(args.config), args.config, args.out)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.dry_run:
        print(dry_run(spec, args.executor))
        return 0
    job = submit(spec, args.executor)
    print(f"tide.slurm: submitted job {job.job_id}; log {job.stdout}")
    if args.timeout:
        try:
            print(wait(job, args.timeout))
        except SlurmError as e:
            print(e, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
