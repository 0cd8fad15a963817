"""`python -m workflows.replay --config configs/experiments/NAME.yaml --out DIR`: one workload, every mode.

The experiment file holds a `workload:` section (phases and arrivals, docs/replay.md), an optional
`replay:` section (modes, base_draft) and any TideConfig section (model, serve, train, control,
runtime ...). Each mode serves the same requests with the same arrivals on the same cores, one
after the other; DIR gets summary.json, windows.jsonl, report.md, acceptance.png, throughput.png
and a directory per mode (its config, windows, requests, events, store and drafts).

With `--executor slurm` the same run is Slurm jobs through submitit: the base draft (where
`replay.base_draft` must build it), then one TIDE het job per mode, side by side, sized by the
experiment's `slurm:` section as the main job is (each serving rank one vLLM instance with its
round-robin share of every phase; docs/replay.md). The command waits for them and writes the report.

With `--endpoint NAME=URL` the same requests go to a running OpenAI-compatible server instead (TIDE's
`python -m tide.launch --serve`, a stock `vllm serve`, any other), recorded as mode NAME; the report
then covers the endpoints and any `--modes` already in DIR (docs/replay.md).
"""

from __future__ import annotations

import argparse
import logging
import os
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
                   help="local: every mode here, one after the other; slurm: the base draft (if it must be built) "
                        "as a job, then a TIDE het job per mode (sized by the slurm: section, the phases spread "
                        "round-robin over the serving ranks) through submitit; then the report here")
    p.add_argument("--stage", choices=("all", "base", "mode", "report"), default="all",
                   help="one step of the local run: the base draft, the modes, or the report of modes already in "
                        "--out; default all of them")
    p.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                   help="send the workload to this OpenAI-compatible server (base URL, e.g. http://127.0.0.1:8000/v1) "
                        "and record it as mode NAME (repeatable); no in-process mode runs unless --modes names it")
    p.add_argument("--model", default="", help="with --endpoint: the model to ask for (default: the server's first)")

    def body(args: argparse.Namespace) -> int:
        from workflows.replay import runner

        cfg, spec, replay = runner.load_experiment(args.config)
        endpoints = dict(_endpoint(e) for e in args.endpoint)
        named = tuple(m for m in args.modes.split(",") if m)
        modes = named or (() if endpoints else replay.modes)
        recorded = {m for m in modes if (args.out / m / "mode.json").exists()}  # e.g. endpoints run before
        if set(modes) - set(MODES) - recorded:
            raise ConfigError(f"--modes: unknown {sorted(set(modes) - set(MODES) - recorded)}; choose from "
                              f"{', '.join(MODES)} or an endpoint mode already in {args.out}")
        args.out.mkdir(parents=True, exist_ok=True)
        if endpoints:
            from workflows.replay.client import run_endpoint

            exp = runner.Experiment.open(args.config, args.out)
            key = os.environ.get("VLLM_API_KEY") or os.environ.get("OPENAI_API_KEY", "")
            for name, url in endpoints.items():
                run_endpoint(exp.requests, name, url, args.out / name, spec.arrivals.concurrency or 1,
                             cfg.runtime.window_s, args.model, key)
            runs = [runner.load_mode(args.out / m, m) for m in (*modes, *endpoints)]
            return _report(runs, spec, args.out, argv)
        served_here = tuple(m for m in modes if m in MODES)  # the rest are endpoint runs already recorded
        if args.executor == "slurm" and args.stage != "all":
            raise ConfigError("--stage: with --executor slurm the jobs run the stages; leave --stage out")
        if args.executor == "slurm":
            from workflows.replay.slurm import run_replay_jobs

            run_replay_jobs(cfg, spec, args.config, args.out, served_here)  # waits; raises if a job failed
        elif args.stage != "report":
            runner.run_stage(args.stage, args.config, args.out, served_here)
            if args.stage in ("base", "mode"):
                return 0
        return _report([runner.load_mode(args.out / m, m) for m in modes], spec, args.out, argv)

    return run(p, body, argv)


def _endpoint(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint: {text!r}: give NAME=URL, e.g. tide=http://127.0.0.1:8000/v1")
    return name, url.rstrip("/")


def _report(runs: list, spec: object, out: Path, argv: list[str] | None) -> int:
    from workflows.replay.report import write_report

    command = " ".join(["python -m workflows.replay", *(argv if argv is not None else sys.argv[1:])])
    summary = write_report(runs, spec, out, command)  # type: ignore[arg-type]
    print((out / "report.md").read_text())
    log.info("results in %s (summary.json, report.md, acceptance.png, throughput.png)", out)
    return 0 if summary["modes"] else 1


if __name__ == "__main__":
    sys.exit(main())
