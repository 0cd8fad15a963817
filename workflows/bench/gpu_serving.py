"""TIDE's serving seam on a CUDA GPU (vLLM's CUDA build), end to end: `python -m workflows.bench.gpu_serving`.

    python -m workflows.bench.gpu_serving --target MODEL_DIR --draft DRAFT_DIR --json OUT.json [--parts a,b]

Parts, each written to the JSON as soon as it is done (a failing part records its error, the rest go
on): `tests` (pytest -m gpu: lossless across hot-swaps and draft lengths, speculation off, capture
equal to transformers' hidden states), `profile` (T(n), D(b, k) and break-even at batch 1..64),
`lossless` (the target with the draft, fp32 and bf16, across a hot-swap mid-request), `capture`
(captured rows against transformers on the same GPU), `capture-overhead` and `off-cost` (alternating
pairs), `hot-swap` (the pause), `speedup` (drafting k against plain decoding, batch 1 and 16), `path`
(a plain engine against the speculative one with speculation off, with and without capture and CUDA
graphs, and with speculation on at k = 1 and 3, each in a process of its own) and `loop` (tide.launch
with the engine and the trainer on this GPU, batch 1 and a serving batch). With `--cpu` the same code
runs on the CPU with the tiny target (a check before spending device time).

On the GPU every engine but the eager lossless runs uses CUDA graphs, as vLLM serves (`--eager`: none).
Without `--target` the target is a tiny random Llama and the draft an untrained head (a seam check:
its AL and speedups mean nothing); with SmolLM2 the prompts are GSM8K test questions through the chat
template. `--same-weights-as` lets the base draft serve a target converted from the same GGUF by
another transformers version (same weights file, another config.json, so another model hash).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import yaml

from tide.cli import parser, run
from tide.config import ServeConfig
from tide.model.target import Target
from workflows.bench.common import alternating_pairs, spread

PARTS = ("tests", "profile", "lossless", "capture", "capture-overhead", "off-cost", "hot-swap", "speedup", "path",
         "loop")
# the serving path, one step at a time: what each layer of TIDE's engine costs against a plain vLLM engine,
# then speculation on at a fixed draft length (spec-kN)
PATH_VARIANTS = ("plain", "spec-off", "spec-off-capture", "spec-k1", "spec-k3", "plain-eager", "spec-off-eager")


def _serve(eng: Any, prompts: list[list[int]], b: int, tag: str, max_tokens: int) -> tuple[float, list[Any]]:
    from tide.serve.engine import Request

    reqs = [Request(f"{tag}{time.monotonic_ns()}-{i}", p, max_tokens) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    res, _ = eng.replay(reqs, concurrency=b, window_s=1e9)
    return sum(len(r.output_ids) for r in res) / (time.perf_counter() - t0), res


class Bench:
    def __init__(self, target: Target, draft: Path, out: Path, cpu: bool, eager: bool = False,
                 batches: tuple[int, ...] = (1, 16), variants: tuple[str, ...] = PATH_VARIANTS) -> None:
        from tide.draft import init_draft, save_draft

        self.target, self.draft, self.out, self.cpu = target, draft, out, cpu
        self.batches, self.variants = batches, variants  # of the path part
        self.graphs = not cpu and not eager  # CUDA graphs where vLLM serves with them, unless --eager
        self.dtype = "float32" if cpu else "bfloat16"
        self.results: dict[str, Any] = {"device": "cpu" if cpu else torch.cuda.get_device_name(0),
                                        "torch": torch.__version__, "target": target.path.name,
                                        "cuda_graphs": not cpu and not eager,
                                        "cuda": torch.version.cuda}
        import transformers
        import vllm

        self.results["vllm"], self.results["transformers"] = vllm.__version__, transformers.__version__
        self.other = out.parent / "draft-other"  # a second draft to swap with
        save_draft(init_draft(target.path, target.layer_ids, json.loads((draft / "config.json").read_text())
                              .get("draft_vocab_size", 0) or 0), self.other)
        self.prompts = _prompts(target)
        self.results["prompts"] = "gsm8k test (chat template)" if (target.path / "tokenizer.json").exists() \
            else "random token ids"

    def serve_cfg(self, batch: int, k: int = 3, eager: bool | None = None) -> ServeConfig:
        return _serve_cfg(batch, not self.graphs if eager is None else eager, self.cpu, k)

    def engine(self, batch: int, draft: Path | None = None, dtype: str | None = None, store: Path | None = None,
               k: int = 3, eager: bool | None = None) -> Any:
        import gc

        from tide.serve.engine import TideEngine

        gc.collect()  # engines closed earlier hold the GPU's memory until collected
        if not self.cpu:
            torch.cuda.empty_cache()
        return TideEngine(self.target, self.serve_cfg(batch, k, eager), draft, dtype=dtype or self.dtype,
                          store_root=store, capture=store is not None)

    def close(self, *engines: Any) -> None:
        """Shut engines down and give their memory back before the next one starts (same process)."""
        import gc

        for e in engines:
            e.close()
        del engines
        gc.collect()
        if not self.cpu:
            torch.cuda.empty_cache()

    def save(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1, default=str))

    def part(self, name: str, fn: Any) -> None:
        t0 = time.time()
        try:
            self.results[name] = fn()
        except Exception as e:  # one part failing must not cost the others their device time
            self.results[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        self.results[f"{name}_s"] = round(time.time() - t0, 1)
        print(name, json.dumps(self.results[name], default=str)[:800], flush=True)
        self.save()

    # ---------------------------------------------------------------- parts
    def tests(self) -> dict[str, Any]:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p",
                            "no:cacheprovider"], capture_output=True, text=True, timeout=900)
        return {"rc": p.returncode, "tail": p.stdout[-2500:] + p.stderr[-1500:]}

    def profile(self) -> dict[str, Any]:
        eng = self.engine(64 if not self.cpu else 4, self.draft)
        try:
            m = eng.profile(64 if not self.cpu else 4, steps=8)
        finally:
            self.close(eng)
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= (64 if not self.cpu else 4)]
        # D0 as timed: the drafter's own passes (device-synchronised around propose), per drafted token
        batches = sorted({b for b, _ in m.draft})
        d0 = {b: min(t / k for (bb, k), t in m.draft.items() if bb == b) * 1e3 for b in batches}
        return {"model": m.to_json(), "d0_ms_measured": d0,
                "d0_over_t1": d0[min(d0)] / (m.target_latency(min(d0)) * 1e3),
                "t_ms": {b: m.target_latency(b) * 1e3 for b in sizes},
                "draft_ms": {f"{b},{k}": m.draft_latency(b, k) * 1e3 for b in sizes for k in (1, 2, 3)},
                "draft_over_target_b1": m.draft_latency(1, 1) / m.target_latency(1),
                "break_even": {f"{b},{k}": m.break_even(b, k) for b in sizes for k in (1, 2, 3)}}

    def lossless(self) -> dict[str, Any]:
        """fp32 and bf16 eagerly; on the GPU bf16 with CUDA graphs too (as served)."""
        runs = [("float32", True), ("bfloat16", True)] + ([("bfloat16", False)] if self.graphs else [])
        return {f"{dtype}-{'eager' if eager else 'graphs'}": self._lossless(dtype, eager) for dtype, eager in runs}

    def _plain_outputs(self, dtype: str, eager: bool) -> dict[str, list[int]]:
        plain = self.engine(4, None, dtype, eager=eager)
        try:
            return {r.request_id.split("-")[1]: r.output_ids for r in _serve(plain, self.prompts[:16], 4, "r", 48)[1]}
        finally:
            self.close(plain)

    def _lossless(self, dtype: str, eager: bool) -> dict[str, Any]:
        """The target with the draft against the target alone, greedy, a hot-swap every 7 steps."""
        from tide.serve.engine import Request

        ref = self._plain_outputs(dtype, eager)
        eng = self.engine(4, self.draft, dtype, eager=eager)
        swaps = []

        def swap(e: Any, t: float) -> None:
            if (len(swaps) + 1) % 7 == 0 or not swaps:
                e.swap(self.other if e.version == 0 else self.draft, 1 - e.version)
            swaps.append(e.version)

        try:
            reqs = [Request(f"s-{i}", p, 48) for i, p in enumerate(self.prompts[:16])]
            res, _ = eng.replay(reqs, concurrency=4, window_s=1e9, between_steps=swap)
        finally:
            self.close(eng)
        got = {r.request_id.split("-")[1]: r.output_ids for r in res}
        return {"equal": sum(got[k] == ref[k] for k in ref), "of": len(ref),
                "swaps": sum(a != b for a, b in zip(swaps, swaps[1:]))}

    def capture(self) -> dict[str, Any]:
        import numpy as np
        from transformers import AutoModelForCausalLM

        from tide.store import ChunkReader, u16_to_bf16

        store = self.out.parent / "capture-store"
        eng = self.engine(4, self.draft, store=store)
        try:
            _serve(eng, self.prompts[:8], 4, "c", 32)
            eng.flush()
        finally:
            self.close(eng)
        dev = "cpu" if self.cpu else "cuda"
        m = AutoModelForCausalLM.from_pretrained(self.target.path, dtype=getattr(torch, self.dtype)).to(dev).eval()
        by: dict[str, list] = {}
        for r in ChunkReader(store, self.target.chunk_meta()).load():
            by.setdefault(r.request_id, []).append(r)
        worst, rel, holes = 0.0, 0.0, 0
        for rid in sorted(by):
            rs = by[rid]
            pos = np.concatenate([r.positions for r in rs])
            order = np.argsort(pos)
            holes += int(not np.array_equal(pos[order], np.arange(len(pos))))
            toks = np.concatenate([r.tokens for r in rs])[order]
            cap = torch.cat([u16_to_bf16(r.hidden) for r in rs])[torch.from_numpy(order)].float()
            with torch.no_grad():
                hs = m(torch.tensor([toks.tolist()], device=dev), output_hidden_states=True).hidden_states
            rec = torch.cat([hs[i][0] for i in self.target.layer_ids], dim=-1).float().cpu()
            worst = max(worst, float((cap - rec).abs().max()))
            rel = max(rel, float((cap - rec).norm() / rec.norm()))
        return {"requests": len(by), "holes": holes, "max_abs_diff": worst, "max_rel_frobenius": rel}

    def capture_overhead(self) -> dict[str, Any]:
        eng = self.engine(16, self.draft, store=self.out.parent / "overhead-store")
        try:
            eng.set_speculation(False)
            _serve(eng, self.prompts[:16], 16, "w", 32)  # warm-up

            def on() -> float:
                eng.set_capture(True)
                return _serve(eng, self.prompts[:32], 16, "on", 64)[0]

            def off() -> float:
                eng.set_capture(False)
                return _serve(eng, self.prompts[:32], 16, "off", 64)[0]

            ratios = _alternate(6, on, off)
        finally:
            self.close(eng)
        return {"ratio_on_off": spread(ratios), "pairs": ratios, "batch": 16}

    def off_cost(self) -> dict[str, Any]:
        return {f"batch{b}": self._off_cost(b) for b in (1, 16)}

    def _off_cost(self, b: int) -> dict[str, Any]:
        """A speculative engine with speculation off against a plain one, alternating pairs."""
        eng, plain = self.engine(b, self.draft), self.engine(b, None)
        try:
            eng.set_speculation(False)
            _serve(eng, self.prompts[:b], b, "w", 16)
            _serve(plain, self.prompts[:b], b, "w", 16)
            ratios = _alternate(6, lambda: _serve(eng, self.prompts[: 2 * b], b, "o", 64)[0],
                                lambda: _serve(plain, self.prompts[: 2 * b], b, "p", 64)[0])
        finally:
            self.close(eng, plain)
        return {"ratio_off_over_plain": spread(ratios), "pairs": ratios}

    def hot_swap(self) -> dict[str, Any]:
        eng = self.engine(4, self.draft)
        try:
            pauses = [eng.swap(self.other if i % 2 == 0 else self.draft, i + 1) for i in range(12)]
        finally:
            self.close(eng)
        return {"pause_ms": spread(pauses[2:]), "all_ms": pauses}

    def speedup(self) -> dict[str, Any]:
        return {f"batch{b}": self._speedup(b) for b in (1, 16)}

    def _speedup(self, b: int) -> dict[str, Any]:
        """Drafting k (1, 2, 3) against plain decoding, the same engine and prompts, alternating."""
        eng = self.engine(b, self.draft)
        k = [1]

        def spec() -> float:
            eng.set_speculation(True)
            eng.set_draft_lengths([k[0]] * len(eng.lengths))
            return _serve(eng, self.prompts[: 2 * b], b, "s", 96)[0]

        def plain() -> float:
            eng.set_speculation(False)
            return _serve(eng, self.prompts[: 2 * b], b, "p", 96)[0]

        try:
            _serve(eng, self.prompts[:b], b, "w", 16)
            row = {}
            for k[0] in (1, 2, 3):
                row[f"k{k[0]}"] = spread(_alternate(3, spec, plain))
        finally:
            self.close(eng)
        return row

    def path(self) -> dict[str, Any]:
        """Tokens/s of each of PATH_VARIANTS (`--variants`) at each of `--batches`, each engine in a fresh
        process (vLLM's CUDA graph state is per process), relative to the plain engine with graphs."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        out: dict[str, Any] = self.results.setdefault("path", {})  # saved after each engine: a cut run keeps them
        for b in self.batches:
            row = out.setdefault(f"batch{b}", {})
            for v in self.variants:
                if v.endswith("eager") and not self.graphs:
                    continue
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    row[v] = pool.submit(_path_rate, str(self.target.path), self.target.layer_ids, str(self.draft),
                                         b, v, self.cpu, str(self.out.parent / f"path-store-{b}")).result()
                base = row["plain"]["tokens_per_s"]["median"] if "plain" in row else None
                if base:
                    row["over_plain"] = {k: r["tokens_per_s"]["median"] / base for k, r in row.items()
                                         if k != "over_plain"}
                self.save()
        return out

    def loop(self) -> dict[str, Any]:
        out = {}
        for batch in (1, 16):
            cfg = yaml.safe_load(Path("configs/gpu.yaml").read_text())
            cfg["model"]["target"] = str(self.target.path)
            cfg["draft"]["init"] = str(self.draft)
            cfg["model"]["aux_layer_ids"] = list(self.target.layer_ids)
            cfg["draft"]["draft_vocab_size"] = json.loads((self.draft / "config.json").read_text())["draft_vocab_size"]
            cfg["workload"]["concurrency"] = batch
            cfg["serve"]["max_num_seqs"] = max(batch, 4)
            path = self.out.parent / f"loop-{batch}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            run_dir = self.out.parent / f"loop-{batch}"
            if not self.cpu:
                _settle_gpu_memory()
            p = subprocess.run([sys.executable, "-m", "tide.launch", "--config", str(path), "--out", str(run_dir)],
                               capture_output=True, text=True, timeout=900)
            s = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
            keep = ("al_start", "al_end", "tokens_per_s_start", "tokens_per_s_end", "nospec_tokens_per_s",
                    "speedup_end_over_nospec", "swaps", "requests", "wall_s", "speculation_on_fraction",
                    "draft_lengths", "latency_model", "serving", "training")
            out[f"batch{batch}"] = {"rc": p.returncode, **{k: s.get(k) for k in keep},
                                    "events": [f"{e['t']:.1f} {e['kind']}: {e['reason'][:160]}" for e in
                                               s.get("events", [])][:60],
                                    "stderr_tail": p.stderr[-1500:] if p.returncode else ""}
        return out


def _serve_cfg(batch: int, eager: bool, cpu: bool, k: int = 3) -> ServeConfig:
    # two engines live at once in off-cost: each takes under half the GPU's memory
    return ServeConfig(num_speculative_tokens=k, max_num_seqs=batch, max_model_len=512,
                       max_num_batched_tokens=max(512, 64 * batch), enforce_eager=eager,
                       kv_cache_space_gib=2 if cpu else 16, gpu_memory_utilization=0.4)


def _path_rate(target_dir: str, layer_ids: tuple[int, ...], draft: str, b: int, variant: str, cpu: bool,
               store: str) -> dict[str, Any]:
    """One PATH_VARIANTS engine in this (fresh) process: a warm-up, then 3 rounds of 4b requests x 128 tokens."""
    from tide.runtime.results import segment
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tide.serve.engine import TideEngine

    target = Target.open(Path(target_dir), tuple(layer_ids))
    eager = cpu or variant.endswith("eager")
    cfg = _serve_cfg(b, eager, cpu)
    spec, capture = variant.startswith("spec"), "capture" in variant
    k = int(variant.removeprefix("spec-k")) if variant.startswith("spec-k") else 0
    eng = TideEngine(target, cfg, Path(draft) if spec else None, dtype="float32" if cpu else "bfloat16",
                     store_root=Path(store) if capture else None, capture=capture)
    try:
        if spec:
            eng.set_speculation(k > 0)
        if k:
            eng.set_draft_lengths([k] * len(eng.lengths))
        prompts = _prompts(target)
        _serve(eng, prompts[:b], b, "w", 32)
        served = [_serve(eng, prompts[: 4 * b], b, f"r{i}", 128) for i in range(3)]
    finally:
        eng.close()
    rates = [rate for rate, _ in served]
    return {"tokens_per_s": spread(rates), "rounds": rates, "cuda_graphs": not eager, "capture": capture,
            "acceptance_length": segment([r for _, res in served for r in res])["acceptance_length"]}


def _settle_gpu_memory(timeout_s: float = 120.0) -> None:
    """Wait until the GPU's free memory holds still: vLLM's start-up profiling asserts when another
    process (the last run's trainer or engine, exiting) gives memory back while it measures."""
    last, still, t0 = -1, 0, time.monotonic()
    while still < 3 and time.monotonic() - t0 < timeout_s:
        free = torch.cuda.mem_get_info()[0]
        still = still + 1 if abs(free - last) < 64 << 20 else 0
        last = free
        time.sleep(1.0)


def _prompts(target: Target, n: int = 64) -> list[list[int]]:
    """Real questions through the chat template for a target with a tokenizer (GSM8K's test split: held out
    of the base draft's training), else random token ids."""
    if (target.path / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        from tide.workload.phases import chat_ids
        from tide.workload.prompts import load_prompts

        tok = AutoTokenizer.from_pretrained(target.path)
        return [chat_ids(tok, text)[-384:] for _, text in load_prompts("gsm8k", "data/gsm8k/test.jsonl")[:n]]
    g = torch.Generator().manual_seed(7)
    vocab = target.config["vocab_size"]
    return [torch.randint(100, vocab - 10, (64,), generator=g).tolist() for _ in range(n)]


def _alternate(n: int, a: Any, b: Any) -> list[float]:
    """a()/b() over n alternating pairs."""
    return [x / y for x, y in alternating_pairs(n, a, b)]


def _retag(draft: Path, target: Target, weights_sha256: str, work: Path) -> dict[str, Any] | None:
    """A copy of `draft` whose meta names `target`'s hash, when only the target's config.json bytes differ
    from the one it was trained against (same weights file); None when the hashes already agree."""
    import shutil

    from tide.model.assets import file_sha256, model_hash

    meta = json.loads((draft / "meta.json").read_text())
    ours = model_hash(target.path)
    if meta.get("target_hash", "") in ("", ours):
        return None
    files = sorted(target.path.glob("*.safetensors"))
    got = file_sha256(files[0]) if len(files) == 1 else ""
    if got != weights_sha256:
        raise ValueError(f"{draft}: trained against target {meta['target_hash']}, serving {ours}, and the weights "
                         f"differ (sha256 {got[:16]} against {weights_sha256[:16]})")
    out = work / f"{draft.name}-retagged"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(draft, out)
    (out / "meta.json").write_text(json.dumps({**meta, "target_hash": ours}, indent=2))
    return {"dir": out, "from": meta["target_hash"], "to": ours, "weights_sha256": got,
            "why": "same model.safetensors, config.json written by another transformers version"}


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m workflows.bench.gpu_serving", __doc__)
    p.add_argument("--target", help="the target: a model dir, a .gguf file or a registered name such as smollm2 "
                   "(default: a tiny random Llama)")
    p.add_argument("--draft", type=Path, default=Path("drafts/smollm2-chat"), help="the draft dir to serve")
    p.add_argument("--json", type=Path, required=True, help="where the figures go")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--cpu", action="store_true", help="run the same code on the CPU (tiny target): a check")
    p.add_argument("--same-weights-as", metavar="SHA256", help="the sha256 of the model.safetensors the draft was "
                   "trained against: when the target's equals it but its model hash differs (config.json written by "
                   "another transformers version), serve a copy of the draft tagged with this target's hash")
    p.add_argument("--eager", action="store_true", help="on the GPU, no CUDA graphs anywhere (default: graphs "
                   "for every part but the eager lossless runs)")
    p.add_argument("--batches", default="1,16", help="the path part's batch sizes, comma-separated")
    p.add_argument("--variants", default=",".join(PATH_VARIANTS),
                   help="the path part's engines, comma-separated (spec-kN: speculation on, N drafts a step)")

    def body(args: argparse.Namespace) -> int:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from tide.model.assets import resolve_model

        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.target:
            target_dir = resolve_model(str(args.target))
        elif args.cpu:
            target_dir = resolve_model("tiny")
        else:  # FlashAttention on the GPU takes a head size of 64, not the CPU tiny's 32
            from tide.model.tiny import make_tiny_llama

            target_dir = make_tiny_llama(args.json.parent / "tiny64", hidden_size=256, num_layers=4, num_heads=4,
                                         num_kv_heads=4, intermediate_size=512, vocab_size=512, layer_gain=0.5)
        # the base draft belongs to its target: with the tiny one (or no draft yet) an untrained head checks the
        # seam; its AL and speedup mean nothing
        draft, untrained = args.draft, not args.target or not (args.draft / "config.json").exists()
        if untrained:
            from tide.draft import init_draft, save_draft

            draft = args.json.parent / "draft-untrained"
            n_layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
            t = Target.open(target_dir, (2, n_layers // 2, n_layers - 3) if n_layers >= 8 else (1, 2, 3))
            vd = min(8192, t.config["vocab_size"] // 2)
            save_draft(init_draft(t.path, t.layer_ids, vd), draft)
        draft_cfg = json.loads((draft / "config.json").read_text())
        target = Target.open(target_dir, tuple(draft_cfg["eagle_aux_hidden_state_layer_ids"]))
        retag = _retag(draft, target, args.same_weights_as, args.json.parent) if args.same_weights_as else None
        variants = tuple(v for v in args.variants.split(",") if v)
        if set(variants) - set(PATH_VARIANTS):
            raise ValueError(f"--variants: unknown {sorted(set(variants) - set(PATH_VARIANTS))}; choose from "
                             f"{', '.join(PATH_VARIANTS)}")
        bench = Bench(target, retag["dir"] if retag else draft, args.json, args.cpu, args.eager,
                      tuple(int(b) for b in args.batches.split(",")), variants)
        bench.results["draft"] = "untrained" if untrained else str(args.draft)
        if retag:
            bench.results["draft_retagged"] = {k: v for k, v in retag.items() if k != "dir"}
        for name in [x for x in args.parts.split(",") if x]:
            if name not in PARTS:
                raise ValueError(f"--parts: unknown {name!r}; choose from {', '.join(PARTS)}")
            bench.part(name, getattr(bench, name.replace("-", "_")))
        return 0

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
