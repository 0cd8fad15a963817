"""What several benches share: the SmolLM2 target, the embedded default config, seeded requests."""

from __future__ import annotations

from pathlib import Path

from tide.config import WorkloadConfig
from tide.model.target import Target
from tide.serve.engine import Request
from tide.workload import build_requests

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def smollm2() -> Target:
    from tide.model.assets import resolve_model

    return Target.open(resolve_model("smollm2"), (2, 15, 27))


def requests(target, data: Path, dataset: str, file: str, n: int, max_tokens: int, tag: str) -> list[Request]:
    reqs = build_requests(WorkloadConfig(dataset=dataset, path=str(data / file), num_prompts=n, max_tokens=max_tokens,
                                         seed=1), target.path, 768)
    return [Request(f"{tag}-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload) for r in reqs]
