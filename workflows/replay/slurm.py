"""The replay as Slurm jobs through submitit: the base draft (where it must be built), then one
array task per mode, then the report, each job depending on the one before (afterok).

The modes run side by side, each in a job of its own sized by the experiment's `slurm.serve`
component (a mode serves and, where it learns, trains: one serving node's worth). Every job runs
`python -m workflows.replay ... --stage STAGE` in the submit directory; the run directory carries
everything between them (the base draft, each mode's files), as it does for the sequential run.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tide.config import TideConfig

log = logging.getLogger(__name__)


def submit_replay(cfg: TideConfig, config: Path, out: Path, modes: tuple[str, ...]) -> Any:
    """Submit the chain; returns the report job (submitit), whose `result()` waits for the whole run."""
    import submitit
    from submitit.helpers import CommandFunction

    comp = cfg.slurm.serve
    ex = submitit.AutoExecutor(folder=out / "submitit", cluster="slurm")
    ex.update_parameters(slurm_partition=comp.partition, nodes=1, tasks_per_node=1, cpus_per_task=comp.cpus_per_task,
                         timeout_min=cfg.slurm.time, slurm_job_name=f"{cfg.slurm.job_name}-replay",
                         slurm_gpus_per_node=comp.gpus_per_node or None)

    def stage(name: str, *extra: str) -> CommandFunction:
        cmd = [sys.executable, "-m", "workflows.replay", "--config", str(config.absolute()), "--out",
               str(out.absolute()), "--stage", name, *extra]
        return CommandFunction(cmd, cwd=Path.cwd())

    after: list[str] = []
    if set(modes) - {"nospec"} and not (Path(cfg.draft.init) / "model.safetensors").exists():
        base = ex.submit(stage("base"))
        after = [base.job_id]
        log.info("replay: base draft: job %s", base.job_id)
    ex.update_parameters(slurm_additional_parameters=_after(after))
    with ex.batch():
        jobs = [ex.submit(stage("mode", "--modes", m)) for m in modes]
    log.info("replay: modes %s: array job %s", ",".join(modes), jobs[0].job_id.split("_")[0])
    ex.update_parameters(slurm_additional_parameters=_after([j.job_id for j in jobs]))
    report = ex.submit(stage("report", "--modes", ",".join(modes)))
    log.info("replay: report: job %s (logs in %s)", report.job_id, out / "submitit")
    return report


def _after(job_ids: list[str]) -> dict[str, str]:
    return {"dependency": "afterok:" + ":".join(job_ids)} if job_ids else {}
