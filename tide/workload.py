"""The embedded default's one-dataset `workload:` section, served through `tide.replay`.

`WorkloadConfig` is a one-phase workload: `num_prompts` (at most the whole set) from one dataset,
Poisson arrivals at `arrival_rate` or a closed loop at `concurrency`, labelled with the dataset name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tide.config import WorkloadConfig
from tide.replay import Arrivals, Phase, WorkloadError, WorkloadSpec, build_workload, load_prompts
from tide.serve.engine import Request


def build_requests(cfg: WorkloadConfig, target_dir: Path, max_prompt_tokens: int) -> list[Request]:
    """Seeded sample of `num_prompts` requests with Poisson arrivals (rate > 0) or a closed loop."""
    try:
        phase = Phase(cfg.dataset, cfg.dataset, cfg.max_tokens, cfg.path, num_prompts=cfg.num_prompts)
        phase = replace(phase, num_prompts=min(cfg.num_prompts, len(load_prompts(cfg.dataset, cfg.path))))
    except ValueError as e:  # field-first messages: `dataset: ...`, `path: ...`
        raise WorkloadError(f"workload.{e}") from None
    arrivals = (Arrivals("poisson", rate=cfg.arrival_rate) if cfg.arrival_rate > 0
                else Arrivals("closed", concurrency=cfg.concurrency))
    return build_workload(WorkloadSpec((phase,), arrivals, cfg.seed), target_dir, max_prompt_tokens)
