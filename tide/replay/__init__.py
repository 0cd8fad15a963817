"""Replaying real workloads: phases of published prompt sets with Poisson, closed-loop or traced
arrivals (docs/replay.md)."""

from tide.replay.arrivals import Arrivals
from tide.replay.prompts import WorkloadError, load_prompts
from tide.replay.workload import (Phase, TextRequest, WorkloadSpec, build_workload, check_workload, draw_requests,
                                  load_workload)

__all__ = ["Arrivals", "Phase", "TextRequest", "WorkloadError", "WorkloadSpec", "build_workload", "check_workload",
           "draw_requests", "load_prompts", "load_workload"]
