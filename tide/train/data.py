"""From chunk runs to padded training batches for the draft.

A request's rows (prompt + accepted output rows, in position order) become one sequence: row t has
the input token x_t, the aux hidden state h_t and whether x_t is an output token. Draft step j at
start t reads x_{t+1+j} and predicts x_{t+2+j}; only predictions of output tokens count (serving
drafts only output tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from tide.store import Run, u16_to_bf16


@dataclass
class Sequence:
    request_id: str
    tokens: np.ndarray  # int64 [n]
    aux: np.ndarray  # uint16 [n, 3H] (bf16 bits)
    is_output: np.ndarray  # bool [n]

    def __len__(self) -> int:
        return len(self.tokens)


def sequences(runs: list[Run], max_len: int) -> list[Sequence]:
    """Join each request's runs by position (first copy of a position wins) and cut into windows.

    RoPE attention depends only on relative positions, so a window starting mid-request is a
    valid sequence of its own (it just sees less context).
    """
    by_req: dict[str, list[Run]] = {}
    for r in runs:
        by_req.setdefault(r.request_id, []).append(r)
    out: list[Sequence] = []
    for rid in sorted(by_req):
        pos = np.concatenate([r.positions for r in by_req[rid]])
        order = np.argsort(pos, kind="stable")
        _, first = np.unique(pos[order], return_index=True)
        idx = order[first]
        tok = np.concatenate([r.tokens for r in by_req[rid]])[idx].astype(np.int64)
        aux = np.concatenate([r.hidden for r in by_req[rid]])[idx]
        out_mask = np.concatenate([r.is_output for r in by_req[rid]])[idx].astype(bool)
        for a in range(0, len(tok), max_len):
            if out_mask[a : a + max_len].sum() >= 2:  # nothing to learn from a window without outputs
                out.append(Sequence(rid, tok[a : a + max_len], aux[a : a + max_len], out_mask[a : a + max_len]))
    return out


@dataclass
class Batch:
    aux: torch.Tensor  # bf16 [B, T, 3H]
    tokens: torch.Tensor  # int64 [B, T + depth + 1], 0-padded
    target_ok: torch.Tensor  # bool [B, T + depth + 1]: token exists and is an output token
    t0: int  # first start whose unrolled steps can reach an output token
    num_tokens: int  # real rows

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.aux.to(device), self.tokens.to(device), self.target_ok.to(device), self.t0, self.num_tokens)


def collate(seqs: list[Sequence], depth: int, prompt_loss: bool = False) -> Batch:
    B, T = len(seqs), max(len(s) for s in seqs)
    D = seqs[0].aux.shape[1]
    aux = torch.zeros(B, T, D, dtype=torch.bfloat16)
    tokens = torch.zeros(B, T + depth + 1, dtype=torch.long)
    ok = torch.zeros(B, T + depth + 1, dtype=torch.bool)
    first_out = T
    for i, s in enumerate(seqs):
        n = len(s)
        aux[i, :n] = u16_to_bf16(s.aux)
        tokens[i, :n] = torch.from_numpy(s.tokens)
        ok[i, :n] = True if prompt_loss else torch.from_numpy(s.is_output)
        outs = np.flatnonzero(np.ones(n, bool) if prompt_loss else s.is_output)
        first_out = min(first_out, int(outs[0]) if len(outs) else T)
    return Batch(aux, tokens, ok, max(0, first_out - 2 - depth + 1), sum(len(s) for s in seqs))


def batches(seqs: list[Sequence], batch_tokens: int, depth: int, shuffle: bool, seed: int = 0,
            prompt_loss: bool = False) -> list[Batch]:
    """Length-sorted packing (little padding) of about `batch_tokens` padded rows per batch; with
    `prompt_loss` every real token is a target, else output tokens only."""
    groups: list[list[Sequence]] = []
    cur: list[Sequence] = []
    for s in sorted(seqs, key=len):
        if cur and (len(cur) + 1) * len(s) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(s)
    if cur:
        groups.append(cur)
    if shuffle:
        random.Random(seed).shuffle(groups)
    return [collate(g, depth, prompt_loss) for g in groups]
