"""What is served: published prompt sets, arrival processes, phases of a domain-shift workload, and
the request source that repeats a segment until the loop has done what a run waits for."""

from tide.workload.arrivals import Arrivals
from tide.workload.phases import (
                                  Phase,
                                  TextRequest,
                                  WorkloadSpec,
                                  build_workload,
                                  check_spread,
                                  check_workload,
                                  draw_requests,
                                  load_workload,
)
from tide.workload.prompts import WorkloadError, load_prompts
from tide.workload.source import Finished, RequestSource, Segment, build_requests, phase_segments, until_status

__all__ = ["Arrivals", "Finished", "Phase", "RequestSource", "Segment", "TextRequest", "WorkloadError",
           "WorkloadSpec", "build_requests", "build_workload", "check_spread", "check_workload", "draw_requests",
           "load_prompts", "load_workload", "phase_segments", "until_status"]
