"""Domain-shift workloads: phases of real prompt sets with an arrival process, seeded.

    >>> spec = load_workload("configs/experiments/ci-shift.yaml")     # doctest: +SKIP
    >>> reqs = build_workload(spec, target_dir, max_prompt_tokens=400)  # arrival order, workload = phase

Prompts come from `random.Random(seed)`: each phase takes a seeded sample of what is left of its
(dataset, path) source, so no prompt repeats within a workload; a phase that takes every prompt
left takes them in file order. Arrival times have their own stream (`tide/workload/arrivals.py`), so
changing the rate or the trace keeps the prompts. The file format is in docs/replay.md.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tide.config import ConfigError, UntilConfig, from_dict
from tide.workload.arrivals import Arrivals, schedule
from tide.workload.prompts import WorkloadError, check_dataset, load_prompts

if TYPE_CHECKING:
    from tide.serve.engine import Request


@dataclass(frozen=True)
class Phase:
    """`num_prompts` requests, or `duration_s` seconds of arrivals, from one prompt set."""

    name: str  # the requests' workload label
    dataset: str  # humaneval | gsm8k | spec_bench[:category] | mt_bench[:category] | sharegpt
    max_tokens: int  # output cap; a trace's max_tokens may lower it per request
    path: str = ""  # file (relative to the current directory) or hf:OWNER/NAME[:CONFIG][@SPLIT]
    num_prompts: int | None = None
    duration_s: float | None = None
    until: UntilConfig = UntilConfig()  # where something learns: served on until the loop did this (docs/replay.md)

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("name: must not be empty")
        check_dataset(self.dataset, self.path)
        if (self.num_prompts is None) == (self.duration_s is None):
            raise ValueError("num_prompts/duration_s: give exactly one of them")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts: must be >= 1, got {self.num_prompts}")
        if self.duration_s is not None and not (0 < self.duration_s < math.inf):
            raise ValueError(f"duration_s: must be > 0 seconds, got {self.duration_s}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class WorkloadSpec:
    """The `workload:` section of an experiment file: phases one after the other, one arrival process."""

    phases: tuple[Phase, ...]
    arrivals: Arrivals
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("phases: at least one phase")
        names = [p.name for p in self.phases]
        for i, p in enumerate(self.phases):
            if names.index(p.name) != i:
                raise ValueError(f"phases[{i}].name: {p.name!r} is already the name of phases[{names.index(p.name)}]")
            if self.arrivals.kind == "closed" and p.duration_s is not None:
                raise ValueError(f"phases[{i}].duration_s: a closed loop has no clock; give num_prompts")

    @property
    def max_tokens(self) -> int:
        """The longest output any request may ask for (to size prompts against max_model_len)."""
        return max(p.max_tokens for p in self.phases)


@dataclass(frozen=True)
class TextRequest:
    """A request before the chat template: what `build_workload` tokenizes."""

    request_id: str  # the prompt set's id (HumanEval/3, gsm8k-12, translation-7, ...); #2, #3 if taken
    text: str
    max_tokens: int
    arrival: float | None  # seconds from the start; None = closed loop
    phase: str


def draw_requests(spec: WorkloadSpec) -> list[TextRequest]:
    """The workload's requests in arrival order, before tokenization (no model needed)."""
    slots = schedule(spec.arrivals, [(p.num_prompts, p.duration_s) for p in spec.phases], spec.seed)
    rng = random.Random(spec.seed)
    left: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (dataset, path) -> prompts not yet drawn
    used: set[str] = set()
    out = []
    for i, (phase, phase_slots) in enumerate(zip(spec.phases, slots)):
        key = (phase.dataset, phase.path)
        if key not in left:
            try:
                left[key] = list(load_prompts(*key))
            except WorkloadError as e:
                raise WorkloadError(f"workload.phases[{i}].{e}") from None
        pool, n = left[key], len(phase_slots)
        if n > len(pool):
            size = "num_prompts" if phase.num_prompts else "duration_s"
            raise WorkloadError(f"workload.phases[{i}].{size}: needs {n} prompts, {phase.dataset} has {len(pool)} left "
                                f"(no prompt is drawn twice); ask for fewer or use a larger set")
        picked = range(n) if n == len(pool) else rng.sample(range(len(pool)), n)
        for j, slot in zip(picked, phase_slots):
            pid, text = pool[j]
            rid, k = pid, 1
            while rid in used:
                k += 1
                rid = f"{pid}#{k}"
            used.add(rid)
            out.append(TextRequest(rid, text, min(phase.max_tokens, slot.max_tokens or phase.max_tokens),
                                   slot.arrival, phase.name))
        taken = set(picked)
        left[key] = [p for j, p in enumerate(pool) if j not in taken]
    return out


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the chat template renders it (plain text for a tokenizer without one)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer.encode(text))


def build_workload(spec: WorkloadSpec, tokenizer_dir: str | Path, max_prompt_tokens: int) -> list[Request]:
    """Engine requests in arrival order; prompts longer than `max_prompt_tokens` keep their end
    (the generation prompt)."""
    from transformers import AutoTokenizer

    from tide.serve.engine import Request  # the engine module is heavy; spec checks do not need it

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [Request(r.request_id, chat_ids(tok, r.text)[-max_prompt_tokens:], r.max_tokens, r.arrival, r.phase)
            for r in draw_requests(spec)]


def check_workload(spec: WorkloadSpec, source: str) -> None:
    """Draw the workload once so that bad data (an unreadable file, a category with no prompts, a
    trace too short) fails before serving, as one line `SOURCE: workload.field: what`."""
    try:
        draw_requests(spec)
    except WorkloadError as e:
        raise WorkloadError(f"{source}: {e}") from None


def check_spread(spec: WorkloadSpec, instances: int, source: str, dedicated: bool = False) -> None:
    """A phase with `until` is served on until the coordinator's loop has done something, which an
    instance following it cannot see: such a workload needs one serving instance, the coordinator's
    own (no `slurm.coordinator`)."""
    for i, p in enumerate(spec.phases):
        if (instances > 1 or dedicated) and p.until.active:
            raise ConfigError(f"{source}: workload.phases[{i}].until: a phase served on until the loop has done "
                              f"something needs one serving instance, on the coordinator's rank; this run has "
                              f"{instances}{' and a coordinator of its own' if dedicated else ''}")


def load_workload(path: str | Path) -> WorkloadSpec:
    """The checked `workload:` section of an experiment file (its other sections are the runner's)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict) or "workload" not in raw:
        raise ConfigError(f"{path}: workload: required section is missing")
    spec = from_dict(WorkloadSpec, raw["workload"], source=str(path), prefix="workload")
    check_workload(spec, str(path))
    return spec
