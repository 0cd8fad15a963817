"""GPU split planner: which GPUs serve, which train the draft, and what that buys.

Model (all rates per GPU, relative to one MI250 = 1). Class c has n_c GPUs, inference rate I_c and
draft-training rate R_c; t_c of them train, the rest serve:

    plain(all)  = sum_c n_c * I_c               every GPU serves, no speculation (s = 1): the baseline
    tide(t)     = s * sum_c (n_c - t_c) * I_c   serving GPUs run s times faster with an aligned draft
    feasible(t) = sum_c t_c * R_c >= D          ... which holds only if the trainers deliver demand D

The planner enumerates t per class (0..min(n_c, ceil(D / R_c)): more trainers only lose inference;
the last class takes the fewest that meet D), keeps the feasible t, takes the best tide(t), and
falls back to plain inference when that is not better. Maximising tide(t) means losing the least
inference per unit of training delivered, i.e. training on the lowest I_c / R_c first: older GPUs
train, newer ones serve. Whole GPUs can bend that order (4 MI250 + one H100 meet D = 6 with less
lost inference than 4 MI250 + two MI300X); ties go to the lowest ratio.

D (`train_demand`) is absolute, in MI250-training units (one MI250 running the trainer = 1.0). It is
not scaled by serving throughput: the trainer consumes a bounded retention window of captured tokens,
not every token served, and the paper dedicates a fixed group (4 MI250) to 8 H100s, so D = 4
reproduces its setup. D left out or 0 means `default_train_demand` = 1.0, "enough to keep one
training job busy" (one trainer on one MI250-equivalent): a draft never trains for free.

Worked example (configs/inventory/h100x8_mi250x4.yaml, D = 4):
    plain = 8*6.76 + 4*1 = 58.08
    4 MI250 train (R = 4 >= 4):      tide = 1.15 * 8*6.76 = 62.19 -> 1.071x  (paper: 1.08x, ShareGPT)
    same split at s = 1.30:          tide = 70.30              -> 1.210x  (paper: 1.22x, Science)
    2 H100 train instead (R = 4.88): tide = 1.15 * (6*6.76 + 4) = 51.24 -> 0.88x, worse
    at s = 1.0 every split only loses the trainers' inference: plain inference wins.
The paper's figures are measurements; this model is within 0.01 of both.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from tide.config import ConfigError, from_dict, load_config

# Measured per-GPU rates from the paper, MI250 = 1: name -> (inference, draft training).
KNOWN: dict[str, tuple[float, float]] = {"H100": (6.76, 2.44), "MI300X": (4.42, 1.77), "MI250": (1.0, 1.0)}
EPS = 1e-9  # float slack: 3.54 / 1.77 must count as 2 trainers, not 3


@dataclass(frozen=True)
class ClassEntry:
    """One `classes.NAME` entry as written; figures left out come from KNOWN[NAME]."""

    count: int
    inference: float | None = None  # per-GPU inference throughput, MI250 = 1
    training: float | None = None  # per-GPU draft-training throughput, MI250 = 1


@dataclass(frozen=True)
class InventoryFile:
    """The inventory YAML as written (keys and types checked by tide.config.from_dict)."""

    speedup: float  # s that a workload-aligned draft sustains on the serving GPUs
    classes: dict[str, Any]  # name -> ClassEntry fields
    train_demand: float = 0.0  # MI250-training units the draft needs; 0 = default_train_demand
    default_train_demand: float = 1.0  # one training job kept busy on one MI250-equivalent


@dataclass(frozen=True)
class GpuClass:
    """One GPU class with its figures resolved."""

    name: str
    count: int
    inference: float
    training: float

    @property
    def ratio(self) -> float:
        """Inference given up per unit of training delivered; the lowest ratio should train."""
        return self.inference / self.training if self.training > 0 else math.inf


@dataclass(frozen=True)
class Inventory:
    """A validated inventory: the planner's input."""

    speedup: float
    train_demand: float  # resolved, > 0
    gpus: tuple[GpuClass, ...]


@dataclass(frozen=True)
class Plan:
    """The chosen split; throughputs in MI250-inference units."""

    serve: dict[str, int]
    train: dict[str, int]
    speculate: bool  # False: plain inference on every GPU beats every feasible split
    speedup: float
    train_demand: float
    train_capacity: float  # sum of the trainers' R_c
    throughput: float  # predicted, for the chosen split
    baseline: float  # every GPU serves, no speculation
    ratio: float  # throughput / baseline
    best_split_ratio: float  # best feasible speculative split / baseline, chosen or not (0: none)
    reason: str


def resolve(raw: InventoryFile, source: str) -> Inventory:
    """Check values and fill known figures; every error is one line `FILE: key.path: what`."""

    def fail(path: str, msg: str) -> NoReturn:
        raise ConfigError(f"{source}: {path}: {msg}")

    if not raw.speedup > 0:
        fail("speedup", f"must be > 0, got {raw.speedup}")
    if raw.train_demand < 0:
        fail("train_demand", f"must be >= 0 (0 = default_train_demand), got {raw.train_demand}")
    if not raw.default_train_demand > 0:
        fail("default_train_demand", f"must be > 0, got {raw.default_train_demand}")
    gpus = []
    for name, value in raw.classes.items():
        path, default = f"classes.{name}", KNOWN.get(str(name))
        entry = from_dict(ClassEntry, value, source=source, prefix=path)
        if default is None and entry.inference is None and entry.training is None:
            fail(path, f"unknown GPU class; give inference and training figures (known: {', '.join(KNOWN)})")
        if entry.count < 0:
            fail(f"{path}.count", "must be >= 0")
        figures = []
        for i, key in enumerate(("inference", "training")):
            v = getattr(entry, key)
            if v is None and default is None:
                fail(f"{path}.{key}", f"required for unknown GPU class {name} (known: {', '.join(KNOWN)})")
            v = default[i] if v is None else v  # type: ignore[index]
            if v < 0:
                fail(f"{path}.{key}", f"must be >= 0, got {v}")
            figures.append(v)
        gpus.append(GpuClass(str(name), entry.count, figures[0], figures[1]))
    if sum(g.count for g in gpus) == 0:
        fail("classes", "no GPUs; give at least one class with count > 0, e.g. H100: {count: 8}")
    demand = raw.train_demand or raw.default_train_demand
    return Inventory(raw.speedup, demand, tuple(gpus))


def parse_inventory(data: Any, source: str = "<dict>") -> Inventory:
    """Inventory from plain data (as YAML would give it)."""
    return resolve(from_dict(InventoryFile, data, source=source), source)


def load_inventory(path: str | Path) -> Inventory:
    """Inventory from a YAML file; raises ConfigError with one line naming the file and key."""
    return resolve(load_config(path, InventoryFile), str(path))


def _max_useful(g: GpuClass, demand: float) -> int:
    """Trainers of class g beyond ceil(D / R_g) only lose inference: never enumerate them."""
    return 0 if g.training <= 0 else min(g.count, math.ceil(demand / g.training - EPS))


def plan(inv: Inventory) -> Plan:
    """Best serve/train split for `inv`, or plain inference when no split beats it."""
    gpus, s, demand = inv.gpus, inv.speedup, inv.train_demand
    baseline = sum(g.count * g.inference for g in gpus)
    *head, last = gpus
    best: tuple[tuple[float, float], tuple[int, ...]] | None = None
    # The last class's trainer count follows from the others: the fewest that meet the demand.
    for t_head in itertools.product(*(range(_max_useful(g, demand) + 1) for g in head)):
        need = demand - sum(t * g.training for t, g in zip(t_head, head))
        if need <= EPS:
            t_last = 0
        elif last.training > 0:
            t_last = math.ceil(need / last.training - EPS)
        else:
            continue
        if t_last > last.count:
            continue
        t = (*t_head, t_last)
        serving = sum((g.count - n) * g.inference for n, g in zip(t, gpus))
        key = (round(serving, 9), -sum(n * g.ratio for n, g in zip(t, gpus) if n))
        if best is None or key > best[0]:
            best = (key, t)
    all_serve = {g.name: g.count for g in gpus}
    if best is None:
        capacity = sum(g.count * g.training for g in gpus)
        reason = f"plain inference: even all GPUs training deliver {capacity:.2f} < demand {demand:.2f}"
        return Plan(all_serve, {}, False, s, demand, 0.0, baseline, baseline, 1.0, 0.0, reason)
    t = best[1]
    split_tp = s * sum((g.count - n) * g.inference for n, g in zip(t, gpus))
    split_ratio = split_tp / baseline
    trainers = ", ".join(f"{n} {g.name}" for n, g in zip(t, gpus) if n)
    if split_tp <= baseline + EPS:
        reason = f"plain inference: no speculation is better ({trainers} training gives {split_ratio:.3f}x)"
        return Plan(all_serve, {}, False, s, demand, 0.0, baseline, baseline, 1.0, split_ratio, reason)
    serve = {g.name: g.count - n for n, g in zip(t, gpus) if g.count - n}
    train = {g.name: n for n, g in zip(t, gpus) if n}
    capacity = sum(n * g.training for n, g in zip(t, gpus))
    reason = f"speculate: {trainers} train, the rest serve at s = {s:g}"
    return Plan(serve, train, True, s, demand, capacity, split_tp, baseline, split_ratio, split_ratio, reason)
