"""`python -m workflows.soak --config configs/experiments/soak.yaml --out runs/soak`: TIDE for an hour.

A bench, not a test. It starts TIDE as deployed, the OpenAI-compatible server (`python -m tide.launch
--serve`, with its trainer process), and replays the experiment's phases against it round after round
until `--minutes` have passed: every round walks through every domain, so shifts, collection,
training cycles and swaps recur. Every `--sample-s` it records

  * RSS, open file descriptors and threads of the server, its vLLM engine-core process and the
    trainer process (/proc);
  * the store's tokens against `store.retention_tokens`;
  * the server's /metrics: training cycles by outcome, swaps, the last swap pause, tokens generated.

Then it sends SIGTERM, waits for the server's summary.json and events.json, checks the targets (RSS
growth after warm-up <= 5%, no fd or thread growth, the store within retention + one chunk, every
training cycle decided in events.json, the summary written) and writes OUT/soak.json and OUT/soak.png.
Warm-up ends once the store holds its retention; RSS growth compares the peaks of the first and the
last ten minutes after it. The server's own run dir is OUT/server (server.log, trainer.log, store/, drafts/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tide.cli import parser, run
from tide.model.files import write_json

log = logging.getLogger("workflows.soak")
RSS_GROWTH_MAX = 0.05  # after warm-up; and no fd or thread growth at all
PEAK_SPAN_S = 600.0  # growth compares the peak of the first and of the last ten minutes after warm-up
CYCLE_END = ("trained", "train-failed", "trainer-down")  # events.json kinds that answer a `train`


def proc(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open fds and threads of `pid`, or None once it has gone (or is a zombie: no VmRSS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:
        return None
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(fields["Threads"])}


PROCESSES = ("serving", "engine_core", "trainer")
ROLES = {"engine_core": b"VLLM::EngineCore", "trainer": b"tide.runtime"}  # child process -> its cmdline


def children(server: int) -> dict[str, int]:
    """The server's children by role: vLLM's engine core process and the trainer process."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{server}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:  # a thread that just ended
            continue
        for child in kids:
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:  # a short-lived child, gone already
                continue
            found.update({role: int(child) for role, mark in ROLES.items() if mark in cmd})
    return found


def scrape(url: str) -> dict[str, float]:
    """The counters the soak follows from the server's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tide_cycles_total":
                out[f"cycles_{s.labels['outcome']}"] = s.value
            elif s.name in ("tide_swaps_total", "tide_last_swap_pause_seconds", "tide_draft_version"):
                out[s.name.removeprefix("tide_")] = s.value
            elif s.name == "vllm:generation_tokens_total":
                out["generation_tokens"] = out.get("generation_tokens", 0.0) + s.value
    return out


class Sampler(threading.Thread):
    """Samples the server, its trainer, the store and /metrics every `every` seconds."""

    def __init__(self, server: int, metrics_url: str, store: Path, every: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.server, self.metrics_url, self.store, self.every = server, metrics_url, store, every
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        from tide.store import ChunkReader

        pids: dict[str, int] = {}
        while not self.halt.wait(self.every):
            s: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1)}
            try:  # a sample lost is logged; the soak, and the sampling, go on
                pids = pids if len(pids) == len(ROLES) else children(self.server)
                s.update(serving=proc(self.server), **{role: proc(pid) for role, pid in pids.items()})
                s["store_tokens"] = ChunkReader(self.store).total_tokens() if self.store.is_dir() else 0
                s.update(scrape(self.metrics_url))
            except Exception as e:
                log.warning("soak: sample at %.0f s incomplete: %s", s["t"], e)
            self.samples.append(s)


def warmup_end(samples: list[dict[str, Any]], warmup_s: float, retention: int, chunk: int) -> float:
    """When growth starts to count: after `warmup_s` and once the store first holds its retention (less
    one chunk). Until then the trainer's working set grows by design: a cycle reads every stored row."""
    full = next((s["t"] for s in samples if s.get("store_tokens", 0) >= retention - chunk), samples[-1]["t"])
    return max(warmup_s, full)


def growth(samples: list[dict[str, Any]], role: str, key: str, after_s: float) -> dict[str, float]:
    """`key` of `role` after warm-up: its peak in the first and in the last PEAK_SPAN_S (a training
    cycle's peak against a cycle's peak, not whichever moment a sample fell on), its highest, and the
    growth from the first peak to the last."""
    got = [(s["t"], s[role][key]) for s in samples if s["t"] >= after_s and s.get(role)]
    if not got:
        return {}
    span = min(PEAK_SPAN_S, (got[-1][0] - got[0][0]) / 3)
    first = max(x for t, x in got if t <= got[0][0] + span)
    last = max(x for t, x in got if t >= got[-1][0] - span)
    return {"after_warmup": first, "max": max(x for _, x in got), "end": last,
            "growth": (last - first) / first if key == "rss_mib" else last - first}


def judge(samples: list[dict[str, Any]], events: list[dict[str, Any]], summary: bool, warmup_s: float,
          bound: int) -> dict[str, Any]:
    """The soak's targets from its samples (growth counted from `warmup_s`) and the server's events."""
    res: dict[str, Any] = {}
    for role in PROCESSES:
        for key in ("rss_mib", "fds", "threads"):
            res[f"{role}_{key}"] = growth(samples, role, key, warmup_s)
    store_max = max((s.get("store_tokens", 0) for s in samples), default=0)
    trains = sum(e["kind"] == "train" for e in events)
    decided = sum(e["kind"] in CYCLE_END for e in events)
    checks = {
        "rss_growth": all(res[f"{r}_rss_mib"].get("growth", 0) <= RSS_GROWTH_MAX for r in PROCESSES),
        "no_fd_growth": all(res[f"{r}_fds"].get("growth", 0) <= 0 for r in PROCESSES),
        "no_thread_growth": all(res[f"{r}_threads"].get("growth", 0) <= 0 for r in PROCESSES),
        "store_within_retention": store_max <= bound,
        "every_cycle_decided": decided >= trains - 1,  # the last one may be cut short by the stop
        "summary_written": summary,
    }
    return {**res, "warmup_s": warmup_s, "store_tokens_max": store_max, "store_bound": bound,
            "cycles_started": trains, "cycles_decided": decided, "checks": checks, "passed": all(checks.values())}


def plot(samples: list[dict[str, Any]], events: list[dict[str, Any]], path: Path, warmup_s: float,
         bound: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, ax = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    for role, style in zip(PROCESSES, ("-", ":", "--")):
        got = {k: [s[role][k] if s.get(role) else None for s in samples] for k in ("rss_mib", "fds", "threads")}
        ax[0, 0].plot(t, got["rss_mib"], style, label=f"{role} RSS (MiB)")
        ax[0, 1].plot(t, got["fds"], style, label=f"{role} fds")
        ax[0, 1].plot(t, got["threads"], style, label=f"{role} threads")
    ax[1, 0].plot(t, [s.get("store_tokens", 0) / 1e3 for s in samples], label="store (k tokens)")
    ax[1, 0].axhline(bound / 1e3, color="r", lw=0.8, label="retention + one chunk")
    rate = [0.0] + [max(0.0, (b.get("generation_tokens", 0) - a.get("generation_tokens", 0)) / (b["t"] - a["t"]))
                    for a, b in zip(samples, samples[1:])]
    ax[1, 1].plot(t, rate, label="tokens/s (server)")
    for e in events:  # the server's clock starts when it is ready, within a sample of the soak's
        if e["kind"] in ("deploy", "rollback"):
            ax[1, 1].axvline(e["t"] / 60, color="g" if e["kind"] == "deploy" else "r", lw=0.6)
    for a in ax.flat:
        a.axvline(warmup_s / 60, color="grey", ls=":", lw=0.8)
        a.legend(fontsize=7)
    for a in ax[1]:
        a.set_xlabel("minutes")
    fig.suptitle("TIDE soak: server and trainer processes, store, throughput (green: deploys)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc_: subprocess.Popen[bytes], url: str, endpoint: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_.poll() is not None:
            raise RuntimeError(f"the server exited with {proc_.returncode} before it was ready")
        if endpoint.exists():
            try:
                urllib.request.urlopen(url, timeout=5)
                return
            except OSError:
                pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def soak(args: argparse.Namespace) -> int:
    from workflows.replay.client import run_endpoint
    from workflows.replay.runner import load_experiment, write_mode_config

    cfg, spec, _ = load_experiment(args.config)
    from tide.store.layout import RunLayout
    from tide.workload import build_workload, phase_segments

    out: Path = args.out
    cfg = write_mode_config(cfg, "tide", out)
    server_dir = out / "server"
    layout = RunLayout.open(cfg, server_dir)
    requests = build_workload(spec, layout.target.path, cfg.serve.max_model_len - spec.max_tokens - 8)
    phases = [s.requests for s in phase_segments(spec, requests)]
    config = out / "config.yaml"
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    with open(out / "server.log", "ab") as server_log:
        server = subprocess.Popen([sys.executable, "-m", "tide.launch", "--config", str(config), "--out",
                                   str(server_dir), "--serve", "--port", str(port)],
                                  stdout=server_log, stderr=subprocess.STDOUT)
    log.info("soak: server %d on %s (log %s)", server.pid, base, out / "server.log")
    sampler = Sampler(server.pid, f"{base}/metrics", layout.store, args.sample_s)
    try:
        wait_ready(server, f"{base}/health", server_dir / "endpoint.json", args.start_timeout)
        sampler.start()
        t_end, k = time.monotonic() + args.minutes * 60, 0
        while time.monotonic() < t_end:
            for i, reqs in enumerate(phases):
                if time.monotonic() >= t_end:
                    break
                rnd = [dataclasses.replace(r, request_id=f"{r.request_id}~{k}", arrival=None) for r in reqs]
                run_endpoint(rnd, f"r{k}-{spec.phases[i].name}", f"{base}/v1", out / "client" / f"{k:02d}-{i}",
                             spec.arrivals.concurrency or 1, cfg.runtime.window_s)
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with {server.returncode} during the soak")
            k += 1
    finally:
        sampler.halt.set()
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=300)
            except subprocess.TimeoutExpired:
                server.kill()
    sampler.join()
    events_file, summary_file = server_dir / "events.json", server_dir / "summary.json"
    events = json.loads(events_file.read_text()) if events_file.exists() else []
    if not sampler.samples:
        raise RuntimeError("the soak took no sample")
    bound = cfg.store.retention_tokens + cfg.store.chunk_tokens
    warm = warmup_end(sampler.samples, args.warmup_minutes * 60, cfg.store.retention_tokens, cfg.store.chunk_tokens)
    result = {"command": " ".join(["python -m workflows.soak", *sys.argv[1:]]), "minutes": args.minutes,
              "rounds": k, "server_exit_code": server.returncode,
              **judge(sampler.samples, events, summary_file.exists(), warm, bound), "samples": sampler.samples}
    write_json(out / "soak.json", result)
    plot(sampler.samples, events, out / "soak.png", warm, bound)
    print(json.dumps({k: result[k] for k in ("rounds", "cycles_started", "cycles_decided", "store_tokens_max",
                                             "checks", "passed")}, indent=1))
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m workflows.soak", __doc__)
    p.add_argument("--config", type=Path, default=Path("configs/experiments/soak.yaml"), help="experiment file")
    p.add_argument("--out", type=Path, default=Path("runs/soak"), help="results directory")
    p.add_argument("--minutes", type=float, default=60.0, help="how long to replay (default 60)")
    p.add_argument("--warmup-minutes", type=float, default=10.0,
                   help="growth counts from this or from when the store first holds its retention, "
                        "whichever is later (default 10)")
    p.add_argument("--sample-s", type=float, default=10.0, help="sampling period (default 10 s)")
    p.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the server to come up")
    return run(p, soak, argv)


if __name__ == "__main__":
    sys.exit(main())
