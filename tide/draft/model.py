"""The EAGLE-3 draft head as plain PyTorch, numerically the same as vLLM's `Eagle3LlamaForCausalLM`.

Parameter names are the checkpoint names vLLM loads (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so `state_dict()` is the saved format. One draft step at row t (vLLM's convention):

    fused  = fc(cat(h_low, h_mid, h_high)_t)                 [H]   (step 0; later steps: previous `pre`)
    x      = cat(input_layernorm(embed(x_{t+1})), hidden_norm(fused))   [2H]
    r      = fused + o_proj(attn(x))                          residual stream
    pre    = r + mlp(post_attention_layernorm(r))             fed back as `fused` of the next step
    logits = lm_head(norm(pre))                               over the draft vocabulary; predicts x_{t+2}

A draft token id d maps to target id d + d2t[d] (EAGLE-3's offset convention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tide.draft.spec import DraftSpec


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: DraftSpec) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, s.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, s: DraftSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: DraftSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.mlp = MLP(s)


class Eagle3Draft(nn.Module):
    """EAGLE-3 head; `embed` (the target's input embeddings) is a frozen, unsaved buffer."""

    def __init__(self, spec: DraftSpec, embed: torch.Tensor) -> None:
        super().__init__()
        s = self.spec = spec
        assert embed.shape == (s.vocab_size, s.hidden_size), (embed.shape, s)
        self.fc = nn.Linear(len(s.aux_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))
        rot = LlamaRotaryEmbedding(LlamaConfig(**spec.rope_config()))  # HF computes every rope type
        # plain fp32 attributes, not buffers: a bf16 cast of the module must not round the frequencies
        self._inv_freq, self._rope_scale = rot.inv_freq.float(), float(rot.attention_scaling)
        for m in (self.midlayer.self_attn, self.midlayer.mlp):
            for lin in m.modules():
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=0.02)

    # ---------------------------------------------------------------- vocabulary
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft id of each target id, -1 where the target token is outside the draft vocabulary."""
        table = torch.full((self.spec.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        draft = torch.arange(self.spec.draft_vocab_size, device=target_ids.device)
        table[self.draft_to_target(draft)] = draft
        return table[target_ids]

    def logits(self, pre: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(pre))

    # ---------------------------------------------------------------- training-time test
    def _qkv(self, fused: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor):
        """fused [B,T,H], tokens [B,T], pos [T] -> q [B,nh,T,hd], k/v [B,nh,T,hd] (rotated, kv repeated)."""
        a, B, T = self.midlayer.self_attn, fused.shape[0], fused.shape[1]
        emb = F.embedding(tokens, self.embed).to(fused.dtype)
        x = torch.cat([self.midlayer.input_layernorm(emb), self.midlayer.hidden_norm(fused)], -1)
        q = a.q_proj(x).view(B, T, a.nh, a.hd).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.nkv, a.hd).transpose(1, 2)
        freqs = pos[:, None].float() * self._inv_freq.to(pos.device)[None]
        emb = torch.cat([freqs, freqs], -1)[None]  # [1,T,hd]
        cos, sin = (emb.cos() * self._rope_scale).to(q.dtype), (emb.sin() * self._rope_scale).to(q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = a.nh // a.nkv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def _finish(self, fused: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Attention output [B,nh,T,hd] -> the pre-norm output `pre` [B,T,H]."""
        B, T = fused.shape[:2]
        r = fused + self.midlayer.self_attn.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        return r + self.midlayer.mlp(self.midlayer.post_attention_layernorm(r))

    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, depth: int, t0: int = 0) -> list[torch.Tensor]:
        """Unrolled drafting over whole sequences, as EAGLE-3's training-time test.

        aux [B,T,3H]: target hidden rows 0..T-1; tokens [B,T+depth]: tokens[:, t+1+j] is the input of
        step j at start row t (step j predicts tokens[t+2+j]). Step 0 runs at every start; steps j>0
        only at starts >= t0 (the output region). Step j at start t sits at position t+j and attends
        to the step-0 keys of rows <= t and to its own chain's keys 1..j, exactly what vLLM's draft KV
        cache holds at that point. Returns `pre` per step: [B,T,H] for j=0, [B,T-t0,H] for j>0.
        """
        B, T, _ = aux.shape
        pos = torch.arange(T, device=aux.device)
        fused = self.fc(aux.to(self.fc.weight.dtype))  # captured rows are bf16; the head may be fp32
        q0, k0, v0 = self._qkv(fused, tokens[:, 1 : T + 1], pos)
        pre = self._finish(fused, F.scaled_dot_product_attention(q0, k0, v0, is_causal=True))
        outs = [pre]
        if depth <= 1:
            return outs
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        mask0 = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()[t0:]  # [Tq, T]
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        x = pre[:, t0:]
        for j in range(1, depth):
            q, k, v = self._qkv(x, tokens[:, t0 + 1 + j : T + 1 + j], pos[t0:] + j)
            chain_k.append(k)
            chain_v.append(v)
            s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask0, float("-inf"))  # [B,nh,Tq,T]
            sc = torch.stack([(q * kk).sum(-1) for kk in chain_k], -1) * scale  # [B,nh,Tq,j]
            p = torch.cat([s0, sc], -1).float().softmax(-1).to(q.dtype)
            att = p[..., :T] @ v0 + sum(p[..., T + i : T + i + 1] * chain_v[i] for i in range(j))
            x = self._finish(x, att)
            outs.append(x)
        return outs
