"""TIDE itself on the test cluster: configs derived from configs/ci.yaml, the ranks' processes, results.

Processes are found through /proc (the cluster's nodes are all this machine): a rank by its command
line (`-m tide.runtime ... --out OUT`) and SLURM_PROCID, a job's left-overs by SLURM_JOB_ID in their
environment. Only processes of the tests' own jobs ever match.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tide.cluster import submit
from tide.cluster.script import JobSpec, load_slurm_config

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "configs" / "ci.yaml"
# component 0 as two serving instances on two nodes (one fake GPU and one CPU each)
TWO_INSTANCES = {"partition": "gpu_infer", "nodes": 2, "ntasks_per_node": 1, "gpus_per_node": 1, "cpus_per_task": 1}


def ci_config(path: Path, **sections: dict[str, Any]) -> Path:
    """configs/ci.yaml with each of `sections` merged into that section key by key, written to `path`."""
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    for name, keys in sections.items():
        cfg[name] = {**cfg.get(name, {}), **keys}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def submit_run(tmp_path: Path, **sections: dict[str, Any]) -> tuple[submit.Job, Path, Path]:
    """TIDE from the rendered script (`python -m tide.cluster --executor sbatch`): job, config, run dir."""
    config, out = ci_config(tmp_path / "ci.yaml", **sections), tmp_path / "out"
    return submit.submit(JobSpec.for_runtime(load_slurm_config(config), config, out), "sbatch"), config, out


def _processes() -> Iterator[tuple[int, list[str], dict[str, str]]]:
    """(pid, argv, environment) of every process we may read."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:  # gone, or not ours to read
            continue
        yield int(d.name), argv, env


def rank_pid(out: Path, rank: int) -> int:
    """The `python -m tide.runtime ... --out OUT` process of global rank `rank` (SLURM_PROCID)."""
    pids = [pid for pid, argv, env in _processes()
            if argv[1:3] == ["-m", "tide.runtime"] and str(out) in argv and env.get("SLURM_PROCID") == str(rank)]
    assert len(pids) == 1, f"rank {rank} of the run in {out}: processes {pids}"
    return pids[0]


def job_processes(job_id: str) -> list[int]:
    """Processes started for job `job_id` (their environment names it), orphans included."""
    return [pid for pid, _, env in _processes() if env.get("SLURM_JOB_ID") == job_id]


def wait_for_line(path: Path, pattern: str, timeout_s: float) -> str:
    """The first line of `path` matching `pattern` (re.search), polled until `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if re.search(pattern, line):
                    return line
        time.sleep(0.5)
    tail = path.read_text(errors="replace").splitlines()[-20:] if path.exists() else ["(no file)"]
    raise TimeoutError(f"no line matching {pattern!r} in {path} after {timeout_s:.0f} s; last lines:\n"
                       + "\n".join(tail))


def run_results(out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """summary.json and the rows of requests.jsonl of the run in `out`."""
    summary = json.loads((out / "summary.json").read_text())
    return summary, [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
