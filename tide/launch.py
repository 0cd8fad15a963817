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
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tide.config import ConfigError, TideConfig, load_config

if TYPE_CHECKING:
    from tide.runtime.transport import SocketTransport

log = logging.getLogger("tide.launch")


@contextlib.contextmanager
def local_trainer(config: Path, out: Path, cores: str) -> Iterator["SocketTransport"]:
    """A trainer process (`python -m tide.runtime --fd`) on `cores`, joined to this one by a socket
    pair; its log is out/trainer.log. On exit it gets two minutes to finish, then is killed."""
    from tide.runtime.transport import SocketTransport

    out.mkdir(parents=True, exist_ok=True)
    ours, theirs = socket.socketpair()
    cmd = [sys.executable, "-m", "tide.runtime", "--config", str(config), "--out", str(out),
           "--fd", str(theirs.fileno()), "--cores", cores]
    with open(out / "trainer.log", "ab") as trainer_log:
        trainer = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdout=trainer_log, stderr=subprocess.STDOUT)
    theirs.close()
    log.info("trainer process %d (cores %s), log %s", trainer.pid, cores or "any", out / "trainer.log")
    transport = SocketTransport(ours, rank=0, peer=1)
    try:
        yield transport
    finally:
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
        transport.close()


def bind_cores(spec: str, threads: int = 0) -> None:
    """Pin this process (and the threads it starts) to `spec` cores, e.g. '1' or '0,2-3', with one
    OpenMP thread per core; without `spec`, only use `threads` threads (0: torch's default)."""
    import torch

    if not spec:
        if threads > 0:
            torch.set_num_threads(threads)
        return
    cores: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        cores.update(range(int(a), int(b or a) + 1))
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def bind_serving(cores: str, threads: int = 0) -> None:
    """This process serves on `cores` (see `bind_cores`), with vLLM's engine core in-process (uniproc
    executor): with vLLM's default engine-core process next to a worker process, the core busy-waits
    on the worker and takes a second CPU core, the trainer's. In-process, vLLM ignores
    VLLM_CPU_OMP_THREADS_BIND (only its multiprocessing executor applies it), so the process pins
    itself; unpinned, its OpenMP team spreads over every core and a busy trainer core stalls each
    step. Only for a process that serves and nothing else: vLLM's process groups then live in it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    bind_cores(cores, threads)


def run_local(cfg: TideConfig, config: Path, out: Path) -> dict:
    from tide.layout import RunLayout
    from tide.runtime.serve_role import run_coordinator

    run = RunLayout.open(cfg, out)
    bind_serving(cfg.runtime.serve_cores)
    with local_trainer(config, out, cfg.runtime.train_cores) as transport:
        return run_coordinator(cfg, run, transport, trainer_ranks=[1])


def run_slurm(cfg: TideConfig, config: Path, out: Path, dry_run: bool) -> int:
    """Submit the het job through submitit, show its state while waiting, report where results are."""
    from tide.slurm import JobSpec, SlurmError, submit, wait
    from tide.slurm import dry_run as render

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
    p = argparse.ArgumentParser(prog="python -m tide.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, type=Path, help="TIDE YAML config, e.g. configs/local.yaml")
    p.add_argument("--out", type=Path, default=Path("runs/local"), help="run directory (default runs/local)")
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(args.config)
        if args.executor == "slurm":
            return run_slurm(cfg, args.config, args.out, args.dry_run)
        if args.dry_run:
            print(f"local: serve + train {cfg.model.target} with {args.config} into {args.out}")
            return 0
        summary = run_local(cfg, args.config, args.out)
    except (ConfigError, ValueError) as e:
        print(f"tide.launch: error: {e}", file=sys.stderr)
        return 2
    keys = ("al_start", "al_end", "swaps", "tokens_per_s_start", "tokens_per_s_end", "nospec_tokens_per_s",
            "speedup_end_over_nospec")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    log.info("results in %s (summary.json, acceptance.png)", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
