"""Stand-in for `python -m tide.runtime` in the Slurm tests: one JSON line per rank on stdout.

Each rank reports its MPI rank and world size, an allreduce over MPI_COMM_WORLD (proof that both het
groups share it), its het group (from SLURM_PROCID and SLURM_NTASKS_HET_GROUP_<i>, the only way: nothing
in a het step names it), that group's partition, its node and GPUs. `--fail-group G` makes every rank of
group G write a message to stderr and exit 3 before the allreduce.
"""

import argparse
import json
import os
import sys

from mpi4py import MPI


def het_group(procid: int) -> int:
    """Ranks are contiguous per het group, group 0 first."""
    end = 0
    for i in range(int(os.environ.get("SLURM_HET_SIZE", "1"))):
        end += int(os.environ[f"SLURM_NTASKS_HET_GROUP_{i}"])
        if procid < end:
            return i
    raise AssertionError(f"SLURM_PROCID {procid} beyond all het groups")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-group", type=int, default=-1)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    group = het_group(int(os.environ["SLURM_PROCID"]))
    if group == args.fail_group:
        print(f"mpi_probe: deliberate failure on rank {world.rank} (het group {group})", file=sys.stderr, flush=True)
        return 3
    total = world.allreduce(1)
    print("PROBE " + json.dumps({
        "rank": world.rank, "size": world.size, "allreduce": total, "group": group,
        "group_size": world.Split(group, world.rank).size,
        "partition": os.environ.get(f"SLURM_JOB_PARTITION_HET_GROUP_{group}"),
        "slurm_job_partition": os.environ.get("SLURM_JOB_PARTITION"),  # the LAST group's, on every rank
        "node": os.environ.get("SLURMD_NODENAME"), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "job_id": os.environ.get("SLURM_JOB_ID")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
