"""What several benches share: the SmolLM2 target, the embedded default config and its drafts, seeded
requests, closed-loop serving, alternating pairs and their spread."""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from tide.config import WorkloadConfig, load_config
from tide.draft import DraftRegistry, init_draft, save_draft
from tide.draft.acceptance import PositionRates
from tide.model.target import Target
from tide.serve.engine import Request, TideEngine
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


def default_setup(work: Path, gamma: int) -> tuple[Any, Any, dict[str, Path]]:
    """The embedded default's config (serving `gamma` drafts at most), its target, and the drafts to
    compare: an untrained head and, when built, the base draft."""
    cfg, target = load_config(DEFAULT), smollm2()
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, num_speculative_tokens=gamma))
    shutil.rmtree(work, ignore_errors=True)
    v0 = DraftRegistry(work / "drafts").path(0)
    save_draft(init_draft(target.path, target.layer_ids, cfg.draft.draft_vocab_size), v0)
    drafts = {"untrained": v0}
    if base_draft() is not None:
        drafts["base"] = base_draft()
    return cfg, target, drafts


class Served(NamedTuple):
    tokens_per_s: float
    rates: PositionRates
    batch: float  # mean over the steps


def serve_closed_loop(eng: TideEngine, reqs: list[Request], b: int, tag: str, **hooks: Any) -> Served:
    """`reqs` served as a closed loop of `b` (`hooks`: `TideEngine.replay`'s, and its `window_s`)."""
    reqs = [Request(f"{tag}-{time.monotonic_ns()}-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload)
            for r in reqs]
    t0 = time.perf_counter()
    res, wins = eng.replay(reqs, concurrency=b, window_s=hooks.pop("window_s", 1e9), **hooks)
    wall = time.perf_counter() - t0
    rates = PositionRates(max(eng.gamma, 1))
    for w in wins:
        if w.rates:
            rates.merge(w.position_rates())
    batch = sum(w.mean_batch * w.steps for w in wins) / max(sum(w.steps for w in wins), 1)
    return Served(sum(len(r.output_ids) for r in res) / wall, rates, batch)
