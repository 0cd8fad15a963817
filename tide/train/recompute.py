"""Recomputed training signals: the target itself (transformers) regenerates the aux hidden states
of prompt + output tokens, in the same chunk format capture writes.

This is the SpecForge-style baseline TIDE's capture is measured against (it costs a full target
prefill per training token), and the reference the capture-equality test compares with.
HF `output_hidden_states[i]` is the residual stream after i decoder layers, which is vLLM's aux
layer id i for 0 <= i < num_layers (vLLM's id L would be un-normed; HF's entry L is normed).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tide.model.target import Target
from tide.store import ChunkWriter, Run, bf16_to_u16
from tide.train.precision import cpu_has_bf16


class Recompute:
    def __init__(self, target: Target, dtype: torch.dtype | None = None) -> None:
        """On the trainer's GPU where it has one (CUDA or ROCm), else the CPU. `dtype` None: bf16 on a
        GPU or where the CPU has bf16 matmul units, else float32 (on an AVX2 CPU a bf16 forward is
        several times slower; the baseline should run at its fastest)."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" or cpu_has_bf16() else torch.float32)
        self.target = target
        self.model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).to(self.device).eval()

    @torch.no_grad()
    def rows(self, token_ids: list[int]) -> torch.Tensor:
        """Aux hidden rows [len-1, k*H] (bf16, on the host) for rows 0..len-2: the last token is never
        an input row."""
        ids = torch.tensor([token_ids[:-1]], device=self.device)
        hs = self.model(input_ids=ids, output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in self.target.layer_ids], -1).to(torch.bfloat16).cpu()

    def run(self, request_id: str, prompt_ids: list[int], output_ids: list[int], workload: str = "") -> Run:
        """The chunk run of one finished request: rows of every token but the last."""
        toks = list(prompt_ids) + list(output_ids)
        n = len(toks) - 1
        return Run(request_id=request_id, tokens=np.asarray(toks[:-1], np.int32),
                   positions=np.arange(n, dtype=np.int32),
                   hidden=bf16_to_u16(self.rows(toks)), is_output=np.arange(n) >= len(prompt_ids), workload=workload)


def write_recomputed(target: Target, store: Path, requests: list[tuple[str, list[int], list[int]]],
                     workload: str = "", chunk_tokens: int = 2048) -> dict[str, int]:
    """Recompute and store the rows of `requests` (id, prompt ids, output ids); returns writer stats."""
    from tqdm import tqdm

    rc = Recompute(target)
    with ChunkWriter(store, target.chunk_meta(), chunk_tokens=chunk_tokens, max_pending_chunks=1 << 20) as w:
        for rid, p, o in tqdm(requests, desc="recompute", unit="req", leave=False):
            w.add(rc.run(rid, p, o, workload))
        w.flush()
        return w.stats()
