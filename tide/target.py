"""What the rest of TIDE needs to know about a target model dir: its config, aux layer ids and
the chunk metadata that tags hidden states captured from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tide.assets import model_hash
from tide.store import ChunkMeta


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: low, middle and high layers (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Target:
    path: Path
    config: dict[str, Any]
    layer_ids: tuple[int, ...]

    @classmethod
    def open(cls, path: Path, layer_ids: tuple[int, ...] = ()) -> "Target":
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
        except OSError:
            raise ValueError(f"{path}: config.json: missing; not a Hugging Face model dir") from None
        L = config["num_hidden_layers"]
        ids = tuple(layer_ids) or default_layer_ids(L)
        if len(set(ids)) != len(ids) or not all(0 <= i < L for i in ids):
            raise ValueError(f"model.aux_layer_ids: {list(ids)} must be distinct and in [0, {L}) for {path}")
        return cls(path, config, ids)

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def chunk_meta(self) -> ChunkMeta:
        return ChunkMeta(target_id=self.path.name, target_hash=model_hash(self.path),
                         hidden_size=self.hidden_size, layer_ids=self.layer_ids)
