"""The serving role: on rank 0 a TideEngine under the coordinator, then the run's results; on each
further serving rank one more instance (`tide.runtime.instance`) with its share of the workload, its
results under instances/<rank>/. A dedicated coordinator (`slurm.coordinator`) serves nothing itself:
`run_dedicated`."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tide.config import TideConfig, UntilConfig, to_dict
from tide.draft import DraftRegistry, init_draft, save_draft
from tide.model.files import write_json, write_jsonl
from tide.runtime.coordinator import Coordinator, Event
from tide.runtime.instance import Instance
from tide.runtime.messages import RESULTS_RECEIVED, InstanceDone, Shutdown
from tide.runtime.results import plot_run, segment
from tide.runtime.transport import Transport
from tide.serve.engine import EngineControl, Request, RequestResult, TideEngine, Window
from tide.store.layout import RunLayout, keep_previous_results
from tide.workload import RequestSource, Segment, WorkloadSpec, build_requests, build_workload, phase_segments

log = logging.getLogger(__name__)


def ensure_draft(cfg: TideConfig, run: RunLayout) -> int:
    """Newest published draft; publishes v0 (an untrained head, or `draft.init`) on first start."""
    reg = DraftRegistry(run.drafts)
    if not reg.path(0).exists() and reg.latest() == 0:
        if cfg.draft.init:
            from tide.draft import load_draft

            head = load_draft(Path(cfg.draft.init), run.target.path)
        else:
            head = init_draft(run.target.path, run.target.layer_ids, cfg.draft.draft_vocab_size, seed=cfg.train.seed)
        save_draft(head, reg.path(0), {"version": 0, "note": cfg.draft.init or "untrained head",
                                       "target_hash": run.target.chunk_meta().target_hash})
    return reg.latest()


def wait_for_draft(run: RunLayout, timeout_s: float = 600.0) -> int:
    """The newest published draft, once rank 0 has published v0 (an instance never publishes)."""
    reg, t0 = DraftRegistry(run.drafts), time.monotonic()
    while not reg.path(0).exists() and reg.latest() == 0:
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{run.drafts}: no draft v0 after {timeout_s:.0f} s (rank 0 publishes it)")
        time.sleep(0.5)
    return reg.latest()


def resume_point(run: RunLayout, version: int) -> int:
    """Where a restarted run's first collection begins (time.time_ns() of chunk names): just after the
    newest chunk draft `version` was trained on, so the rows stored after it (and before the stop)
    are not lost to the next cycle and none is read twice. 0 (collect from now) for a draft this run
    never trained."""
    from tide.store.chunk import chunk_time_ns

    meta = DraftRegistry(run.drafts).meta(version) if (run.drafts / f"v{version}" / "meta.json").exists() else {}
    read = [chunk_time_ns(Path(name)) for name in meta.get("source_chunks", [])]
    return max(read) + 1 if read else 0


@dataclass
class Served:
    """What one serving run did: its requests, windows and decisions, and how it ran."""

    results: list[RequestResult]
    windows: list[Window]
    events: list[Event]
    requests: dict[str, Request]  # every request submitted, by id
    workload: list[dict[str, Any]]  # per segment: passes and whether its `until` was met
    process: dict[str, Any]  # the serving process: engine core placement, cores, threads
    latency: dict[str, Any] | None  # the latency model at the end (start-up profile, refit while serving)
    lengths: list[int]  # the draft length of each batch size at the end
    stopped: str = ""  # the signal that ended the workload early, "" when it ran to its end
    instances: dict[int, str] = field(default_factory=dict)  # the other serving instances: rank -> done or down
    started: float = 0.0  # time.time() when serving began: the clock of its requests and windows starts there


def serve(cfg: TideConfig, run: RunLayout, segments: list[Segment], transport: Transport | None,
          trainer_ranks: list[int], concurrency: int = 0, instances: list[int] | None = None,
          leader: int | None = None) -> Served:
    """Serve `segments` under a coordinator (with the other serving `instances`), or as an instance
    following the coordinator on rank `leader`; windows, requests and events go to the run dir (an
    instance's to instances/<rank>/)."""
    out, version = serving_start(cfg, run, transport, leader)
    draft = None if cfg.control.plain else run.drafts / f"v{version}"
    engine = TideEngine(run.target, cfg.serve, draft, store_root=run.store,
                        chunk_tokens=cfg.store.chunk_tokens, retention_tokens=cfg.store.retention_tokens,
                        max_pending_chunks=cfg.store.max_pending_chunks, version=version, dtype=cfg.model.dtype)
    learning = cfg.control.learns and (bool(trainer_ranks) or leader is not None)
    coord = coordinator(cfg, run, engine, transport, trainer_ranks, version, instances, leader,
                        on_stop=lambda why: source.stop(why))
    source = RequestSource(segments, coord.events, learning=learning)
    coord.wait_for_trainer(cfg.runtime.trainer_start_timeout_s)
    coord.start()
    coord.serving_starts()
    t0 = time.time()

    def show(w: Window) -> None:
        coord.on_window(w)
        al = f"{w.acceptance_length:.2f}" if sum(w.accept_counts) else " -  "
        log.info("[%5.0fs] AL %s  %6.1f tok/s  batch %.1f  draft v%d  spec %s  stored %6.1fk  %s", time.time() - t0,
                 al, w.tokens_per_s, w.mean_batch, w.draft_version, "on " if w.speculate else "off",
                 w.stored_tokens / 1e3, coord.training_status())

    def finished(r: RequestResult) -> None:
        coord.on_result(r)
        source.observe(r)

    try:
        with stop_on_signals(source.stop):
            results, windows = engine.replay(source, concurrency or cfg.workload.concurrency, cfg.runtime.window_s,
                                             between_steps=coord.between_steps, on_window=show, on_result=finished)
        engine.flush()
        if source.stopped:
            coord.record("stop", f"{source.stopped}: the workload ended early, after the requests in flight")
        repeated = learning and any(seg.until.active for seg in segments)  # the others repeat until told
        coord.finish(source.stopped or ("workload done" if repeated else ""))
        process, lengths = engine.process_info(), list(engine.lengths)
    finally:
        if transport is not None:
            coord.shutdown("workload done")
        engine.close()
    write_jsonl(out / "windows.jsonl", (w.to_json() for w in windows))
    write_jsonl(out / "requests.jsonl", (r.to_json() for r in results))
    write_json(out / "events.json", [asdict(e) for e in coord.events])
    latency = coord.model.to_json() if coord.model else None
    return Served(results, windows, coord.events, source.served, source.outcomes, process, latency, lengths,
                  source.stopped, {r: p.state for r, p in coord.peers.items()}, t0)


def instance_dir(run: RunLayout, rank: int) -> Path:
    return run.out / "instances" / str(rank)


def serving_start(cfg: TideConfig, run: RunLayout, transport: Transport | None,
                  leader: int | None) -> tuple[Path, int]:
    """Where this serving rank writes its results (rank 0: the run dir; an instance following rank
    `leader`: instances/<rank>/), the last run's moved to previous/<k>/ there, and the draft it starts
    from (rank 0 publishes v0 on a first start, an instance waits for it; none for plain engines)."""
    out = run.out if leader is None else instance_dir(run, transport.rank)  # type: ignore[union-attr]
    keep_previous_results(out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.control.plain:
        return out, 0
    return out, ensure_draft(cfg, run) if leader is None else wait_for_draft(run)


def coordinator(cfg: TideConfig, run: RunLayout, engine: EngineControl, transport: Transport | None,
                trainer_ranks: list[int], version: int, instances: list[int] | None, leader: int | None,
                on_stop: Callable[[str], None]) -> Coordinator:
    """Rank 0's coordinator (with the other serving `instances`), or an instance following rank
    `leader` (`on_stop`: what the coordinator's Shutdown does to its workload)."""
    if leader is None:
        return Coordinator(cfg, engine, transport, trainer_ranks, drafts_root=str(run.drafts),
                           resume_ns=resume_point(run, version), instances=instances)
    return Instance(cfg, engine, transport, leader, str(run.drafts), on_stop=on_stop)  # type: ignore[arg-type]


def instance_figures(s: Served) -> dict[str, Any]:
    """One instance's figures: its requests, acceptance, throughput and the drafts it swapped in."""
    seg = segment(s.results)
    swaps = [e for e in s.events if e.kind == "swap" and "instance" not in e.data]  # its own, not reported ones
    wall = s.windows[-1].t_end if s.windows else 0.0
    return {"requests": len(s.results), "output_tokens": seg["tokens"], "acceptance_length": seg["acceptance_length"],
            "output_tokens_per_s": seg["tokens"] / wall if wall > 0 else 0.0, "wall_s": wall,
            "swaps": len(swaps), "versions": sorted({e.version for e in swaps}),
            "speculation_on_fraction": spec_on_fraction(s.windows), "stopped": s.stopped or None}


def instances_section(run: RunLayout, own: Served | None, states: dict[int, str]) -> dict[str, Any]:
    """The summary's per-instance figures (the coordinator's engine first, where it serves; each other
    instance from its own summary, or only its state where it died) and their totals."""
    rows = [{"rank": 0, "state": "coordinator", **instance_figures(own)}] if own else []
    for rank, state in sorted(states.items()):
        path = instance_dir(run, rank) / "summary.json"
        figures = json.loads(path.read_text())["figures"] if state == "done" and path.exists() else {}
        rows.append({"rank": rank, "state": state, **figures})
    total = {key: sum(r.get(key, 0) for r in rows) for key in ("requests", "output_tokens", "output_tokens_per_s")}
    return {"spread": "round-robin", "instances": rows, "total": total}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)  # USR2: submitit's before the time limit
ECHO_S = 5.0  # a stop signal this soon after the first is the same stop, delivered twice


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[str], None]) -> Iterator[None]:
    """The first SIGTERM, SIGINT or SIGUSR2 ends the workload early: no new requests, those in flight
    finish, and the run writes its results as at a normal end. Under Slurm one stop arrives twice
    (slurmstepd signals every process of the step, and the step guard passes its own TERM on to the
    rank's process group): a signal within ECHO_S of the first is that echo. A later one acts as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    first: list[float] = []

    def handler(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if first and time.monotonic() - first[0] < ECHO_S:
            return
        if first:  # a second stop: as if we had never caught the first
            for sig, h in before.items():
                signal.signal(sig, h)
            signal.raise_signal(signum)
            return
        first.append(time.monotonic())
        log.warning("%s: no new requests; the ones in flight finish, then the results are written", name)
        stop(name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def nospec_rate(cfg: TideConfig, run: RunLayout, requests: list[Request]) -> dict[str, float]:
    """The same requests on a plain vLLM engine (no speculative_config), one at a time."""
    engine = TideEngine(run.target, cfg.serve, None, dtype=cfg.model.dtype)
    try:
        base = [Request(f"nospec-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload) for r in requests]
        results, _ = engine.replay(base, concurrency=cfg.workload.concurrency, window_s=1e9)
    finally:
        engine.close()
    return segment(results)


def summarize(cfg: TideConfig, run: RunLayout, s: Served, nospec: dict[str, float] | None, tail: int) -> dict[str, Any]:
    """summary.json and the plot: start = the first `tail` requests, end = the last `tail`."""
    results, windows, events = s.results, s.windows, s.events
    done = sorted(results, key=lambda r: r.finish)
    start, end = segment(done[:tail]), segment(done[-tail:])
    swaps = [e for e in events if e.kind == "swap" and "instance" not in e.data]  # this engine's
    summary = {
        "al_start": start["acceptance_length"], "al_end": end["acceptance_length"],
        "tokens_per_s_start": start["tokens_per_s"], "tokens_per_s_end": end["tokens_per_s"],
        "nospec_tokens_per_s": nospec["tokens_per_s"] if nospec else None,
        "speedup_end_over_nospec": end["tokens_per_s"] / nospec["tokens_per_s"] if nospec else None,
        "swaps": len(swaps), "versions": sorted({e.version for e in swaps}),
        "requests": len(results), "output_tokens": sum(len(r.output_ids) for r in results),
        "wall_s": windows[-1].t_end if windows else 0.0, "started_unix": s.started, "segment_requests": tail,
        "stopped": s.stopped or None,
        "stored_tokens": windows[-1].stored_tokens if windows else 0,
        "training": training_state(events),
        "speculation_on_fraction": spec_on_fraction(windows),
        "eval_al_deployed": next((e.data.get("eval_al") for e in reversed(events) if e.kind == "trained"
                                  and e.version == (swaps[-1].version if swaps else None)), None),
        **(instances_section(run, s, s.instances) if s.instances else {}),
        "workload": s.workload, "serving": s.process, "latency_model": s.latency, "draft_lengths": s.lengths,
        "events": [asdict(e) for e in events], "config": to_dict(cfg),
    }
    write_json(run.out / "summary.json", summary)
    plot_run(run.out / "acceptance.png", windows, [e for e in events if "instance" not in e.data],
             f"{run.target.path.name}: AL {summary['al_start']:.2f} -> {summary['al_end']:.2f}, {len(swaps)} swaps")
    return summary


def spec_on_fraction(windows: list[Window]) -> float:
    """Share of serving time with speculation on."""
    total = sum(w.t_end - w.t_start for w in windows)
    return sum(w.t_end - w.t_start for w in windows if w.speculate) / total if total > 0 else 0.0


def training_state(events: list[Any]) -> str:
    """'ok'; 'degraded' when the trainer went down or a cycle failed (serving went on with the last
    good draft) and that was the last word; 'recovered' when the trainer came back or a cycle
    trained after that."""
    bad = ("trainer-down", "train-failed")
    kinds = [e.kind for e in events if e.kind in (*bad, "trainer-up", "trained")]
    return "ok" if not set(bad) & set(kinds) else "degraded" if kinds[-1] in bad else "recovered"


def workload_share(cfg: TideConfig, run: RunLayout, share: int, shares: int,
                   phases: WorkloadSpec | None = None) -> tuple[list[Segment], int]:
    """Serving rank number `share` of `shares`: its round-robin share of what the run serves, and the
    closed loop's concurrency (each instance keeps the workload's). The workload is the config's
    (`workload:`, one segment), or the phases of an experiment (`--phases`: one segment per phase,
    each split round-robin). Built alike on every rank (seeded)."""
    if phases is None:
        reqs = build_requests(cfg.workload, run.target.path, cfg.serve.max_model_len - cfg.workload.max_tokens - 8)
        return [Segment(reqs[share::shares], cfg.workload.until)], cfg.workload.concurrency
    reqs = build_workload(phases, run.target.path, cfg.serve.max_model_len - phases.max_tokens - 8)
    return phase_segments(phases, reqs, share, shares), phases.arrivals.concurrency or 1


def run_coordinator(cfg: TideConfig, run: RunLayout, transport: Transport | None, trainer_ranks: list[int],
                    tail: int = 0, instances: list[int] | None = None,
                    phases: WorkloadSpec | None = None) -> dict[str, Any]:
    """Rank 0's whole job: serve the configured workload or `phases` (its share, round-robin, when other
    serving `instances` take the rest; on until its `until` holds), measure the no-speculation
    baseline on the last `tail` requests (a fifth by default), and write summary.json, windows/requests
    JSONL, events and the plot."""
    segments, concurrency = workload_share(cfg, run, 0, 1 + len(instances or []), phases)
    served = serve(cfg, run, segments, transport, trainer_ranks, concurrency, instances=instances)
    tail = tail or max(1, len(served.results) // 5)
    last = [served.requests[r.request_id] for r in sorted(served.results, key=lambda r: r.finish)[-tail:]]
    nospec = nospec_rate(cfg, run, last) if cfg.workload.nospec_baseline and not served.stopped else None
    return summarize(cfg, run, served, nospec, tail)


def run_instance(cfg: TideConfig, run: RunLayout, transport: Transport, leader: int, share: int, shares: int,
                 phases: WorkloadSpec | None = None) -> None:
    """A further serving rank's whole job: its round-robin share (number `share` of `shares`) of the
    workload or `phases` (served once, or repeated until the coordinator says the run's `until` held),
    its results under instances/<rank>/, then `InstanceDone`."""
    segments, concurrency = workload_share(cfg, run, share, shares, phases)
    if phases is None and cfg.workload.until.active:  # the coordinator decides when `until` held
        segments = [Segment(segments[0].requests, UntilConfig(max_s=cfg.workload.until.max_s))]
    served = serve(cfg, run, segments, transport, [], concurrency, leader=leader)
    instance_done(cfg, run, transport, leader, served)


def run_dedicated(cfg: TideConfig, run: RunLayout, transport: Transport, trainer_ranks: list[int],
                  instances: list[int]) -> dict[str, Any]:
    """Rank 0 as a het group of its own: no engine. The `instances` serve the workload round-robin;
    this rank runs the collection gate on all their requests, drives the trainers, deploys to every
    instance, and ends their workloads once `workload.until` holds over all of them (or at a stop
    signal). Then summary.json (per-instance figures and totals; each instance's plot is its own)
    and events.json."""
    keep_previous_results(run.out)
    run.out.mkdir(parents=True, exist_ok=True)
    version = 0 if cfg.control.plain else ensure_draft(cfg, run)
    coord = Coordinator(cfg, None, transport, trainer_ranks, drafts_root=str(run.drafts),
                        resume_ns=resume_point(run, version), instances=instances, version=version)
    until = cfg.workload.until if cfg.workload.until.active and cfg.control.learns else None
    stopped: list[str] = []
    try:
        coord.wait_for_trainer(cfg.runtime.trainer_start_timeout_s)
        coord.start()
        coord.serving_starts()
        with stop_on_signals(stopped.append):
            met = coord.coordinate(until, stopped)
    finally:
        coord.shutdown("workload done")
    deployed = sorted({e.version for e in coord.events if e.kind == "deploy"})
    summary = {"coordinator": "dedicated", "deployed": deployed, "training": training_state(coord.events),
               "until_met": met, "stopped": stopped[0] if stopped else None,
               **instances_section(run, None, {r: p.state for r, p in coord.peers.items()}),
               "events": [asdict(e) for e in coord.events], "config": to_dict(cfg)}
    write_json(run.out / "events.json", summary["events"])
    write_json(run.out / "summary.json", summary)
    return summary


def instance_done(cfg: TideConfig, run: RunLayout, transport: Transport, leader: int, served: Served) -> None:
    """An instance's summary and plot (beside its windows, requests and events), then `InstanceDone`,
    and the coordinator's word that it has the results (or as long as it gives an instance to start)."""
    rank, out = transport.rank, instance_dir(run, transport.rank)
    write_json(out / "summary.json", {"rank": rank, "figures": instance_figures(served), "started_unix": served.started,
                                      "workload": served.workload,
                                      "serving": served.process, "latency_model": served.latency,
                                      "draft_lengths": served.lengths, "events": [asdict(e) for e in served.events]})
    plot_run(out / "acceptance.png", served.windows, served.events, f"instance {rank}: {len(served.results)} requests")
    transport.send(leader, InstanceDone(rank, len(served.results)))
    # exit once the coordinator has it: Open MPI sends over a connection the coordinator accepts only when
    # it next polls (it may still be starting its engine), and what a rank that exited had sent is lost
    timeout_s = max(cfg.runtime.instance_timeout_s, cfg.runtime.trainer_start_timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(src == leader and msg == Shutdown(RESULTS_RECEIVED) for src, msg in transport.poll()):
            return
        time.sleep(0.05)
    log.warning("instance %d: no word from the coordinator (rank %d) for %.0f s after InstanceDone", rank, leader,
                timeout_s)
