"""`python -m tide.plan --inventory FILE [--json OUT]`: which GPUs serve, which train, what it buys."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from tide.config import ConfigError
from tide.plan.planner import Inventory, Plan, load_inventory, plan


def format_plan(inv: Inventory, p: Plan) -> str:
    """The printed table: one row per GPU class, then predicted vs plain throughput."""
    rows = [f"{'class':<8}{'count':>6}{'infer':>8}{'train':>8}{'inf/train':>10}{'serve':>7}{'train':>7}"]
    for g in inv.gpus:
        rows.append(f"{g.name:<8}{g.count:>6}{g.inference:>8.2f}{g.training:>8.2f}{g.ratio:>10.2f}"
                    f"{p.serve.get(g.name, 0):>7}{p.train.get(g.name, 0):>7}")
    rows += [f"speedup s {p.speedup:g}; training demand {p.train_demand:g}, trainers deliver {p.train_capacity:g}"
             " (MI250-training units)",
             f"predicted throughput {p.throughput:8.2f}  (MI250-inference units)",
             f"plain inference      {p.baseline:8.2f}  (every GPU serves, s = 1)",
             f"ratio                {p.ratio:8.3f}x",
             p.reason]
    return "\n".join(rows)


def write_json(path: Path, inv: Inventory, p: Plan) -> None:
    """Write the plan and the resolved classes atomically (temporary name, then rename)."""
    data = {**dataclasses.asdict(p), "classes": [dataclasses.asdict(g) for g in inv.gpus]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Parse -> load the inventory -> plan -> print (and write JSON). Exit 2 on a bad inventory."""
    ap = argparse.ArgumentParser(
        prog="python -m tide.plan",
        description="Split a GPU inventory between serving and draft training; predict throughput "
                    "against using every GPU for plain inference.",
        epilog="Inventory YAML: speedup (s sustained by an aligned draft), train_demand (MI250-training "
               "units; 0 or left out = default_train_demand, 1.0), classes: NAME: {count, inference?, "
               "training?}; figures default to the paper's for H100, MI300X, MI250 (MI250 = 1). "
               "Model and worked example: tide/plan/planner.py.")
    ap.add_argument("--inventory", required=True, metavar="FILE",
                    help="inventory YAML, e.g. configs/inventory/h100x8_mi250x4.yaml")
    ap.add_argument("--json", metavar="OUT", type=Path, help="also write the plan as JSON here")
    args = ap.parse_args(argv)
    try:
        inv = load_inventory(args.inventory)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    p = plan(inv)
    print(format_plan(inv, p))
    if args.json:
        write_json(args.json, inv, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
