"""The coordinator's decisions with a stand-in engine: no vLLM, a real chunk writer and reader.

The engine is the one part mocked here (a vLLM start-up per case would cost minutes); what the
coordinator reads from it, the rows on disk since a moment, comes from a real `ChunkWriter`, and
every count is checked against what a `ChunkReader` told the same moment finds, as the trainer is.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from tide.config import TideConfig, load_config
from tide.control import LatencyModel
from tide.draft.acceptance import PositionRates
from tide.runtime.coordinator import Coordinator
from tide.runtime.messages import DraftReady, Heartbeat, Message, Shutdown, Train, TrainFailed, TrainProgress
from tide.serve.engine import Window
from tide.store import ChunkMeta, ChunkReader, ChunkWriter, Run

ROOT = Path(__file__).resolve().parents[1]
META = ChunkMeta("fake", "0" * 16, hidden_size=8, layer_ids=(1, 2, 3))
CHUNK = 100


class FakeEngine:
    """The calls the coordinator makes of a TideEngine; capture writes real chunks."""

    speculative = True

    def __init__(self, store: Path, gamma: int = 3) -> None:
        self.gamma, self.version, self.speculate, self.capture = gamma, 0, True, False
        self.lengths = [gamma] * 5
        self.writer = ChunkWriter(store, META, chunk_tokens=CHUNK)
        self.swaps: list[int] = []
        self.paths: list[str] = []
        self._n = 0

    def set_capture(self, on: bool) -> None:
        self.capture = on

    def set_speculation(self, on: bool) -> None:
        self.speculate = on

    def set_draft_lengths(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)

    def set_probe(self, every: int) -> None:
        self.probe_every = every

    def swap(self, path: str, version: int) -> float:
        self.version = version
        self.swaps.append(version)
        self.paths.append(path)
        return 1.0

    def stored_since(self, since_ns: int) -> int:
        return self.writer.tokens_since(since_ns)

    def profile(self, max_batch: int) -> LatencyModel:
        return LatencyModel.flat(((1, 0.03), (64, 0.03)), 0.002, self.gamma)

    def serve_chunks(self, n: int) -> None:
        """Finish requests whose rows fill `n` chunks, and wait until they are on disk."""
        for _ in range(n):
            self._n += 1
            rows = np.zeros((CHUNK, META.row_dim), np.uint16)
            self.writer.add(Run(f"r{self._n}", np.zeros(CHUNK, np.int32), np.arange(CHUNK, dtype=np.int32), rows,
                                np.ones(CHUNK, bool)))
        self.writer.flush()
        time.sleep(0.002)  # a later since_ns is a later name


class ListTransport:
    """Messages to the trainer rank are kept; messages from it are queued by the test."""

    rank = 0

    def __init__(self) -> None:
        self.sent: list[tuple[int, Message]] = []
        self.inbox: list[tuple[int, Message]] = []

    def send(self, dest: int, msg: Message) -> None:
        self.sent.append((dest, msg))

    def poll(self) -> list[tuple[int, Message]]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        pass


def config(policy: str) -> TideConfig:
    cfg = load_config(ROOT / "configs" / "ci.yaml")
    collect = dataclasses.replace(cfg.control.collect, n_threshold=250)
    speculation = dataclasses.replace(cfg.control.speculation, min_dwell_s=0.0)
    return dataclasses.replace(cfg, control=dataclasses.replace(cfg.control, policy=policy, collect=collect,
                                                                 speculation=speculation))


def window(engine: FakeEngine, first: float = 0.0, steps: int = 5) -> Window:
    """A window of `steps` drafting steps at batch 1, drafting 1 token, `first` of them accepted."""
    accepted = round(first * steps)
    rates = {"tried": [steps] + [0] * (engine.gamma - 1), "accepted": [accepted] + [0] * (engine.gamma - 1)}
    return Window(0.0, 1.0, 10, steps, 1.0, [steps - accepted, accepted] + [0] * (engine.gamma - 1), engine.version,
                  True, engine.writer.stats()["tokens"], rates)


def ready(cycle: int, version: int, eval_al: float, base_al: float, base_version: int = 0,
          live: tuple[float, int] | None = None) -> DraftReady:
    """A trainer's answer whose held-out walks (gamma 1) have these acceptance lengths; the live draft
    is the base unless `live` (its AL and version) says otherwise."""
    hist = lambda al: [1000 - round((al - 1) * 1000), round((al - 1) * 1000)]  # noqa: E731
    live_al, live_version = live or (base_al, base_version)
    return DraftReady(cycle, version, f"v{version}", eval_al, base_al, base_version, live_al, live_version, 300, 1.0,
                      hist(eval_al), hist(base_al), hist(live_al))


def trains(t: ListTransport) -> list[Train]:
    return [m for _, m in t.sent if isinstance(m, Train)]


def test_the_count_that_triggers_training_is_what_the_trainer_reads_also_after_a_deploy(tmp_path: Path) -> None:
    """Rows written while a cycle trains belong to the collection before the deploy: the collection
    started by the deploy counts (and its cycle reads) only chunks named after it."""
    engine, transport = FakeEngine(tmp_path), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    reader = ChunkReader(tmp_path, META)
    engine.serve_chunks(3)
    coord.on_window(window(engine))
    (first,) = trains(transport)
    assert sum(len(r) for r in reader.load(since_ns=first.since_ns)) == 300
    engine.serve_chunks(2)  # while cycle 1 trains, in the window that will also see its draft deployed
    transport.inbox.append((1, ready(1, 1, 1.5, 1.0)))
    coord.between_steps(engine, 1.0)
    assert engine.swaps == [1] and [e.kind for e in coord.events][-2:] == ["deploy", "collect"]
    engine.serve_chunks(1)
    coord.on_window(window(engine))
    assert len(trains(transport)) == 1  # 100 new rows, not the 200 written while cycle 1 trained
    engine.serve_chunks(2)
    coord.on_window(window(engine))
    second = trains(transport)[1]
    assert second.since_ns > first.since_ns and "300/250 tokens" in second.reason
    assert sum(len(r) for r in reader.load(since_ns=second.since_ns)) == 300
    engine.writer.close()


def test_policy_always_deploys_every_trained_draft_even_a_worse_one(tmp_path: Path) -> None:
    engine, transport = FakeEngine(tmp_path), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine))
    transport.inbox.append((1, ready(1, 1, 1.2, 1.9)))  # worse than its base
    coord.between_steps(engine, 1.0)
    assert engine.version == 1 and engine.speculate and engine.capture
    assert [e.kind for e in coord.events if e.kind in ("deploy", "reject")] == ["deploy"]
    engine.writer.close()


def test_a_draft_is_swapped_from_the_run_drafts_dir_whatever_path_the_message_names(tmp_path: Path) -> None:
    """Security: a DraftReady's `path` is informational; the swap reads DRAFTS/v<int version>."""
    engine, transport = FakeEngine(tmp_path / "store"), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path / "drafts"))
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine))
    transport.inbox.append((1, dataclasses.replace(ready(1, 1, 1.5, 1.0), path="/etc/../tmp/evil")))
    coord.between_steps(engine, 1.0)
    assert engine.paths == [f"{tmp_path}/drafts/v1"]
    engine.writer.close()


def test_the_coordinator_beats_and_a_trainer_silent_at_shutdown_is_reported_down(tmp_path: Path) -> None:
    """Heartbeats go both ways; a trainer that died shortly before the end (within trainer_timeout_s,
    so no window noticed) makes the run 'degraded', not 'ok'."""
    engine, transport = FakeEngine(tmp_path), ListTransport()
    cfg = config("adaptive")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, heartbeat_s=0.1))
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    transport.inbox.append((1, Heartbeat("trainer", 1, 0.0)))
    coord.between_steps(engine, 1.0)
    assert [m.role for _, m in transport.sent if isinstance(m, Heartbeat)] == ["coordinator"]
    coord.trainer_seen -= 1.0  # last heard a second ago: 10 beats missed
    coord.shutdown("workload done")
    last = coord.events[-1]
    assert last.kind == "trainer-down" and "no heartbeat at shutdown" in last.reason
    assert isinstance(transport.sent[-1][1], Shutdown)

    alive = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    alive.start()
    alive.trainer_alive, alive.trainer_seen = True, time.time() - 1.0
    transport.inbox.append((1, Heartbeat("trainer", 1, 0.0)))  # it answers within two beats
    alive.shutdown("workload done")
    assert "trainer-down" not in [e.kind for e in alive.events]
    engine.writer.close()


def test_shutdown_waits_for_the_cycle_in_flight_and_records_its_draft_undeployed(tmp_path: Path) -> None:
    """The trainer reads Shutdown only after its cycle: the coordinator stays until the answer comes
    (so that it is there to deliver the Shutdown) and records the draft, which nothing deploys."""
    import threading

    engine, transport = FakeEngine(tmp_path), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    coord.trainer_alive, coord.trainer_seen, coord.in_flight = True, time.time(), (1, time.time())
    answer = threading.Timer(0.3, lambda: transport.inbox.append((1, ready(1, 1, 1.8, 1.0))))
    answer.start()
    coord.shutdown("workload done")
    answer.join()
    assert isinstance(transport.sent[-1][1], Shutdown) and coord.in_flight is None
    last = coord.events[-1]
    assert (last.kind, last.version) == ("trained", 1) and "after the stop: not deployed" in last.reason
    assert engine.swaps == [] and "deploy" not in [e.kind for e in coord.events]
    engine.writer.close()


def test_a_restarted_run_collects_from_after_the_chunks_its_newest_draft_was_trained_on(tmp_path: Path) -> None:
    """Rows stored after the newest draft's training read (and before a stop) belong to the first
    collection of the next start; the rows that draft already learnt do not."""
    from tide.draft import DraftRegistry, init_draft
    from tide.runtime.serve_role import resume_point
    from tide.store import chunk_name
    from tide.store.chunk import chunk_time_ns
    from tide.store.layout import RunLayout

    run = RunLayout.open(load_config(ROOT / "configs" / "ci.yaml"), tmp_path / "run")
    reg = DraftRegistry(run.drafts)
    head = init_draft(run.target.path, run.target.layer_ids, 256)
    read = [chunk_name(i) for i in (5, 9, 7)]
    newest = max(chunk_time_ns(Path(name)) for name in read)
    assert resume_point(run, reg.publish(head, {"source_chunks": read})) == newest + 1
    assert resume_point(run, 0) == 0  # v0 (an initial draft): collect from now

    engine, transport = FakeEngine(tmp_path / "store"), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path),
                        resume_ns=12345)
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine))
    assert trains(transport)[0].since_ns == 12345
    engine.writer.close()


def test_the_window_line_says_where_a_cycle_is(tmp_path: Path) -> None:
    engine, transport = FakeEngine(tmp_path), ListTransport()
    coord = Coordinator(config("always"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    assert coord.training_status() == "trainer idle"
    engine.serve_chunks(3)
    coord.on_window(window(engine))
    assert coord.training_status().startswith("train c1 asked ")
    for t, (msg, status) in enumerate([(TrainProgress(1, "read", 0, 0, float("nan"), 0.0), "train c1 read"),
                        (TrainProgress(1, "train", 7, 60, 0.5, 100.0), "train c1 7/60 loss 0.50"),
                        (TrainProgress(1, "publish", 60, 60, 0.4, 100.0), "train c1 publish"),
                        (TrainFailed(1, "not enough stored data"), "trainer idle")], start=2):
        transport.inbox.append((1, msg))
        coord.between_steps(engine, float(t))
        assert coord.training_status() == status
    engine.writer.close()


@pytest.mark.parametrize("policy", ["always", "adaptive"])
def test_no_trainer_means_no_capture(tmp_path: Path, policy: str) -> None:
    engine = FakeEngine(tmp_path)
    coord = Coordinator(config(policy), engine, None, trainer_ranks=[], drafts_root=str(tmp_path))
    coord.start()
    assert not engine.capture and coord.training_status() == "no trainer"
    engine.writer.close()


def test_a_regime_trains_on_while_cycles_gain_and_stops_at_a_plateau(tmp_path: Path) -> None:
    """Adaptive: a gaining cycle is deployed and the next one is asked at once, on the same rows
    (same since_ns); the first that does not gain ends collection."""
    engine, transport = FakeEngine(tmp_path, gamma=1), ListTransport()
    coord = Coordinator(config("adaptive"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()  # an untrained v0: collect from the start
    engine.serve_chunks(3)
    coord.on_window(window(engine, first=0.0))
    (first,) = trains(transport)
    transport.inbox.append((1, ready(1, 1, 1.4, 1.0)))
    coord.between_steps(engine, 1.0)
    second = trains(transport)[1]
    assert engine.version == 1 and second.since_ns == first.since_ns and second.base_version == 1
    transport.inbox.append((1, ready(2, 2, 1.403, 1.4, base_version=1)))  # < min_gain 0.02 and < min_rise 0.005
    coord.between_steps(engine, 2.0)
    kinds = [e.kind for e in coord.events]
    assert kinds[-1] == "reject" and "a plateau" in coord.events[-1].reason
    assert engine.version == 1 and not engine.capture and len(trains(transport)) == 2
    engine.writer.close()


def test_a_chain_starts_each_cycle_from_the_newest_draft_and_deploys_against_the_live_one(tmp_path: Path) -> None:
    """A draft under min_gain over the live one but still rising over its start is not deployed: the
    next cycle is asked at once from it, with the live draft named as the bar; the trainer's figure
    of the live draft (not the chain's base) is the gate's estimate; a deploy ends the chain."""
    engine, transport = FakeEngine(tmp_path, gamma=1), ListTransport()
    coord = Coordinator(config("adaptive"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine, first=0.0))
    (first,) = trains(transport)
    assert (first.base_version, first.live_version) == (0, 0)
    transport.inbox.append((1, ready(1, 1, 1.01, 1.0)))  # +0.01: under min_gain 0.02, over min_rise 0.005
    coord.between_steps(engine, 1.0)
    assert coord.events[-2].kind == "chain" and engine.swaps == [] and engine.capture
    second = trains(transport)[1]
    assert (second.base_version, second.live_version) == (1, 0) and second.since_ns == first.since_ns
    assert coord._estimate is not None and coord._estimate.rates()[0] == pytest.approx(0.0)  # v0's own walk
    transport.inbox.append((1, ready(2, 2, 1.03, 1.01, base_version=1, live=(1.0, 0))))  # 1.03 > 1.0 + 0.02
    coord.between_steps(engine, 2.0)
    assert engine.swaps == [2]
    third = trains(transport)[2]
    assert (third.base_version, third.live_version) == (2, 2)
    engine.writer.close()


def test_a_hold_trains_at_once_on_rows_stored_while_the_missed_cycle_trained(tmp_path: Path) -> None:
    """patience 2: a miss HOLDs the live draft, and the trainer does not wait for n_threshold more
    rows: the chunk stored while the cycle trained starts the next cycle with the HOLD."""
    cfg = config("adaptive")
    cfg = dataclasses.replace(cfg, control=dataclasses.replace(
        cfg.control, collect=dataclasses.replace(cfg.control.collect, patience=2)))
    engine, transport = FakeEngine(tmp_path, gamma=1), ListTransport()
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine, first=0.5))
    (first,) = trains(transport)
    engine.serve_chunks(1)  # lands while the cycle trains
    coord.on_window(window(engine, first=0.5))
    transport.inbox.append((1, ready(1, 1, 1.502, 1.5)))  # no gain, no rise: a miss
    coord.between_steps(engine, 1.0)
    assert [e.kind for e in coord.events[-2:]] == ["hold", "train"]
    second = trains(transport)[1]
    assert second.since_ns == first.since_ns and engine.capture
    engine.writer.close()


def test_after_a_plateau_speculation_off_resumes_the_regime_with_all_its_rows(tmp_path: Path) -> None:
    """Speculation off shows no shift: collection restarted because the live draft does not pay goes on
    with the last regime. The next cycle waits for `n_threshold` new rows and trains on all of them
    and the regime's earlier rows (same since_ns), as the trainer reads them."""
    engine, transport = FakeEngine(tmp_path, gamma=1), ListTransport()
    coord = Coordinator(config("adaptive"), engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    engine.serve_chunks(3)
    coord.on_window(window(engine, first=0.0))
    (first,) = trains(transport)
    transport.inbox.append((1, ready(1, 1, 1.002, 1.0)))  # no gain: a plateau ends the regime
    coord.between_steps(engine, 1.0)
    assert coord.events[-1].kind == "reject" and not engine.capture
    coord.on_window(window(engine, first=0.0, steps=300))  # the live draft accepts nothing: off
    assert engine.lengths == [0] * 5 and engine.capture and "the regime goes on" in coord.events[-1].reason
    engine.serve_chunks(2)
    coord.on_window(window(engine, first=0.0))
    assert len(trains(transport)) == 1  # 200 new rows < n_threshold 250
    engine.serve_chunks(1)
    coord.on_window(window(engine, first=0.0))
    second = trains(transport)[1]
    assert second.since_ns == first.since_ns and "300/250 tokens" in second.reason
    assert sum(len(r) for r in ChunkReader(tmp_path, META).load(since_ns=second.since_ns)) == 600
    engine.writer.close()


def test_the_gate_sets_the_draft_lengths_from_the_live_rates(tmp_path: Path) -> None:
    """K 3 from the start, a base draft serving and learning the live workload from the start (no
    draft has seen it); one that accepts nothing is turned off at every batch size, and the engine
    is told."""
    engine, transport = FakeEngine(tmp_path), ListTransport()
    cfg = config("adaptive")
    cfg = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, init="some-base-draft"))
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    assert engine.lengths == [0, 3, 3, 3, 3] and engine.capture
    assert coord.events[-1].kind == "collect" and "learn the live workload" in coord.events[-1].reason
    coord.on_window(window(engine, first=0.0, steps=300))
    assert engine.lengths == [0, 0, 0, 0, 0] and coord.events[-1].kind == "spec-off"
    engine.writer.close()


def test_the_engine_probes_rarer_while_the_draft_lengths_stand(tmp_path: Path) -> None:
    engine, transport = FakeEngine(tmp_path), ListTransport()
    cfg = config("adaptive")
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    every = cfg.control.speculation.probe_every
    assert engine.probe_every == every
    for _ in range(4):
        coord.on_window(window(engine, first=0.9, steps=every))  # a draft that pays: the lengths stand
    assert engine.lengths == [0, 3, 3, 3, 3] and engine.probe_every == 4 * every
    engine.writer.close()


def test_a_draft_turned_off_by_live_steps_stays_off_whatever_its_held_out_walk_said(tmp_path: Path) -> None:
    """After a shift the live steps turn the draft off; its held-out walk, from before the shift, must
    not turn it on again a window later (the oscillation of a replay's translation phase)."""
    engine, transport = FakeEngine(tmp_path), ListTransport()
    cfg = config("adaptive")
    cfg = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, init="some-base-draft"))
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    coord.held_out[0] = PositionRates(3, [300] * 3, [270, 240, 210])  # what v0's training cycle measured
    coord._estimate = coord.held_out[0]
    coord.on_window(window(engine, first=0.0, steps=300))
    assert engine.lengths == [0] * 5 and coord.events[-1].kind == "spec-off"
    plain = Window(0.0, 1.0, 100, 100, 1.0, [100, 0, 0, 0], 0, False, engine.writer.stats()["tokens"],
                   {"tried": [0] * 3, "accepted": [0] * 3})
    for _ in range(3):
        coord.on_window(plain)  # off: plain steps, nothing drafted
    assert engine.lengths == [0] * 5 and "spec-on" not in [e.kind for e in coord.events]
    engine.writer.close()


def test_a_live_off_that_shows_a_shift_makes_the_cycle_in_flight_no_evidence(tmp_path: Path) -> None:
    """Live steps turn speculation off far below the collection gate's long EMA: a shift, seen while a
    cycle trains. That cycle's walks are on the old workload's rows: its live draft's walk must not
    turn speculation on again (a replay's translation phase did, twice), and the next regime's cycles
    read only chunks named after it started."""
    from tide.serve.engine import RequestResult

    engine, transport = FakeEngine(tmp_path, gamma=1), ListTransport()
    cfg = config("adaptive")
    cfg = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, init="some-base-draft"))
    coord = Coordinator(cfg, engine, transport, trainer_ranks=[1], drafts_root=str(tmp_path))
    coord.start()
    for i in range(cfg.control.collect.n_init):  # the EMAs' baseline: requests at first-draft acceptance 0.4
        coord.on_result(RequestResult(f"q{i}", "w", 8, [1] * 10, 0.0, 1.0, [6, 4], 0, True))
    engine.serve_chunks(3)
    coord.on_window(window(engine, first=0.4))
    (first,) = trains(transport)
    coord.on_window(window(engine, first=0.0, steps=300))  # the workload shifts: the draft accepts nothing
    assert engine.lengths == [0] * 5 and coord.collect.shifted
    transport.inbox.append((1, ready(1, 1, 1.41, 1.40)))  # no gain on the old rows, where v0 walks 0.40
    coord.between_steps(engine, 1.0)
    assert coord.events[-1].kind == "collect" and "during the cycle" in coord.events[-1].reason
    plain = Window(0.0, 1.0, 100, 100, 1.0, [100, 0], 0, False, engine.writer.stats()["tokens"],
                   {"tried": [0], "accepted": [0]})
    for _ in range(3):
        coord.on_window(plain)
    assert engine.lengths == [0] * 5 and "spec-on" not in [e.kind for e in coord.events] and not coord.held_out
    engine.serve_chunks(3)
    coord.on_window(plain)
    second = trains(transport)[1]
    assert second.since_ns > first.since_ns
    assert sum(len(r) for r in ChunkReader(tmp_path, META).load(since_ns=second.since_ns)) == 300
    engine.writer.close()


class Wire:
    """The ends of a loopback between ranks 0 .. n-1: what one end sends to another lands in its inbox;
    what goes to any other rank (the trainer) is kept in `sent`."""

    def __init__(self, n: int = 2) -> None:
        self.ends = {rank: ListTransport() for rank in range(n)}
        for rank, end in self.ends.items():
            end.rank = rank
            end.send = self._sender(rank, end)  # type: ignore[method-assign]

    def _sender(self, src: int, end: ListTransport):  # noqa: ANN202
        def send(dest: int, msg: Message) -> None:
            end.sent.append((dest, msg))
            if dest in self.ends:
                self.ends[dest].inbox.append((src, msg))
        return send


def test_an_instance_done_before_the_coordinator_serves_is_answered_and_leaves_on_that_answer(tmp_path: Path) -> None:
    """An instance with a short share can be done while rank 0 still waits for its trainer: its
    `InstanceDone` is taken there and answered (`RESULTS_RECEIVED`, what the instance waits for before
    it exits), and answered again should it come from an instance already given up."""
    from tide.runtime.messages import RESULTS_RECEIVED, InstanceDone

    wire = Wire(3)
    engine = FakeEngine(tmp_path / "store")
    coord = Coordinator(config("always"), engine, wire.ends[0], trainer_ranks=[2], drafts_root=str(tmp_path),
                        instances=[1])
    wire.ends[1].send(0, InstanceDone(1, 3))
    wire.ends[2].send(0, Heartbeat("trainer", 2, time.time()))
    coord.wait_for_trainer(5.0)
    assert coord.trainer_alive and coord.peers[1].state == "done"
    assert wire.ends[1].inbox == [(0, Shutdown(RESULTS_RECEIVED))]
    coord.peers[1].state = "down"
    wire.ends[1].send(0, InstanceDone(1, 3))
    coord._poll()
    assert wire.ends[1].inbox[-1] == (0, Shutdown(RESULTS_RECEIVED)) and coord.peers[1].state == "down"
    engine.writer.close()


def test_a_second_instance_captures_for_the_collection_deploys_its_draft_and_can_die_alone(tmp_path: Path) -> None:
    """The coordinator (rank 0) and one more serving instance (rank 1) on one store, a trainer on rank 2:
    the instance captures when told, its rows count towards the cycle (and are what the trainer reads
    from the collection's start), the deployed draft is swapped on both, what the instance did is in
    the coordinator's events, and an instance that falls silent is marked down alone."""
    from tide.runtime.instance import Instance
    from tide.runtime.messages import Capture, Deploy, InstanceReport

    wire = Wire()
    engine, other = FakeEngine(tmp_path / "store"), FakeEngine(tmp_path / "store")
    drafts = str(tmp_path / "drafts")
    coord = Coordinator(config("always"), engine, wire.ends[0], trainer_ranks=[2], drafts_root=drafts, instances=[1])
    stopped: list[str] = []
    inst = Instance(config("always"), other, wire.ends[1], leader=0, drafts_root=drafts, on_stop=stopped.append)
    coord.start()
    inst.start()
    assert not other.capture
    inst._poll()
    assert other.capture and isinstance(wire.ends[0].sent[0][1], Capture)
    other.serve_chunks(3)  # the instance's rows only
    inst.on_window(window(other))
    coord._poll()
    coord.on_window(window(engine))
    (train,) = [m for d, m in wire.ends[0].sent if isinstance(m, Train) and d == 2]
    assert "300/250 tokens" in train.reason
    assert sum(len(r) for r in ChunkReader(tmp_path / "store", META).load(since_ns=train.since_ns)) == 300
    wire.ends[0].inbox.append((2, ready(1, 1, 1.5, 1.0)))
    coord._poll()
    assert engine.swaps == [1] and any(isinstance(m, Deploy) and m.version == 1 for _, m in wire.ends[0].sent)
    inst._poll()
    assert other.swaps == [1] and other.paths == [f"{drafts}/v1"] and other.capture  # still collecting
    coord._poll()
    assert [(e.kind, e.version) for e in coord.events if e.data.get("instance") == 1] == [("swap", 1)]
    reports = [m for _, m in wire.ends[1].sent if isinstance(m, InstanceReport)]
    assert reports and reports[0].stored_rows == 300
    coord.peers[1].seen -= 1000  # silent for longer than instance_timeout_s
    coord.on_window(window(engine))
    assert coord.events[-1].kind == "instance-down" and coord.peers[1].state == "down"
    told = len(wire.ends[1].inbox)
    coord.finish("workload done")  # a down instance is not waited for, nor told anything more
    assert len(wire.ends[1].inbox) == told
    engine.writer.close()
    other.writer.close()


def test_a_dedicated_coordinator_trains_on_every_instances_rows_deploys_to_all_and_ends_them_at_until(
        tmp_path: Path) -> None:
    """A coordinator without an engine (rank 0, `slurm.coordinator`), instances on ranks 1 and 2, a
    trainer on rank 3: the cycle's count is both instances' rows (what the trainer reads), the trained
    draft is deployed to both (the coordinator swaps nothing itself), and once the instances' reports
    show `until.trained_requests` served by it, the coordinator ends their workloads."""
    from tide.config import UntilConfig
    from tide.runtime.instance import Instance
    from tide.runtime.messages import Deploy
    from tide.serve.engine import RequestResult

    wire, drafts = Wire(3), str(tmp_path / "drafts")
    cfg = config("always")
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, instance_timeout_s=0.3))
    coord = Coordinator(cfg, None, wire.ends[0], trainer_ranks=[3], drafts_root=drafts, instances=[1, 2], version=0)
    engines = {r: FakeEngine(tmp_path / "store") for r in (1, 2)}
    stopped: dict[int, list[str]] = {1: [], 2: []}
    insts = {r: Instance(cfg, engines[r], wire.ends[r], leader=0, drafts_root=drafts, on_stop=stopped[r].append)
             for r in (1, 2)}
    coord.start()
    for r, inst in insts.items():
        inst.start()
        inst._poll()
        engines[r].serve_chunks(2)
        inst.on_window(window(engines[r]))
    coord._tick()
    (train,) = trains(wire.ends[0])
    assert "400/250 tokens" in train.reason and train.base_version == 0
    assert sum(len(r) for r in ChunkReader(tmp_path / "store", META).load(since_ns=train.since_ns)) == 400
    wire.ends[0].inbox.append((3, ready(1, 1, 1.5, 1.0)))
    coord._tick()
    assert coord.version == 1 and [e.kind for e in coord.events].count("swap") == 0
    assert [d for d, m in wire.ends[0].sent if isinstance(m, Deploy) and m.version == 1] == [1, 2]
    for r, inst in insts.items():
        inst._poll()
        assert engines[r].swaps == [1]
    result = lambda v: RequestResult("q", "w", 4, [7], 0.0, 1.0, [0, 1, 0, 0], v, True)  # noqa: E731
    insts[1].on_result(result(0))  # served by the untrained draft: not counted
    insts[1].on_result(result(1))
    insts[1].on_window(window(engines[1]))
    insts[2].on_result(result(1))
    insts[2].on_window(window(engines[2]))
    assert coord.coordinate(UntilConfig(trained_requests=2, max_s=60.0), []) is True
    assert coord.events[-3].kind == "stop" and "until met over all instances" in coord.events[-3].reason
    assert [e.kind for e in coord.events[-2:]] == ["instance-down"] * 2  # silent after being told (no engines here)
    for r, inst in insts.items():
        inst._poll()
        assert stopped[r] == ["coordinator: workload.until met over all instances"]
    for e in engines.values():
        e.writer.close()
