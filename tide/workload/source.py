"""The workload as served: the embedded default's one-dataset requests, and segments that repeat
until the loop has done what a run waits for.

`WorkloadConfig` is a one-phase workload: `num_prompts` (at most the whole set) from one dataset,
Poisson arrivals at `arrival_rate` or a closed loop at `concurrency`, labelled with the dataset name.
A replay is one segment per phase. A segment with an active `UntilConfig` is served whole, then its
prompts again under new ids (`ID~k`) until its conditions hold: serving never waits for training, so
a run that must show a trained draft at work waits for that event rather than racing the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from tide.config import UntilConfig, WorkloadConfig
from tide.serve.engine import Request, RequestResult
from tide.workload.arrivals import Arrivals
from tide.workload.phases import Phase, WorkloadSpec, build_workload
from tide.workload.prompts import WorkloadError, load_prompts

log = logging.getLogger(__name__)
CYCLE_OUTCOMES = ("trained", "deploy", "chain", "hold", "reject")  # events.json kinds that end a training cycle


def build_requests(cfg: WorkloadConfig, target_dir: Path, max_prompt_tokens: int) -> list[Request]:
    """Seeded sample of `num_prompts` requests with Poisson arrivals (rate > 0) or a closed loop."""
    try:
        phase = Phase(cfg.dataset, cfg.dataset, cfg.max_tokens, cfg.path, num_prompts=cfg.num_prompts)
        phase = replace(phase, num_prompts=min(cfg.num_prompts, len(load_prompts(cfg.dataset, cfg.path))))
    except ValueError as e:  # field-first messages: `dataset: ...`, `path: ...`
        raise WorkloadError(f"workload.{e}") from None
    arrivals = (Arrivals("poisson", rate=cfg.arrival_rate) if cfg.arrival_rate > 0
                else Arrivals("closed", concurrency=cfg.concurrency))
    return build_workload(WorkloadSpec((phase,), arrivals, cfg.seed), target_dir, max_prompt_tokens)


@dataclass(frozen=True)
class Segment:
    """Requests in arrival order (arrivals from the run's start, or None) and when to stop repeating them."""

    requests: list[Request]
    until: UntilConfig = UntilConfig()


def phase_segments(spec: WorkloadSpec, requests: list[Request], share: int = 0, shares: int = 1) -> list[Segment]:
    """One segment per phase of `spec` (with its `until`): share number `share` of `shares` of the
    phase's requests, round-robin (all of them by default)."""
    return [Segment([r for r in requests if r.workload == p.name][share::shares], p.until) for p in spec.phases]


class RequestSource:
    """Yields the segments' requests in order, each segment repeated while its `until` is not met.

    Conditions are read from what the serving loop reports: `observe` gets every finished request,
    `events` is the coordinator's live event list. A repeated pass of timed arrivals starts one mean
    gap after the last arrival, and later segments move by as much as the repeats took.
    """

    def __init__(self, segments: list[Segment], events: list[Any], learning: bool) -> None:
        self.segments, self.events, self.learning = segments, events, learning
        self.served: dict[str, Request] = {}  # every request yielded, by id
        self.outcomes: list[dict[str, Any]] = []  # per segment: passes, whether `until` was met, seconds
        self._results: list[tuple[RequestResult, int]] = []  # finished in this segment, with len(events) then
        self._first_event = 0  # index into events where the current segment started
        self.stopped = ""  # why no more requests are yielded (a signal), "" while the workload runs

    def observe(self, r: RequestResult) -> None:
        self._results.append((r, len(self.events)))

    def stop(self, reason: str) -> None:
        """Yield nothing more: requests in flight finish, the run ends with its results written."""
        self.stopped = reason

    def __iter__(self) -> Iterator[Request]:
        shift, last, end = 0.0, 0.0, 0.0  # arrival shift, last arrival yielded, previous segment's planned end
        for i, seg in enumerate(self.segments):
            if not seg.requests:
                continue
            self._results, self._first_event, t0 = [], len(self.events), time.monotonic()
            until = seg.until if self.learning and seg.until.active else None
            first, final = seg.requests[0].arrival, seg.requests[-1].arrival
            timed = first is not None and final is not None
            if timed and i:  # keep the planned gap to where the previous segment really ended
                shift = last - end
            k, stop, met = 0, until is None, until is None
            while True:
                for r in seg.requests:
                    if self.stopped:
                        self.outcomes.append(dict(segment=i, passes=k + 1, until_met=False, stopped=self.stopped,
                                                  s=round(time.monotonic() - t0, 3)))
                        return
                    if k:
                        stop, met = self._check(until, t0)  # type: ignore[arg-type]
                        if stop:
                            break
                    req = dataclasses.replace(r, request_id=f"{r.request_id}~{k}" if k else r.request_id,
                                              arrival=None if r.arrival is None else r.arrival + shift)
                    self.served[req.request_id] = req
                    last = req.arrival or 0.0
                    yield req
                if not stop:
                    stop, met = self._check(until, t0)  # type: ignore[arg-type]
                if stop:
                    break
                k += 1
                if timed:  # the next pass starts one mean gap after the last arrival
                    gap = (final - first) / max(len(seg.requests) - 1, 1)  # type: ignore[operator]
                    shift = last + gap - first  # type: ignore[operator]
            end = final or 0.0
            self.outcomes.append(dict(segment=i, passes=k + 1, until_met=met, s=round(time.monotonic() - t0, 3)))
            if until is not None and not met:
                log.warning("workload: segment %d: `until` not met within max_s %.0f s: moving on", i, until.max_s)

    def _check(self, until: UntilConfig, t0: float) -> tuple[bool, bool]:
        return until_status(until, self.events, self._first_event, self._results, time.monotonic() - t0)


class Finished(NamedTuple):
    """What `until` reads of a finished request (a RequestResult has both; an instance reports them)."""

    speculate: bool
    draft_version: int


def until_status(until: UntilConfig, events: list[Any], first_event: int,
                 finished: Sequence[tuple[Finished | RequestResult, int]], elapsed_s: float) -> tuple[bool, bool]:
    """(stop repeating, conditions met) of a segment that started at `events[first_event]`, `elapsed_s`
    ago; `finished`: its requests with len(events) when each finished. A bare max_s is the segment's
    length; with conditions it is a deadline, and passing it stops with met = False."""
    if not (until.trained_requests or until.event):
        return elapsed_s >= until.max_s, True
    events = events[first_event:]
    met = True
    if until.trained_requests:
        deployed = {e.version for e in events if e.kind == "deploy"}
        met = sum(r.speculate and r.draft_version in deployed for r, _ in finished) >= until.trained_requests
    if met and until.event:
        # a cycle's outcome counts only for a cycle started in this segment: one that trained on it
        start = next((j for j, e in enumerate(events) if e.kind == "train"), len(events)) \
            if until.event in CYCLE_OUTCOMES else 0
        at = next((first_event + j for j, e in enumerate(events) if j >= start and e.kind == until.event), None)
        met = at is not None and sum(n > at for _, n in finished) >= until.event_requests
    return met or elapsed_s >= until.max_s, met
