"""One experiment: the same workload and arrivals served in each mode, one mode after the other.

Modes: `nospec` (plain vLLM), `static` (the base draft, `draft.init`, frozen: the usual deployment of
a general draft), `tide` (the adaptive system), `tide-always` (speculation, collection, training and
deployment always on: the paper's TIDE-default) and `tide-recompute` (TIDE whose trainer regenerates
the hidden states with the target instead of using captured ones, that cost counted). Every TIDE
mode starts from the same base draft. Serving is bound to `runtime.serve_cores` in every mode and
trainers to `runtime.train_cores`, so no mode serves on more CPU than another.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tide.config import ConfigError, TideConfig, from_dict, to_dict
from tide.serve.engine import Request, RequestResult, TideEngine, Window
from tide.store.layout import RunLayout
from tide.workload import phase_segments
from tide.workload.phases import WorkloadSpec, build_workload, load_workload

log = logging.getLogger(__name__)
MODES = ("nospec", "static", "tide", "tide-always", "tide-recompute")
POLICY = {"nospec": "nospec", "static": "frozen", "tide": "adaptive", "tide-always": "always",
          "tide-recompute": "adaptive"}


@dataclass(frozen=True)
class ReplayConfig:
    """The `replay:` section of an experiment file."""

    modes: tuple[str, ...] = MODES
    # a base-draft config (workflows/base_draft.py) that builds `draft.init` when it does not exist yet
    base_draft: str = ""

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes: {bad or 'empty'}: choose from {', '.join(MODES)}")


@dataclass
class ModeRun:
    mode: str
    results: list[RequestResult]
    windows: list[Window]
    events: list[Any] = field(default_factory=list)
    store: Path | None = None
    workload: list[dict[str, Any]] = field(default_factory=list)  # per phase: passes, `until` met
    latency: dict[str, Any] = field(default_factory=dict)  # a client's view (endpoint modes): TTFT, ITL
    instances: int = 1  # serving instances, the phases spread round-robin over them (a mode's Slurm job)


def load_experiment(path: Path) -> tuple[TideConfig, WorkloadSpec, ReplayConfig]:
    """`workload:` (tide.workload), `replay:` and every TideConfig section but `workload`, checked."""
    spec = load_workload(path)
    raw = yaml.safe_load(Path(path).read_text())
    replay = from_dict(ReplayConfig, raw.get("replay") or {}, str(path), "replay")
    cfg = from_dict(TideConfig, {k: v for k, v in raw.items() if k not in ("workload", "replay")}, str(path))
    return cfg, spec, replay


@dataclass
class Experiment:
    """An experiment file, resolved: its config, workload, replay section and requests."""

    cfg: TideConfig
    spec: WorkloadSpec
    replay: ReplayConfig
    requests: list[Request]

    @classmethod
    def open(cls, path: Path, out: Path) -> Experiment:
        cfg, spec, rc = load_experiment(path)
        target = RunLayout.open(cfg, out / "nospec").target
        return cls(cfg, spec, rc, build_workload(spec, target.path, cfg.serve.max_model_len - spec.max_tokens - 8))


def run_stage(stage: str, path: Path, out: Path, modes: tuple[str, ...]) -> None:
    """`all`: the base draft (when it has to be built), then every mode, one after the other; `base`
    (what the Slurm executor's base-draft job runs) or `mode` alone. Serving runs on `runtime.serve_cores`."""
    from tide.runtime.processes import bind_serving

    exp = Experiment.open(path, out)
    if stage in ("all", "base") and set(modes) - {"nospec"}:
        ensure_base_draft(exp, path)
    bind_serving(exp.cfg.runtime.serve_cores, tensor_parallel_size=exp.cfg.serve.tensor_parallel_size)
    log.info("replay: %d requests in %d phases, modes %s", len(exp.requests), len(exp.spec.phases), ", ".join(modes))
    for mode in modes if stage in ("all", "mode") else ():
        log.info("replay: mode %s", mode)
        run_mode(exp, mode, out / mode)


def ensure_base_draft(exp: Experiment, path: Path) -> None:
    """`static` serves `draft.init` frozen and the TIDE modes start from it: it must exist. Where it
    does not, `replay.base_draft` builds it (workflows/base_draft.py), in a process of its own."""
    init = Path(exp.cfg.draft.init)
    if not exp.cfg.draft.init:
        raise ConfigError(f"{path}: draft.init: the static mode serves it and the TIDE modes start from it; give "
                          "a base draft (workflows/base_draft.py builds one)")
    if (init / "model.safetensors").exists():
        return
    if not exp.replay.base_draft:
        raise ConfigError(f"{path}: draft.init: {init} does not exist; build it (python -m workflows.base_draft) or "
                          "give replay.base_draft")
    out = init.parent / f"{init.name}.run"
    subprocess.run([sys.executable, "-m", "workflows.base_draft", "--config", exp.replay.base_draft, "--out", str(out),
                    "--publish", str(init)], check=True)


def write_mode_config(cfg: TideConfig, mode: str, out: Path) -> TideConfig:
    """The experiment's config as `mode` runs it, also written to OUT/config.yaml."""
    mcfg = dataclasses.replace(
        cfg, control=dataclasses.replace(cfg.control, policy=POLICY[mode]),
        train=dataclasses.replace(cfg.train, signals="recompute" if mode == "tide-recompute" else "captured"),
        draft=dataclasses.replace(cfg.draft, init=str(Path(cfg.draft.init).resolve())),
        workload=dataclasses.replace(cfg.workload, nospec_baseline=False))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(mcfg), sort_keys=False))
    return mcfg


def run_mode(exp: Experiment, mode: str, out: Path) -> None:
    """Serve the experiment's requests in `mode`; everything the report needs goes to `out`."""
    from tide.model.files import write_json, write_jsonl
    from tide.runtime.processes import local_trainer
    from tide.runtime.serve_role import serve

    mcfg = write_mode_config(exp.cfg, mode, out)
    run = RunLayout.open(mcfg, out)
    concurrency = exp.spec.arrivals.concurrency or 1
    workload: list[dict[str, Any]] = []
    if mode == "nospec":
        eng = TideEngine(run.target, mcfg.serve, None, dtype=mcfg.model.dtype)
        try:
            results, windows = eng.replay(exp.requests, concurrency, mcfg.runtime.window_s)
        finally:
            eng.close()
        write_jsonl(out / "windows.jsonl", (w.to_json() for w in windows))
        write_jsonl(out / "requests.jsonl", (r.to_json() for r in results))
        write_json(out / "events.json", [])
    else:
        segments = phase_segments(exp.spec, exp.requests)
        if mode == "static":
            workload = serve(mcfg, run, segments, None, [], concurrency).workload
        else:
            with local_trainer(out / "config.yaml", out, mcfg.runtime.train_cores) as transport:
                workload = serve(mcfg, run, segments, transport, [1], concurrency).workload
    write_mode_record(out, mode, workload)


def write_mode_record(out: Path, mode: str, workload: list[dict[str, Any]], instances: Sequence[int] = ()) -> None:
    """OUT/mode.json: what `load_mode` needs beside the serving files (per phase: passes, `until` met;
    the other serving instances whose files are under instances/<rank>/)."""
    from tide.model.files import write_json

    write_json(out / "mode.json", {"mode": mode, "workload": workload, "learns": mode.startswith("tide"),
                                   "instances": list(instances)})


def load_mode(out: Path, mode: str) -> ModeRun:
    """A mode's run from its files (written by `run_mode`, or by a mode's Slurm job, whose serving
    instances other than rank 0 write theirs under instances/<rank>/): the requests and windows of
    all of them, on one clock (each instance counts from its own start; `started_unix` in its
    summary puts them side by side)."""
    from tide.runtime.coordinator import Event

    meta = json.loads((out / "mode.json").read_text())
    dirs = [d for d in (out, *(out / "instances" / str(r) for r in meta.get("instances", [])))
            if (d / "requests.jsonl").exists()]
    starts = [json.loads((d / "summary.json").read_text()).get("started_unix", 0.0)
              if (d / "summary.json").exists() else 0.0 for d in dirs]
    t0 = min(starts, default=0.0)
    results: list[RequestResult] = []
    windows: list[Window] = []
    for d, start in zip(dirs, starts):
        shift = start - t0 if t0 else 0.0
        results += [dataclasses.replace(r, arrival=r.arrival + shift, finish=r.finish + shift)
                    for r in map(RequestResult.from_json, _rows(d / "requests.jsonl"))]
        windows += [dataclasses.replace(w, t_start=w.t_start + shift, t_end=w.t_end + shift)
                    for w in map(Window.from_json, _rows(d / "windows.jsonl"))]
    events = [Event(**d) for d in json.loads((out / "events.json").read_text())]
    if dirs and dirs[0] == out and t0:  # the coordinator's events count from its own start too
        events = [dataclasses.replace(e, t=e.t + starts[0] - t0) for e in events]
    return ModeRun(mode, results, sorted(windows, key=lambda w: w.t_end), events,
                   store=out / "store" if meta["learns"] else None, workload=meta["workload"],
                   latency=json.loads((out / "latency.json").read_text()) if (out / "latency.json").exists() else {},
                   instances=len(dirs))


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
