"""TIDE's Prometheus series, served on vLLM's own /metrics (the process's default registry).

Updated by the coordinator's thread once a window from what it already knows (the window, its
events); a scrape never calls into the engine.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tide.serve.engine import Window

# events.json kind -> the outcome label of tide_cycles_total
CYCLE_EVENTS = {"train": "started", "deploy": "deployed", "chain": "chained", "hold": "held",
                "reject": "rejected", "rollback": "rolled_back", "train-failed": "failed"}


class TideMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.version = Gauge("tide_draft_version", "Version of the draft serving (0: the initial one)", **kw)
        self.speculating = Gauge("tide_speculation_on", "1 when the last window drafted at its batch size", **kw)
        self.acceptance = Gauge("tide_acceptance_length", "Live acceptance length over the last window "
                                "(tokens per drafting step)", **kw)
        self.draft_length = Gauge("tide_draft_length", "Draft tokens per step chosen at the last window's batch size",
                                  **kw)
        self.stored = Gauge("tide_stored_rows", "Hidden-state rows written to the chunk store by this server", **kw)
        self.cycles = Counter("tide_cycles", "Training cycles by outcome", ["outcome"], **kw)
        self.swaps = Counter("tide_swaps", "Draft hot-swaps", **kw)
        self.swap_pause = Gauge("tide_last_swap_pause_seconds", "Pause of the last hot-swap", **kw)
        self.switches = Counter("tide_speculation_switches", "Speculation turned on or off", ["to"], **kw)
        self._seen = 0  # events already counted

    def update(self, w: Window, events: list[Any]) -> None:
        self.version.set(w.draft_version)
        b = max(1, min(round(w.mean_batch), len(w.lengths) - 1)) if w.lengths else 0
        k = w.lengths[b] if w.lengths else 0
        self.speculating.set(1 if w.speculate and k else 0)
        self.draft_length.set(k)
        if w.speculate and sum(w.accept_counts):
            self.acceptance.set(w.acceptance_length)
        self.stored.set(w.stored_tokens)
        for e in events[self._seen:]:
            if e.kind in CYCLE_EVENTS:
                self.cycles.labels(CYCLE_EVENTS[e.kind]).inc()
            elif e.kind == "swap":
                self.swaps.inc()
                self.swap_pause.set(e.data.get("pause_ms", 0.0) / 1e3)
            elif e.kind in ("spec-on", "spec-off"):
                self.switches.labels(e.kind.removeprefix("spec-")).inc()
        self._seen = len(events)
