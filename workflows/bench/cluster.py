"""1 vs 2 serving instances with one trainer, as Slurm het jobs (`python -m workflows.bench serving-instances`).

Each run is TIDE's own job (`python -m tide.runtime` on every rank, the rendered script) on
configs/ci.yaml's tiny target and cluster (`slurm:` names the test cluster's partitions; start it with
tests/cluster/slurm_up.sh and export the SLURM_CONF it prints). Serving starts on an untrained draft,
so collection starts with serving: that moment is the shift. Per run: rows captured per second (all
instances), and the time from the shift to the training request (the threshold), to the published
draft and to its deployment. The keys are those `tide.plan simulate --measured` compares with.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import yaml

from tide.cluster import submit
from tide.cluster.script import JobSpec, load_slurm_config

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "configs" / "ci.yaml"
UNTIL = {"event": "deploy", "event_requests": 16, "max_s": 300}
THRESHOLD = 16384  # rows before the first cycle: several 2-s windows of capture, so the time to it resolves


def job_config(path: Path, instances: int) -> Path:
    """configs/ci.yaml with `instances` serving ranks, one per node, a first cycle after THRESHOLD rows,
    and a run that ends 16 requests after the first deployment (policy always: every trained draft is
    deployed)."""
    cfg = yaml.safe_load(CI.read_text())
    cfg["slurm"]["serve"] = {**cfg["slurm"]["serve"], "nodes": instances, "ntasks_per_node": 1}
    cfg["control"] = {**cfg["control"], "policy": "always",
                      "collect": {**cfg["control"]["collect"], "n_threshold": THRESHOLD}}
    cfg["train"] = {**cfg["train"], "max_steps": 60}
    cfg["workload"] = {**cfg["workload"], "max_tokens": 64, "nospec_baseline": False, "until": UNTIL}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def figures(out: Path) -> dict[str, Any]:
    """The run's measured figures, from its summary, events and every instance's windows."""
    s = json.loads((out / "summary.json").read_text())
    events = s["events"]

    def first(kind: str) -> dict[str, Any]:
        return next(e for e in events if e["kind"] == kind and "instance" not in e["data"])

    shift, train, trained, deploy = first("collect"), first("train"), first("trained"), first("deploy")
    dirs = [out, *sorted((out / "instances").glob("*"))]
    windows = [[json.loads(line) for line in (d / "windows.jsonl").read_text().splitlines()] for d in dirs]
    stored = sum(w[-1]["stored_tokens"] for w in windows if w)
    wall = max(w[-1]["t_end"] for w in windows if w)
    counted = re.search(r"(\d+)/(\d+) tokens", train["reason"])
    rows = s.get("instances") or [{"requests": s["requests"], "output_tokens": s["output_tokens"]}]
    return {"instances": len(dirs), "shift_to_threshold_s": train["t"] - shift["t"],
            "shift_to_published_s": trained["t"] - shift["t"], "shift_to_deployed_s": deploy["t"] - shift["t"],
            "cycle_s": trained["data"]["wall_s"], "threshold_rows": int(counted.group(1)) if counted else None,
            "stored_rows": stored, "wall_s": wall, "capture_tokens_per_s": stored / wall,
            "output_tokens": sum(r.get("output_tokens", 0) for r in rows),
            "output_tokens_per_s": s.get("total", {}).get("output_tokens_per_s", s["output_tokens"] / wall),
            "requests": sum(r.get("requests", 0) for r in rows)}


def serving_instances(work: Path, data: Path, quick: bool) -> dict[str, Any]:
    """Alternating 1- and 2-instance runs (one pair with --quick, else two)."""
    runs: dict[str, list[dict[str, Any]]] = {"1": [], "2": []}
    for pair in range(1 if quick else 2):
        for n in (1, 2) if pair % 2 == 0 else (2, 1):
            out = work / f"pair{pair}-{n}"
            config = job_config(work / f"pair{pair}-{n}.yaml", n)
            job = submit.submit(JobSpec.for_runtime(load_slurm_config(config), config, out / "run"), "sbatch")
            submit.wait(job, 900)
            runs[str(n)].append(figures(out / "run"))
            print(f"{n} instance(s): {runs[str(n)][-1]}")
    keys = ("capture_tokens_per_s", "shift_to_threshold_s", "shift_to_published_s", "shift_to_deployed_s", "cycle_s",
            "output_tokens_per_s")
    median = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items()}
    return {"runs": runs, "median": median, "note": "the test cluster's 4 nodes share this machine's cores: "
            "two instances and the trainer compete for them, so this shows the mechanism, not a speedup"}
