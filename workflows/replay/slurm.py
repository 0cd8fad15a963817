"""The replay as Slurm jobs through submitit, waited on: the base draft (where it must be built) as a
job of its own, then every mode as a TIDE het job of its own, side by side.

A mode's job is the main job's (`tide.runtime`, sized by the experiment's `slurm:` section) serving
the experiment's phases (`--phases`): each serving rank is one vLLM instance with its round-robin
share of every phase, rank 0 coordinates, the training component trains where the mode learns (in
`static` and `nospec` it only waits to be stopped). `nospec` is the same job with plain engines
(`control.policy: nospec`), so every mode serves on as many instances. Each
mode's files land in OUT/MODE as in a local run (the other instances' under OUT/MODE/instances/);
the command then writes the report itself.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tide.config import TideConfig
from tide.workload import WorkloadSpec, check_spread
from workflows.replay.runner import write_mode_config, write_mode_record

log = logging.getLogger(__name__)


def run_replay_jobs(cfg: TideConfig, spec: WorkloadSpec, config: Path, out: Path, modes: tuple[str, ...]) -> None:
    """Submit the base-draft job (where `draft.init` must be built) and wait for it, then one het job per
    mode; wait for all of them (a job that fails raises `tide.cluster.submit.SlurmError`)."""
    from tide.cluster.commands import cancel
    from tide.cluster.script import JobSpec
    from tide.cluster.submit import submit, wait

    check_spread(spec, cfg.slurm.serve.nodes * cfg.slurm.serve.ntasks_per_node, str(config),
                 cfg.slurm.coordinator is not None)
    if set(modes) - {"nospec"} and not (Path(cfg.draft.init) / "model.safetensors").exists():
        base = _base_job(cfg, config, out)
        log.info("replay: base draft: job %s", base.job_id)
        base.result()  # raises if it failed
    jobs = {}
    for mode in modes:
        mcfg = write_mode_config(cfg, mode, out / mode)
        job_spec = JobSpec.for_runtime(mcfg.slurm, out / mode / "config.yaml", out / mode,
                                       extra=("--phases", str(config.absolute())))
        jobs[mode] = submit(job_spec, "slurm")
        log.info("replay: mode %s: job %s", mode, jobs[mode].job_id)
    try:
        for mode, job in jobs.items():  # a job's own time limit bounds its run; a queue may hold it longer
            wait(job, float("inf"))
            summary = json.loads((out / mode / "summary.json").read_text())
            done = [row["rank"] for row in summary.get("instances", []) if row["rank"] and row["state"] == "done"]
            write_mode_record(out / mode, mode, summary.get("workload", []), done)  # none: a coordinator of its own
    except BaseException:  # one mode failed (or the command was stopped): no report would read the others
        for job in jobs.values():
            cancel(job.job_id)
        raise


def _base_job(cfg: TideConfig, config: Path, out: Path):  # -> submitit.Job
    """`python -m workflows.replay ... --stage base` as a job on one serving node."""
    import submitit
    from submitit.helpers import CommandFunction

    comp = cfg.slurm.serve
    ex = submitit.AutoExecutor(folder=out / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition=comp.partition, nodes=1, tasks_per_node=1, cpus_per_task=comp.cpus_per_task,
                         timeout_min=cfg.slurm.time, slurm_job_name=f"{cfg.slurm.job_name}-replay-base",
                         slurm_gpus_per_node=comp.gpus_per_node or None)
    cmd = [sys.executable, "-m", "workflows.replay", "--config", str(config.absolute()), "--out", str(out.absolute()),
           "--stage", "base"]
    return ex.submit(CommandFunction(cmd, cwd=Path.cwd()))
