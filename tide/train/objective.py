"""The training loss and the offline acceptance estimate, on the same unrolled forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tide.draft import Eagle3Draft
from tide.draft.acceptance import AcceptanceHistogram
from tide.train.data import Batch


def _targets(b: Batch, j: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids and validity for step j over starts start..T-1: token x_{t+2+j}."""
    T = b.aux.shape[1]
    return b.tokens[:, start + 2 + j : T + 2 + j], b.target_ok[:, start + 2 + j : T + 2 + j]


def ttt_loss(model: Eagle3Draft, b: Batch, depth: int, decay: float) -> tuple[torch.Tensor, list[float]]:
    """sum_j decay**j * CE(step j) over output-token targets inside the draft vocabulary.

    Returns the loss and the top-1 accuracy of each step (teacher-forced)."""
    outs = model(b.aux, b.tokens, depth, b.t0)
    loss = b.aux.new_zeros((), dtype=torch.float32)
    accs: list[float] = []
    for j, pre in enumerate(outs):
        tgt, ok = _targets(b, j, 0 if j == 0 else b.t0)
        d = model.target_to_draft(tgt)
        sel = ok & (d >= 0)
        if not sel.any():
            accs.append(0.0)
            continue
        logits = model.logits(pre[sel]).float()
        loss = loss + decay**j * F.cross_entropy(logits, d[sel])
        accs.append((logits.argmax(-1) == d[sel]).float().mean().item())
    return loss, accs


@torch.no_grad()
def simulate_acceptance(model: Eagle3Draft, batches: list[Batch], gamma: int) -> AcceptanceHistogram:
    """Acceptance of chained greedy drafting with gamma tokens, stepped as serving steps.

    Serving drafts first after the prompt (start t = last prompt row, whose input x_{t+1} is the
    first output token); a step that accepts k drafts moves the next start to t + k + 1. Counting
    every start instead would over-weight easy stretches (a run of good drafts is one serving step
    but gamma+1 starts), so the walk is what live acceptance is compared with. Teacher forcing gives
    the same counts as feeding the draft its own tokens: the chain only counts while every earlier
    draft was right. A target past the end of the known sequence counts as a miss.
    """
    hist = AcceptanceHistogram(gamma)
    for b in batches:
        outs = model(b.aux, b.tokens, gamma, 0)
        T = b.aux.shape[1]
        starts = b.target_ok[:, 1 : T + 1]  # x_{t+1} is an output token  [B, T]
        alive = torch.ones_like(starts)
        accepted = torch.zeros(starts.shape, dtype=torch.long, device=starts.device)
        for j, pre in enumerate(outs):
            tgt, ok = _targets(b, j, 0)
            pred = model.draft_to_target(model.logits(pre).argmax(-1))
            alive &= ok & (pred == tgt)
            accepted += alive.long()
        for acc, valid in zip(accepted.tolist(), starts.tolist()):
            t = valid.index(True) if True in valid else T
            while t < T and valid[t]:
                hist.add(acc[t])
                t += acc[t] + 1
    return hist
