"""Small typed messages between roles, encoded with msgpack (never pickle).

Messages are the doorbell; files are the truth: a `Train` names the chunks to read by time, a
`DraftReady` a published draft dir. Nothing bulky ever travels in a message. Every message carries the protocol
version; a receiver drops (and logs) a message of an unknown kind or version instead of failing, so
roles of different releases degrade to "not understood", never to a crash.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import msgpack

PROTOCOL = 7  # bump when a message changes incompatibly
MAX_BYTES = 1 << 16  # the largest message is a DraftReady of a few hundred bytes; a frame above this is refused


@dataclass(frozen=True)
class Train:
    cycle: int
    window_tokens: int  # at most this many of the newest stored tokens (0: no bound)
    since_ns: int  # only chunks written from this time on (time.time_ns() of the writer's host; 0: all)
    base_version: int  # the draft to train from: the one serving or a chain's newest (-1: the newest published)
    live_version: int  # the draft serving, which the new one must beat (-1 or base_version: the base)
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
    live_al: float  # the draft serving when the cycle was asked (Train.live_version), on the same data
    live_version: int
    train_tokens: int
    wall_s: float
    eval_counts: list[int]  # the held-out walk's histogram of accepted drafts per step (train.gamma)
    base_counts: list[int]
    live_counts: list[int]


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


RESULTS_RECEIVED = "results received"  # the coordinator's Shutdown answering an instance's InstanceDone


@dataclass(frozen=True)
class Join:
    """The first frame of a training component that comes back (tide.runtime.rejoin): the run's key."""

    key: str


# ---- between the coordinator and the other serving instances (ranks 1.. of component 0)


@dataclass(frozen=True)
class Capture:
    """Coordinator -> instance: capture on or off; a collection counts the chunks named from `since_ns` on."""

    on: bool
    since_ns: int


@dataclass(frozen=True)
class Deploy:
    """Coordinator -> instance: swap to draft `version` of the run's drafts dir, with its held-out walk
    (the rollback gate's reference)."""

    version: int
    reason: str
    eval_counts: list[int]


@dataclass(frozen=True)
class InstanceReport:
    """Instance -> coordinator, once a window: the first-draft acceptance of the requests it finished
    speculating since the last report (the collection gate merges every instance's), the draft
    version of each request it finished (-1: served without speculation; a dedicated coordinator's
    `workload.until` counts them), and the rows it stored in the collection that started at `since_ns`."""

    instance: int
    first_acceptance: list[float]
    stored_rows: int
    since_ns: int
    served: list[int]


@dataclass(frozen=True)
class InstanceEvent:
    """Instance -> coordinator: a decision the instance took on its own engine (swap, rollback, spec-off...)."""

    instance: int
    kind: str
    reason: str
    version: int  # -1: none


@dataclass(frozen=True)
class InstanceDone:
    """Instance -> coordinator: its workload is served and its results are in the run dir."""

    instance: int
    requests: int


Message = (Train | TrainProgress | DraftReady | TrainFailed | Heartbeat | Shutdown | Join | Capture | Deploy
           | InstanceReport | InstanceEvent | InstanceDone)
TYPES: dict[str, type] = {t.__name__: t for t in Message.__args__}  # type: ignore[attr-defined]
FIELDS = {name: typing.get_type_hints(t) for name, t in TYPES.items()}


class BadMessage(ValueError):
    """Bytes that are not a message of this protocol version."""


def encode(msg: Message) -> bytes:
    return msgpack.packb({"protocol": PROTOCOL, "type": type(msg).__name__, **dataclasses.asdict(msg)},
                         use_bin_type=True)


def decode(data: bytes) -> Message:
    """Inverse of `encode`; anything else (an unknown kind or version, a field of another type, more
    than MAX_BYTES) is a BadMessage saying why. Field types are checked because receivers build paths
    and indices from them (a `version` is an int, never a string like "../x")."""
    if len(data) > MAX_BYTES:
        raise BadMessage(f"{len(data)} bytes, over the limit of {MAX_BYTES}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated kinds on garbage
        raise BadMessage(f"not msgpack ({len(data)} bytes): {e!r}") from None
    if not isinstance(d, dict):
        raise BadMessage(f"not a mapping but {type(d).__name__}")
    version, kind = d.pop("protocol", None), d.pop("type", None)
    if version != PROTOCOL:
        raise BadMessage(f"protocol version {version!r} (kind {kind!r}); this side speaks {PROTOCOL}")
    if kind not in TYPES:
        raise BadMessage(f"unknown kind {kind!r} (protocol {PROTOCOL})")
    fields = FIELDS[kind]
    if set(d) != set(fields):
        raise BadMessage(f"{kind}: fields {sorted(map(str, set(d) ^ set(fields)))} missing or unknown")
    for name, value in d.items():
        if not _is(value, fields[name]):
            raise BadMessage(f"{kind}.{name}: {type(value).__name__} where {fields[name]} belongs")
    return TYPES[kind](**d)


def _is(value: object, hint: object) -> bool:
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_is(v, item) for v in value)
    return isinstance(value, hint)  # type: ignore[arg-type]
