"""`python -m tide.launch --serve`: vLLM's OpenAI server with TIDE's loop behind it, on 127.0.0.1,
driven by the `openai` client: greedy output equal to the target's own (across a hot-swap made by
the loop while streams are open), TIDE's series on /metrics, a malformed request, and SIGTERM in
the middle of a stream. The tiny target, on the embedded CI config."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import greedy, random_prompts

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.vllm
MAX_TOKENS = 48
KEY = "tide-test-key"  # the server runs with vLLM's --api-key: every /v1 call needs it


def metric(url: str, name: str) -> float:
    """A `tide_*` or `vllm:*` sample from /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def wait_healthy(proc: subprocess.Popen, bases: list[str], timeout_s: float = 300) -> None:
    """Until every server in `bases` answers /health, `proc` exits, or `timeout_s` passes."""
    deadline = time.time() + timeout_s
    for base in bases:
        while time.time() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_target):
    work = tmp_path_factory.mktemp("server")
    config = ROOT / "configs" / "ci.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, log = work / "run", open(work / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tide.launch", "--config", str(config), "--out", str(out),
                             "--serve", "--port", str(port), "--grace", "30", f"--vllm-arg=--api-key={KEY}"],
                            cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, [base])
    assert proc.poll() is None, (work / "server.log").read_text()[-4000:]
    yield proc, base, out
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    log.close()


def test_without_the_api_key_the_v1_routes_refuse(server) -> None:
    """Security: the one port TIDE opens takes vLLM's --api-key; /health and /metrics stay open."""
    import openai

    _, base, _ = server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=f"{base}/v1", api_key=KEY).models.list().data
    assert urllib.request.urlopen(f"{base}/health", timeout=5).status == 200


def test_greedy_output_is_the_targets_across_a_hot_swap_with_streams_open(server, tiny_target) -> None:
    import openai

    proc, base, out = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY)
    model = client.models.list().data[0].id
    prompts = random_prompts(24, tiny_target.config["vocab_size"], seed=3)
    ref = greedy(tiny_target.path, prompts, MAX_TOKENS)
    got: list[tuple[int, list[int]]] = []
    open_across_swap = []
    stop = threading.Event()

    def client_loop(worker: int) -> None:
        i = worker
        while not stop.is_set():
            p = i % len(prompts)
            if i % 2:  # streaming
                before = metric(base, "tide_swaps_total")
                ids: list[int] = []
                for chunk in client.completions.create(model=model, prompt=prompts[p], max_tokens=MAX_TOKENS,
                                                       temperature=0, stream=True,
                                                       extra_body={"return_token_ids": True}):
                    ids += (getattr(chunk.choices[0], "token_ids", None) or []) if chunk.choices else []
                if metric(base, "tide_swaps_total") > before:
                    open_across_swap.append(p)
            else:
                r = client.completions.create(model=model, prompt=prompts[p], max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
                ids = list(r.choices[0].token_ids)
            got.append((p, ids))
            i += 4

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.time() + 400  # the loop: speculation off, collect, train, deploy
    while time.time() < deadline and not open_across_swap and proc.poll() is None:
        time.sleep(2)
    stop.set()
    for t in threads:
        t.join()
    assert got and all(ids == ref[p] for p, ids in got), [p for p, ids in got if ids != ref[p]][:5]
    assert open_across_swap, "no hot-swap happened while a stream was open"
    assert metric(base, 'tide_speculation_switches_total{to="off"}') >= 1  # the untrained draft did not pay
    assert metric(base, 'tide_cycles_total{outcome="deployed"}') >= 1 and metric(base, "tide_draft_version") >= 1
    chat = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello there"}],
                                           max_tokens=16, temperature=0, stream=s) for s in (False, True)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat[1] if c.choices)
    assert chat[0].choices[0].message.content == streamed and streamed
    assert json.loads((out / "endpoint.json").read_text())["url"] == f"{base}/v1"


def test_the_replay_as_a_client_records_the_server_as_a_mode(server, tmp_path: Path) -> None:
    """`workflows.replay --endpoint NAME=URL`: the experiment's requests through HTTP, recorded as a
    mode with the server's per-request acceptance and the client's latencies."""
    _, base, _ = server
    exp = tmp_path / "exp.yaml"
    exp.write_text((ROOT / "configs" / "experiments" / "ci-shift.yaml").read_text().replace("num_prompts: 32",
                                                                                             "num_prompts: 6"))
    p = subprocess.run([sys.executable, "-m", "workflows.replay", "--config", str(exp), "--out", str(tmp_path / "o"),
                        "--endpoint", f"tide-server={base}/v1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "VLLM_API_KEY": KEY})
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "o" / "summary.json").read_text())["modes"]["tide-server"]
    assert s["overall"]["requests"] == 12 and s["overall"]["tokens"] > 0
    assert s["latency"]["errors"] == 0 and s["latency"]["ttft_p50_s"] > 0 and s["latency"]["itl_mean_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "o" / "tide-server" / "requests.jsonl").read_text().splitlines()]
    assert {r["workload"] for r in rows} == {"code", "translation"}
    assert all(len(r["accept_counts"]) == 4 for r in rows)  # the server's histograms (K = 3), one per request


def test_a_malformed_request_gets_a_4xx_and_serving_goes_on(server) -> None:
    _, base, _ = server
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    bad = urllib.request.Request(f"{base}/v1/completions", data=b'{"prompt": "x", "max_tokens": -3}',
                                 headers=headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert 400 <= e.value.code < 500 and e.value.code != 401
    good = urllib.request.Request(f"{base}/v1/completions", headers=headers,
                                  data=json.dumps({"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}).encode())
    assert json.loads(urllib.request.urlopen(good, timeout=60).read())["choices"][0]["text"]


def test_sigterm_during_a_stream_ends_it_cleanly_and_keeps_every_row(server, tiny_target) -> None:
    import openai

    from tide.store import ChunkReader

    proc, base, out = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    stream = client.completions.create(model=client.models.list().data[0].id, prompt=[5, 6, 7, 8, 9] * 4,
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"vllm_xargs": {"tide_workload": "sigterm"}})
    pieces = [next(iter(stream))]
    proc.send_signal(signal.SIGTERM)
    try:
        pieces += list(stream)
        ended = "finished"
    except (openai.APIError, openai.APIConnectionError):
        ended = "error"
    assert proc.wait(timeout=120) == 0
    assert ended in ("finished", "error") and pieces
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] >= 1 and summary["stopped"] == "SIGTERM" and (out / "events.json").exists()
    runs = ChunkReader(out / "store", tiny_target.chunk_meta()).load()  # every chunk verifies
    if ended == "finished":
        mine = [r for r in runs if r.workload == "sigterm"]
        assert mine and sum(int(r.is_output.sum()) for r in mine) >= 399 - 1


def test_every_serving_rank_of_a_job_serves_an_endpoint_of_its_own(tmp_path: Path, tiny_target) -> None:
    """Component 0 of two ranks under mpirun (no trainer): rank 0 serves with the coordinator on PORT,
    rank 1 as an instance on PORT + 1 (its node-local id). Both answer with the target's greedy
    output; SIGTERM to both ranks (as Slurm sends it) stops them, each writes its results, and rank 0's
    summary lists both instances."""
    import openai

    config = ROOT / "configs" / "ci.yaml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "SLURM_NTASKS_HET_GROUP_0",
           sys.executable, "-m", "tide.runtime", "--config", str(config), "--out", str(out), "--serve",
           "--host", "127.0.0.1", "--port", str(port), "--grace", "5"]
    with open(tmp_path / "mpirun.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "SLURM_NTASKS_HET_GROUP_0": "2"})
    try:
        bases = [f"http://127.0.0.1:{port + rank}" for rank in (0, 1)]
        wait_healthy(proc, bases)
        assert proc.poll() is None, (tmp_path / "mpirun.log").read_text()[-4000:]
        prompts = random_prompts(3, tiny_target.config["vocab_size"], seed=5)
        ref = greedy(tiny_target.path, prompts, MAX_TOKENS)
        for base in bases:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
            model = client.models.list().data[0].id
            for p, want in zip(prompts, ref):
                r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"return_token_ids": True})
                assert list(r.choices[0].token_ids) == want
        ranks = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _is_rank_of(pid, out)]
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, (tmp_path / "mpirun.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    assert [(i["rank"], i["state"]) for i in summary["instances"]] == [(0, "coordinator"), (1, "done")]
    assert json.loads((out / "instances" / "1" / "endpoint.json").read_text())["port"] == port + 1
    # (a request that finished in the engine's last step before the stop may go uncounted: its runner
    # state is gone when the server closes what is still open)
    served = len((out / "instances" / "1" / "requests.jsonl").read_text().splitlines())
    assert 0 < served <= 3 and summary["instances"][1]["requests"] == served


def _is_rank_of(pid: int, out: Path) -> bool:
    """Whether `pid` is a `python -m tide.runtime ... --out OUT` process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:3] == [b"-m", b"tide.runtime"] and str(out).encode() in argv
