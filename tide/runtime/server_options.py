"""The `--serve` options of `tide.launch` and `tide.runtime`: where TIDE's OpenAI server listens.

Kept apart from the server (which imports vLLM) so that parsing a command line stays cheap.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpOptions:
    """Where and how to listen; any other `vllm serve` option goes in `vllm_args`."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = ""  # default: the target's directory name
    grace_s: float = 30.0  # in-flight requests get this long after SIGTERM
    vllm_args: tuple[str, ...] = ()

    def to_argv(self) -> list[str]:
        """These options as `tide.runtime` arguments (what a Slurm job's ranks are given)."""
        argv = ["--serve", "--host", self.host, "--port", str(self.port), "--grace", str(self.grace_s)]
        argv += ["--served-model-name", self.served_model_name] if self.served_model_name else []
        return argv + [f"--vllm-arg={a}" for a in self.vllm_args]


def add_arguments(p: argparse.ArgumentParser, host: str = "127.0.0.1") -> None:
    g = p.add_argument_group("OpenAI-compatible server (vLLM's)")
    g.add_argument("--serve", action="store_true",
                   help="serve HTTP (vLLM's OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                        "/metrics) with TIDE's loop, until SIGTERM, instead of replaying the config's workload")
    g.add_argument("--host", default=host, help=f"address to bind (default {host})")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--served-model-name", default="", help="the model name clients ask for (default: the target's)")
    g.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM (default 30)")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more `vllm serve` argument, e.g. --vllm-arg=--api-key=KEY (repeatable; the API key "
                        "can also come from VLLM_API_KEY)")


def from_args(args: argparse.Namespace) -> HttpOptions | None:
    if not args.serve:
        return None
    return HttpOptions(args.host, args.port, args.served_model_name, args.grace, tuple(args.vllm_arg))
