"""The serving seam on a CUDA GPU (vLLM's CUDA build): run with `-m gpu` on a machine with one.

CI has no GPU, so these are skipped there; `python -m workflows.bench.gpu_serving` runs them on the
GPU before it measures (docs/BENCHMARKS.md says when and with what result). A tiny random Llama
whose head size FlashAttention takes (64) is built on the spot; greedy outputs are compared with a
plain engine's in bfloat16, the dtype a GPU serves in, and float32, with CUDA graphs as vLLM serves
(TIDE_GPU_EAGER=1: without).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build")]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from tide.draft import init_draft, save_draft
    from tide.model.target import Target
    from tide.model.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("gpu")
    tgt = Target.open(make_tiny_llama(root / "tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                                      intermediate_size=512, vocab_size=512, layer_gain=0.5), (1, 2, 3))
    torch.manual_seed(0)
    save_draft(init_draft(tgt.path, tgt.layer_ids, 256), root / "v0")
    d1 = init_draft(tgt.path, tgt.layer_ids, 256)
    with torch.no_grad():
        for p in d1.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_draft(d1, root / "v1")
    return root, tgt, random_prompts(16, 512, seed=7)


def requests(prompts, tag):
    from tide.serve.engine import Request

    return [Request(f"{tag}-{i}", p, MAX_TOKENS, None, tag) for i, p in enumerate(prompts)]


def outputs(results):
    return {r.request_id.split("-")[1]: list(r.output_ids) for r in results}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lossless_swap_draft_lengths_off_and_capture_on_the_gpu(setup, dtype: str) -> None:
    from tide.config import ServeConfig
    from tide.serve.engine import TideEngine
    from tide.store import ChunkReader, u16_to_bf16

    root, tgt, prompts = setup
    serve = ServeConfig(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, num_speculative_tokens=3,
                        enforce_eager=os.environ.get("TIDE_GPU_EAGER", "0") == "1")
    plain = TideEngine(tgt, serve, None, dtype=dtype)
    try:
        ref = outputs(plain.replay(requests(prompts, "ref"), concurrency=4)[0])
    finally:
        plain.close()
    store = root / f"store-{dtype}"
    eng = TideEngine(tgt, serve, root / "v0", store_root=store, chunk_tokens=256, dtype=dtype)
    try:
        assert outputs(eng.replay(requests(prompts, "a"), concurrency=4)[0]) == ref
        seen = []

        def vary(e, t):  # a hot-swap every 5 steps, a new draft length every step
            seen.append(0)
            e.set_draft_lengths([[3, 0, 1, 2][len(seen) % 4]] * len(e.lengths))
            if len(seen) % 5 == 0:
                e.swap(root / ("v1" if e.version == 0 else "v0"), 1 - e.version)

        assert outputs(eng.replay(requests(prompts, "b"), concurrency=4, between_steps=vary)[0]) == ref
        eng.set_draft_lengths([3] * len(eng.lengths))
        eng.set_speculation(False)
        res, windows = eng.replay(requests(prompts, "c"), concurrency=4)
        assert outputs(res) == ref and sum(sum(w.accept_counts) for w in windows) == 0
        eng.flush()
    finally:
        eng.close()
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tgt.path, dtype=getattr(torch, dtype)).cuda().eval()
    by: dict[str, list] = {}
    for r in ChunkReader(store, tgt.chunk_meta()).load():
        by.setdefault(r.request_id, []).append(r)
    tol = 0.05 if dtype == "bfloat16" else 0.01
    for rid in sorted(by)[:8]:
        rs = by[rid]
        pos = np.concatenate([r.positions for r in rs])
        order = np.argsort(pos)
        assert np.array_equal(pos[order], np.arange(len(pos)))  # no holes, no drafts
        toks = np.concatenate([r.tokens for r in rs])[order]
        cap = torch.cat([u16_to_bf16(r.hidden) for r in rs])[torch.from_numpy(order)].float()
        with torch.no_grad():
            hs = m(torch.tensor([toks.tolist()]).cuda(), output_hidden_states=True).hidden_states
        rec = torch.cat([hs[i][0] for i in tgt.layer_ids], dim=-1).float().cpu()
        assert torch.allclose(cap, rec, rtol=tol, atol=tol), (rid, float((cap - rec).abs().max()))


def test_the_gpu_profile_times_the_draft_itself(setup) -> None:
    """D(b, k) comes from the drafter's own passes: a GPU step that is launch-bound (flat T) still
    gives every draft pass a cost, so break-even is above 1."""
    from tide.config import ServeConfig
    from tide.serve.engine import TideEngine

    root, tgt, _ = setup
    eng = TideEngine(tgt, ServeConfig(max_model_len=256, max_num_seqs=4, num_speculative_tokens=3), root / "v0",
                     dtype="bfloat16", capture=False)
    try:
        model = eng.profile(4)
    finally:
        eng.close()
    assert all(model.draft_latency(b, k) > 0 for b in (1, 4) for k in (1, 2, 3))
    assert model.break_even(1, 1) > 1.0
