"""The EAGLE-3 head: vLLM's checkpoint format, target initialisation, causal unrolled forward."""

import json

import pytest
import torch
from safetensors import safe_open

from tide.draft import DraftRegistry, init_draft, load_draft, save_draft
from tide.draft.io import checked_weights, read_target_tensors, weight_shapes

VLLM_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}


def test_saved_format_is_what_vllm_loads(tiny_target, tmp_path):
    d = init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=128)
    out = save_draft(d, tmp_path / "d", {"note": "x"})
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(tiny_target.layer_ids)
    assert cfg["draft_vocab_size"] == 128 and cfg["vocab_size"] == tiny_target.config["vocab_size"]
    H = tiny_target.hidden_size
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == VLLM_NAMES  # embeddings are shared from the target, never saved
        assert f.get_tensor("fc.weight").shape == (H, 3 * H)
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * H
        assert f.get_tensor("lm_head.weight").shape == (128, H)
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert json.loads((out / "meta.json").read_text()) == {"note": "x"}
    assert not list(tmp_path.glob(".*tmp*"))


def test_init_reads_only_the_heads_and_maps_vocab(tiny_target):
    got = read_target_tensors(tiny_target.path, ["model.embed_tokens.weight"])
    assert list(got) == ["model.embed_tokens.weight"]
    vocab = torch.tensor([5, 9, 300, 7])
    d = init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=4, vocab=vocab)
    assert d.draft_to_target(torch.arange(4)).tolist() == [5, 7, 9, 300]  # d2t is an offset table
    assert d.target_to_draft(torch.tensor([7, 8])).tolist() == [1, -1]
    head = read_target_tensors(tiny_target.path, ["lm_head.weight"])["lm_head.weight"].float()
    assert torch.equal(d.lm_head.weight.data, head[[5, 7, 9, 300]])


def test_round_trip_and_registry(tiny_target, tmp_path):
    d = init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=64, seed=3)
    reg = DraftRegistry(tmp_path / "drafts")
    assert reg.latest() == 0
    v = reg.publish(d, {"eval_al": 1.5})
    assert v == 1 and reg.latest() == 1 and reg.meta(1)["eval_al"] == 1.5
    back = load_draft(reg.path(1), tiny_target.path)
    for k, t in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], t.to(torch.bfloat16).to(t.dtype)), k


def test_unrolled_forward_is_causal(tiny_target):
    """Changing rows after t must not change any step's output at starts <= t."""
    torch.manual_seed(0)
    d = init_draft(tiny_target.path, tiny_target.layer_ids)
    T, D = 12, 3 * tiny_target.hidden_size
    aux = torch.randn(1, T, D)
    tokens = torch.randint(0, 500, (1, T + 4))
    outs = d(aux, tokens, depth=3)
    aux2, tokens2 = aux.clone(), tokens.clone()
    aux2[:, 7:] = torch.randn(1, T - 7, D)
    tokens2[:, 10:] = 1  # tokens[t+1+j] with t <= 6, j <= 2 stay unchanged
    outs2 = d(aux2, tokens2, depth=3)
    for a, b in zip(outs, outs2):
        assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5)
        assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_a_bad_draft_is_refused_with_one_line_naming_file_and_field(tiny_target, tmp_path):
    good = save_draft(init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=64),
                      tmp_path / "good", {"target_hash": "abc"})
    shapes = weight_shapes(good)
    assert set(checked_weights(good, shapes, "abc")) == VLLM_NAMES

    def refused(d, match, target_hash="abc"):
        with pytest.raises(ValueError, match=match) as e:
            checked_weights(d, shapes, target_hash)
        assert "\n" not in str(e.value) and str(d) in str(e.value)

    other = save_draft(init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=32), tmp_path / "other")
    refused(other, r": (d2t|lm_head.weight): shape \(32")
    refused(good, "target_hash abc is not", target_hash="xyz")
    nan = init_draft(tiny_target.path, tiny_target.layer_ids, draft_vocab_size=64)
    with torch.no_grad():
        nan.fc.weight[0, 0] = float("nan")
    refused(save_draft(nan, tmp_path / "nan"), "fc.weight: NaN")
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])
    refused(cut, "not a readable safetensors file")
