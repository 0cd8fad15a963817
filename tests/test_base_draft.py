"""The base draft: built by TIDE itself at CI size (the same code as the SmolLM2 one), and the
committed SmolLM2 draft checked against what the workloads serve today."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from workflows.base_draft import load, served_prompts

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "drafts" / "smollm2-chat"


@pytest.mark.vllm
def test_a_base_draft_is_built_served_trained_and_published(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "workflows.base_draft", "--config", "configs/base-draft-ci.yaml",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    draft = out / "published"
    card = json.loads((draft / "card.json").read_text())
    assert card["sha256"] == hashlib.sha256((draft / "model.safetensors").read_bytes()).hexdigest()
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert card["training"]["held_out_al"] > 1.0 and card["training"]["output_tokens"] > 0
    assert set(card["eval"]) == {"code", "chat"} and all(v["steps"] > 0 for v in card["eval"].values())
    assert "| code |" in (draft / "README.md").read_text()
    _, bd = load(ROOT / "configs" / "base-draft-ci.yaml")
    assert_never_served(card, bd.exclude)


def assert_never_served(card: dict, configs: tuple[str, ...] | list[str]) -> None:
    """No training prompt of the draft is one that these configs' workloads serve now."""
    served = set().union(*(served_prompts(str(ROOT / c)) for c in configs))
    trained = {tuple(key) for key in card["train_prompt_ids"]}
    assert trained and not trained & served, sorted(trained & served)[:5]


@pytest.mark.skipif(not (COMMITTED / "card.json").exists(), reason="the SmolLM2 base draft is not built")
def test_the_committed_base_draft_is_whole_and_trained_on_nothing_the_workloads_serve() -> None:
    card = json.loads((COMMITTED / "card.json").read_text())
    assert card["sha256"] == hashlib.sha256((COMMITTED / "model.safetensors").read_bytes()).hexdigest()
    assert (COMMITTED / "model.safetensors").stat().st_size < 25 * 2**20
    assert_never_served(card, ["configs/local.yaml", "configs/experiments/shift.yaml"])
