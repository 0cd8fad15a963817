"""A serving instance beside the coordinator's (ranks 1.. of component 0): one more vLLM engine.

What depends on the instance's own engine stays here: the latency model, the speculation gate (its
batch sizes differ), the rollback of a deployed draft on its own live acceptance, the hot-swap
between its own steps. What the job decides once is the coordinator's (`tide.runtime.coordinator`):
when to capture, when to train, which draft to deploy. The instance follows it (`Capture`, `Deploy`,
`Shutdown`) and informs it: once a window the first-draft acceptance of the requests it finished
and the rows it stored (`InstanceReport`), each decision it took (`InstanceEvent`), and at the end
that its results are written (`InstanceDone`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tide.config import TideConfig
from tide.draft.acceptance import AcceptanceHistogram, PositionRates
from tide.runtime.coordinator import Coordinator
from tide.runtime.messages import Capture, Deploy, Heartbeat, InstanceEvent, InstanceReport, Shutdown
from tide.runtime.transport import Transport
from tide.serve.engine import EngineControl, RequestResult, Window

FORWARDED = frozenset({"swap", "swap-failed", "rollback", "confirm", "spec-on", "spec-off", "stop"})


class Instance(Coordinator):
    def __init__(self, cfg: TideConfig, engine: EngineControl, transport: Transport, leader: int,
                 drafts_root: str, on_stop: Callable[[str], None]) -> None:
        super().__init__(cfg, engine, transport, [], drafts_root=drafts_root)
        self.leader, self.on_stop = leader, on_stop
        self._capture = False  # as the coordinator said
        self._finished: list[float] = []  # first-draft acceptance of requests finished since the last report
        self._served: list[int] = []  # their draft versions (-1: not speculated)

    def record(self, kind: str, reason: str, version: int | None = None, **data: Any) -> None:
        super().record(kind, reason, version, **data)
        if kind in FORWARDED:
            self.transport.send(self.leader, InstanceEvent(self.transport.rank, kind, reason,  # type: ignore[union-attr]
                                                           -1 if version is None else version))

    def on_result(self, r: RequestResult) -> None:
        if r.speculate and sum(r.accept_counts) > 0:
            self._finished.append(r.first_acceptance)
        self._served.append(r.draft_version if r.speculate else -1)

    def on_window(self, w: Window) -> None:
        super().on_window(w)
        rows = self.engine.stored_since(self._since_ns) if self._capture else 0
        self.transport.send(self.leader, InstanceReport(self.transport.rank, self._finished, rows,  # type: ignore[union-attr]
                                                        self._since_ns, self._served))
        self._finished, self._served = [], []

    def _poll(self) -> None:
        if time.time() - self._beat_sent >= self.cfg.runtime.heartbeat_s:
            self._beat_sent = time.time()
            self.transport.send(self.leader, Heartbeat("instance", self.transport.rank, self._beat_sent))  # type: ignore[union-attr]
        for src, msg in self.transport.poll():  # type: ignore[union-attr]
            if src != self.leader:
                continue
            if isinstance(msg, Capture):
                self._capture, self._since_ns = msg.on, msg.since_ns
                self.engine.set_capture(msg.on)
            elif isinstance(msg, Deploy):
                if msg.eval_counts:
                    self.held_out[msg.version] = PositionRates.from_histogram(
                        AcceptanceHistogram(len(msg.eval_counts) - 1, list(msg.eval_counts)))
                self._deploy(msg.version, msg.reason)
            elif isinstance(msg, Shutdown):
                self.on_stop(f"coordinator: {msg.reason}")

    def _sync_capture(self) -> None:
        self.engine.set_capture(self._capture)

    def shutdown(self, reason: str) -> None:
        """Nothing to tell: the coordinator hears `InstanceDone` once the results are written."""
