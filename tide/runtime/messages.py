"""Small typed messages between roles, encoded with msgpack (never pickle).

Messages are the doorbell; files are the truth: a `Train` names the chunks to read by time, a
`DraftReady` a published draft dir. Nothing bulky ever travels in a message. Every message carries the protocol
version; a receiver drops (and logs) a message of an unknown kind or version instead of failing, so
roles of different releases degrade to "not understood", never to a crash.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack

PROTOCOL = 4  # bump when a message changes incompatibly


@dataclass(frozen=True)
class Train:
    cycle: int
    window_tokens: int  # at most this many of the newest stored tokens (0: no bound)
    since_ns: int  # only chunks written from this time on (time.time_ns() of the writer's host; 0: all)
    base_version: int  # the draft to train from: the one serving (-1: the newest published)
    reason: str


@dataclass(frozen=True)
class TrainProgress:
    """Where a cycle is: phase read (the chunks), eval (the base draft), train (step of steps) or publish."""

    cycle: int
    phase: str
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
    base_version: int
    train_tokens: int
    wall_s: float
    eval_counts: list[int]  # the held-out walk's histogram of accepted drafts per step (train.gamma)
    base_counts: list[int]


@dataclass(frozen=True)
class TrainFailed:
    cycle: int
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    role: str
    rank: int
    t: float


@dataclass(frozen=True)
class Shutdown:
    reason: str


Message = Train | TrainProgress | DraftReady | TrainFailed | Heartbeat | Shutdown
TYPES: dict[str, type] = {t.__name__: t for t in Message.__args__}  # type: ignore[attr-defined]


class BadMessage(ValueError):
    """Bytes that are not a message of this protocol version."""


def encode(msg: Message) -> bytes:
    return msgpack.packb({"protocol": PROTOCOL, "type": type(msg).__name__, **dataclasses.asdict(msg)},
                         use_bin_type=True)


def decode(data: bytes) -> Message:
    """Inverse of `encode`; anything else (an unknown kind or version too) is a BadMessage saying why."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated kinds on garbage
        raise BadMessage(f"not msgpack ({len(data)} bytes): {e!r}") from None
    if not isinstance(d, dict):
        raise BadMessage(f"not a mapping but {type(d).__name__}")
    version, kind = d.pop("protocol", None), d.pop("type", None)
    if version != PROTOCOL:
        raise BadMessage(f"protocol version {version!r} (kind {kind!r}); this side speaks {PROTOCOL}")
    if kind not in TYPES:
        raise BadMessage(f"unknown kind {kind!r} (protocol {PROTOCOL})")
    try:
        return TYPES[kind](**d)
    except TypeError as e:  # missing or unknown fields
        raise BadMessage(f"{kind}: {e}") from None
