"""`python -m workflows.replay --config configs/experiments/NAME.yaml --out DIR`: one workload, every mode.

The experiment file holds a `workload:` section (phases and arrivals, docs/replay.md), an optional
`replay:` section (modes, base_draft) and any TideConfig section (model, serve, train, control,
runtime ...). Each mode serves the same requests with the same arrivals on the same cores, one
after the other; DIR gets summary.json, windows.jsonl, report.md, acceptance.png, throughput.png
and a directory per mode (its config, windows, requests, events, store and drafts).

With `--executor slurm` the same run is a chain of Slurm jobs through submitit: the base draft
(where `replay.base_draft` must build it), an array job with one task per mode (side by side), and
the report, each after the one before.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tide.cli import parser, run
from tide.config import ConfigError

log = logging.getLogger("workflows.replay")


def main(argv: list[str] | None = None) -> int:
    from workflows.replay.runner import MODES

    p = parser("python -m workflows.replay", __doc__)
    p.add_argument("--config", required=True, type=Path, help="experiment file, e.g. configs/experiments/shift.yaml")
    p.add_argument("--out", required=True, type=Path, help="results directory")
    p.add_argument("--modes", default="", help=f"comma-separated subset of the file's modes ({','.join(MODES)})")
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="local: every mode here, one after the other; slurm: the base draft (if it must be built), "
                        "an array job of the modes and the report as dependent jobs through submitit (sized by "
                        "slurm.serve)")
    p.add_argument("--stage", choices=("all", "base", "mode", "report"), default="all",
                   help="one step of the run (what each Slurm job runs); default all of them")

    def body(args: argparse.Namespace) -> int:
        from workflows.replay import runner
        from workflows.replay.report import write_report

        cfg, spec, replay = runner.load_experiment(args.config)
        modes = tuple(m for m in args.modes.split(",") if m) or replay.modes
        if set(modes) - set(MODES):
            raise ConfigError(f"--modes: unknown {sorted(set(modes) - set(MODES))}; choose from {', '.join(MODES)}")
        args.out.mkdir(parents=True, exist_ok=True)
        if args.executor == "slurm":  # the report job writes the report
            from workflows.replay.slurm import submit_replay

            submit_replay(cfg, args.config, args.out, modes).result()  # waits; raises if a job failed
            print((args.out / "report.md").read_text())
            return 0
        if args.stage != "report":
            runner.run_stage(args.stage, args.config, args.out, modes)
        if args.stage in ("base", "mode"):
            return 0
        runs = [runner.load_mode(args.out / m, m) for m in modes]
        command = " ".join(["python -m workflows.replay", *(argv if argv is not None else sys.argv[1:])])
        summary = write_report(runs, spec, args.out, command)
        print((args.out / "report.md").read_text())
        log.info("results in %s (summary.json, report.md, acceptance.png, throughput.png)", args.out)
        return 0 if summary["modes"] else 1

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
