"""Disaggregated pipeline on two GPUs (`python -m workflows.bench.pipeline --json OUT`): GPU 0 runs a
target-sized forward at serving batch and captures the accepted rows into HDF5 chunks, as a serving
instance would; GPU 1 waits for `--threshold` stored tokens (the collection gate's N_threshold) and
runs one real `DraftTrainer` cycle on them (read, train, evaluate, publish). Reports whether training
keeps up with capture and the time from the shift (capture starts) to a published draft.
Random weights at Llama-3.1-8B dimensions; `--tiny` checks the code on CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch


def make_target_dir(path: Path, cfg: dict) -> Path:
    """A target dir with just what the trainer reads: config.json and the two vocabulary matrices."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    g = torch.Generator().manual_seed(0)
    e = (torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g) * 0.02).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": e, "lm_head.weight": e.clone()}, str(path / "model.safetensors"))
    return path


def producer(cfg: dict, target_dir: str, store: str, stop: str, stats: str, batch: int, k: int, dev: str) -> None:
    """Serving-rate capture: forward [batch, k+1] tokens, keep ~(1 + 2.5) rows per sequence."""
    from tide.model.target import Target
    from tide.store import ChunkWriter, Run, bf16_to_u16
    from workflows.bench.gpu import target_model

    os.environ["LOCAL_RANK"] = dev
    torch.cuda.set_device(int(dev)) if torch.cuda.is_available() else None
    model = target_model(cfg)
    tgt = Target.open(Path(target_dir), (2, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"] - 3))
    keep = int(batch * 3.5)
    H, rows_per_run = cfg["hidden_size"], int(3.5 * 64)
    t0, produced, step = time.time(), 0, 0
    with ChunkWriter(Path(store), tgt.chunk_meta(), chunk_tokens=4096, max_pending_chunks=8) as w, torch.no_grad():
        while not os.path.exists(stop):
            ids = torch.randint(0, cfg["vocab_size"], (batch, k + 1), device=model.device)
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            rows = torch.cat([hs[i].reshape(-1, H)[:keep] for i in tgt.layer_ids], -1)
            hid = bf16_to_u16(rows)  # device -> host
            for a in range(0, keep, rows_per_run):
                n = min(rows_per_run, keep - a)
                tokens = np.random.randint(0, min(32000, cfg["vocab_size"]), n, dtype=np.int32)
                w.add(Run(f"s{step}-{a}", tokens, np.arange(n, dtype=np.int32), hid[a : a + n], np.arange(n) >= 4,
                          "pipeline", 3.5, 1))
            produced += keep
            step += 1
            Path(stats).write_text(json.dumps({"produced_rows": produced, "wall_s": time.time() - t0, "steps": step,
                                               "stored": w.stats()}))


def main(argv: list[str] | None = None) -> int:
    from workflows.bench.gpu import L8B, TINY

    p = argparse.ArgumentParser(prog="python -m workflows.bench.pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/tide-pipeline"))
    p.add_argument("--threshold", type=int, default=131072, help="stored tokens that start training")
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    cfg = TINY if a.tiny else L8B
    shutil.rmtree(a.work, ignore_errors=True)
    target = make_target_dir(a.work / "target", cfg)
    store, stop, stats = a.work / "store", a.work / "stop", a.work / "producer.json"
    ctx = mp.get_context("spawn")
    t_shift = time.time()
    prod = ctx.Process(target=producer, args=(cfg, str(target), str(store), str(stop), str(stats),
                                               8 if a.tiny else 64, 3, "0"))
    prod.start()
    # --- the trainer side (GPU 1): wait for the threshold, then one real cycle
    os.environ["LOCAL_RANK"] = "1" if torch.cuda.device_count() > 1 else "0"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from tide.config import TrainConfig
    from tide.model.target import Target
    from tide.store import ChunkReader
    from tide.train import DraftTrainer

    tgt = Target.open(target, (2, cfg["num_hidden_layers"] // 2, cfg["num_hidden_layers"] - 3))
    reader = ChunkReader(store, tgt.chunk_meta())
    while reader.total_tokens() < a.threshold and prod.is_alive():
        time.sleep(0.5)
    t_threshold = time.time()
    trainer = DraftTrainer(TrainConfig(epochs=1.0, batch_tokens=8192, seq_len=2048, zero_stage=2, precision="bf16"),
                           target, store, a.work / "drafts", expect=tgt.chunk_meta(), aux_layer_ids=tgt.layer_ids,
                           draft_vocab_size=32000 if not a.tiny else 512, eval_fraction=0.05)
    r = trainer.cycle(a.threshold)
    t_published = time.time()
    stop.write_text("done")
    prod.join(timeout=120)
    ps = json.loads(stats.read_text())
    capture_rate = ps["produced_rows"] / ps["wall_s"]
    out = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threshold_tokens": a.threshold, "capture_tokens_per_s": capture_rate,
        "store_write_bytes_per_s": ps["stored"]["bytes"] / ps["wall_s"], "producer": ps,
        "shift_to_threshold_s": t_threshold - t_shift, "cycle_s": r.wall_s if r else None,
        "shift_to_published_s": t_published - t_shift, "train_tokens": r.train_tokens if r else 0,
        "train_tokens_per_s": r.tokens_per_s if r else 0,
        "cycle_tokens_per_s": (r.train_tokens / r.wall_s) if r else 0,
        "keeps_up": bool(r and r.train_tokens / r.wall_s >= capture_rate),
        "version": r.version if r else None,
    }
    a.json.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "producer"}, indent=1))
    trainer.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
