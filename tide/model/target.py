"""What the rest of TIDE needs to know about a target model dir: its config, aux layer ids and
the chunk metadata that tags hidden states captured from it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tide.model.assets import model_hash


@dataclass(frozen=True)
class ChunkMeta:
    """File attributes; a reader rejects a chunk whose meta differs from what it expects."""

    target_id: str  # model dir name or hub id
    target_hash: str  # short hash of the target's config/weights (computed by the caller)
    hidden_size: int  # H of the target
    layer_ids: tuple[int, ...]  # vLLM aux layer ids; hidden rows are [len(layer_ids)*H]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(i) for i in self.layer_ids))
        if self.hidden_size <= 0 or not self.layer_ids:
            raise ValueError(f"ChunkMeta: need hidden_size > 0 and layer_ids, got {self}")

    @property
    def row_dim(self) -> int:
        """D = len(layer_ids) * hidden_size: the width of one hidden row."""
        return len(self.layer_ids) * self.hidden_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one row in a chunk file: the bf16 hidden row, token, position and is_output
        (HDF5's own overhead aside)."""
        return 2 * self.row_dim + 9


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: low, middle and high layers (2, L//2, L-3)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Target:
    path: Path
    config: dict[str, Any]
    layer_ids: tuple[int, ...]

    @classmethod
    def open(cls, path: Path, layer_ids: tuple[int, ...] = ()) -> Target:
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
