"""What several benches share: the SmolLM2 target, the embedded default config, seeded requests,
alternating pairs and their spread."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tide.config import WorkloadConfig
from tide.model.target import Target
from tide.serve.engine import Request
from tide.workload import build_requests

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "local.yaml"
BASE_DRAFT = ROOT / "drafts" / "smollm2-chat"  # workflows/base_draft's SmolLM2 draft, kept in the repository


def base_draft() -> Path | None:
    """The committed base draft for SmolLM2, where it has been built."""
    return BASE_DRAFT if (BASE_DRAFT / "model.safetensors").exists() else None


def smollm2() -> Target:
    from tide.model.assets import resolve_model

    return Target.open(resolve_model("smollm2"), (2, 15, 27))


def requests(target, data: Path, dataset: str, file: str, n: int, max_tokens: int, tag: str) -> list[Request]:
    reqs = build_requests(WorkloadConfig(dataset=dataset, path=str(data / file), num_prompts=n, max_tokens=max_tokens,
                                         seed=1), target.path, 768)
    return [Request(f"{tag}-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload) for r in reqs]


def alternating_pairs(n: int, first: Callable[[], Any], second: Callable[[], Any]) -> list[tuple[Any, Any]]:
    """n (first(), second()) pairs, the order flipped every pair so that the machine's drift cancels."""
    out = []
    for i in range(n):
        if i % 2:
            b = second()
            a = first()
        else:
            a = first()
            b = second()
        out.append((a, b))
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}
