"""`python -m tide.launch`: run the whole TIDE loop.

  --executor local   (default) the embedded default on this machine: vLLM serves on the serving
                     cores, a DeepSpeed trainer process trains on the training cores, a socket
                     carries the messages.
  --executor slurm   a heterogeneous Slurm job through submitit: component 0 serves, component 1
                     trains, MPI carries the messages (see slurm/README.md).
  --dry-run          print what would run (the batch script for slurm) and exit.
  --serve            instead of replaying the config's workload, serve vLLM's OpenAI-compatible API
                     (127.0.0.1:8000 locally; every address of the serving node under Slurm, which
                     writes OUT/endpoint.json) with the same loop behind it, until SIGTERM.

Results land in --out: summary.json, windows.jsonl, requests.jsonl, events.json, acceptance.png,
store/ (captured hidden states) and drafts/vN (published drafts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from tide.cli import parser, run
from tide.config import TideConfig, load_config
from tide.runtime import server_options
from tide.runtime.server_options import HttpOptions

log = logging.getLogger("tide.launch")


def run_local(cfg: TideConfig, config: Path, out: Path, http: HttpOptions | None = None) -> dict:
    from tide.runtime.processes import bind_serving, local_trainer
    from tide.store.layout import RunLayout

    run = RunLayout.open(cfg, out)
    bind_serving(cfg.runtime.serve_cores, tensor_parallel_size=cfg.serve.tensor_parallel_size)
    with local_trainer(config, out, cfg.runtime.train_cores) as transport:
        if http is not None:
            from tide.runtime.openai_server import run_server

            return run_server(cfg, run, transport, [1], http)
        from tide.runtime.serve_role import run_coordinator

        return run_coordinator(cfg, run, transport, trainer_ranks=[1])


def run_slurm(cfg: TideConfig, config: Path, out: Path, dry_run: bool, http: HttpOptions | None = None) -> int:
    """Submit the het job through submitit, show its state while waiting, report where results are."""
    from tide.cluster.script import JobSpec
    from tide.cluster.submit import SlurmError, submit, wait
    from tide.cluster.submit import dry_run as render

    spec = JobSpec.for_runtime(cfg.slurm, config, out, extra=http.to_argv() if http else ())
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
    server_options.add_arguments(p)

    def body(args: argparse.Namespace) -> int:
        cfg = load_config(args.config)
        http = server_options.from_args(args)
        if args.executor == "slurm":
            if http is not None and args.host == "127.0.0.1":  # reachable from the login node
                http = dataclasses.replace(http, host="0.0.0.0")
            return run_slurm(cfg, args.config, args.out, args.dry_run, http)
        if args.dry_run:
            what = f"serve http://{http.host}:{http.port}/v1" if http else "serve + train"
            print(f"local: {what} {cfg.model.target} with {args.config} into {args.out}")
            return 0
        summary = run_local(cfg, args.config, args.out, http)
        keys = ("al_start", "al_end", "swaps", "tokens_per_s_start", "tokens_per_s_end", "nospec_tokens_per_s",
                "speedup_end_over_nospec")
        print(json.dumps({k: summary[k] for k in keys}, indent=1))
        log.info("results in %s (summary.json, acceptance.png)", args.out)
        return 0

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
