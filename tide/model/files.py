"""Files other processes read: written under a temporary name, then renamed into place.

A reader on the shared filesystem sees a whole file (or directory) or none; several writers of the
same directory (nodes sharing a model cache) keep the first one published.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh sibling of `final` to build in (same filesystem, so the rename is atomic); removed on exit."""
    final.parent.mkdir(parents=True, exist_ok=True)
    # unique per host, process and call: several nodes (shared filesystem) or threads may build at once
    prefix = f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_dir(tmp: Path, final: Path) -> Path:
    """Rename the finished `tmp` to `final`; if another process published `final` first, keep theirs."""
    tmp.chmod(0o755)  # mkdtemp makes 0700 and safetensors arrive 0600: a shared cache is read by every user
    for f in tmp.iterdir():
        f.chmod(0o644)
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir() or not any(final.iterdir()):
            raise
        log.info("%s: another process finished it first; using theirs", final)
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=1, default=str))


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))
