"""The simulator's scenario: a YAML file (`configs/simulate/*.yaml`) loaded strictly into frozen
dataclasses, plus the rates derived from it (trainer tokens/s, Eq. 5 speedup, the plain baseline).
Defaults and where each comes from: docs/SIMULATOR.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from tide.config import ConfigError, from_dict, load_config
from tide.control import LatencyModel
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
    cycle_fixed_s: float = 7.65  # DeepSpeed set-up, eval, publish: fitted on two H200x2 pipeline runs
    read_bytes_per_s: float = 307.5e6  # one rank reads and verifies the window's chunks (same fit)
    start_s: float = 0.0  # trainer start-up before its first cycle; 0: resident (serving waits for it)
    n_threshold: int = 32_768  # stored rows that start a cycle (CollectConfig.n_threshold)
    retention_tokens: int = 1_000_000  # most rows a cycle trains on (StoreConfig.retention_tokens)
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


def latency_model(s: Scenario) -> LatencyModel:
    """Eq. 5 through the speculation gate's own code: time in plain steps at the serving batch, so
    T(batch) = 1 (`n` = 1 stands for the batch) and T(batch * (gamma + 1)) = beta.
    `latency_model(s).speedup(1, gamma, al)` = al / (gamma * c + beta)."""
    sv = s.serving
    return LatencyModel.flat(((1, 1.0), (sv.gamma + 1, sv.verify_cost)), sv.draft_cost, sv.gamma)


def group_tokens_per_s(s: Scenario) -> float:
    """The trainer group's tokens/s (data parallel, `dp_efficiency` per added GPU); 0 without trainers."""
    tr = s.training
    one = tr.tokens_per_s_per_gpu
    if one is None:
        one = trainer_tokens_per_s(tr.gpu, s.hidden_size)
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
                          ("read_bytes_per_s", tr.read_bytes_per_s > 0, "> 0"),
                          ("start_s", tr.start_s >= 0, ">= 0"),
                          ("n_threshold", tr.n_threshold >= 1, ">= 1"),
                          ("retention_tokens", tr.retention_tokens >= tr.n_threshold, ">= n_threshold"),
                          ("eval_fraction", 0 <= tr.eval_fraction < 1, "in [0, 1)"),
                          ("cycles_per_shift", tr.cycles_per_shift >= 1, ">= 1"),
                          ("deploy_s", tr.deploy_s >= 0, ">= 0"),
                          ("tokens_per_s_per_gpu",
                           tr.tokens_per_s_per_gpu is None or tr.tokens_per_s_per_gpu > 0, "> 0"),
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


def with_training(s: Scenario, **changes: Any) -> Scenario:
    """`s` with training fields changed (sweeps; count = 0 gives the static-draft baseline)."""
    return replace(s, training=replace(s.training, **changes))
