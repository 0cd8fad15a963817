"""`python -m workflows.bench NAME --json OUT`: benchmarks (never tests). Each prints a short table and
writes its figures as JSON; docs/BENCHMARKS.md records them with command, machine and date."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tide.cli import parser, run
from tide.model.files import write_json

BENCHES: dict[str, str] = {
    "draft-learning": "workflows.bench.learning:draft_learning",
    "draft-recipe": "workflows.bench.learning:draft_recipe",
    "storage": "workflows.bench.storage:storage",
    "capture-overhead": "workflows.bench.serving:capture_overhead",
    "hot-swap": "workflows.bench.serving:hot_swap",
    "training-cycle": "workflows.bench.learning:training_cycle",
    "controller-accuracy": "workflows.bench.control:controller_accuracy",
    "never-worse": "workflows.bench.control:never_worse",
    "off-cost": "workflows.bench.control:off_cost",
    "adaptive-k": "workflows.bench.control:adaptive_k",
    "draft-pass": "workflows.bench.draft_pass:draft_pass",
    "cpu-gemm": "workflows.bench.serving:cpu_gemm",
    "http-endpoints": "workflows.bench.endpoints:http_endpoints",
    "serving-instances": "workflows.bench.cluster:serving_instances",
}


def machine() -> dict[str, Any]:
    import os

    import torch

    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d")}


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m workflows.bench", __doc__)
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--json", type=Path, required=True, help="where to write the figures")
    p.add_argument("--work", type=Path, default=Path("runs/bench"), help="scratch dir (models, stores, drafts)")
    p.add_argument("--data", type=Path, default=Path("data"), help="prompt sets (see docs/BENCHMARKS.md)")
    p.add_argument("--quick", action="store_true", help="a smaller version (fewer prompts, pairs or tokens)")
    return run(p, bench, argv)


def bench(args: argparse.Namespace) -> int:
    module, fn = BENCHES[args.name].split(":")
    measure: Callable[..., dict[str, Any]] = getattr(__import__(module, fromlist=[fn]), fn)
    t0 = time.time()
    figures = measure(work=args.work / args.name, data=args.data, quick=args.quick)
    result = {"bench": args.name, "command": " ".join(["python -m workflows.bench", *sys.argv[1:]]),
              "machine": machine(), "bench_wall_s": time.time() - t0, **figures}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, result)
    width = max(len(k) for k in figures)
    for k, v in figures.items():
        if not isinstance(v, (dict, list)):
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
