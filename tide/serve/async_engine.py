"""vLLM's async engine (the one behind its OpenAI server) with TIDE's worker extension.

The coordinator drives it like `TideEngine` (`EngineControl`), from a thread of its own: each call
is a `collective_rpc` coroutine handed to the server's event loop, so the engine core runs it
between two steps while the loop keeps serving HTTP. No caller sees every request finish here, so
the worker closes each one itself when the scheduler drops it (`tide_install(auto_close=True)`)
and reports it in `tide_stats`; windows are built from the same stats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tide.config import ServeConfig, StoreConfig
from tide.model.target import Target
from tide.serve.engine import (
    EXTENSION,
    EngineControl,
    RequestResult,
    Window,
    executor_backend,
    speculative_config,
    step_costs,
)

if TYPE_CHECKING:
    from tide.control import LatencyModel


def server_args(target: Target, cfg: ServeConfig, draft_dir: Path | None, dtype: str, host: str, port: int,
                served_model_name: str, extra: list[str]) -> argparse.Namespace:
    """`vllm serve`'s arguments for this config (vLLM's own parser, so `extra`, any `vllm serve`
    option, overrides what the config says). The API key is vLLM's: `--api-key` or VLLM_API_KEY."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", str(target.path), "--served-model-name", served_model_name or target.path.name,
            "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(cfg.seed),
            "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            "--no-enable-prefix-caching",  # cached prompt rows would never reach the capture hook
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--distributed-executor-backend", executor_backend(cfg)]
    argv += ["--enforce-eager"] if cfg.enforce_eager else []
    if draft_dir is not None:  # as TideEngine: the worker picks each step's k; no async scheduling
        argv += ["--speculative-config", json.dumps(speculative_config(cfg, draft_dir)),
                 "--worker-extension-cls", EXTENSION, "--no-async-scheduling",
                 "--per-request-spec-decode-metrics", "summary"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv + list(extra))
    validate_parsed_serve_args(args)
    return args


class AsyncEngine(EngineControl):
    """`AsyncLLM` built from `server_args`; `rpc` may be called from any thread but the loop's."""

    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop, model: LatencyModel | None,
                 version: int, rpc_timeout_s: float = 120.0) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        eargs = AsyncEngineArgs.from_cli_args(args)
        vcfg = eargs.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        t0 = time.time()
        self.client = AsyncLLM.from_vllm_config(vcfg, usage_context=UsageContext.OPENAI_API_SERVER,
                                                enable_log_requests=eargs.enable_log_requests,
                                                disable_log_stats=False)  # vLLM's vllm:* series on /metrics
        self.startup_s = time.time() - t0
        self.loop, self.timeout, self.model = loop, rpc_timeout_s, model
        spec = vcfg.speculative_config
        self.speculative = spec is not None
        self.gamma = spec.num_speculative_tokens if spec is not None else 0
        self.version, self.speculate = version, self.speculative
        self.lengths = [self.gamma] * (vcfg.scheduler_config.max_num_seqs + 1)
        self._t0, self._t0_wall = time.perf_counter(), time.time()
        self._last = 0.0  # when the last window closed

    def install(self, target: Target, store_root: Path, store: StoreConfig, draft_dtype: str = "auto") -> None:
        """The worker extension's hooks, the chunk writer, closing requests in the worker, and the draft's
        GEMMs (`ServeConfig.draft_dtype`)."""
        if self.speculative:
            self.draft_gemms = self.rpc("tide_install", str(store_root), asdict(target.chunk_meta()),
                                        store.chunk_tokens, store.max_pending_chunks, store.retention_tokens, True,
                                        True, self.version, True, draft_dtype)["draft_gemms"]

    def rpc(self, method: str, *args: Any) -> Any:
        call = self.client.collective_rpc(method, args=args)
        return asyncio.run_coroutine_threadsafe(call, self.loop).result(self.timeout)[0]

    def profile(self, max_batch: int) -> LatencyModel:
        """Measured before the server started (a step-by-step engine: `TideEngine.profile`)."""
        if self.model is None:
            raise RuntimeError("AsyncEngine: no start-up profile was given")
        return self.model

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def window(self) -> tuple[Window, list[RequestResult]]:
        """The window since the last call, from the worker's counters, and the requests it closed."""
        s = self.stats(reset=True)
        t, t_start = self.now(), self._last
        self._last = t
        costs = s.get("step_costs", [])
        steps = len(costs)
        w = Window(t_start, t, int(s.get("generated", 0)), steps, sum(c[1] for c in costs) / steps if steps else 0.0,
                   list(s["accept_counts"]), self.version, sum(s["accept_counts"]) > 0,
                   int(s["writer"].get("tokens", 0)), s.get("rates", {}), s.get("lengths", []),
                   step_costs(costs, [], self.most_tokens))
        done = [RequestResult(c["request_id"], c["workload"], c["prompt_tokens"], c["output_ids"],
                              c["started"] - self._t0_wall, c["finished"] - self._t0_wall, c["accept_counts"],
                              c["draft_version"], sum(c["accept_counts"]) > 0, c["rows"])
                for c in s.get("closed", [])]
        return w, done

    def process_info(self) -> dict[str, Any]:
        return {"engine_core": "own process", "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads(), "draft_gemms": self.draft_gemms}

    def shutdown(self) -> None:
        self.client.shutdown()
