"""Recomputed rows equal the residual stream read straight off the decoder layers."""

import torch
from transformers import AutoModelForCausalLM

from tide.store import ChunkReader, u16_to_bf16
from tide.train.recompute import Recompute, write_recomputed


def test_rows_equal_a_direct_forward(tiny_target, tiny_requests):
    _, prompt, output = tiny_requests[0]
    toks = prompt + output
    model = AutoModelForCausalLM.from_pretrained(tiny_target.path, dtype=torch.bfloat16).eval()
    residual = {}  # vLLM aux id i = residual stream after i decoder layers (0 = embeddings)
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, o: residual.__setitem__(0, o))]
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(
            lambda m, a, o, i=i: residual.__setitem__(i + 1, o[0] if isinstance(o, tuple) else o)))
    with torch.no_grad():
        model(input_ids=torch.tensor([toks[:-1]]))
    for h in hooks:
        h.remove()
    direct = torch.cat([residual[i][0] for i in tiny_target.layer_ids], -1).float()
    rows = Recompute(tiny_target).rows(toks).float()
    assert rows.shape == (len(toks) - 1, 3 * tiny_target.hidden_size)
    assert torch.allclose(rows, direct, rtol=2e-2, atol=2e-2)


def test_written_runs_have_prompt_and_output_rows(tiny_target, tiny_requests, tmp_path):
    reqs = tiny_requests[:3]
    stats = write_recomputed(tiny_target, tmp_path / "store", reqs, workload="w", chunk_tokens=64)
    assert stats["tokens"] == sum(len(p) + len(o) - 1 for _, p, o in reqs)
    runs = ChunkReader(tmp_path / "store", tiny_target.chunk_meta()).load()
    r0 = [r for r in runs if r.request_id == reqs[0][0]]
    n_prompt = len(reqs[0][1])
    assert sum(int((~r.is_output).sum()) for r in r0) == n_prompt
    assert all(r.workload == "w" for r in runs)
    assert u16_to_bf16(r0[0].hidden).dtype == torch.bfloat16
