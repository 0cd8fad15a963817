"""Draft checkpoints: initialise from a target (reading only the tensors needed), save in vLLM's
EAGLE-3 format, and publish versions `drafts/vN/` atomically for the server to hot-swap."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tide.draft.model import Eagle3Draft
from tide.draft.spec import DraftSpec, read_json

WEIGHTS = "model.safetensors"
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def read_target_tensors(target_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read just `names` from a HF safetensors dir (single file or sharded with an index)."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {n: WEIGHTS for n in names}
    out: dict[str, torch.Tensor] = {}
    for fname in sorted({where[n] for n in names if n in where}):
        with safe_open(str(target_dir / fname), framework="pt") as f:
            for n in names:
                if where.get(n) == fname and n in f.keys():
                    out[n] = f.get_tensor(n)
    return out


def target_heads(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings [V,H], output head [V,H]) of a target; tied targets share one tensor."""
    t = read_target_tensors(target_dir, [_EMBED, _LM_HEAD])
    if _EMBED not in t:
        raise ValueError(f"{target_dir}: tensor {_EMBED} not found in the target's safetensors")
    return t[_EMBED].float(), t.get(_LM_HEAD, t[_EMBED]).float()


def init_draft(target_dir: Path, aux_layer_ids: tuple[int, ...] = (), draft_vocab_size: int = 0,
               vocab: torch.Tensor | None = None, seed: int = 0) -> Eagle3Draft:
    """A fresh head for `target_dir`; its LM head starts as the target's rows of the draft vocabulary.

    `vocab`: sorted target ids of the draft vocabulary (default: the first `draft_vocab_size` ids,
    which byte-level BPE orders roughly by frequency; the trainer rebuilds it from captured counts).
    """
    spec = DraftSpec.from_target(read_json(Path(target_dir) / "config.json"), aux_layer_ids, draft_vocab_size)
    embed, head = target_heads(target_dir)
    torch.manual_seed(seed)
    model = Eagle3Draft(spec, embed)  # draft vocabulary = target ids 0..Vd-1 (d2t = 0)
    with torch.no_grad():
        model.lm_head.weight.copy_(head[: spec.draft_vocab_size])
        model.t2d.zero_()
        model.t2d[: spec.draft_vocab_size] = True
    if vocab is not None:
        set_vocab(model, vocab, head)
    return model


@torch.no_grad()
def set_vocab(model: Eagle3Draft, target_ids: torch.Tensor, target_head: torch.Tensor) -> None:
    """Switch the draft vocabulary to `target_ids`; rows of tokens kept stay trained, new rows come
    from the target's own output head (a good start for a token the draft has never predicted)."""
    s = model.spec
    ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
    assert ids.numel() == s.draft_vocab_size and ids.unique().numel() == ids.numel(), "vocab size is fixed"
    old_ids = model.draft_to_target(torch.arange(s.draft_vocab_size))
    old_rows = dict(zip(old_ids.tolist(), model.lm_head.weight.detach().clone()))
    fresh = target_head[ids].to(model.lm_head.weight.dtype)
    model.lm_head.weight.copy_(torch.stack([old_rows.get(t, f) for t, f in zip(ids.tolist(), fresh)]))
    model.d2t.copy_(ids - torch.arange(s.draft_vocab_size))
    model.t2d.zero_()
    model.t2d[ids] = True


def save_draft(model: Eagle3Draft, out_dir: Path, meta: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors (bf16, vLLM names) and meta.json into a new dir, atomically."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model.spec.to_hf_config(), indent=2))
    (tmp / "meta.json").write_text(json.dumps(meta or {}, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir


def weight_shapes(draft_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a published draft, from the safetensors header alone."""
    with safe_open(str(Path(draft_dir) / WEIGHTS), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def checked_weights(draft_dir: Path, shapes: dict[str, tuple[int, ...]], target_hash: str = "") -> dict[str, Any]:
    """The tensors of a draft to swap in, or ValueError with one line naming the file and what is
    wrong: unreadable (a truncated or foreign file), a draft of another target (meta.json's
    target_hash), other tensor names or shapes than `shapes` (the serving draft's), NaN or Inf."""
    path = Path(draft_dir) / WEIGHTS
    try:
        weights = load_file(str(path))
    except Exception as e:  # safetensors raises its own error kinds for a truncated or garbled file
        raise ValueError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"[:300]) from None
    meta_file = Path(draft_dir) / "meta.json"
    theirs = json.loads(meta_file.read_text()).get("target_hash", "") if meta_file.exists() else ""
    if target_hash and theirs and theirs != target_hash:
        raise ValueError(f"{meta_file}: target_hash {theirs} is not the serving target's {target_hash}: "
                         "a draft of another model")
    if set(weights) != set(shapes):
        raise ValueError(f"{path}: tensors {sorted(set(weights) ^ set(shapes))[:4]} differ from the serving draft's")
    for name, t in weights.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{path}: {name}: shape {tuple(t.shape)}, the serving draft has {shapes[name]}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{path}: {name}: NaN or Inf weights")
    return weights


def load_draft(draft_dir: Path, target_dir: Path) -> Eagle3Draft:
    """Load a saved head; the embeddings come from the target (the draft does not store them)."""
    draft_dir = Path(draft_dir)
    try:
        spec = DraftSpec.from_hf_config(read_json(draft_dir / "config.json"))
        sd = load_file(str(draft_dir / WEIGHTS))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{draft_dir}: not a TIDE/vLLM EAGLE-3 draft: {e}") from None
    embed, _ = target_heads(target_dir)
    model = Eagle3Draft(spec, embed)
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in sd.items()}, strict=True)
    return model


class DraftRegistry:
    """Published drafts `ROOT/vN/`; a version exists once its dir is renamed into place."""

    _name = re.compile(r"^v(\d+)$")

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def versions(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := self._name.match(p.name)))

    def latest(self) -> int:
        """Newest published version, 0 when none."""
        return max(self.versions(), default=0)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def meta(self, version: int) -> dict[str, Any]:
        return read_json(self.path(version) / "meta.json")

    def publish(self, model: Eagle3Draft, meta: dict[str, Any]) -> int:
        version = self.latest() + 1
        for stale in self.root.glob(".v*.tmp-*"):  # left by a publisher killed mid-write (save_draft's temp dirs)
            if (m := re.match(r"^\.v(\d+)\.tmp-", stale.name)) and int(m.group(1)) <= version:
                shutil.rmtree(stale, ignore_errors=True)
        save_draft(model, self.path(version), {**meta, "version": version, "published_at": time.time()})
        return version
