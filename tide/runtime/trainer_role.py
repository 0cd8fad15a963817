"""The trainer role: wait for `Train`, run one DeepSpeed cycle, answer `DraftReady` (or `TrainFailed`).

Every trainer rank receives the same `Train` and runs the cycle together (one DeepSpeed group);
the group's rank 0 answers. A failing cycle is reported, never fatal: the coordinator keeps serving
with the last good draft. Heartbeats, from a thread of their own, tell the coordinator the trainer
process is alive, also through a cycle's set-up (reading the window, building the DeepSpeed
engine), which sends nothing else for longer than the coordinator waits. The coordinator beats
too: a trainer that hears nothing for `trainer_timeout_s` after the first word exits (under
mpirun, a dead serving rank would otherwise leave it waiting for ever).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from tide.config import TideConfig
from tide.runtime.messages import DraftReady, Heartbeat, Shutdown, Train, TrainFailed, TrainProgress
from tide.runtime.transport import Transport
from tide.store.layout import RunLayout

log = logging.getLogger(__name__)
PROGRESS_S = 1.0  # at most one TrainProgress a second while training steps run


def run_trainer(cfg: TideConfig, run: RunLayout, transport: Transport, coordinator: int = 0) -> None:
    from tide.train import DraftTrainer

    trainer = DraftTrainer.from_config(cfg, run)
    leader = trainer.rank == 0
    log.info("trainer rank %d/%d ready (MPI rank %d)", trainer.rank, trainer.world, transport.rank)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(transport, coordinator, cfg.runtime.heartbeat_s, stop),
                            name="tide-heartbeat", daemon=True)
    if leader:
        beat.start()
    if threading.current_thread() is threading.main_thread():  # a job's TERM (submitit's USR2, a Ctrl-C to the
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):  # local process group) reaches every rank
            signal.signal(sig, lambda signum, _: log.warning(
                "trainer: %s: going on until the coordinator says Shutdown (or falls silent)",
                signal.Signals(signum).name))
    heard = 0.0  # when the coordinator last sent anything (it beats every heartbeat_s while it serves)
    try:
        while not getattr(transport, "closed", False):
            for _, msg in transport.poll():
                heard = time.monotonic()
                if isinstance(msg, Shutdown):
                    log.info("trainer: shutdown (%s)", msg.reason)
                    return
                if isinstance(msg, Train):
                    _cycle(trainer, msg, transport, coordinator, leader)
                    heard = time.monotonic()  # its beats queued up meanwhile
            if heard and time.monotonic() - heard > cfg.runtime.trainer_timeout_s:
                log.error("trainer: nothing from the coordinator for %.0f s: it is gone; exiting",
                          cfg.runtime.trainer_timeout_s)
                raise SystemExit(1)
            time.sleep(0.2)
    finally:
        stop.set()
        if beat.is_alive():
            beat.join()
        trainer.shutdown()


def _heartbeat(transport: Transport, coordinator: int, period_s: float, stop: threading.Event) -> None:
    while True:
        transport.send(coordinator, Heartbeat("trainer", transport.rank, time.time()))
        if stop.wait(period_s):
            return


def _cycle(trainer, msg: Train, transport: Transport, coordinator: int, leader: bool) -> None:
    log.info("trainer: cycle %d (%s)", msg.cycle, msg.reason)
    last = {"phase": "", "t": 0.0}

    def progress(p: dict) -> None:
        """Every phase change, the last step, and a training step at most every PROGRESS_S."""
        now = time.monotonic()
        if p["phase"] != last["phase"] or p["step"] == p["steps"] or now - last["t"] >= PROGRESS_S:
            last.update(phase=p["phase"], t=now)
            transport.send(coordinator, TrainProgress(msg.cycle, p["phase"], p["step"], p["steps"], p["loss"],
                                                      p["tokens_per_s"]))

    try:
        r = trainer.cycle(msg.window_tokens or None, msg.since_ns, msg.base_version if msg.base_version >= 0 else None,
                          on_progress=progress if leader else None,
                          live=msg.live_version if msg.live_version >= 0 else None)
    except Exception as e:  # a failed cycle degrades the loop (no new draft), it never stops serving
        log.exception("trainer: cycle %d failed", msg.cycle)
        if leader:
            transport.send(coordinator, TrainFailed(msg.cycle, f"{type(e).__name__}: {e}"[:300]))
        return
    if not leader:
        return
    if r is None:
        transport.send(coordinator, TrainFailed(msg.cycle, "not enough stored data"))
        return
    transport.send(coordinator, DraftReady(msg.cycle, r.version, str(trainer.registry.path(r.version)),
                                           r.al_after, r.al_before, r.base_version, r.al_live, r.live_version,
                                           r.train_tokens, r.wall_s, r.counts_after, r.counts_before, r.counts_live))
