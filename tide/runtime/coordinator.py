"""The coordinator (rank 0): applies the control policies to a serving engine and drives trainers.

It is the engine's between-steps hook: it polls role messages, swaps in drafts the collection gate
accepts, rolls back drafts that collapse live, sets how many tokens each batch size drafts (0 where
speculation does not pay; back on when a draft's evaluation says it will), refits the latency model
from the steps served, turns capture on and off, and asks the trainers for a cycle when enough has
been stored. Every decision is recorded with its time and reason.

With several serving instances (ranks 1.. of component 0, `tide.runtime.instance`), the coordinator
also runs the collection gate on every instance's per-request acceptance, counts the rows they store,
tells them when to capture and which draft to deploy, and records what each did with it; each
instance keeps its own speculation gate and rollback on its own engine. A dedicated coordinator
(`slurm.coordinator`, `engine` None) does only that: it serves nothing itself.

`control.policy` picks how much of that runs: `adaptive` (all gates), `always` (the paper's
TIDE-default: speculate, collect, train and deploy without gates), `frozen` (a static draft: speculate,
never collect or train) or `nospec` (the engine is a plain one: serve, nothing else).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tide.config import TideConfig, UntilConfig
from tide.control import (
    CollectAction,
    CollectionGate,
    Decision,
    LatencyModel,
    RollbackAction,
    RollbackGate,
    SpecAction,
    SpeculationGate,
    SpeculationObservation,
    cost_key,
)
from tide.draft.acceptance import AcceptanceHistogram, PositionRates, RecentRates
from tide.runtime.messages import (
    RESULTS_RECEIVED,
    Capture,
    Deploy,
    DraftReady,
    Heartbeat,
    InstanceDone,
    InstanceEvent,
    InstanceReport,
    Message,
    Shutdown,
    Train,
    TrainFailed,
    TrainProgress,
)
from tide.runtime.transport import Transport
from tide.serve.engine import EngineControl, RequestResult, Window
from tide.workload import Finished, until_status

log = logging.getLogger(__name__)
SHUTDOWN_WAIT_S = 30.0  # for the cycle in flight at the end; the step guard gives the trainer 60 s (TIDE_TRAIN_GRACE)


@dataclass
class Event:
    t: float
    kind: str
    reason: str
    version: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Peer:
    """Another serving instance, as the coordinator knows it."""

    seen: float  # time.time() of its last message (or of the coordinator's start, before its first)
    heard: bool = False  # it has said something: until then it may still be starting its engine
    state: str = "serving"  # serving, done (its results are written) or down (silent for too long)
    rows: int = 0  # rows it stored in the current collection, as last reported


class Coordinator:
    def __init__(self, cfg: TideConfig, engine: EngineControl | None, transport: Transport | None,
                 trainer_ranks: list[int], drafts_root: str = "", resume_ns: int = 0,
                 instances: list[int] | None = None, version: int = 0) -> None:
        self.cfg, self.engine, self.transport = cfg, engine, transport
        self.gamma = engine.gamma if engine else cfg.serve.num_speculative_tokens
        self._version = version  # the draft deployed, where no engine of ours serves it
        self.trainer_ranks = list(trainer_ranks)
        self.peers = {r: Peer(time.time()) for r in instances or []}  # the other serving instances, by rank
        self.eval_counts: dict[int, list[int]] = {}  # each trained draft's held-out histogram (for Deploy)
        self.policy = cfg.control.policy
        self.collect = CollectionGate(cfg.control.collect)
        self.rollback = RollbackGate(cfg.control.rollback, self.gamma)
        self.gate: SpeculationGate | None = None
        self.model: LatencyModel | None = None  # step latencies: the start-up profile, refit while serving
        self._reported: dict[str, float] = {}  # the model's figures as last recorded
        self._live = RecentRates(self.gamma, cfg.control.speculation.min_steps)  # drafting steps while speculating
        self._steps = 0
        self._estimate: PositionRates | None = None  # the serving draft's held-out walk, from its training cycle
        self.held_out: dict[int, PositionRates] = {}  # each trained draft's held-out walk
        self.events: list[Event] = []
        self.eval_al: dict[int, float] = {self.version: float("nan")}
        self.cycles_asked = 0
        self.in_flight: tuple[int, float] | None = None  # (cycle, when asked) until its answer comes
        self.progress: TrainProgress | None = None  # of the cycle in flight
        self.trainer_seen = time.time()
        self.trainer_alive = bool(trainer_ranks)
        self.finished: list[tuple[Finished, int]] = []  # without an engine: the instances' requests, len(events) then
        self._since_ns = 0  # the current regime's start: its collections count, its cycles read chunks named since
        self._old_cycles = 0  # cycles asked before the last shift: their held-out walks are of the old workload
        self._chain: int | None = None  # an undeployed draft that still learns: the next cycle starts from it
        self._resume_ns = resume_ns  # a restarted run's first collection starts here (serve_role.resume_point)
        self._counted = 0  # rows stored since then, as last counted
        self._t0 = time.perf_counter()
        self._last_poll = 0.0
        self._beat_sent = 0.0  # when the coordinator last told the trainer ranks it is alive
        self._swapped_in_window = False
        self.drafts_root = drafts_root

    # ------------------------------------------------------------------ bookkeeping
    @property
    def version(self) -> int:
        """The draft serving: this engine's, or (a dedicated coordinator) the one last deployed."""
        return self.engine.version if self.engine else self._version

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def record(self, kind: str, reason: str, version: int | None = None, **data: Any) -> None:
        self.events.append(Event(self.now(), kind, reason, version, data))
        log.info("decision: %s%s: %s", kind, f" v{version}" if version is not None else "", reason)

    def _apply(self, d: Decision, regime_goes_on: bool = False) -> None:
        if d.action is CollectAction.COLLECT:
            if not (regime_goes_on and self._since_ns):  # a new regime: the chunks named from now on
                # the writer names chunks by this clock (same host); a restart picks up what it had stored
                self._since_ns, self._counted, self._resume_ns = self._resume_ns or time.time_ns(), 0, 0
                self._old_cycles = self.cycles_asked
                for peer in self.peers.values():
                    peer.rows = 0
                self._chain = None
            self._sync_capture()
            self.record("collect", d.reason)
        elif d.action is CollectAction.TRAIN:
            self._train(d.reason)
        elif d.action in (CollectAction.DEPLOY, CollectAction.CHAIN):
            if d.action is CollectAction.DEPLOY:
                self._chain = None
                self._deploy(d.version, d.reason)
            else:
                self._chain = d.version
                self.record("chain", d.reason, d.version)
            self._apply(self.collect.next_cycle())  # the regime trains on while a cycle gains
        elif d.action is CollectAction.HOLD:  # the chain, if any, goes on from its newest draft
            self.record("hold", d.reason, d.version)
            self._apply(self.collect.on_stored(0))  # rows stored while the cycle trained: train on them now
        elif d.action is CollectAction.REJECT:
            self._chain = None
            self._sync_capture()
            self.record("reject", d.reason, d.version)

    # ------------------------------------------------------------------ hooks
    def start(self) -> None:
        """Profile the latencies the speculation gate needs (its prior), set the draft lengths; a fresh
        (untrained) draft shows no shift: collect from the start."""
        fixed = self.cfg.serve.fixed_lengths()
        if self.policy == "adaptive" and self.engine is not None and self.engine.speculative:
            self.model = self.engine.profile(self.cfg.serve.max_num_seqs)
            self._reported = self._figures(self.model)
            m, K = self.model, self.gamma
            t = ", ".join(f"{b},{n}:{s * 1e3:.1f}" for (b, n), s in sorted(m.target.items()))
            self.record("profile", f"T(b,n) {t} ms, "
                        f"D(1, k) {', '.join(f'{m.draft_latency(1, k) * 1e3:.1f}' for k in range(1, K + 1))} ms: "
                        f"break-even at batch 1 {', '.join(f'k{k} {m.break_even(1, k):.2f}' for k in range(1, K + 1))}",
                        model=m.to_json())
            if fixed is None:  # clock: serving_starts
                self.gate = SpeculationGate(self.cfg.control.speculation, self.model, self.cfg.serve.max_num_seqs)
                self.engine.set_draft_lengths(self.gate.lengths)
                self.engine.set_probe(self.gate.probe_gap(self._steps))
        if fixed is not None and self.engine is not None:
            self.engine.set_draft_lengths(fixed)
        if not self.cfg.control.learns or not self.trainer_ranks:  # nothing would learn from what is captured
            if self.engine is not None:
                self.engine.set_capture(False)
        elif self.policy == "always":
            self._apply(self.collect.collect_now("policy always: collect from the start"))
        else:  # no draft has seen this workload yet: a regime from the start (it ends at the first plateau)
            start = "an untrained draft" if self.version == 0 and not self.cfg.draft.init else \
                f"draft v{self.version}"
            self._apply(self.collect.collect_now(f"serving starts with {start}: learn the live workload"))

    def serving_starts(self) -> None:
        """Event times count from here (the replay's clock); earlier events (profile) get negative times."""
        shift = time.perf_counter() - self._t0
        self._t0 += shift
        for e in self.events:
            e.t -= shift

    def wait_for_trainer(self, timeout: float) -> None:
        """Serve once a trainer has said hello (or `timeout` passed): a trainer still importing and
        building its ops would otherwise take the first training request late. After this, serving
        never waits for training."""
        # also where nothing learns: the trainer is told to stop at the end, which it hears once it listens
        if not self.trainer_ranks or self.transport is None:
            return
        t0 = time.time()
        while time.time() - t0 < timeout:
            heard = False
            for src, msg in self.transport.poll():
                heard |= src in self.trainer_ranks
                if src in self.peers:  # an instance with a short share may be done already
                    self._from_peer(src, msg)
            if heard:
                self.trainer_seen, self.trainer_alive = time.time(), True
                log.info("coordinator: trainer up after %.1f s", time.time() - t0)
                return
            time.sleep(0.2)
        self.trainer_alive = False
        self.record("trainer-down", f"no trainer heartbeat within {timeout:.0f} s: serving without training")

    def on_result(self, r: RequestResult) -> None:
        if r.speculate and sum(r.accept_counts) > 0:
            self._acceptance(r.first_acceptance)

    def _acceptance(self, first: float) -> None:
        """One request's first-draft acceptance, from any instance: the collection gate's evidence."""
        if self.cfg.control.learns:
            self._collect(self.collect.on_request(first))

    def _collect(self, d: Decision[CollectAction]) -> None:
        """Act on the collection gate's answer to live evidence, which may have seen a shift."""
        if self.collect.shifted:  # seen while a cycle trains: it and those before it walked the old workload
            self._old_cycles = self.cycles_asked
        if d.action is not CollectAction.WAIT:
            self._apply(d)

    def on_window(self, w: Window) -> None:
        self._steps += w.steps
        # A window in which the draft changed, or speculation came back on (requests that span the
        # switch draft from a stale KV cache), is no evidence about the draft: the gates skip it.
        evidence, self._swapped_in_window = not self._swapped_in_window and w.speculate, False
        self._learn(w)
        if self.gate is not None:
            self._gate(w, evidence)
        self._count_stored()
        if evidence and self.rollback.watching:
            d = self.rollback.decide(w.position_rates())
            if d.action is RollbackAction.ROLLBACK:
                self.record("rollback", d.reason, d.version)
                if d.version is None:
                    self._speculation_off()
                else:
                    self._estimate = None  # the held-out walk of the draft rolled back, not of the one restored
                    self._swap(d.version)
            elif d.action is RollbackAction.CONFIRM:
                self.record("confirm", d.reason, d.version)
        self._check_trainer()
        self._check_peers()

    def _count_stored(self) -> None:
        """Counted exactly as the trainer will read: rows in chunks named since collection started, of
        this engine and, as last reported, of every other instance."""
        if self.collect.collecting and self.trainer_alive:
            own = self.engine.stored_since(self._since_ns) if self.engine else 0
            rows = own + sum(p.rows for p in self.peers.values())
            new, self._counted = rows - self._counted, rows
            d = self.collect.on_stored(new) if new > 0 else None
            if d is not None and d.action is not CollectAction.WAIT:
                self._apply(d)

    def between_steps(self, engine: EngineControl, t: float) -> None:
        if self.transport is None or t - self._last_poll < 0.1:
            return
        self._last_poll = t
        self._poll()

    def _poll(self) -> None:
        """Beat, and act on every message that arrived."""
        assert self.transport is not None
        if time.time() - self._beat_sent >= self.cfg.runtime.heartbeat_s:  # the trainer watches for it too
            self._beat_sent = time.time()
            for r in [*self.trainer_ranks, *self._serving()]:
                self.transport.send(r, Heartbeat("coordinator", self.transport.rank, self._beat_sent))
        for src, msg in self.transport.poll():
            if src in self.peers:
                self._from_peer(src, msg)
                continue
            if src in self.trainer_ranks:
                if not self.trainer_alive:
                    self.record("trainer-up", f"{type(msg).__name__} from rank {src}: the trainer is back")
                self.trainer_seen, self.trainer_alive = time.time(), True
            if isinstance(msg, (DraftReady, TrainFailed)) and self.in_flight and msg.cycle == self.in_flight[0]:
                self.in_flight, self.progress = None, None
            if isinstance(msg, TrainProgress):
                if self.in_flight and msg.cycle == self.in_flight[0]:
                    self.progress = msg
            elif isinstance(msg, DraftReady):
                new, live = self._trained(msg)
                fresh = msg.cycle > self._old_cycles  # else its walks are on rows from before the last shift
                if fresh:  # the gate's evidence once this draft serves, and the rollback gate's bar
                    self.eval_counts[msg.version], self.held_out[msg.version] = list(msg.eval_counts), new
                if self.policy == "always":
                    self.collect.on_trained(msg.version, msg.eval_al, msg.live_al)
                    self._deploy(msg.version, "policy always: deploy every trained draft")
                    self._apply(self.collect.restart("policy always: collect anew"))
                else:
                    d = self.collect.on_trained(msg.version, msg.eval_al, msg.live_al, msg.base_al)
                    if fresh and d.action is not CollectAction.DEPLOY and msg.live_version == self.version:
                        self._estimate = live  # the live draft on fresh data: the gate's evidence while off
                    self._apply(d)
            elif isinstance(msg, TrainFailed):
                self.record("train-failed", msg.reason)
                self._apply(self.collect.on_training_failed(msg.reason))
            elif not isinstance(msg, Heartbeat):
                log.warning("coordinator: unexpected %s from rank %d", type(msg).__name__, src)

    def _trained(self, msg: DraftReady, note: str = "") -> tuple[PositionRates, PositionRates]:
        """Record a trained draft; its held-out and the live draft's rates."""
        new, base, live = (PositionRates.from_histogram(AcceptanceHistogram(len(c) - 1, list(c)))
                           for c in (msg.eval_counts, msg.base_counts, msg.live_counts))
        chained = f", live v{msg.live_version} {msg.live_al:.3f}" if msg.live_version != msg.base_version else ""
        self.record("trained", f"cycle {msg.cycle}: eval AL {msg.eval_al:.3f} (from v{msg.base_version} "
                    f"{msg.base_al:.3f}{chained}) on {msg.train_tokens} tokens in {msg.wall_s:.0f} s{note}",
                    msg.version, eval_al=msg.eval_al, base_al=msg.base_al, live_al=msg.live_al,
                    base_version=msg.base_version, wall_s=msg.wall_s, eval_rates=new.rates(), base_rates=base.rates())
        self.eval_al[msg.version] = msg.eval_al
        return new, live

    # ------------------------------------------------------------------ the other serving instances
    def _serving(self) -> list[int]:
        return [r for r, p in self.peers.items() if p.state == "serving"]

    def _tell_peers(self, msg: Message) -> None:
        for r in self._serving():
            self.transport.send(r, msg)  # type: ignore[union-attr]

    def _from_peer(self, src: int, msg: Message) -> None:
        peer = self.peers[src]
        if isinstance(msg, InstanceDone):  # its results are written: it exits on this answer (even if given up)
            self.transport.send(src, Shutdown(RESULTS_RECEIVED))  # type: ignore[union-attr]
        if peer.state == "down":  # it was given up: what it stored still counts, its word no longer
            return
        if not peer.heard:
            log.info("coordinator: instance %d is up (%s)", src, type(msg).__name__)
        peer.seen, peer.heard = time.time(), True
        if isinstance(msg, InstanceReport):
            for first in msg.first_acceptance:
                self._acceptance(first)
            if self.engine is None:  # `until` is this coordinator's to decide (`coordinate`)
                self.finished += [(Finished(v >= 0, v), len(self.events)) for v in msg.served]
            if msg.since_ns == self._since_ns:
                peer.rows = msg.stored_rows
        elif isinstance(msg, InstanceEvent):
            self.record(msg.kind, f"instance {src}: {msg.reason}", None if msg.version < 0 else msg.version,
                        instance=src)
        elif isinstance(msg, InstanceDone):
            peer.state = "done"
            self.record("instance-done", f"instance {src} served its {msg.requests} requests", instance=src)
        elif not isinstance(msg, Heartbeat):
            log.warning("coordinator: unexpected %s from instance %d", type(msg).__name__, src)

    def _check_peers(self) -> None:
        """An instance silent for `instance_timeout_s` is down; one never heard from gets as long as a
        trainer gets to start (`trainer_start_timeout_s`), since its engine may start slower than ours."""
        rt = self.cfg.runtime
        for r in self._serving():
            timeout = rt.instance_timeout_s if self.peers[r].heard else max(rt.instance_timeout_s,
                                                                              rt.trainer_start_timeout_s)
            if time.time() - self.peers[r].seen > timeout:
                self.peers[r].state = "down"
                self.record("instance-down", f"instance {r}: no word for {timeout:.0f} s: its requests in flight are "
                                             "lost, the other instances go on", instance=r)

    def _sync_capture(self) -> None:
        """Capture while collecting, on every instance; a collection counts chunks named from its start."""
        on = self.collect.collecting
        if self.engine is not None:
            self.engine.set_capture(on)
        self._tell_peers(Capture(on, self._since_ns))

    def finish(self, stop: str = "") -> None:
        """After this engine's workload: `stop` (non-empty) ends the other instances' workloads too; then
        wait, still coordinating, until each is done or down."""
        if stop:
            self._tell_peers(Shutdown(stop))
        if self._serving():
            log.info("coordinator: waiting for instance(s) %s", self._serving())
        while self._serving():
            self._tick()

    def coordinate(self, until: UntilConfig | None, stopped: list[str]) -> bool:
        """A dedicated coordinator's serving time: coordinate until every instance is done or down; end
        their workloads once `until` holds over all their requests, or a stop signal was appended to
        `stopped`. Whether `until` was met (True without one)."""
        t0, told, met = time.monotonic(), False, until is None
        while self._serving():
            self._tick()
            if told:
                continue
            why = stopped[0] if stopped else ""
            if until is not None and not why:
                done, met = until_status(until, self.events, 0, self.finished, time.monotonic() - t0)
                why = ("workload.until met over all instances" if met else
                       f"workload.until not met within max_s {until.max_s:.0f} s") if done else ""
            if why:
                self.record("stop", f"{why}: the instances finish the requests in flight")
                self._tell_peers(Shutdown(why))
                told = True
        return met

    def _tick(self) -> None:
        self._poll()
        self._count_stored()
        self._check_trainer()
        self._check_peers()
        time.sleep(0.1)

    # ------------------------------------------------------------------ latency model, speculation gate
    def _learn(self, w: Window) -> None:
        """Refit the latency model from the window's steps: the target's part by (batch, scheduled tokens),
        the draft's by (batch, k) (`tide.serve.engine.step_costs`). A refit that moves
        a headline figure (T(1), T at the largest batch, one draft pass at batch 1) by 10% is an event."""
        costs = w.costs
        if not costs or not costs.get("target"):
            return
        most = self.cfg.serve.max_num_seqs * (self.gamma + 1)  # decode and verify steps; not prefills
        if self.model is None:  # no start-up profile (policy always or frozen): learn from serving alone
            target = {key: s / c for key, (c, s) in costs["target"].items() if c and cost_key(key)[1] <= most}
            if not target:
                return
            self.model = LatencyModel.from_json({"target": target, "draft": {}, "gamma": self.gamma})
        self.model.observe_costs(costs, most)
        now = self._figures(self.model)
        moved = [k for k, v in now.items() if abs(v - self._reported.get(k, 0.0)) > 0.1 * max(v, 1e-9)]
        if moved:
            self._reported = now
            self.record("latency", "refit from serving: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in now.items()),
                        model=self.model.to_json())

    def _figures(self, m: LatencyModel) -> dict[str, float]:
        b = self.cfg.serve.max_num_seqs
        return {"T(1)": m.target_latency(1), f"T({b})": m.target_latency(b), "D(1,1)": m.draft_latency(1, 1)}

    def _gate(self, w: Window, evidence: bool) -> None:
        if evidence and w.steps:
            self._live.add(w.position_rates())
        live = self._live.merged()
        d = self.gate.decide(SpeculationObservation(self._steps, self.now(), max(w.mean_batch, 1.0), live,
                                                    self._estimate))
        if d.action is not SpecAction.STAY:
            self.engine.set_draft_lengths(self.gate.lengths)
            if d.action is not SpecAction.RESIZE:  # requests that span an off -> on switch draft from a stale KV
                self._live.clear()
                self._swapped_in_window = True
            if d.action is SpecAction.DISABLE:  # live steps outrank the draft's held-out walk, which predates
                self._estimate = None  # them (a shift): off until a cycle or a deploy brings fresh evidence
            kind = {SpecAction.ENABLE: "spec-on", SpecAction.DISABLE: "spec-off"}.get(d.action, "draft-length")
            self.record(kind, d.reason, self.engine.version, lengths=list(self.gate.lengths))
            control = self.cfg.control
            if d.action is SpecAction.DISABLE and control.learns and live.steps >= control.speculation.min_steps:
                self._collect(self.collect.on_speculation_off(live.rates()[0]))  # the live steps may show a shift
        self.engine.set_probe(self.gate.probe_gap(self._steps))
        if self.gate.length(w.mean_batch) == 0:
            self._keep_learning()

    def _speculation_off(self) -> None:
        if self.gate is not None:
            self.gate.lengths = [0] * len(self.gate.lengths)
            self.engine.set_draft_lengths(self.gate.lengths)
            self._estimate = None
        else:
            self.engine.set_speculation(False)

    def _keep_learning(self) -> None:
        """While the live draft does not pay, collect for the next cycle (when a trainer is up). With
        speculation off no shift can show, so the last regime goes on: its next cycle trains on all of
        its rows (within retention) once `n_threshold` more are stored, not on those new rows alone."""
        if self.trainer_alive and not self.collect.collecting:
            self._apply(self.collect.collect_now(f"speculation off: draft v{self.version} does not pay yet; "
                                                 "the regime goes on"), regime_goes_on=True)

    # ------------------------------------------------------------------ actions
    def _train(self, reason: str) -> None:
        """Train on the chunks written since collection started (all of them, up to when the trainer
        reads): rows from before a shift would teach the draft the old workload and, in the eval split,
        hide whether it learned the new one."""
        self.cycles_asked += 1
        self.in_flight, self.progress = (self.cycles_asked, time.time()), None
        base = self.version if self._chain is None else self._chain
        for r in self.trainer_ranks:
            self.transport.send(r, Train(self.cycles_asked, self.cfg.store.retention_tokens, self._since_ns,  # type: ignore[union-attr]
                                         base, self.version, reason))
        self.record("train", reason, data_cycle=self.cycles_asked, base_version=base)

    def _deploy(self, version: int, reason: str) -> None:
        previous, before = self.version, self._live.merged()
        if not self._swap(version):
            return
        self.record("deploy", reason, version)
        self._estimate = self.held_out.get(version)
        if self.policy == "adaptive" and self._estimate is not None and self.engine is not None:
            control = self.cfg.control  # the gates keep about speculation.min_steps of recent steps
            enough = before.steps >= min(control.rollback.window_steps, control.speculation.min_steps)
            self.rollback.watch(version, self._estimate.rates()[0], previous, before.rates()[0] if enough else None)
        self._tell_peers(Deploy(version, reason, self.eval_counts.get(version, [])))
        self._sync_capture()

    def _swap(self, version: int) -> bool:
        if self.engine is None:  # the instances swap, each between its own steps, and report it
            self._version = version
            return True
        path = f"{self.drafts_root}/v{version}"
        try:
            pause = self.engine.swap(path, version)
        except Exception as e:  # a draft that does not load degrades nothing: keep the live one
            self.record("swap-failed", f"{path}: {type(e).__name__}: {e}"[:300], version)
            return False
        self.record("swap", f"hot-swapped in {pause:.1f} ms", version, pause_ms=pause)
        self._swapped_in_window = True
        if self.gate is None and not self.engine.speculate:  # no gate: a new draft always speculates
            self.engine.set_speculation(True)
        self._live.clear()
        return True

    def training_status(self) -> str:
        """One phrase for the window log: what the trainer is doing, as far as the coordinator knows."""
        if not self.trainer_alive:
            return "trainer down" if self.trainer_ranks else "no trainer"
        if self.in_flight is None:
            return "trainer idle"
        cycle, asked = self.in_flight
        p = self.progress
        if p is None:
            return f"train c{cycle} asked {time.time() - asked:.0f} s ago"
        if p.phase == "train":
            return f"train c{cycle} {p.step}/{p.steps} loss {p.loss:.2f}"
        return f"train c{cycle} {p.phase}"

    def _check_trainer(self) -> None:
        closed = getattr(self.transport, "closed", False)
        if self.trainer_alive and (closed or time.time() - self.trainer_seen > self.cfg.runtime.trainer_timeout_s):
            self.trainer_alive, self.in_flight, self.progress = False, None, None
            self.record("trainer-down", "trainer connection closed" if closed else
                        f"no heartbeat for {self.cfg.runtime.trainer_timeout_s:.0f} s: serving goes on with "
                        f"draft v{self.version}")
            self._apply(self.collect.on_training_failed("trainer down"))

    def shutdown(self, reason: str) -> None:
        """Tell the trainer ranks to stop, after checking that they are still alive: a trainer that
        died in the last `trainer_timeout_s` would otherwise end the run as "ok"."""
        if self.trainer_alive and time.time() - self.trainer_seen > 2 * self.cfg.runtime.heartbeat_s:
            deadline = time.time() + 2 * self.cfg.runtime.heartbeat_s + 1.0
            while time.time() < deadline and not getattr(self.transport, "closed", False):
                if any(src in self.trainer_ranks for src, _ in self.transport.poll()):  # type: ignore[union-attr]
                    self.trainer_seen = time.time()
                    break
                time.sleep(0.05)
            else:
                self.trainer_alive = False
                self.record("trainer-down", f"no heartbeat at shutdown (last {time.time() - self.trainer_seen:.0f} s "
                                            "ago): the trainer died before the end")
        for r in self.trainer_ranks:
            self.transport.send(r, Shutdown(reason))  # type: ignore[union-attr]
        self._await_cycle()

    def _await_cycle(self) -> None:
        """A trainer reads Shutdown only between cycles. Wait, at most SHUTDOWN_WAIT_S, for the answer
        to the cycle in flight, so that this rank is still there when the trainer reads it: over MPI a
        trainer that finished its cycle after rank 0 had exited never read the Shutdown sent before
        (seen in CI), and waited `trainer_timeout_s` for a word until the step guard stopped it."""
        deadline = time.time() + SHUTDOWN_WAIT_S
        while self.in_flight and self.trainer_alive and time.time() < deadline:
            for _, msg in self.transport.poll():  # type: ignore[union-attr]
                if isinstance(msg, (DraftReady, TrainFailed)) and msg.cycle == self.in_flight[0]:
                    self.in_flight = None
                    if isinstance(msg, DraftReady):
                        self._trained(msg, ", after the stop: not deployed")
                    else:
                        self.record("train-failed", f"{msg.reason} (after the stop)")
            time.sleep(0.05)
        if self.in_flight:
            log.warning("coordinator: cycle %d still training %.0f s after the stop: not waiting for it",
                        self.in_flight[0], SHUTDOWN_WAIT_S)
