"""Small typed messages between roles, encoded with msgpack (never pickle).

Messages are the doorbell; files are the truth: a `ChunkReady` names a chunk file, a `DraftReady`
a published draft dir. Nothing bulky ever travels in a message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

import msgpack


@dataclass(frozen=True)
class ChunkReady:
    path: str
    tokens: int


@dataclass(frozen=True)
class Stats:
    t: float
    acceptance_length: float
    tokens_per_s: float
    batch: float
    version: int
    speculate: bool
    stored_tokens: int


@dataclass(frozen=True)
class Train:
    cycle: int
    window_tokens: int
    reason: str


@dataclass(frozen=True)
class TrainProgress:
    cycle: int
    step: int
    steps: int
    loss: float
    tokens_per_s: float


@dataclass(frozen=True)
class DraftReady:
    cycle: int
    version: int
    path: str
    eval_al: float  # the new draft's simulated acceptance on held-out captured data
    base_al: float  # the draft it started from, on the same data
    train_tokens: int
    wall_s: float


@dataclass(frozen=True)
class TrainFailed:
    cycle: int
    reason: str


@dataclass(frozen=True)
class Deploy:
    version: int
    path: str


@dataclass(frozen=True)
class SpeculationMode:
    on: bool
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    role: str
    rank: int
    t: float


@dataclass(frozen=True)
class Shutdown:
    reason: str


Message = Union[ChunkReady, Stats, Train, TrainProgress, DraftReady, TrainFailed, Deploy, SpeculationMode,
                Heartbeat, Shutdown]
TYPES: dict[str, type] = {t.__name__: t for t in Message.__args__}  # type: ignore[attr-defined]


def encode(msg: Message) -> bytes:
    return msgpack.packb({"type": type(msg).__name__, **dataclasses.asdict(msg)}, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Inverse of `encode`; anything else is a ValueError that says what was wrong."""
    try:
        d: dict[str, Any] = msgpack.unpackb(data, raw=False)
        cls = TYPES[d.pop("type")]
        return cls(**d)
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"bad message ({len(data)} bytes): {e!r}") from None
