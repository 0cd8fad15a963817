"""Shared fixtures: a tiny random Llama target (offline) and greedy continuations of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from cluster.cluster import cluster  # noqa: F401 (the local Slurm cluster, a fixture of the tests that need it)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LAYER_IDS = (1, 2, 3)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory):
    from tide.model.target import Target
    from tide.model.tiny import make_tiny_llama

    return Target.open(make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", layer_gain=0.5), LAYER_IDS)


def greedy(target_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference greedy continuations from transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = m.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
            outs.append(ids[0, len(p):].tolist())
    return outs


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 12, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


@pytest.fixture(scope="session")
def tiny_requests(tiny_target) -> list[tuple[str, list[int], list[int]]]:
    """80 (request id, prompt ids, greedy output ids) of the tiny target: training data for drafts."""
    prompts = random_prompts(80, tiny_target.config["vocab_size"], seed=1)
    return [(f"req-{i}", p, o) for i, (p, o) in enumerate(zip(prompts, greedy(tiny_target.path, prompts, 48)))]
