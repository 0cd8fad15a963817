"""Discrete-event model of the TIDE loop at cluster scale (`python -m tide.plan simulate`).

The planner (`planner.py`) answers the steady state: which GPUs serve and which train. This answers
what no test machine can show: after a workload shift, how long N serving instances wait for an
aligned draft, whether the shared store or the trainers hold that up, and how much capture the store
drops. Between two events every rate is constant, so the loop jumps from event to event exactly.

    speedup(AL)  = AL / (gamma * c + beta)           Eq. 5, T normalised at the serving batch
    served/s     = I * r0 * max(1, speedup(AL))      the speculation gate turns a losing draft off
    offered/s    = served/s * keep                   rows offered to the store while collecting
    demand       = offered/s * (6H + 9) bytes/s      three bf16 aux rows + 9 bytes of row metadata
    stored/s     = min(demand, B(I)) / (6H + 9)      B: the store's aggregate write bandwidth at I
                                                     writers; the rest is dropped (writer queue full)
    cycle k      starts once k * N_threshold rows were stored since the shift and the trainers are
                 free; lasts fixed + W * (6H + 9) / read + epochs * W * (1 - eval) / R_n, where
                 W = min(rows stored since the shift, retention) (every rank reads all of it) and
                 R_n = R * (1 + (n - 1) * eff) for n trainers of R tokens/s each
    deploy       AL = AL_low + (AL_high - AL_low) * g(fresh rows): g is the recovery curve

Events: shift (AL drops; collection starts `detect_s` later), cycle start (derived: the threshold
crossing), cycle done (publish), deploy, end. Worked example and validation: docs/SIMULATOR.md.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tide.plan.scenario import Scenario, group_tokens_per_s, latency_model, plain_tokens_per_s


@dataclass(frozen=True)
class Segment:
    """An interval of constant rates (the timeline)."""

    t0: float
    t1: float
    al: float
    served_per_s: float
    demand_bytes_per_s: float  # what capture offers the store
    write_bytes_per_s: float  # what the store takes


@dataclass(frozen=True)
class ShiftResult:
    """One shift; times are seconds after it, None where it never happened before the next shift."""

    at_s: float
    al_before: float
    al_shifted: float
    al_final: float  # serving when the next shift (or the end) comes
    threshold_s: float | None  # N_threshold rows stored (the first cycle starts then, or once trainers are free)
    cycle_s: float | None  # duration of the first cycle (without the trainer's start-up)
    train_tokens: float | None  # rows the first cycle trains on, per epoch
    published_s: float | None  # first draft published
    recovered_s: float | None  # last deploy for this shift
    cycles: int
    dropped_tokens: float
    storage_limited: bool  # the store's bandwidth capped capture for this shift
    bottleneck: str  # the longest phase: detect | capture | storage | read | training | none


@dataclass(frozen=True)
class Result:
    """Totals over the run; rows and tokens are counts, rates per second."""

    served_tokens: float
    plain_tokens: float | None  # every GPU (trainers too) serving plainly; None: no trainer figure
    offered_tokens: float
    stored_tokens: float
    dropped_tokens: float
    written_bytes: float
    bytes_per_token: int
    bandwidth_bytes_per_s: float  # B(I)
    storage_saturated_s: float
    train_tokens_per_s: float  # the whole trainer group
    shifts: tuple[ShiftResult, ...]
    timeline: tuple[Segment, ...]


class _Loop:
    """The event loop's state. Rows and tokens are floats: rates integrate over exact intervals."""

    def __init__(self, s: Scenario) -> None:
        self.s, sv = s, s.serving
        self.bpt = 6 * s.hidden_size + s.storage.row_overhead_bytes
        writers, rates = zip(*s.storage.bandwidth)
        self.bw = float(np.interp(sv.instances, writers, rates))
        self.train_rate = group_tokens_per_s(s)
        self.latency = latency_model(s)
        self.t, self.al, self.phase = 0.0, s.al_aligned, -1  # phase: index of the latest shift
        self.collecting, self.training, self.trainer_started, self.cycles = False, False, False, 0
        self.fresh = 0.0  # rows stored since the shift (collection starts after it)
        self.totals = dict(served=0.0, offered=0.0, stored=0.0, dropped=0.0, saturated_s=0.0)
        self.segments: list[Segment] = []
        self.shift_log: list[dict[str, Any]] = []
        self.events: list[tuple[float, int, str, int, float]] = []  # (t, seq, kind, phase, value)
        self.seq = itertools.count()
        for i, sh in enumerate(s.shifts):
            self.push(sh.at_s, "shift", i)
        self.push(s.duration_s, "end", -1)

    def push(self, t: float, kind: str, phase: int, value: float = 0.0) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, phase, value))  # seq: ties keep push order

    def rates(self) -> tuple[float, float, float]:
        """(served tokens/s, demand bytes/s, written bytes/s) in the current state."""
        sv = self.s.serving
        served = sv.instances * sv.tokens_per_s * max(1.0, self.latency.speedup(1, sv.gamma, self.al))
        demand = served * sv.keep_fraction * self.bpt if self.collecting else 0.0
        return served, demand, min(demand, self.bw)

    def advance(self, t1: float) -> None:
        """Integrate the constant rates over [t, t1]."""
        dt = t1 - self.t
        if dt <= 0:
            return
        served, demand, write = self.rates()
        stored, dropped = write / self.bpt * dt, (demand - write) / self.bpt * dt
        n = self.s.training.n_threshold
        log = self.shift_log[self.phase] if self.phase >= 0 else {}
        if log and log["threshold"] is None and self.fresh < n <= self.fresh + stored:
            log["threshold"] = self.t + (n - self.fresh) / stored * dt  # the exact crossing
        self.fresh += stored
        for key, v in [("served", served * dt), ("offered", demand / self.bpt * dt), ("stored", stored),
                       ("dropped", dropped), ("saturated_s", dt if demand > self.bw else 0.0)]:
            self.totals[key] += v
        if log:
            log["dropped"] += dropped
            log["saturated"] |= demand > self.bw
        self.segments.append(Segment(self.t, t1, self.al, served, demand, write))
        self.t = t1

    def next_cycle_start(self) -> float:
        """When the next cycle may start: its threshold crossed and the trainers free (inf: never)."""
        tr = self.s.training
        if not self.collecting or self.training or self.cycles >= tr.cycles_per_shift:
            return math.inf
        need = (self.cycles + 1) * tr.n_threshold - self.fresh
        if need <= 1e-6 * tr.n_threshold:
            return self.t
        stored_per_s = self.rates()[2] / self.bpt
        return self.t + need / stored_per_s if stored_per_s > 0 else math.inf

    def start_cycle(self) -> None:
        """Train on the rows stored since the shift, at most `retention_tokens` (as the runtime's
        `Coordinator._train`): fixed cost, reading them, epochs over their train split."""
        tr, log = self.s.training, self.shift_log[self.phase]
        window = min(self.fresh, tr.retention_tokens)
        rows, read = window * (1 - tr.eval_fraction), window * self.bpt / tr.read_bytes_per_s
        cycle = tr.cycle_fixed_s + read + tr.epochs * rows / self.train_rate
        start, self.trainer_started = (0.0 if self.trainer_started else tr.start_s), True
        self.training, self.cycles = True, self.cycles + 1
        log["cycles"] = self.cycles
        if self.cycles == 1:
            log.update(cycle=cycle, read=read, train_tokens=rows)
            if log["threshold"] is None:  # crossed within float slack of the cycle start
                log["threshold"] = self.t
        self.push(self.t + start + cycle, "done", self.phase, window)  # the rows it trains on

    def handle(self, kind: str, phase: int, value: float) -> None:
        s, tr = self.s, self.s.training
        if kind == "shift":
            sh = s.shifts[phase]
            self.close_phase()
            detect = sh.at_s + s.detect_s if tr.count else None  # no trainer: the gate never collects
            self.shift_log.append(dict(at=sh.at_s, before=self.al, shifted=sh.al, detect=detect, dropped=0.0,
                                       saturated=False, threshold=None, cycle=None, read=0.0, train_tokens=None,
                                       published=None, recovered=None, cycles=0))
            self.al, self.phase, self.fresh, self.cycles, self.collecting = sh.al, phase, 0.0, 0, False
            if detect is not None:
                self.push(detect, "detect", phase)
        elif kind == "detect" and phase == self.phase:
            self.collecting = True
        elif kind == "done":
            self.training = False
            if phase == self.phase:  # a cycle of an earlier workload is discarded
                log = self.shift_log[phase]
                if log["published"] is None:
                    log["published"] = self.t
                self.push(self.t + tr.deploy_s, "deploy", phase, self.recovered_al(value))
                self.collecting = self.cycles < tr.cycles_per_shift  # Algorithm 1: the result ends collection
        elif kind == "deploy" and phase == self.phase and value > self.al:
            self.al, self.shift_log[phase]["recovered"] = value, self.t

    def recovered_al(self, fresh: float) -> float:
        """AL of a draft trained on `fresh` rows of the current workload (the recovery curve)."""
        sh = self.s.shifts[self.phase]
        top = self.s.al_aligned if sh.al_recovered is None else sh.al_recovered
        rows, frac = zip(*self.s.recovery)
        return sh.al + (top - sh.al) * float(np.interp(fresh, rows, frac))

    def run(self) -> None:
        while True:
            t_cycle = self.next_cycle_start()
            if t_cycle < self.events[0][0]:
                self.advance(t_cycle)
                self.start_cycle()
                continue
            t, _, kind, phase, value = heapq.heappop(self.events)
            self.advance(t)
            if kind == "end":
                self.close_phase()
                return
            self.handle(kind, phase, value)

    def close_phase(self) -> None:
        """The latest shift's phase ends now (a new shift, or the end of the run)."""
        if self.phase >= 0:
            self.shift_log[self.phase].update(end=self.t, final=self.al)


def _shift_result(log: dict[str, Any]) -> ShiftResult:
    """Times relative to the shift, and which phase took longest: detection, collection (bound by
    capture, or by storage where the store's bandwidth capped it), the first cycle's read of its
    rows, or training (waiting for the trainers, start-up, fixed cost, steps)."""
    at, end = log["at"], log["end"]
    rel = {k: (None if log[k] is None else log[k] - at) for k in ("threshold", "published", "recovered")}
    if log["detect"] is None:
        bottleneck = "none"  # no trainers: nothing is waited for
    else:
        detected = min(log["detect"], end)
        collected = log["threshold"] if log["threshold"] is not None else end
        published = log["published"] if log["published"] is not None else end
        read = min(log["read"], published - collected)
        phases = {"detect": detected - at, "storage" if log["saturated"] else "capture": collected - detected,
                  "read": read, "training": published - collected - read}
        bottleneck = max(phases, key=lambda k: phases[k])
    return ShiftResult(at, log["before"], log["shifted"], log["final"], rel["threshold"], log["cycle"],
                       log["train_tokens"], rel["published"],
                       rel["recovered"], log["cycles"], log["dropped"], log["saturated"], bottleneck)


def simulate(s: Scenario) -> Result:
    """Run scenario `s` from t = 0 to `duration_s`."""
    loop = _Loop(s)
    loop.run()
    t = loop.totals
    plain = plain_tokens_per_s(s)
    return Result(served_tokens=t["served"], plain_tokens=None if plain is None else plain * s.duration_s,
                  offered_tokens=t["offered"], stored_tokens=t["stored"], dropped_tokens=t["dropped"],
                  written_bytes=t["stored"] * loop.bpt, bytes_per_token=loop.bpt, bandwidth_bytes_per_s=loop.bw,
                  storage_saturated_s=t["saturated_s"], train_tokens_per_s=loop.train_rate,
                  shifts=tuple(_shift_result(log) for log in loop.shift_log),
                  timeline=tuple(loop.segments))
