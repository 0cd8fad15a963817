"""The package's shape: every module imports, folders import only downward, no import cycles.

The folders follow the data flow (docs/architecture.md): a folder may import the ones before it in
LAYERS and none after it; `workflows/` composes the library and the library never imports it.
Imports inside functions and under TYPE_CHECKING count: a cycle through a lazy import is a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["cli", "config", "model", "store", "draft", "control", "serve", "train", "workload", "runtime", "cluster",
          "plan", "launch"]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "tide").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The tide and workflows modules `path` imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import y
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    return {m for m in found if m.split(".")[0] in ("tide", "workflows")}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1]) if module.count(".") else -1


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    mods = [m for m in modules() if not m.endswith("__main__")]
    p = subprocess.run([sys.executable, "-c", code, *mods], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


def test_folders_import_only_downward_and_never_workflows() -> None:
    mods = modules()
    bad = []
    for name, path in mods.items():
        for dep in imports(path, name, set(mods)):
            if dep.startswith("workflows"):
                bad.append(f"{name} -> {dep} (the library never imports workflows/)")
            elif layer(dep) > layer(name) >= 0:
                bad.append(f"{name} -> {dep}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {name: imports(path, name, set(mods)) & set(mods) for name, path in mods.items()}
    cycles, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state[d] == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [m, d]))
            elif state[d] == 0:
                visit(d, stack + [m])
        state[m] = 2

    for m in graph:
        if state[m] == 0:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
