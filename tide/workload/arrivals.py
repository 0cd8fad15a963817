"""Arrival processes: when each request of a workload arrives, phase after phase, seeded.

A phase asks for `num_prompts` requests or for `duration_s` seconds of arrivals. It starts where
the previous one ended: at its last arrival (a `num_prompts` phase) or at its start plus
`duration_s` (a duration phase).

- `poisson`: exponential gaps at `rate` requests/s from `random.Random("arrivals-SEED")`, a stream
  of its own, so the rate never changes which prompts a seed draws.
- `closed`: no times (arrival None); the engine keeps `concurrency` requests in flight. Without a
  clock a phase must give `num_prompts`.
- `trace`: the timestamps of a JSONL file (docs/replay.md), shifted to start at 0, consumed in order.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from tide.workload.prompts import WorkloadError

_FIELD = {"poisson": "rate", "closed": "concurrency", "trace": "trace"}  # the parameter each kind needs


@dataclass(frozen=True)
class Arrivals:
    """How requests arrive: Poisson at `rate`, a closed loop of `concurrency`, or a `trace` file."""

    kind: Literal["poisson", "closed", "trace"]
    rate: float | None = None  # requests/s (poisson)
    concurrency: int | None = None  # requests in flight (closed)
    trace: str = ""  # JSONL file of timestamps (trace); relative to the current directory

    def __post_init__(self) -> None:
        given = {kind: getattr(self, name) not in (None, "") for kind, name in _FIELD.items()}
        if not given[self.kind]:
            raise ValueError(f"{_FIELD[self.kind]}: required for {self.kind} arrivals")
        for kind in given:
            if kind != self.kind and given[kind]:
                raise ValueError(f"{_FIELD[kind]}: applies to {kind} arrivals only, these are {self.kind}")
        if self.kind == "poisson" and not (self.rate > 0 and math.isfinite(self.rate)):  # type: ignore[operator]
            raise ValueError(f"rate: must be > 0 requests/s, got {self.rate}")
        if self.kind == "closed" and self.concurrency < 1:  # type: ignore[operator]
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")


@dataclass(frozen=True)
class Slot:
    """One arrival: its time (None in a closed loop) and the trace's output length, if it has one."""

    arrival: float | None
    max_tokens: int | None = None


def schedule(arrivals: Arrivals, sizes: Sequence[tuple[int | None, float | None]], seed: int) -> list[list[Slot]]:
    """The arrivals of each phase, given each phase's (num_prompts, duration_s) with exactly one set."""
    if arrivals.kind == "closed":
        return [[Slot(None)] * n for n, _ in sizes]  # type: ignore[operator]  # closed phases give num_prompts
    stream = iter(read_trace(arrivals.trace)) if arrivals.kind == "trace" else _poisson(arrivals.rate, seed)
    nxt = next(stream, None)  # the first arrival not yet given to a phase
    out: list[list[Slot]] = []
    start = 0.0
    for i, (n, duration) in enumerate(sizes):
        end = start + duration if duration is not None else math.inf
        slots: list[Slot] = []
        while nxt is not None and len(slots) < (n or math.inf) and nxt.arrival < end:  # type: ignore[operator]
            slots.append(nxt)
            nxt = next(stream, None)
        if n is not None and len(slots) < n:  # only a trace runs out
            raise WorkloadError(f"workload.phases[{i}].num_prompts: the trace {arrivals.trace} has {len(slots)} "
                                f"arrivals left for this phase's {n}")
        if not slots:
            source = f"in the trace {arrivals.trace}" if arrivals.kind == "trace" else f"at {arrivals.rate}/s"
            raise WorkloadError(f"workload.phases[{i}].duration_s: no arrival {source} within {duration} s "
                                f"of the phase's start at {start:.3f} s")
        start = end if duration is not None else slots[-1].arrival  # type: ignore[assignment]
        out.append(slots)
    return out


def _poisson(rate: float | None, seed: int) -> Iterator[Slot]:
    rng = random.Random(f"arrivals-{seed}")
    t = 0.0
    while True:
        t += rng.expovariate(rate)  # type: ignore[arg-type]
        yield Slot(t)


def read_trace(path: str) -> list[Slot]:
    """Slots of a JSONL trace sorted by time and shifted to start at 0 (other fields are ignored)."""
    where = "workload.arrivals.trace"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{where}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    rows: list[tuple[float, int | None]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where}: {path}: line {i}: not JSON ({e.msg})") from None
        ts, mt = (rec.get("timestamp"), rec.get("max_tokens")) if isinstance(rec, dict) else (None, None)
        if not _number(ts) or not math.isfinite(ts):
            raise WorkloadError(f"{where}: {path}: line {i}: 'timestamp' must be a number of seconds, got {ts!r}")
        if mt is not None and not (type(mt) is int and mt >= 1):
            raise WorkloadError(f"{where}: {path}: line {i}: 'max_tokens' must be an int >= 1, got {mt!r}")
        rows.append((float(ts), mt))
    if not rows:
        raise WorkloadError(f"{where}: {path}: no arrivals in the file")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [Slot(t - t0, mt) for t, mt in rows]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
