"""`python -m tide.plan --inventory FILE [--json OUT]`: which GPUs serve, which train, what it buys.
`python -m tide.plan simulate --scenario FILE ...`: the same loop over time, at cluster scale."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from tide.cli import parser, run
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


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary name, then rename): a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Parse -> load the inventory -> plan -> print (and write JSON). Exit 2 on a bad inventory.
    `simulate` as the first argument runs the simulator instead (`simulate_main`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        return simulate_main(argv[1:])
    ap = parser(
        "python -m tide.plan",
        "Split a GPU inventory between serving and draft training; predict throughput "
        "against using every GPU for plain inference.",
        epilog="Inventory YAML: speedup (s sustained by an aligned draft), train_demand (MI250-training "
               "units; 0 or left out = default_train_demand, 1.0), classes: NAME: {count, inference?, "
               "training?}; figures default to the paper's for H100, MI300X, MI250 (MI250 = 1). "
               "Model and worked example: tide/plan/planner.py. The loop over time (shifts, storage, "
               "trainers, recovery): python -m tide.plan simulate --help.")
    ap.add_argument("--inventory", required=True, metavar="FILE",
                    help="inventory YAML, e.g. configs/inventory/h100x8_mi250x4.yaml")
    ap.add_argument("--json", metavar="OUT", type=Path, help="also write the plan as JSON here")

    def body(args: argparse.Namespace) -> None:
        inv = load_inventory(args.inventory)
        p = plan(inv)
        print(format_plan(inv, p))
        if args.json:
            write_json(args.json, {**dataclasses.asdict(p), "classes": [dataclasses.asdict(g) for g in inv.gpus]})

    return run(ap, body, argv)


def simulate_main(argv: list[str]) -> int:
    """Parse -> scenario (with --set) -> one run, a sweep, or a comparison with a measured run ->
    print, write JSON and plot. Exit 2 on a bad scenario, override or measured file."""
    ap = parser(
        "python -m tide.plan simulate",
        "Discrete-event model of the TIDE loop at cluster scale: serving instances whose "
                    "throughput follows the live acceptance length (Eq. 5), capture of 6H+9 bytes per kept "
                    "row into a store whose write bandwidth saturates with writers, trainers that run a "
                    "cycle every N_threshold stored rows, deploys that lift acceptance along a recovery "
                    "curve, and a schedule of workload shifts. Prints throughput against a static draft "
                    "and against every GPU serving plainly, dropped capture, and per shift the time to "
                    "a published draft, to recovery, and the bottleneck (detect, capture, storage, the trainer's "
                    "read of the rows collected since the shift, training).",
        epilog="Scenario YAML (configs/simulate/*.yaml): hidden_size, duration_s, al_aligned, detect_s, "
               "serving {tokens_per_s, instances, gpu, gpus_per_instance, gamma, draft_cost, verify_cost, "
               "keep_fraction}, storage {bandwidth: [[writers, bytes_per_s], ...], row_overhead_bytes}, "
               "training {count, gpu, tokens_per_s_per_gpu, plain_tokens_per_s_per_gpu, dp_efficiency, epochs, "
               "cycle_fixed_s, read_bytes_per_s, start_s, n_threshold, retention_tokens, eval_fraction, "
               "cycles_per_shift, "
               "deploy_s}, shifts [{at_s, al, al_recovered}], recovery [[rows, fraction], ...]. "
               "Model, defaults, validation and a worked example: docs/SIMULATOR.md.")
    ap.add_argument("--scenario", required=True, metavar="FILE",
                    help="scenario YAML, e.g. configs/simulate/cluster-64h100-16mi250.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one scenario value by its key path, e.g. training.count=8 or "
                         "shifts[0].al=1.2 (repeatable)")
    ap.add_argument("--sweep", metavar="KEY=V1,V2,...",
                    help="run once per value of one key and print one row each, e.g. training.count=1,2,4,8,16 "
                         "(how many trainers) or serving.instances=1,2,4,8,16 (when storage limits)")
    ap.add_argument("--measured", metavar="JSON", type=Path,
                    help="a measured run (workflows.bench.pipeline's JSON, or any JSON with its keys): print the "
                         "prediction next to it with the relative error")
    ap.add_argument("--json", metavar="OUT", type=Path, help="also write the figures (and timeline) as JSON")
    ap.add_argument("--plot", metavar="OUT.png", type=Path,
                    help="plot the timeline (one run) or the sweep's answers (with --sweep)")
    return run(ap, simulate, argv)


def simulate(args: argparse.Namespace) -> int:
    from tide.plan import simreport

    if args.sweep and args.measured:
        raise ValueError("--measured compares one run with a measurement: leave out --sweep")
    sets = [(k, v[0]) for k, v in (simreport.parse_assignment(a, "--set") for a in args.set)]
    sweep = simreport.parse_assignment(args.sweep, "--sweep") if args.sweep else None
    scenarios = [simreport.with_overrides(args.scenario, sets + [(sweep[0], v)]) for v in sweep[1]] \
        if sweep else [simreport.with_overrides(args.scenario, sets)]
    try:
        measured = json.loads(args.measured.read_text()) if args.measured else None
    except (OSError, ValueError) as e:
        raise ValueError(f"{args.measured}: cannot read: {e}") from None
    data: dict[str, Any] = {"scenario_file": args.scenario, "set": args.set}
    if sweep:
        rows = [simreport.sweep_row(v, simreport.summarize(s)[0]) for v, s in zip(sweep[1], scenarios)]
        print(simreport.format_sweep(sweep[0], rows))
        data["sweep"] = {"key": sweep[0], "rows": rows}
        if args.plot:
            from tide.plan.plot import plot_sweep
            plot_sweep(sweep[0], rows, args.plot)
    else:
        (s,) = scenarios
        summary, result, static = simreport.summarize(s)
        print(simreport.format_summary(s, summary))
        data.update(scenario=dataclasses.asdict(s), summary=summary,
                    timeline=[dataclasses.asdict(g) for g in result.timeline])
        if measured is not None:
            rows = simreport.compare(simreport.predictions(s, result), measured)
            print(f"\npredicted vs measured ({args.measured})\n{simreport.format_compare(rows)}")
            data["validation"] = {"measured_file": str(args.measured), "rows": rows}
        if args.plot:
            from tide.plan.plot import plot_timeline
            plot_timeline(s, result, static, args.plot)
    if args.json:
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
