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
                 free, and lasts fixed + epochs * W * (1 - eval) / (R * (1 + (n - 1) * eff)),
                 W = rows in the retention window, R = one trainer's tokens/s, n trainers
    deploy       AL = AL_low + (AL_high - AL_low) * g(fresh rows): g is the recovery curve

Events: shift (AL drops; collection starts `detect_s` later), cycle start (derived: the threshold
crossing), cycle done (publish), deploy, end. Worked example and validation: docs/SIMULATOR.md.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from tide.config import ConfigError, from_dict, load_config
from tide.control import LatencyProfile
from tide.plan.planner import KNOWN

# Draft trainer, DeepSpeed ZeRO-2 bf16, TTT depth 3, at Llama-3.1-8B dims (H 4096) on one H200
# (docs/BENCHMARKS.md); taken as an H100's (same bf16 peak), other classes scale by KNOWN's training.
REF_TRAIN_TOKENS_PER_S, REF_HIDDEN = 46.3e3, 4096
# Recovery curve: fraction of the lost AL regained vs fresh stored rows, from our SmolLM2 GSM8K runs
# against the calibration's 1.8 plateau: 37.1k rows -> AL 1.32 (draft-learning bench), ~141k rows
# -> 1.75 (notes: 50.5k output + ~91k prompt rows). Flat beyond the last point: nothing measured there.
RECOVERY = ((0.0, 0.0), (37_100.0, 0.40), (141_000.0, 0.94))


@dataclass(frozen=True)
class Serving:
    """The serving instances (one capture writer each)."""

    tokens_per_s: float  # r0: one instance's output tokens/s decoding plainly (no speculation)
    instances: int = 1
    gpu: str = "H100"
    gpus_per_instance: int = 1
    gamma: int = 3
    draft_cost: float = 0.05  # c = one draft step / one target step at the serving batch
    verify_cost: float = 1.0  # beta = target pass over b(gamma+1) tokens / over b tokens
    keep_fraction: float = 1.0  # stored rows per output token while collecting (prompt rows add)


@dataclass(frozen=True)
class Storage:
    """The shared store: aggregate write bandwidth vs concurrent writers (flat outside the points)."""

    bandwidth: tuple[tuple[float, float], ...] = ((1.0, 564e6), (8.0, 1.47e9))  # (writers, bytes/s): VAST
    row_overhead_bytes: int = 9  # token, position, is-output per row


@dataclass(frozen=True)
class Training:
    """The trainer group (data parallel) and the collection gate's cycle."""

    count: int = 1  # training GPUs; 0 = no training (a static draft)
    gpu: str = "MI250"
    tokens_per_s_per_gpu: float | None = None  # None = estimated (`trainer_tokens_per_s`)
    plain_tokens_per_s_per_gpu: float | None = None  # a trainer serving instead; None = from KNOWN
    dp_efficiency: float = 0.99  # each added GPU adds this share of one (H200: 2 GPUs = 1.99x)
    epochs: float = 2.0
    cycle_fixed_s: float = 22.0  # DeepSpeed set-up, read and verify chunks, eval, publish (H200x2 pipeline)
    start_s: float = 0.0  # trainer start-up before its first cycle; 0: resident (serving waits for it)
    n_threshold: int = 32_768  # stored rows that start a cycle (CollectConfig.n_threshold)
    retention_tokens: int = 1_000_000  # the window a cycle trains on (StoreConfig.retention_tokens)
    eval_fraction: float = 0.1
    cycles_per_shift: int = 1  # 1 = Algorithm 1: one cycle, then stop collecting
    deploy_s: float = 0.0  # publish -> serving on every instance


@dataclass(frozen=True)
class Shift:
    """At `at_s` the live draft's AL on the new workload is `al`; training can bring it back up to
    `al_recovered` (None = the scenario's `al_aligned`)."""

    at_s: float
    al: float
    al_recovered: float | None = None


@dataclass(frozen=True)
class Scenario:
    """One scenario file (`configs/simulate/*.yaml`)."""

    hidden_size: int
    duration_s: float
    al_aligned: float  # AL of the draft serving at t = 0
    serving: Serving
    training: Training = field(default_factory=Training)
    storage: Storage = field(default_factory=Storage)
    shifts: tuple[Shift, ...] = ()
    detect_s: float = 0.0  # shift -> the collection gate starts collecting
    recovery: tuple[tuple[float, float], ...] = RECOVERY  # (fresh stored rows, fraction regained)


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
    threshold_s: float | None  # N_threshold rows stored: the first cycle may start
    cycle_s: float | None  # duration of the first cycle (without the trainer's start-up)
    train_tokens: float | None  # rows the first cycle trains on, per epoch
    published_s: float | None  # first draft published
    recovered_s: float | None  # last deploy for this shift
    cycles: int
    dropped_tokens: float
    storage_limited: bool  # the store's bandwidth capped capture for this shift
    bottleneck: str  # the longest phase: detect | capture | storage | training | none


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


def draft_params(hidden: int, vocab: int = 32_000, kv_dim: int = 1024, mlp_ratio: float = 3.5) -> float:
    """Trainable EAGLE-3 head parameters with Llama-3 proportions: fc 3H*H, q 2H*H, k and v 2H*kv,
    o H*H, MLP 3*H*(3.5H), LM head H*V. H 4096: 424.7M (the benchmarked head has 425M)."""
    h = hidden
    return 3 * h * h + 2 * h * h + 2 * 2 * h * kv_dim + h * h + 3 * h * mlp_ratio * h + h * vocab


def trainer_tokens_per_s(gpu: str, hidden: int) -> float | None:
    """One GPU's training tokens/s: the H200 figure scaled by class (KNOWN) and by draft size
    (cost per token ~ parameters). MI250 at H 8192: 46.3k / 2.44 / 3.30 = 5.75k. None: unknown class."""
    if gpu not in KNOWN:
        return None
    return REF_TRAIN_TOKENS_PER_S * KNOWN[gpu][1] / KNOWN["H100"][1] * draft_params(REF_HIDDEN) / draft_params(hidden)


def latency_profile(s: Scenario) -> LatencyProfile:
    """Eq. 5 through the speculation gate's own code: time in plain steps at the serving batch, so
    T(batch) = 1 (`n` = 1 stands for the batch) and T(batch * (gamma + 1)) = beta.
    `latency_profile(s).predicted_speedup(al, 1)` = al / (gamma * c + beta)."""
    sv = s.serving
    return LatencyProfile(((1, 1.0), (sv.gamma + 1, sv.verify_cost)), sv.draft_cost, sv.gamma)


def group_tokens_per_s(s: Scenario) -> float:
    """The trainer group's tokens/s (data parallel, `dp_efficiency` per added GPU); 0 without trainers."""
    tr = s.training
    one = tr.tokens_per_s_per_gpu if tr.tokens_per_s_per_gpu is not None else trainer_tokens_per_s(tr.gpu, s.hidden_size)
    return 0.0 if tr.count == 0 or one is None else one * (1 + (tr.count - 1) * tr.dp_efficiency)


def plain_tokens_per_s(s: Scenario) -> float | None:
    """Every GPU serving plainly, trainers included (the planner's baseline); None: no figure."""
    sv, tr = s.serving, s.training
    per_trainer = tr.plain_tokens_per_s_per_gpu
    if per_trainer is None and tr.count and {sv.gpu, tr.gpu} <= set(KNOWN):
        per_trainer = sv.tokens_per_s / sv.gpus_per_instance * KNOWN[tr.gpu][0] / KNOWN[sv.gpu][0]
    if per_trainer is None and tr.count:
        return None
    return sv.instances * sv.tokens_per_s + tr.count * (per_trainer or 0.0)


def validate(s: Scenario, source: str) -> Scenario:
    """Check values; every error is one line `FILE: key.path: what`."""

    def need(ok: bool, path: str, msg: str) -> None:
        if not ok:
            fail(path, msg)

    def fail(path: str, msg: str) -> NoReturn:
        raise ConfigError(f"{source}: {path}: {msg}")

    sv, tr, st = s.serving, s.training, s.storage
    need(s.hidden_size > 0, "hidden_size", f"must be > 0, got {s.hidden_size}")
    need(s.duration_s > 0, "duration_s", f"must be > 0 seconds, got {s.duration_s}")
    need(s.al_aligned >= 1, "al_aligned", f"must be >= 1 (an AL counts the bonus token), got {s.al_aligned}")
    need(s.detect_s >= 0, "detect_s", f"must be >= 0 seconds, got {s.detect_s}")
    for key, ok, rule in [("tokens_per_s", sv.tokens_per_s > 0, "> 0"), ("instances", sv.instances >= 1, ">= 1"),
                          ("gpus_per_instance", sv.gpus_per_instance >= 1, ">= 1"), ("gamma", sv.gamma >= 1, ">= 1"),
                          ("draft_cost", sv.draft_cost >= 0, ">= 0"),
                          ("verify_cost", sv.verify_cost >= 1, ">= 1 (verifying more tokens is never cheaper)"),
                          ("keep_fraction", sv.keep_fraction > 0, "> 0")]:
        need(ok, f"serving.{key}", f"must be {rule}, got {getattr(sv, key)}")
    need(len(st.bandwidth) > 0, "storage.bandwidth", "give at least one [writers, bytes_per_s] pair")
    for i, pair in enumerate(st.bandwidth):
        need(len(pair) == 2 and pair[0] >= 1 and pair[1] > 0, f"storage.bandwidth[{i}]",
             f"must be [writers >= 1, bytes_per_s > 0], got {list(pair)}")
        need(i == 0 or pair[0] > st.bandwidth[i - 1][0], f"storage.bandwidth[{i}]", "writers must increase")
    need(st.row_overhead_bytes >= 0, "storage.row_overhead_bytes", f"must be >= 0, got {st.row_overhead_bytes}")
    for key, ok, rule in [("count", tr.count >= 0, ">= 0"), ("dp_efficiency", 0 <= tr.dp_efficiency <= 1, "in [0, 1]"),
                          ("epochs", tr.epochs > 0, "> 0"), ("cycle_fixed_s", tr.cycle_fixed_s >= 0, ">= 0"),
                          ("start_s", tr.start_s >= 0, ">= 0"),
                          ("n_threshold", tr.n_threshold >= 1, ">= 1"),
                          ("retention_tokens", tr.retention_tokens >= tr.n_threshold, ">= n_threshold"),
                          ("eval_fraction", 0 <= tr.eval_fraction < 1, "in [0, 1)"),
                          ("cycles_per_shift", tr.cycles_per_shift >= 1, ">= 1"), ("deploy_s", tr.deploy_s >= 0, ">= 0"),
                          ("tokens_per_s_per_gpu", tr.tokens_per_s_per_gpu is None or tr.tokens_per_s_per_gpu > 0, "> 0"),
                          ("plain_tokens_per_s_per_gpu",
                           tr.plain_tokens_per_s_per_gpu is None or tr.plain_tokens_per_s_per_gpu >= 0, ">= 0")]:
        need(ok, f"training.{key}", f"must be {rule}, got {getattr(tr, key)}")
    need(tr.count == 0 or group_tokens_per_s(s) > 0, "training.gpu",
         f"unknown GPU class {tr.gpu}; give training.tokens_per_s_per_gpu (known: {', '.join(KNOWN)})")
    last = -math.inf
    for i, sh in enumerate(s.shifts):
        need(sh.at_s > last and 0 <= sh.at_s < s.duration_s, f"shifts[{i}].at_s",
             f"must increase and lie in [0, duration_s = {s.duration_s:g}), got {sh.at_s}")
        need(sh.al >= 1, f"shifts[{i}].al", f"must be >= 1, got {sh.al}")
        top = s.al_aligned if sh.al_recovered is None else sh.al_recovered
        need(top >= sh.al, f"shifts[{i}].al_recovered", f"must be >= al ({sh.al}), got {top}")
        last = sh.at_s
    for i, pair in enumerate(s.recovery):
        need(len(pair) == 2 and pair[0] >= 0 and 0 <= pair[1] <= 1, f"recovery[{i}]",
             f"must be [rows >= 0, fraction in [0, 1]], got {list(pair)}")
        need(i == 0 or (pair[0] > s.recovery[i - 1][0] and pair[1] >= s.recovery[i - 1][1]), f"recovery[{i}]",
             "rows must increase and the fraction must not fall")
    need(len(s.recovery) > 0, "recovery", "give at least one [rows, fraction] point")
    return s


def parse_scenario(data: Any, source: str = "<dict>") -> Scenario:
    """Scenario from plain data (as YAML would give it)."""
    return validate(from_dict(Scenario, data, source=source), source)


def load_scenario(path: str | Path) -> Scenario:
    """Scenario from a YAML file; raises ConfigError with one line naming the file and key."""
    return validate(load_config(path, Scenario), str(path))


class _Loop:
    """The event loop's state. Rows and tokens are floats: rates integrate over exact intervals."""

    def __init__(self, s: Scenario) -> None:
        self.s, sv = s, s.serving
        self.bpt = 6 * s.hidden_size + s.storage.row_overhead_bytes
        writers, rates = zip(*s.storage.bandwidth)
        self.bw = float(np.interp(sv.instances, writers, rates))
        self.train_rate = group_tokens_per_s(s)
        self.profile = latency_profile(s)
        self.t, self.al, self.phase = 0.0, s.al_aligned, -1  # phase: index of the latest shift
        self.collecting, self.training, self.trainer_started, self.cycles = False, False, False, 0
        self.fresh = self.window = 0.0  # rows stored since the shift / in the retention window
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
        served = sv.instances * sv.tokens_per_s * max(1.0, self.profile.predicted_speedup(self.al, 1))
        demand = served * sv.keep_fraction * self.bpt if self.collecting else 0.0
        return served, demand, min(demand, self.bw)

    def advance(self, t1: float) -> None:
        """Integrate the constant rates over [t, t1]."""
        dt = t1 - self.t
        if dt <= 0:
            return
        served, demand, write = self.rates()
        stored, dropped = write / self.bpt * dt, (demand - write) / self.bpt * dt
        self.fresh += stored
        self.window = min(self.window + stored, self.s.training.retention_tokens)
        for key, v in [("served", served * dt), ("offered", demand / self.bpt * dt), ("stored", stored),
                       ("dropped", dropped), ("saturated_s", dt if demand > self.bw else 0.0)]:
            self.totals[key] += v
        if self.phase >= 0:
            self.shift_log[self.phase]["dropped"] += dropped
            self.shift_log[self.phase]["saturated"] |= demand > self.bw
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
        """Train on the retention window: fixed cost + epochs over its train split."""
        tr, log = self.s.training, self.shift_log[self.phase]
        rows = self.window * (1 - tr.eval_fraction)
        cycle = tr.cycle_fixed_s + tr.epochs * rows / self.train_rate
        start, self.trainer_started = (0.0 if self.trainer_started else tr.start_s), True
        self.training, self.cycles = True, self.cycles + 1
        log["cycles"] = self.cycles
        if self.cycles == 1:
            log["threshold"], log["cycle"], log["train_tokens"] = self.t, cycle, rows
        self.push(self.t + start + cycle, "done", self.phase, self.fresh)

    def handle(self, kind: str, phase: int, value: float) -> None:
        s, tr = self.s, self.s.training
        if kind == "shift":
            sh = s.shifts[phase]
            self.close_phase()
            detect = sh.at_s + s.detect_s if tr.count else None  # no trainer: the gate never collects
            self.shift_log.append(dict(at=sh.at_s, before=self.al, shifted=sh.al, dropped=0.0, saturated=False, threshold=None,
                                       cycle=None, train_tokens=None, published=None, recovered=None, detect=detect, cycles=0))
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
    capture, or by storage where the store's bandwidth capped it), or training (queue + cycle)."""
    at, end = log["at"], log["end"]
    rel = {k: (None if log[k] is None else log[k] - at) for k in ("threshold", "published", "recovered")}
    if log["detect"] is None:
        bottleneck = "none"  # no trainers: nothing is waited for
    else:
        detected = min(log["detect"], end)
        collected = log["threshold"] if log["threshold"] is not None else end
        published = log["published"] if log["published"] is not None else end
        phases = {"detect": detected - at, "storage" if log["saturated"] else "capture": collected - detected,
                  "training": published - collected}
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


def with_training(s: Scenario, **changes: Any) -> Scenario:
    """`s` with training fields changed (sweeps; count = 0 gives the static-draft baseline)."""
    return replace(s, training=replace(s.training, **changes))
