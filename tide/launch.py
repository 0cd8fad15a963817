"""`python -m tide.launch`: run the whole TIDE loop.

  --executor local   (default) the embedded default on this machine: vLLM serves on the serving
                     cores, a DeepSpeed trainer process trains on the training cores, a socket
                     carries the messages.
  --executor slurm   a heterogeneous Slurm job through submitit: component 0 serves, component 1
                     trains, MPI carries the messages (see slurm/README.md).
  --dry-run          print what would run (the batch script for slurm) and exit.

Results land in --out: summary.json, windows.jsonl, requests.jsonl, events.json, acceptance.png,
store/ (captured hidden states) and drafts/vN (published drafts).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tide.cli import parser, run
from tide.config import TideConfig, load_config

if TYPE_CHECKING:
    pass

log = logging.getLogger("tide.launch")


def run_local(cfg: TideConfig, config: Path, out: Path) -> dict:
    from tide.runtime.processes import bind_serving, local_trainer
    from tide.runtime.serve_role import run_coordinator
    from tide.store.layout import RunLayout

    run = RunLayout.open(cfg, out)
    bind_serving(cfg.runtime.serve_cores)
    with local_trainer(config, out, cfg.runtime.train_cores) as transport:
        return run_coordinator(cfg, run, transport, trainer_ranks=[1])


def run_slurm(cfg: TideConfig, config: Path, out: Path, dry_run: bool) -> int:
    """Submit the het job through submitit, show its state while waiting, report where results are."""
    from tide.cluster.script import JobSpec
    from tide.cluster.submit import SlurmError, submit, wait
    from tide.cluster.submit import dry_run as render

    spec = JobSpec.for_runtime(cfg.slurm, config, out)
    if dry_run:
        print(render(spec, "slurm"))
        return 0
    try:
        result = wait(submit(spec, "slurm"), timeout=cfg.slurm.time * 60 + 120)
    except SlurmError as e:
        print(f"tide.launch: error: {e}", file=sys.stderr)
        return 1
    log.info("job %s %s after %.0f s; results in %s", result.job_id, result.state, result.elapsed_s, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m tide.launch", __doc__)
    p.add_argument("--config", required=True, type=Path, help="TIDE YAML config, e.g. configs/local.yaml")
    p.add_argument("--out", type=Path, default=Path("runs/local"), help="run directory (default runs/local)")
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")

    def body(args: argparse.Namespace) -> int:
        cfg = load_config(args.config)
        if args.executor == "slurm":
            return run_slurm(cfg, args.config, args.out, args.dry_run)
        if args.dry_run:
            print(f"local: serve + train {cfg.model.target} with {args.config} into {args.out}")
            return 0
        summary = run_local(cfg, args.config, args.out)
        keys = ("al_start", "al_end", "swaps", "tokens_per_s_start", "tokens_per_s_end", "nospec_tokens_per_s",
                "speedup_end_over_nospec")
        print(json.dumps({k: summary[k] for k in keys}, indent=1))
        log.info("results in %s (summary.json, acceptance.png)", args.out)
        return 0

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
