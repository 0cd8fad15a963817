"""`draft-pass`: where a draft step's time goes on the CPU (D0), and what a smaller draft vocabulary saves.

The engine serves in this process (`bind_serving`), so the bench reaches vLLM's drafter and times its
parts from the outside: the fusion of the target's three hidden states (`combine_hidden_states`), the
draft's decoder layer (`model.forward`), the LM head and argmax (`_sample_draft_tokens`), attention
metadata and the first pass's inputs; what is left of `propose` is vLLM's bookkeeping between them.
Each setting is served once unmeasured first (a new draft length meets new shapes, and oneDNN builds
its kernels for them on first use), then in three measured rounds. The same on an untrained head at
draft vocabulary 8k and 4k gives the LM head's share. A profiled run (torch.profiler, CPU) splits the
base draft's passes by aten op and Python time. The bytes of the weights a pass reads, against the
target's (float32), give the floor a memory-bound pass cannot go under; the draft's GEMMs read bf16 where
`serve.draft_dtype` makes them so (the default on a CPU with bf16 matmul units)."""

from __future__ import annotations

import collections
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tide.config import load_config
from tide.draft import DraftRegistry, init_draft, save_draft
from tide.runtime.processes import bind_serving
from tide.serve.engine import Request, TideEngine
from workflows.bench.common import DEFAULT, default_setup, requests, serve_closed_loop

PARTS = {  # drafter method -> label; what `propose` spends outside them is vLLM's bookkeeping
    "combine_hidden_states": "fc (3 hidden states -> 1)",
    "forward": "decoder layer",
    "_sample_draft_tokens": "LM head + argmax",
    "build_per_group_and_layer_attn_metadata": "attention metadata",
    "set_inputs_first_pass": "first pass inputs",
    "_update_positions_dependent_metadata": "position updates",
}


class _Timer:
    """Wraps the drafter's methods (instance attributes over the class's): wall time and calls of
    each, and a `record_function` range of the same name while profiling."""

    def __init__(self, drafter: Any) -> None:
        self.s: dict[str, float] = collections.defaultdict(float)
        self.n: dict[str, int] = collections.defaultdict(int)
        self.profiling = False
        self._wrap(drafter, "propose")
        for name in PARTS:
            self._wrap(drafter.model if name in ("combine_hidden_states", "forward") else drafter, name)

    def _wrap(self, obj: Any, attr: str) -> None:
        import torch

        inner = getattr(obj, attr)

        def timed(*args: Any, **kw: Any) -> Any:
            with torch.profiler.record_function(f"draft.{attr}") if self.profiling else nullcontext():
                t0 = time.perf_counter()
                try:
                    return inner(*args, **kw)
                finally:
                    self.s[attr] += time.perf_counter() - t0
                    self.n[attr] += 1

        setattr(obj, attr, timed)

    def take(self, k: int) -> dict[str, Any]:
        calls = max(self.n["propose"], 1)
        parts = {PARTS[p]: 1e3 * self.s[p] / calls for p in PARTS}
        propose = 1e3 * self.s["propose"] / calls
        parts["bookkeeping (rest of propose)"] = propose - sum(parts.values())
        row = {"calls": self.n["propose"], "propose_ms": propose, "per_pass_ms": propose / k, "parts_ms": parts}
        self.s.clear()
        self.n.clear()
        return row


def _mb(model_dir: Path, bytes_per_param: int = 4) -> float:
    """MB of weights a pass reads at `bytes_per_param`: every float tensor of the checkpoint (the target's
    tied embedding once, as its LM head; the draft's index maps d2t/t2d are not weights)."""
    from safetensors import safe_open

    n = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            t = f.get_slice(key)
            if t.get_dtype() in ("F32", "BF16", "F16"):
                n += math.prod(t.get_shape())
    return n * bytes_per_param / 2**20


def _op_table(prof: Any, top: int) -> dict[str, Any]:
    """The profiled `draft.propose` ranges: their aten ops by self time and the time in the bench's
    ranges outside any op (Python)."""
    events = prof.events()
    calls = [e for e in events if e.name == "draft.propose"]

    def inside(e: Any) -> bool:
        p = e.cpu_parent
        while p is not None and p.name != "draft.propose":
            p = p.cpu_parent
        return p is not None

    ops: dict[str, float] = collections.defaultdict(float)
    python_us = 0.0
    for e in events:
        if e.name.startswith("draft."):
            python_us += e.self_cpu_time_total if e.name == "draft.propose" or inside(e) else 0.0
        elif inside(e):
            ops[e.name] += e.self_cpu_time_total
    n = max(len(calls), 1)
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    return {"calls": len(calls), "propose_us": sum(c.cpu_time_total for c in calls) / n,
            "python_us": python_us / n,
            "ops_us": {k: v / n for k, v in ranked[:top]}, "other_ops_us": sum(v for _, v in ranked[top:]) / n}


def _plain_step_ms(eng: TideEngine, reqs: list[Request], b: int) -> float:
    """A decode step with speculation off at batch b, the engine's own work included: T(b, b)."""
    eng.set_speculation(False)
    try:
        _, wins = eng.replay([Request(f"plain-{time.monotonic_ns()}-{r.request_id}", r.prompt_ids, r.max_tokens)
                              for r in reqs], concurrency=b, window_s=1e9)
    finally:
        eng.set_speculation(True)
    key = f"{b},{b}"
    cost = [w.costs["target"][key] for w in wins if key in w.costs.get("target", {})]
    return 1e3 * sum(c[1] for c in cost) / max(sum(c[0] for c in cost), 1)


def _measure(cfg: Any, target: Any, draft: Path, data: Path, quick: bool, profile: bool) -> dict[str, Any]:
    import torch

    eng = TideEngine(target, cfg.serve, draft, dtype=cfg.model.dtype, capture=False)
    runner = eng.engine.collective_rpc(lambda worker: worker.model_runner)[0]
    timer = _Timer(runner.drafter)
    out: dict[str, Any] = {"draft_gemms": eng.draft_gemms,
                           "draft_mb": _mb(draft, 2 if eng.draft_gemms == "bfloat16" else 4)}
    try:
        for b in (1, 4):
            reqs = requests(target, data, "gsm8k", "gsm8k/test.jsonl", b, 32 if quick else 96, f"dp{b}")
            serve_closed_loop(eng, reqs, b, "warm")
            out[f"batch{b}_plain_step_ms"] = _plain_step_ms(eng, reqs, b)
            for k in (1, 3):
                eng.set_draft_lengths([k] * len(eng.lengths))
                rounds = []
                for r in range(2 if quick else 4):  # round 0 warms the new shapes up
                    serve_closed_loop(eng, reqs, b, f"k{k}r{r}")
                    rounds.append(timer.take(k))
                row = _mean_rows(rounds[1:])
                if profile and b == 1:
                    timer.profiling = True
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        serve_closed_loop(eng, reqs, b, f"prof{k}")
                    timer.profiling = False
                    timer.take(k)
                    row["profiled"] = _op_table(prof, 12)
                out[f"batch{b}_k{k}"] = row
                print(f"{draft.name} batch {b} k {k}: propose {row['propose_ms']:.2f} ms; "
                      + ", ".join(f"{p} {v:.2f}" for p, v in row["parts_ms"].items()), flush=True)
    finally:
        eng.close()
    return out


def _mean_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"calls": sum(r["calls"] for r in rows), "propose_ms": mean([r["propose_ms"] for r in rows]),
            "per_pass_ms": mean([r["per_pass_ms"] for r in rows]),
            "parts_ms": {p: mean([r["parts_ms"][p] for r in rows]) for p in rows[0]["parts_ms"]},
            "rounds_propose_ms": [r["propose_ms"] for r in rows]}


def draft_pass(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    bind_serving(load_config(DEFAULT).runtime.serve_cores)  # the engine core in this process, on core 0
    cfg, target, drafts = default_setup(work, 3)
    v4k = DraftRegistry(work / "drafts-4k").path(0)
    save_draft(init_draft(target.path, target.layer_ids, 4096), v4k)
    out: dict[str, Any] = {"target_mb": _mb(target.path)}
    settings = [("base", drafts.get("base")), ("untrained-8k", drafts["untrained"]), ("untrained-4k", v4k)]
    for name, path in settings:
        if path is not None:
            out[name] = _measure(cfg, target, path, data, quick, profile=name == "base")
    for name, _ in settings:
        if name in out:
            out[f"{name}_d0_ms"] = out[name]["batch1_k1"]["propose_ms"]
            out[f"{name}_d0_over_t1"] = out[f"{name}_d0_ms"] / out[name]["batch1_plain_step_ms"]
            out[f"{name}_mb_over_target_mb"] = out[name]["draft_mb"] / out["target_mb"]
    return out
