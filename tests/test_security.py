"""The security pass (docs/architecture.md, "Threat model"): what a writer of the shared filesystem
or a peer on the wire can make TIDE do.

  * nothing read from the run dir or the wire is unpickled: no pickle, marshal, `torch.load` or
    `np.load(allow_pickle=True)` in TIDE's code, and DeepSpeed checkpoints are never loaded;
  * message fields cannot name a path outside the run dir (decode checks types; the coordinator
    builds a draft's path from the run's drafts dir and an int version: tests/test_coordinator.py);
  * what TIDE creates is not writable by others, whatever the caller's umask;
  * messages have a size limit (tests/test_fuzz.py); of the two ports TIDE opens, the OpenAI server
    takes vLLM's --api-key (tests/test_server.py) and rank 0's join port wants the run's key
    (tests/test_faults.py::test_a_returned_training_component_joins_with_the_runs_key_and_nothing_else_does).
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest

from tide.runtime.messages import PROTOCOL, BadMessage, decode

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "tide").rglob("*.py")) + sorted((ROOT / "workflows").rglob("*.py"))


def calls(tree: ast.AST) -> list[tuple[str, ast.Call]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            out.append((f"{base}.{name}" if base else name, node))
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_path_unpickles(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not {"pickle", "cPickle", "dill", "marshal", "joblib"} & set(names), f"{path}: imports {names}"
    for name, call in calls(tree):
        kw = {k.arg: k.value for k in call.keywords}
        if name == "torch.load":
            safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            assert safe, f"{path}:{call.lineno}: torch.load without weights_only=True"
        if name in ("np.load", "numpy.load"):
            assert not (isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value), \
                f"{path}:{call.lineno}: np.load(allow_pickle=True)"
        assert not name.endswith("load_checkpoint"), f"{path}:{call.lineno}: a DeepSpeed checkpoint is loaded"


@pytest.mark.parametrize("version", ["../../etc", "/tmp/x", -1.5, None, [1]])
def test_a_draft_message_cannot_name_a_path_outside_the_run_dir(version: object) -> None:
    fields = dict(cycle=1, version=version, path="/etc/passwd", eval_al=1.5, base_al=1.2, base_version=0,
                  live_al=1.2, live_version=0, train_tokens=1, wall_s=1.0, eval_counts=[1, 1], base_counts=[1, 1],
                  live_counts=[1, 1])
    with pytest.raises(BadMessage, match="DraftReady.version"):
        decode(msgpack.packb({"protocol": PROTOCOL, "type": "DraftReady", **fields}))


def test_nothing_tide_creates_is_world_writable(tmp_path: Path) -> None:
    """Under umask 000, the entry-point preamble still keeps others from writing the run dir: the
    store (a chunk), the drafts (a published version), the results (JSON)."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tide.cli import parser, run
        from tide.config import load_config
        from tide.draft import DraftRegistry, init_draft
        from tide.model.files import write_json
        from tide.store import ChunkWriter
        from tide.store.layout import RunLayout
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_store import make_run

        def body(args):
            cfg = load_config({str(ROOT / "configs" / "ci.yaml")!r})
            lay = RunLayout.open(cfg, Path({str(tmp_path / "run")!r}))
            meta = lay.target.chunk_meta()
            with ChunkWriter(lay.store, meta, chunk_tokens=8) as w:
                w.add(make_run("r0", 16, meta=meta))
            reg = DraftRegistry(lay.drafts)
            reg.publish(init_draft(lay.target.path, lay.target.layer_ids, 64), {{}})
            write_json(lay.out / "summary.json", {{}})
        sys.exit(run(parser("probe", None), body, []))
    """)
    subprocess.run(["bash", "-c", f"umask 000 && exec {sys.executable} -c \"$0\"", code], cwd=ROOT, check=True,
                   timeout=300)
    made = [p for p in (tmp_path / "run").rglob("*")]
    assert any(p.suffix == ".h5" for p in made) and any(p.name == "model.safetensors" for p in made)
    writable = [str(p) for p in made if os.stat(p).st_mode & stat.S_IWOTH]
    assert not writable, writable
