"""The serving role as vLLM's OpenAI-compatible server: `python -m tide.launch --serve`.

vLLM's app, routes and arguments (/v1/completions, /v1/chat/completions, streaming, /v1/models,
/health, /metrics; --api-key or VLLM_API_KEY) on its async engine, and TIDE's loop beside it: the
coordinator in a thread of this process (capture, collection, training cycles on the trainer role,
hot-swap, speculation control, rollback), its `tide_*` series on /metrics, `endpoint.json` in the
run dir. A request's `vllm_xargs: {"tide_workload": NAME}` labels its rows in the store.

SIGTERM or SIGINT: stop accepting, give in-flight requests `grace_s` to finish (then they are
aborted), close and flush what the worker holds, stop the trainer, write windows.jsonl,
requests.jsonl, events.json and summary.json.

In a Slurm job every rank of component 0 serves: rank 0 with the coordinator, each further rank as an
instance (`tide.runtime.instance`) that writes its results and `endpoint.json` under instances/<rank>/.
Ranks on one node listen on `port` + their node-local id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tide.config import TideConfig
from tide.model.files import write_json, write_jsonl
from tide.runtime.coordinator import Coordinator
from tide.runtime.metrics import TideMetrics
from tide.runtime.processes import node_local_id
from tide.runtime.serve_role import STOP_SIGNALS, Served, coordinator, instance_done, serving_start, summarize
from tide.runtime.server_options import HttpOptions
from tide.runtime.transport import Transport
from tide.serve.async_engine import AsyncEngine, server_args
from tide.serve.engine import RequestResult, TideEngine, Window
from tide.store.layout import RunLayout

log = logging.getLogger(__name__)


def run_server(cfg: TideConfig, run: RunLayout, transport: Transport | None, trainer_ranks: list[int],
               http: HttpOptions, instances: list[int] | None = None, leader: int | None = None) -> dict[str, Any]:
    """Serve until SIGTERM or SIGINT (or, as an instance, the coordinator's Shutdown); returns the
    summary (an instance's own figures, for an instance)."""
    return asyncio.run(_serve(cfg, run, transport, trainer_ranks, http, instances or [], leader))


def _profile(cfg: TideConfig, run: RunLayout, draft: Any, version: int) -> Any:
    """The speculation gate's prior, from a step-by-step engine (vLLM's async one cannot be stepped)."""
    if cfg.control.policy != "adaptive" or cfg.serve.fixed_lengths() is not None:
        return None
    eng = TideEngine(run.target, cfg.serve, draft, capture=False, version=version, dtype=cfg.model.dtype)
    try:
        return eng.profile(cfg.serve.max_num_seqs)
    finally:
        eng.close()


class _Loop(threading.Thread):
    """The coordinator's thread: polls the trainer every 0.1 s, closes a window every window_s."""

    def __init__(self, cfg: TideConfig, coord: Coordinator, engine: AsyncEngine, metrics: TideMetrics,
                 on_error: Any) -> None:
        super().__init__(name="tide-coordinator", daemon=True)
        self.cfg, self.coord, self.engine, self.metrics, self.on_error = cfg, coord, engine, metrics, on_error
        self.halt = threading.Event()
        self.results: list[RequestResult] = []
        self.windows: list[Window] = []

    def run(self) -> None:
        due = time.monotonic() + self.cfg.runtime.window_s
        try:
            while not self.halt.wait(0.1):
                self.coord.between_steps(self.engine, self.engine.now())
                if time.monotonic() >= due:
                    due += self.cfg.runtime.window_s
                    self.close_window(decide=True)
        except Exception:  # the engine died, or a bug: stop serving rather than serve without the loop
            log.exception("server: the coordinator failed; stopping")
            self.on_error()

    def close_window(self, decide: bool) -> None:
        w, done = self.engine.window()
        self.results += done
        self.windows.append(w)
        if decide:
            for r in done:
                self.coord.on_result(r)
            self.coord.on_window(w)
        self.metrics.update(w, self.coord.events)
        al = f"{w.acceptance_length:.2f}" if sum(w.accept_counts) else " -  "
        log.info("[%5.0fs] AL %s  %6.1f tok/s  batch %.1f  draft v%d  spec %s  stored %6.1fk  %d done  %s", w.t_end,
                 al, w.tokens_per_s, w.mean_batch, w.draft_version, "on " if w.speculate else "off",
                 w.stored_tokens / 1e3, len(done), self.coord.training_status())


async def _serve(cfg: TideConfig, run: RunLayout, transport: Transport | None, trainer_ranks: list[int],
                 http: HttpOptions, instances: list[int], leader: int | None) -> dict[str, Any]:
    import uvicorn

    with _root_logging_kept():  # vLLM's SageMaker routes set the root logger to ERROR on import
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.launcher import NoSignalServer, setup_server, watchdog_loop

    out, version = serving_start(cfg, run, transport, leader)
    port = http.port + (node_local_id() or 0)  # several instances on one node
    draft = None if cfg.control.plain else run.drafts / f"v{version}"
    model = _profile(cfg, run, draft, version)
    args = server_args(run.target, cfg.serve, draft, cfg.model.dtype, http.host, port, http.served_model_name,
                       ["--shutdown-timeout", str(int(http.grace_s)), *http.vllm_args])
    _, sock = setup_server(args, reuse_port=False)  # bound before the engine starts, as `vllm serve` does
    loop = asyncio.get_running_loop()
    engine = AsyncEngine(args, loop, model, version)
    stop, stopped = asyncio.Event(), list[str]()  # the signal(s) that stopped the server
    coord = coordinator(cfg, run, engine, transport, trainer_ranks, version, instances, leader,
                        on_stop=lambda why: (stopped.append(why), loop.call_soon_threadsafe(stop.set)))
    worker = _Loop(cfg, coord, engine, TideMetrics(), lambda: loop.call_soon_threadsafe(stop.set))

    def prepare() -> None:  # RPCs wait on this loop: run them from another thread
        engine.install(run.target, run.store, cfg.store, cfg.serve.draft_dtype)
        coord.wait_for_trainer(cfg.runtime.trainer_start_timeout_s)
        coord.start()
        coord.serving_starts()

    try:
        await asyncio.to_thread(prepare)
        tasks = await engine.client.get_supported_tasks()
        with _root_logging_kept():
            app = build_app(args, tasks, engine.client.model_config)
        await init_app_state(engine.client, app.state, args, tasks)
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=int(http.grace_s))
        config.load()
        server = NoSignalServer(config)
        app.state.server = server  # vLLM's engine-error handler stops the server through it
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, lambda name=sig.name: (stopped.append(name), stop.set()))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        watchdog = asyncio.create_task(watchdog_loop(server, engine.client))  # exits uvicorn if the engine dies
        worker.start()
        endpoint = _endpoint(out, args.host, port, args.served_model_name[0])
        log.info("server: %s (model %s); SIGTERM stops it", endpoint["url"], endpoint["model"])
        await asyncio.wait({serving, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        log.info("server: stopping; in-flight requests have %.0f s", http.grace_s)
        server.should_exit = True
        await serving  # uvicorn stops accepting and waits for the in-flight responses, then cancels them
        watchdog.cancel()
    finally:
        worker.halt.set()
        if worker.is_alive():
            await asyncio.to_thread(worker.join)
        await asyncio.to_thread(_finish, engine, coord, worker)
        engine.shutdown()
        sock.close()
    served = Served(worker.results, worker.windows, coord.events, {}, [], engine.process_info(),
                    coord.model.to_json() if coord.model else None, list(engine.lengths), "".join(stopped[:1]),
                    {r: p.state for r, p in coord.peers.items()})
    write_jsonl(out / "windows.jsonl", (w.to_json() for w in served.windows))
    write_jsonl(out / "requests.jsonl", (r.to_json() for r in served.results))
    write_json(out / "events.json", [asdict(e) for e in coord.events])
    if leader is not None:
        instance_done(cfg, run, transport, leader, served)  # type: ignore[arg-type]
        return {"rank": transport.rank}  # type: ignore[union-attr]
    return summarize(cfg, run, served, None, max(1, len(served.results) // 5))


def _finish(engine: AsyncEngine, coord: Coordinator, worker: _Loop) -> None:
    """Close what the worker still holds, count it, stop the trainer. An engine core that got the
    signal itself refuses calls: its worker then flushes on its own way out."""
    try:
        if engine.client.errored:
            raise RuntimeError("the engine core has exited")
        engine.timeout = 15.0
        engine.rpc("tide_flush", True)
        worker.close_window(decide=False)
        engine.rpc("tide_close")
    except Exception as e:
        log.warning("server: no final flush (%s): the worker flushed on its own way out", e)
    if coord.transport is not None:
        coord.finish("server stopped")  # the other instances stop too; their results are written
        coord.shutdown("server stopped")


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    root = logging.getLogger()
    level, handlers = root.level, [(h, h.level) for h in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for h, lv in handlers:
            h.setLevel(lv)


def _endpoint(out: Path, bind: str, port: int, model: str) -> dict[str, Any]:
    """endpoint.json: where a client (or a login node, on a cluster) reaches this server."""
    host = socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind
    info = {"url": f"http://{host}:{port}/v1", "host": host, "port": port, "model": model, "started": time.time()}
    write_json(out / "endpoint.json", info)
    return info
