"""Architecture of an EAGLE-3 head, derived from its target and written as vLLM's draft config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tide.model.target import default_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class DraftSpec:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_target(cls, target_config: dict[str, Any], aux_layer_ids: tuple[int, ...] = (),
                    draft_vocab_size: int = 0) -> DraftSpec:
        """The head mirrors one target decoder layer; layer ids default to vLLM's (2, L//2, L-3)."""
        c = target_config
        L = c["num_hidden_layers"]
        ids = tuple(aux_layer_ids) or default_layer_ids(L)
        if len(set(ids)) != len(ids) or not all(0 <= i < L for i in ids):
            raise ValueError(f"aux_layer_ids {list(ids)} must be distinct and in [0, {L}) for a {L}-layer target")
        V = c["vocab_size"]
        if not 0 <= draft_vocab_size <= V:
            raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [0, {V}] (0 = full vocabulary)")
        heads = c["num_attention_heads"]
        return cls(
            hidden_size=c["hidden_size"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-5), vocab_size=V, draft_vocab_size=draft_vocab_size or V,
            aux_layer_ids=ids, max_position_embeddings=c.get("max_position_embeddings", 8192),
            rope_parameters=_rope_parameters(c),
        )

    def rope_config(self) -> dict[str, Any]:
        """Keyword arguments of a transformers LlamaConfig with this head's attention and rope."""
        return dict(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                    num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                    max_position_embeddings=self.max_position_embeddings, rope_parameters=dict(self.rope_parameters))

    def to_hf_config(self) -> dict[str, Any]:
        """The draft's config.json, as vLLM's `LlamaForCausalLMEagle3` reads it."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": dict(self.rope_parameters), **_legacy_rope(self.rope_parameters),
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "target_hidden_size": self.hidden_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_config(cls, c: dict[str, Any]) -> DraftSpec:
        if ARCHITECTURE not in c.get("architectures", []):
            raise ValueError(f"architectures: expected {ARCHITECTURE}, got {c.get('architectures')}")
        return cls(
            hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
            head_dim=c["head_dim"], intermediate_size=c["intermediate_size"], rms_norm_eps=c["rms_norm_eps"],
            vocab_size=c["vocab_size"], draft_vocab_size=c["draft_vocab_size"],
            aux_layer_ids=tuple(c["eagle_aux_hidden_state_layer_ids"]),
            max_position_embeddings=c["max_position_embeddings"], rope_parameters=_rope_parameters(c),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rope_parameters(c: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older configs have `rope_theta` (+ `rope_scaling`)."""
    if c.get("rope_parameters"):
        return dict(c["rope_parameters"])
    p = dict(c.get("rope_scaling") or {})
    p.setdefault("rope_type", p.pop("type", "default"))
    p["rope_theta"] = c.get("rope_theta", 10000.0)
    return p


def _legacy_rope(p: dict[str, Any]) -> dict[str, Any]:
    """Also write the pre-5.0 keys so older transformers/vLLM read the same rope."""
    out: dict[str, Any] = {"rope_theta": p.get("rope_theta", 10000.0)}
    if p.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in p.items() if k != "rope_theta"}
    return out


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
