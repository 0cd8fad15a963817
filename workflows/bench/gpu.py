"""GPU figures in one call (`python -m workflows.bench.gpu --json OUT`; add `--world 2` for the two-GPU
part, which relaunches itself under torchrun). Random weights at Llama-3.1-8B dimensions: cost, not
quality, is measured. `--tiny` runs the same code at toy sizes (on CPU too) to check it works.

- matmul: the bf16 matrix rate measured in the same call (the MFU denominator)
- trainer: one DeepSpeed ZeRO-2 bf16 draft-training step (TTT depth 3 and 7): tokens/s, MFU
- capture-copy: a target forward with and without copying the accepted rows [n, 3H] to pinned host
  memory on a side stream
- prefill: target prefill tokens/s with hidden states (the recompute baseline's cost)
- data-parallel (--world 2): the trainer over 2 GPUs vs 1, and the loss curves of one global batch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tide.draft.model import Eagle3Draft
from tide.draft.spec import DraftSpec

L8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
           vocab_size=128256, num_hidden_layers=32, rms_norm_eps=1e-5, max_position_embeddings=8192,
           rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
TINY = dict(L8B, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, intermediate_size=256,
            vocab_size=1024, num_hidden_layers=8)


def device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def timed(fn, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call (synchronised)."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(n: int) -> float:
    a = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
    return 2 * n**3 / timed(lambda: a @ b, 10, 3) / 1e12


def draft_model(cfg: dict[str, Any], draft_vocab: int) -> Eagle3Draft:
    spec = DraftSpec.from_target(cfg, (2, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"] - 3), draft_vocab)
    torch.manual_seed(0)
    return Eagle3Draft(spec, torch.randn(cfg["vocab_size"], cfg["hidden_size"]) * 0.02)


def batch(spec: DraftSpec, B: int, T: int, depth: int, seed: int):
    from tide.train.data import Batch

    g = torch.Generator().manual_seed(seed)
    aux = (torch.randn(B, T, 3 * spec.hidden_size, generator=g) * 0.5).to(torch.bfloat16)
    tokens = torch.randint(0, spec.draft_vocab_size, (B, T + depth + 1), generator=g)
    return Batch(aux, tokens, torch.ones_like(tokens, dtype=torch.bool), 0, B * T).to(device())


def flops_per_token(s: DraftSpec, depth: int, T: int) -> float:
    """Training FLOPs (6 x weights used, fwd + bwd) per position over `depth` TTT steps, plus
    causal attention (QK and PV: 4 x T/2 x heads x head_dim forward, x3 with backward)."""
    H, nh, nkv, hd = s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim
    layer = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * s.intermediate_size + H * s.draft_vocab_size
    attn = 3 * 4 * (T / 2) * nh * hd
    return 6 * (3 * H * H) + depth * (6 * layer + attn)


def train_engine(model: Eagle3Draft, depth: int, gas: int = 1):
    import deepspeed

    from tide.train.trainer import _Objective

    obj = _Objective(model, depth, 0.8)
    opt = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-4,
                            fused=torch.cuda.is_available())
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=obj, optimizer=opt, config=cfg)
    return engine


def trainer_throughput(cfg: dict[str, Any], depth: int, B: int, T: int, peak: float, iters: int) -> dict[str, Any]:
    model = draft_model(cfg, 32000 if cfg is L8B else 512)
    engine = train_engine(model, depth)
    world = torch.distributed.get_world_size()
    b = batch(model.spec, B, T, depth, seed=torch.distributed.get_rank())

    def step() -> None:
        loss, _ = engine(b)
        engine.backward(loss)
        engine.step()

    s = timed(step, iters, 3)
    tps = world * B * T / s
    fpt = flops_per_token(model.spec, depth, T)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"depth": depth, "world": world, "micro_batch": B, "seq_len": T, "step_ms": s * 1e3,
            "tokens_per_s": tps, "trainable_params": trainable, "flops_per_token": fpt,
            "mfu": tps * fpt / world / (peak * 1e12) if peak else None}


def loss_curve(cfg: dict[str, Any], steps: int, B: int, T: int) -> list[float]:
    """One global batch of 2 micro-batches per step: 1 GPU accumulates both, 2 GPUs take one each."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model = draft_model(cfg, 32000 if cfg is L8B else 512)
    engine = train_engine(model, 3, gas=2 // world)
    losses = []
    for s in range(steps):
        total = torch.zeros((), device=device())
        for m in range(2 // world):
            loss, _ = engine(batch(model.spec, B, T, 3, seed=1000 * s + rank + m))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 2)
    return losses


def target_model(cfg: dict[str, Any]):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(**{k: v for k, v in cfg.items()}, attn_implementation="sdpa")
    with torch.device(device()):
        model = LlamaForCausalLM(c).to(torch.bfloat16).eval()
    return model


@torch.no_grad()
def capture_copy(model, cfg: dict[str, Any], shape: tuple[int, int], keep: int, iters: int) -> dict[str, Any]:
    """Step time of a target forward alone vs with the capture: gather `keep` rows of 3 aux layers
    and copy them to pinned host memory on a side stream (host buffers sized once, as in serving)."""
    ids = torch.randint(0, cfg["vocab_size"], shape, device=device())
    layers = (2, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"] - 3)
    idx = torch.arange(keep, device=device())
    H = cfg["hidden_size"]
    host = torch.empty(keep, 3 * H, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
    side = torch.cuda.Stream() if torch.cuda.is_available() else None

    def plain() -> None:
        model(input_ids=ids, output_hidden_states=True)

    def with_capture() -> None:
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        rows = torch.cat([hs[i].reshape(-1, H).index_select(0, idx) for i in layers], -1)
        if side is None:
            host.copy_(rows)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rows.record_stream(side)
            host.copy_(rows, non_blocking=True)

    t_plain, t_cap = timed(plain, iters), timed(with_capture, iters)
    t_plain2 = timed(plain, iters)  # bracket: drift shows as a difference between the two plain runs
    base = (t_plain + t_plain2) / 2
    return {"tokens": shape[0] * shape[1], "rows_copied": keep, "copy_bytes": keep * 3 * H * 2,
            "step_ms": base * 1e3, "step_ms_with_capture": t_cap * 1e3, "overhead": (t_cap - base) / base,
            "plain_runs_ms": [t_plain * 1e3, t_plain2 * 1e3]}


@torch.no_grad()
def prefill_rate(model, cfg: dict[str, Any], B: int, T: int, iters: int) -> float:
    ids = torch.randint(0, cfg["vocab_size"], (B, T), device=device())
    return B * T / timed(lambda: model(input_ids=ids, output_hidden_states=True), iters)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="toy sizes (checks the code, also on CPU)")
    p.add_argument("--world", type=int, default=1, help="2: also the data-parallel figures (torchrun)")
    p.add_argument("--part", default="all", choices=("all", "dp"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cfg = TINY if a.tiny else L8B
    B, T, iters = (2, 64, 2) if a.tiny else (4, 2048, 8)
    from tide.train.trainer import init_distributed

    init_distributed()
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    if a.part == "dp":  # under torchrun: the 2-GPU half of the data-parallel figures
        out["trainer_dp"] = trainer_throughput(cfg, 3, B, T, 0.0, iters)  # MFU comes from the 1-GPU part
        out["loss_curve"] = loss_curve(cfg, 6, 2, T // 4)
        if rank == 0:
            a.json.write_text(json.dumps(out))
        return 0
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out["matmul_tflops"] = peak = matmul_tflops(1024 if a.tiny else 8192)
    print(f"matmul {peak:.0f} TFLOP/s", flush=True)
    out["trainer"] = [trainer_throughput(cfg, d, B, T, peak, iters) for d in (3, 7)]
    for r in out["trainer"]:
        print(f"trainer depth {r['depth']}: {r['tokens_per_s']:.0f} tok/s, MFU {r['mfu'] or 0:.1%}", flush=True)
    a.json.write_text(json.dumps(out, indent=1))  # keep what is measured if a later part fails
    out["loss_curve_1gpu"] = loss_curve(cfg, 6, 2, T // 4)
    model = target_model(cfg)
    out["capture_copy"] = [capture_copy(model, cfg, (64, 4), 224, iters * 3),  # decode: 64 seqs, K=3, ~2.5 accepted
                           capture_copy(model, cfg, (2, 2048), 4096, iters)]  # prefill chunk: every row kept
    out["prefill_tokens_per_s"] = prefill_rate(model, cfg, B, T, iters)
    del model
    for c in out["capture_copy"]:
        print(f"capture {c['tokens']} tokens: {c['overhead']:.2%} of {c['step_ms']:.2f} ms", flush=True)
    print(f"prefill {out['prefill_tokens_per_s']:.0f} tok/s", flush=True)
    train_tps = out["trainer"][0]["tokens_per_s"]
    # one update from N fresh tokens: TIDE trains on captured rows; recompute first prefills them
    out["recompute_over_tide"] = {f"epochs_{e}": (1 / out["prefill_tokens_per_s"] + e / train_tps) / (e / train_tps)
                                  for e in (1, 2)}
    if a.world > 1:
        torch.distributed.destroy_process_group()
        dp_json = a.json.with_name(a.json.stem + "-dp.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.world),
               "-m", "workflows.bench.gpu",
               "--json", str(dp_json), "--part", "dp"] + (["--tiny"] if a.tiny else [])
        launcher_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        subprocess.run(cmd, check=True, env={k: v for k, v in os.environ.items() if k not in launcher_env})
        dp = json.loads(dp_json.read_text())
        one = out["trainer"][0]
        out["data_parallel"] = {**dp["trainer_dp"], "tokens_per_s_1gpu": one["tokens_per_s"],
                                "speedup": dp["trainer_dp"]["tokens_per_s"] / one["tokens_per_s"],
                                "loss_curve_2gpu": dp["loss_curve"],
                                "loss_max_rel_diff": max(abs(x - y) / abs(x) for x, y in
                                                         zip(out["loss_curve_1gpu"], dp["loss_curve"]))}
        print(f"data parallel x{a.world}: {out['data_parallel']['speedup']:.2f}x, loss max rel diff "
              f"{out['data_parallel']['loss_max_rel_diff']:.2e}", flush=True)
    a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
