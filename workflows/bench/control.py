"""`controller-accuracy` and `never-worse`: the speculation gate's model against measured serving."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from tide.config import load_config
from tide.draft import DraftRegistry, init_draft, save_draft
from tide.draft.acceptance import AcceptanceHistogram
from tide.serve.engine import Request, TideEngine
from workflows.bench.common import DEFAULT, requests, smollm2


def _setup(work: Path) -> tuple[Any, Any, Path]:
    """The embedded default's config and target, and an untrained head at work/drafts/v0."""

    cfg, target = load_config(DEFAULT), smollm2()
    shutil.rmtree(work, ignore_errors=True)
    v0 = DraftRegistry(work / "drafts").path(0)
    save_draft(init_draft(target.path, target.layer_ids, cfg.draft.draft_vocab_size), v0)
    return cfg, target, v0


def _serve(eng: TideEngine, reqs: list[Request], b: int, tag: str) -> tuple[float, float, float]:
    """(tokens/s, AL, mean batch) of `reqs` as a closed loop of `b`."""
    reqs = [Request(f"{tag}-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload) for r in reqs]
    t0 = time.perf_counter()
    res, wins = eng.replay(reqs, concurrency=b, window_s=1e9)
    wall = time.perf_counter() - t0
    hist = AcceptanceHistogram(eng.gamma)
    for r in res:
        hist.merge(AcceptanceHistogram(eng.gamma, list(r.accept_counts)))
    batch = sum(w.mean_batch * w.steps for w in wins) / max(sum(w.steps for w in wins), 1)
    return sum(len(r.output_ids) for r in res) / wall, hist.acceptance_length, batch


def controller_accuracy(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Eq. 5 with the start-up profile against measured speedup (speculation on over off, same engine,
    same prompts) over batch sizes 1, 2, 4 and drafts of different acceptance: the untrained head and
    the GSM8K-trained one of `draft-learning`, on GSM8K test questions."""

    cfg, target, v0 = _setup(work)
    drafts = {"untrained": v0}
    trained = work.parent / "draft-learning" / "drafts" / "v1"
    if (trained / "model.safetensors").exists():
        drafts["gsm8k-trained"] = trained
    eng = TideEngine(target, cfg.serve, v0, dtype=cfg.model.dtype, capture=False)
    rows = []
    try:
        profile = eng.profile(cfg.serve.max_num_seqs)
        for v, (name, path) in enumerate(drafts.items()):
            eng.swap(path, v)
            for b in (1, 2, 4):
                reqs = requests(target, data, "gsm8k", "gsm8k/test.jsonl", (2 if quick else 4) * b, 96, f"{name}{b}")
                eng.set_speculation(True)
                on, al, batch = _serve(eng, reqs, b, "on")
                eng.set_speculation(False)
                off, _, batch_off = _serve(eng, reqs, b, "off")
                predicted = profile.predicted_speedup(al, batch)
                rows.append({"draft": name, "batch": b, "mean_batch": batch, "al": al, "tokens_per_s_on": on,
                             "tokens_per_s_off": off, "measured_speedup": on / off, "predicted_speedup": predicted,
                             "rel_error": abs(predicted - on / off) / (on / off)})
                print(f"{name:>14} b={b} (mean {batch:.2f}) AL {al:.2f}: measured {on / off:.3f}x "
                      f"predicted {predicted:.3f}x  ({rows[-1]['rel_error']:.1%})", flush=True)
    finally:
        eng.close()
    errors = [r["rel_error"] for r in rows]
    return {"max_rel_error": max(errors), "mean_rel_error": sum(errors) / len(errors),
            "profile": profile.to_json(), "break_even_batch1": profile.min_acceptance(1), "rows": rows,
            "dtype": cfg.model.dtype}


def never_worse(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """A useless draft (untrained, no trainer) under TIDE's gate against plain vLLM, same prompts,
    same cores, one after the other in one run: `ratio_vs_nospec` = TIDE tokens/s over plain."""
    from tide.runtime.coordinator import Coordinator
    from tide.runtime.serve_role import spec_on_fraction

    cfg, target, v0 = _setup(work)
    reqs = requests(target, data, "humaneval", "humaneval/HumanEval.jsonl.gz", 16 if quick else 40,
                     cfg.workload.max_tokens, "nw")
    eng = TideEngine(target, cfg.serve, v0, dtype=cfg.model.dtype, capture=False)
    try:
        coord = Coordinator(cfg, eng, None, trainer_ranks=[], drafts_root=str(work / "drafts"))
        coord.start()  # profiles T(n) and D0 before the clock starts, like the main job
        coord.serving_starts()
        t0 = time.perf_counter()
        res, wins = eng.replay(reqs, cfg.workload.concurrency, cfg.runtime.window_s, between_steps=coord.between_steps,
                               on_window=coord.on_window, on_result=coord.on_result)
        tide = sum(len(r.output_ids) for r in res) / (time.perf_counter() - t0)
    finally:
        eng.close()
    plain_eng = TideEngine(target, cfg.serve, None, dtype=cfg.model.dtype)
    try:
        plain, _, _ = _serve(plain_eng, reqs, cfg.workload.concurrency, "plain")
    finally:
        plain_eng.close()
    off = next((e for e in coord.events if e.kind == "spec-off"), None)
    return {"ratio_vs_nospec": tide / plain, "tokens_per_s_tide": tide, "tokens_per_s_nospec": plain,
            "spec_off_at_s": off.t if off else None, "spec_off_reason": off.reason if off else None,
            "speculation_on_fraction": spec_on_fraction(wins),
            "requests": len(res), "output_tokens": sum(len(r.output_ids) for r in res),
            "window_s": cfg.runtime.window_s}
