"""The replay as a client of any OpenAI-compatible server (`--endpoint NAME=URL`).

An experiment's requests, with their arrivals (or its closed loop), go to the server as streaming
/v1/completions with the prompt as token ids and greedy sampling, so every server gets exactly the
same prompts. The run is recorded as a mode of the replay (requests.jsonl, windows.jsonl, mode.json
in OUT/NAME), so the report compares servers with each other and with the in-process modes, plus
what only a client sees: time to first token and inter-token latency (latency.json). Where the
server returns vLLM's per-request speculative metrics (`--per-request-spec-decode-metrics`), each
request carries its acceptance histogram.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tide.model.files import write_json, write_jsonl
from tide.serve.engine import Request, RequestResult, Window

log = logging.getLogger(__name__)


@dataclass
class _Sent:
    req: Request
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per streamed chunk
    ids: list[int] = field(default_factory=list)
    spec: dict[str, Any] | None = None
    finish: float = 0.0
    error: str = ""


async def _send(client: Any, model: str, s: _Sent, clock: Any) -> None:
    try:
        stream = await client.completions.create(
            model=model, prompt=s.req.prompt_ids, max_tokens=s.req.max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "vllm_xargs": {"tide_workload": s.req.workload}})
        async for chunk in stream:
            t = clock()
            if chunk.choices:
                ids = getattr(chunk.choices[0], "token_ids", None) or []
                s.ids += ids
                s.chunks.append((t, len(ids) or (1 if chunk.choices[0].text else 0)))
            metrics = getattr(chunk, "metrics", None) or {}
            s.spec = metrics.get("speculative_decoding") or s.spec
    except Exception as e:  # a refused or broken request is a result too
        s.error = f"{type(e).__name__}: {e}"[:300]
    s.finish = clock()


async def _replay(url: str, model: str, requests: list[Request], concurrency: int, api_key: str) -> list[_Sent]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=3600)
    model = model or (await client.models.list()).data[0].id
    t0 = time.perf_counter()
    clock = lambda: time.perf_counter() - t0  # noqa: E731
    slots = asyncio.Semaphore(max(concurrency, 1))
    sent: list[_Sent] = []

    async def one(req: Request) -> None:
        if req.arrival is not None:
            await asyncio.sleep(max(0.0, req.arrival - clock()))
            s = _Sent(req, clock())
            sent.append(s)
            await _send(client, model, s, clock)
            return
        async with slots:
            s = _Sent(req, clock())
            sent.append(s)
            await _send(client, model, s, clock)

    await asyncio.gather(*(one(r) for r in requests))
    await client.close()
    return sent


def run_endpoint(requests: list[Request], name: str, url: str, out: Path, concurrency: int, window_s: float,
                 model: str = "", api_key: str = "") -> None:
    """Send `requests` to `url` (an OpenAI base URL, .../v1) and write the mode `name` into `out`."""
    log.info("replay: %d requests to %s as mode %s", len(requests), url, name)
    for noisy in ("httpx", "httpx2"):  # a line per request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    sent = asyncio.run(_replay(url, model, requests, concurrency, api_key))
    gamma = max((len(s.spec["acceptance_histogram"]) - 1 for s in sent if s.spec), default=1)
    results = [RequestResult(s.req.request_id, s.req.workload, len(s.req.prompt_ids),
                             s.ids or [0] * sum(n for _, n in s.chunks), s.sent, s.finish,
                             list(s.spec["acceptance_histogram"]) if s.spec else [0] * (gamma + 1), -1,
                             bool(s.spec and s.spec.get("num_spec_steps"))) for s in sent if not s.error]
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "requests.jsonl", (r.to_json() for r in results))
    write_jsonl(out / "windows.jsonl", (w.to_json() for w in _windows(sent, results, window_s, gamma)))
    write_json(out / "events.json", [])
    write_json(out / "latency.json", latency(sent))
    write_json(out / "mode.json", {"mode": name, "endpoint": url, "workload": [], "learns": False})
    errors = [s for s in sent if s.error]
    if errors:
        log.warning("replay: %d of %d requests to %s failed, e.g. %s", len(errors), len(sent), url, errors[0].error)


def latency(sent: list[_Sent]) -> dict[str, Any]:
    """Time to first token and inter-token latency over the requests that streamed (seconds)."""
    ttft = sorted(s.chunks[0][0] - s.sent for s in sent if s.chunks)
    gaps = [b[0] - a[0] for s in sent for a, b in zip(s.chunks, s.chunks[1:])]
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    return {"requests": len(sent), "errors": sum(bool(s.error) for s in sent), "ttft_p50_s": pick(0.5),
            "ttft_p90_s": pick(0.9), "itl_mean_s": statistics.fmean(gaps) if gaps else float("nan"),
            "chunks": sum(len(s.chunks) for s in sent)}


def _windows(sent: list[_Sent], results: list[RequestResult], window_s: float, gamma: int) -> list[Window]:
    """Tokens by the time their chunk arrived; the mean number of requests in flight; the acceptance
    of the requests that finished in the window."""
    end = max((s.finish for s in sent), default=0.0)
    edges = [i * window_s for i in range(int(end // window_s) + 2)]
    out = []
    for a, b in zip(edges, edges[1:]):
        if a >= end:
            break
        tokens = sum(n for s in sent for t, n in s.chunks if a <= t < b)
        busy = sum(max(0.0, min(b, s.finish) - max(a, s.sent)) for s in sent)
        counts = [0] * (gamma + 1)
        for r in results:
            if a <= r.finish < b:
                counts = [x + y for x, y in zip(counts, r.accept_counts)]
        out.append(Window(a, min(b, end), tokens, 0, busy / (min(b, end) - a), counts, -1, sum(counts) > 0))
    return out

