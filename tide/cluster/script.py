"""The het job's batch script: one pure function of the config (checked against
tests/expected/hetjob.sbatch), and the step guard every TIDE batch script runs its step through.

Het group 0 serves (H100-class nodes), het group 1 trains the draft (MI250-class nodes); one
`srun --het-group=0,1 --mpi=pmix` step runs the same command on every rank of both, giving ONE
MPI_COMM_WORLD with group 0's ranks first. With `slurm.coordinator` the coordinator has a group of its
own, first (rank 0, one CPU task), and serving and training move to groups 1 and 2. Nothing in a het
step's environment names the rank's group: derive it from SLURM_PROCID and SLURM_NTASKS_HET_GROUP_<i>;
and SLURM_JOB_PARTITION holds the *last* group's partition on every rank (use
SLURM_JOB_PARTITION_HET_GROUP_<i>).

`tide_step` (STEP_GUARD, the file tide_step.sh beside this module): rank 0's exit code decides the
job's (a failed coordinator ends the step; a failed serving instance ends only itself, a failed
training rank only degrades training), srun of a het step sometimes does not return after all
ranks have exited (Slurm 22.05 mpi/pmix) and is then killed, and srun gets a deadline.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tide.config import Component, ConfigError, SlurmConfig, from_dict

STEP_GUARD_FILE = Path(__file__).with_name("tide_step.sh")
STEP_GUARD = STEP_GUARD_FILE.read_text()


@dataclass(frozen=True)
class JobSpec:
    """One submission: the config section plus the command every rank runs and the output dir."""

    slurm: SlurmConfig
    command: tuple[str, ...]
    output_dir: str  # absolute; must be on a filesystem shared by every component

    def __post_init__(self) -> None:
        if not Path(self.output_dir).is_absolute() or any(c in self.output_dir for c in ' \t\n"$`\\\''):
            raise ValueError(f"JobSpec.output_dir: an absolute path without spaces, quotes, $ or \\, "
                             f"got {self.output_dir!r}")
        if not self.command:
            raise ValueError("JobSpec.command: empty; JobSpec.for_runtime() makes the tide.runtime one")

    @classmethod
    def for_runtime(cls, slurm: SlurmConfig, config: str | Path, output_dir: str | Path,
                    python: str = sys.executable, extra: tuple[str, ...] | list[str] = ()) -> JobSpec:
        """The real job: `python -m tide.runtime --config CONFIG --out OUTDIR [extra]` on every rank."""
        out = str(Path(output_dir).absolute())
        cmd = (python, "-m", "tide.runtime", "--config", str(Path(config).absolute()), "--out", out, *extra)
        return cls(slurm, cmd, out)

    @property
    def components(self) -> tuple[Component, ...]:
        """The het groups in order: the coordinator's (when it has one), serving, training."""
        first = (self.slurm.coordinator,) if self.slurm.coordinator else ()
        return (*first, self.slurm.serve, self.slurm.train)

    @property
    def roles(self) -> tuple[str, ...]:
        return ("coordinator",) * bool(self.slurm.coordinator) + ("serving", "draft training")

    @property
    def srun_timeout_s(self) -> int:
        """Explicit value, else the time limit minus 10% (at most 5 min) so the script can still report."""
        limit = self.slurm.time * 60
        return self.slurm.srun_timeout_s or limit - min(300, limit // 10)

    @property
    def signal(self) -> str:
        """`sbatch --signal`: TERM to every rank a minute before the step guard would stop srun (Slurm
        sends it up to a minute late), so that serving drains and writes its results before the limit;
        at most a quarter of the limit (as submitit sizes its own), so a short job is not signalled at
        its start."""
        limit = self.slurm.time * 60
        return f"TERM@{min(limit // 4, limit - self.srun_timeout_s + 60)}"


def exports(env: Mapping[str, Any]) -> list[str]:
    return [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]


def time_str(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def sbatch_lines(opts: Mapping[str, Any]) -> list[str]:
    return [f"#SBATCH --{k.replace('_', '-')}={shlex.quote(str(v))}" for k, v in opts.items()]


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
             "# TIDE heterogeneous job, made by tide.cluster.script.render_hetjob_script (edit the config, not this).",
             f"#SBATCH --job-name={s.job_name}",
             f"#SBATCH --output={out / 'slurm-%j.out'}",
             f"#SBATCH --error={out / 'slurm-%j.err'}",
             "# a requeued run resumes from its newest draft and stored rows, and appends to the logs",
             "#SBATCH --requeue",
             "#SBATCH --open-mode=append"]
    for i, (comp, role) in enumerate(zip(spec.components, spec.roles)):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# het group {i}: {role}")
        lines += sbatch_lines({"time": time_str(s.time), "signal": spec.signal, **comp.sbatch_options()})
    lines += ["", "export PYTHONUNBUFFERED=1", *exports({"TIDE_TRAIN_RESTARTS": s.train_restarts, **s.env}), "",
              *STEP_GUARD.splitlines(), ""]
    groups = ", ".join(f"group {i} ${{SLURM_JOB_NODELIST_HET_GROUP_{i}}}" for i in range(len(spec.components)))
    step_dir = f"{out}/.step-${{SLURM_JOB_ID}}"
    lines += [f'echo "tide: job ${{SLURM_JOB_ID}}: {groups}"',
              step_line(len(spec.components), s.mpi, spec.srun_timeout_s, step_dir, ["--label"],
                        shlex.join(spec.command)), ""]
    return "\n".join(lines)


def load_slurm_config(path: str | Path) -> SlurmConfig:
    """The `slurm:` section of a TIDE config file, checked like every other section (one-line ConfigError)."""


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
