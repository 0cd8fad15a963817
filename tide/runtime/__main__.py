"""`python -m tide.runtime`: one rank of a TIDE job.

Under Slurm (`srun --het-group=0,1 --mpi=pmix`) every rank runs this; MPI_COMM_WORLD spans both
components, component 0 (inference) first. Rank 0 is the coordinator and serves; every further rank
of component 0 is one more serving instance (its own vLLM engine and share of the workload); component 1
ranks train as one DeepSpeed group. With `slurm.coordinator` rank 0 is a het group of its own that
only coordinates, and serving and training are groups 1 and 2. A local trainer started by `tide.launch` gets `--fd`, the
socket to the coordinator, instead of MPI. A training component started again after it was lost
(`--rejoin`, its own srun step) joins the coordinator over TCP (tide.runtime.rejoin).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from tide.cli import parser, run
from tide.config import ConfigError, load_config
from tide.runtime import server_options
from tide.runtime.processes import bind_cores, bind_serving
from tide.runtime.rejoin import JoinableTransport, RelayTransport, join
from tide.runtime.trainer_role import run_trainer
from tide.runtime.transport import MPITransport, SocketTransport
from tide.store.layout import RunLayout
from tide.workload import check_spread, load_workload


def slurm_cpus(group: int) -> int:
    """CPUs per task of het group `group` (a het step sets only SLURM_CPUS_PER_TASK_HET_GROUP_<i>);
    0 when Slurm says nothing. A rank runs that many threads and leaves the binding to Slurm."""
    value = os.environ.get(f"SLURM_CPUS_PER_TASK_HET_GROUP_{group}") or os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() else 0


def het_layout(size: int, dedicated: bool) -> tuple[range, range]:
    """(serving ranks, training ranks). Slurm names no component in a het step's environment: derive
    them from SLURM_NTASKS_HET_GROUP_<i>. Rank 0 coordinates: it serves too (het group 0 serves, 1
    trains), unless it has a group of its own (`slurm.coordinator`: group 0 is that one task, 1
    serves, 2 trains). Without Slurm: rank 0 serves, the rest train."""
    groups = [int(os.environ[f"SLURM_NTASKS_HET_GROUP_{i}"]) for i in range(3)
              if f"SLURM_NTASKS_HET_GROUP_{i}" in os.environ] or [1]
    if dedicated:
        if len(groups) < 2 or groups[0] != 1:
            raise SystemExit(f"tide.runtime: slurm.coordinator is set, so het group 0 must be one task (the "
                             f"coordinator) before the serving group; the job's groups have {groups} tasks")
        return range(1, 1 + groups[1]), range(1 + groups[1], size)
    return range(groups[0]), range(groups[0], size)


def trainer_group_env(comm, n0: int) -> None:
    """torch.distributed env of the trainer group, ranks n0.. of `comm` (MPI_COMM_WORLD); master =
    its first. Only trainer ranks take part, so a serving rank never waits on a trainer that did not
    start. LOCAL_RANK counts trainer ranks on this node, and OMPI_COMM_WORLD_LOCAL_RANK (which counts
    every rank of the world there) goes: DeepSpeed insists that the two agree."""
    from mpi4py import MPI

    group = comm.Get_group().Range_incl([(n0, comm.Get_size() - 1, 1)])
    trainers = comm.Create_group(group)
    rank, size = trainers.Get_rank(), trainers.Get_size()
    host = socket.gethostname().encode()[:255].ljust(256, b"\0")
    hosts = bytearray(256 * size)
    trainers.Allgather([host, MPI.BYTE], [hosts, MPI.BYTE])
    trainers.Free()
    group.Free()
    names = [bytes(hosts[256 * r : 256 * (r + 1)]).rstrip(b"\0").decode() for r in range(size)]
    job, step = (int(os.environ.get(v, "0") or 0) for v in ("SLURM_JOB_ID", "SLURM_STEP_ID"))
    os.environ.pop("OMPI_COMM_WORLD_LOCAL_RANK", None)  # a returned component (a later step): another port
    os.environ.update(MASTER_ADDR=names[0], MASTER_PORT=str(20000 + (job + 97 * step) % 20000), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(names[:rank].count(names[rank])))


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m tide.runtime", __doc__)
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--fd", type=int, help="(local) socket to the coordinator: run as the trainer")
    p.add_argument("--cores", default="", help="(local) CPU cores for this process, e.g. '1' or '2-3'")
    p.add_argument("--phases", type=Path, help="serve the phases of this file's `workload:` section (an experiment "
                   "file, docs/replay.md) instead of the config's workload, each split round-robin over the "
                   "serving ranks")
    p.add_argument("--rejoin", action="store_true",
                   help="(Slurm) a training component started again in a running job: join its coordinator "
                        "through the run dir (the step guard starts it after the first one was lost)")
    server_options.add_arguments(p, host="0.0.0.0")
    return run(p, rank, argv)


def rank(args: argparse.Namespace) -> int:
    """Open the run (a bad config or store stops every rank with one line), then be this rank."""
    cfg = load_config(args.config)
    run_dir = RunLayout.open(cfg, args.out)
    phases = load_workload(args.phases) if args.phases else None
    if phases is not None and server_options.from_args(args) is not None:
        raise ConfigError("--phases: the OpenAI server serves what its clients send; give --phases or --serve")
    if args.fd is not None:
        bind_cores(args.cores)
        run_trainer(cfg, run_dir, SocketTransport(socket.socket(fileno=args.fd), rank=1, peer=0))
        return 0
    transport: MPITransport | JoinableTransport | RelayTransport = MPITransport()
    dedicated = cfg.slurm.coordinator is not None  # het groups: coordinator, serving, training
    serve_group, train_group = (1, 2) if dedicated else (0, 1)
    if args.rejoin:  # this step's ranks train; its first joins the coordinator and relays to the others
        bind_cores(args.cores, slurm_cpus(train_group))
        trainer_group_env(transport.comm, 0)
        if transport.rank == 0:
            transport = RelayTransport(join(args.out), transport)
        run_trainer(cfg, run_dir, transport)
        transport.close()
        return 0
    serving, trainers = het_layout(transport.size, dedicated)
    if phases is not None:
        check_spread(phases, len(serving), str(args.phases), dedicated)
    if transport.rank in trainers:
        bind_cores(args.cores, slurm_cpus(train_group))
        trainer_group_env(transport.comm, trainers.start)
        run_trainer(cfg, run_dir, transport)
        transport.close()
        return 0
    if transport.rank == 0 and trainers:  # a training component lost later can come back
        transport = JoinableTransport(transport, list(trainers), run_dir.out)
    http = server_options.from_args(args)
    if dedicated and transport.rank == 0:  # no engine: the instances serve, each its own endpoint
        from tide.runtime.serve_role import run_dedicated

        bind_cores(args.cores, slurm_cpus(0))
        run_dedicated(cfg, run_dir, transport, list(trainers), list(serving))
        transport.close()
        return 0
    bind_serving(args.cores, slurm_cpus(serve_group), cfg.serve.tensor_parallel_size)
    instances = [r for r in serving if r]  # the serving ranks that follow rank 0
    leader = None if transport.rank == 0 else 0
    if http is not None:  # imports vLLM: after bind_serving's environment
        from tide.runtime.openai_server import run_server

        run_server(cfg, run_dir, transport, list(trainers) if leader is None else [], http, instances=instances,
                   leader=leader)
    elif leader is not None:
        from tide.runtime.serve_role import run_instance

        run_instance(cfg, run_dir, transport, leader, share=serving.index(transport.rank), shares=len(serving),
                     phases=phases)
    else:
        from tide.runtime.serve_role import run_coordinator

        run_coordinator(cfg, run_dir, transport, list(trainers), instances=instances, phases=phases)
    transport.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
