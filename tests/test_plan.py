"""Planner: the paper's 8 H100 + 4 MI250 figures, who trains, and one-line errors for bad inventories."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tide.config import ConfigError
from tide.plan import KNOWN, load_inventory, parse_inventory, plan
from tide.plan.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def inventory(speedup: float = 1.15, train_demand: float = 4.0, **counts: int) -> dict:
    """Plain data as the YAML would give it; known classes with the paper's figures."""
    return {"speedup": speedup, "train_demand": train_demand,
            "classes": {name: {"count": n} for name, n in (counts or {"H100": 8, "MI250": 4}).items()}}


@pytest.mark.parametrize("speedup, paper", [(1.15, 1.08), (1.30, 1.22)])  # ShareGPT, Science
def test_paper_testbed_ratio(speedup: float, paper: float) -> None:
    p = plan(parse_inventory(inventory(speedup)))
    assert p.speculate and p.ratio == pytest.approx(paper, abs=0.02)
    assert p.train == {"MI250": 4} and p.serve == {"H100": 8}
    assert p.baseline == pytest.approx(8 * 6.76 + 4) and p.throughput == pytest.approx(speedup * 8 * 6.76)


def test_shipped_inventories_plan() -> None:
    files = sorted((ROOT / "configs" / "inventory").glob("*.yaml"))
    assert ROOT / "configs" / "inventory" / "h100x8_mi250x4.yaml" in files
    for f in files:
        p = plan(load_inventory(f))
        assert p.speculate and p.ratio > 1 and "MI250" in p.train and "H100" not in p.train, f


def test_no_speculation_wins_at_s_1() -> None:
    p = plan(parse_inventory(inventory(1.0)))
    assert not p.speculate and p.train == {} and p.serve == {"H100": 8, "MI250": 4}
    assert p.ratio == 1.0 and p.throughput == p.baseline and p.best_split_ratio < 1
    assert "no speculation is better" in p.reason


def test_unmeetable_demand_falls_back_to_plain() -> None:
    p = plan(parse_inventory(inventory(1.3, train_demand=100.0)))
    assert not p.speculate and p.best_split_ratio == 0 and "demand" in p.reason


def test_lowest_inference_per_training_ratio_trains() -> None:
    ratio = {name: i / r for name, (i, r) in KNOWN.items()}
    assert min(ratio, key=ratio.get) == "MI250" and ratio["MI300X"] < ratio["H100"]
    p = plan(parse_inventory(inventory(1.2, 3.0, H100=8, MI300X=4, MI250=4)))
    assert p.train == {"MI250": 3} and p.serve == {"H100": 8, "MI300X": 4, "MI250": 1}
    # without MI250s the MI300Xs train, not the H100s; same when demand needs two of them
    for demand, n in [(1.0, 1), (3.5, 2)]:
        p = plan(parse_inventory(inventory(1.2, demand, H100=8, MI300X=4)))
        assert p.train == {"MI300X": n}, demand
    # listing order does not matter
    p = plan(parse_inventory(inventory(1.2, 3.0, MI250=4, MI300X=4, H100=8)))
    assert p.train == {"MI250": 3}


def test_default_demand_keeps_one_trainer_busy() -> None:
    for demand in (0.0, None):
        data = inventory(1.15)
        if demand is None:
            del data["train_demand"]
        else:
            data["train_demand"] = demand
        inv = parse_inventory(data)
        assert inv.train_demand == 1.0 and plan(inv).train == {"MI250": 1}
    data = {**inventory(1.15, 0.0), "default_train_demand": 2.0}
    assert plan(parse_inventory(data)).train == {"MI250": 2}


def test_custom_class_figures_and_large_cluster_is_fast() -> None:
    data = inventory(1.15, 64.0, H100=512, MI300X=256, MI250=32)
    data["classes"]["OLD"] = {"count": 64, "inference": 0.5, "training": 0.9}  # ratio 0.56: trains first
    t0 = time.perf_counter()
    p = plan(parse_inventory(data))
    assert time.perf_counter() - t0 < 2.0
    assert p.train["OLD"] == 64 and p.train_capacity >= 64.0 and "H100" not in p.train


def error(data: object, source: str = "inv.yaml") -> str:
    with pytest.raises(ConfigError) as e:
        parse_inventory(data, source=source)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{source}: ")
    return msg


def test_bad_inventories_give_one_line() -> None:
    unknown = inventory(H100=8, B200=4)
    assert error(unknown) == ("inv.yaml: classes.B200: unknown GPU class; give inference and training "
                              "figures (known: H100, MI300X, MI250)")
    assert error(inventory(H100=-1, MI250=4)) == "inv.yaml: classes.H100.count: must be >= 0"
    half = inventory()
    half["classes"]["X"] = {"count": 2, "inference": 3.0}
    assert error(half).startswith("inv.yaml: classes.X.training: required for unknown GPU class X")
    no_count = inventory()
    no_count["classes"]["MI250"] = {}
    assert error(no_count) == "inv.yaml: classes.MI250.count: required value is missing"
    typo_key = error({**inventory(), "train_demnd": 4})
    assert typo_key == "inv.yaml: train_demnd: unknown key; did you mean train_demand?"
    typo = inventory()
    typo["classes"]["H100"] = {"count": 8, "inferense": 7.0}
    assert "classes.H100.inferense: unknown key; did you mean inference?" in error(typo)
    assert error({"classes": {"H100": {"count": 8}}}) == "inv.yaml: speedup: required value is missing"
    assert "speedup: must be > 0" in error(inventory(speedup=0.0))
    assert "train_demand: must be >= 0" in error(inventory(train_demand=-1.0))
    assert "classes.H100: expected a mapping" in error({"speedup": 1.1, "classes": {"H100": 8}})
    negative = {"speedup": 1.1, "classes": {"H100": {"count": 8, "training": -1.0}}}
    assert "classes.H100.training: must be >= 0" in error(negative)
    assert "classes: no GPUs" in error(inventory(H100=0))


def test_cli_bad_inventory_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("speedup: 1.15\nclasses:\n  H100: {count: -8}\n")
    assert main(["--inventory", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"{f}: classes.H100.count: must be >= 0\n"
    assert main(["--inventory", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["--inventory", str(ROOT / "configs/inventory/h100x8_mi250x4.yaml"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MI250" in text and "1.071x" in text and "58.08" in text
    data = json.loads(out.read_text())
    assert data["serve"] == {"H100": 8} and data["train"] == {"MI250": 4} and data["speculate"] is True
    assert data["ratio"] == pytest.approx(1.08, abs=0.02) and data["baseline"] == pytest.approx(58.08)
    assert {"throughput", "speedup", "train_demand", "train_capacity", "best_split_ratio", "reason"} <= set(data)
    assert [c["name"] for c in data["classes"]] == ["H100", "MI250"]
    assert not list(tmp_path.glob("*.tmp"))


def test_module_entry_point_and_help(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("speedup: 1.15\nclasses:\n  TPU: {count: 4}\n")
    run = subprocess.run([sys.executable, "-m", "tide.plan", "--inventory", str(f)], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    known = "(known: H100, MI300X, MI250)"
    assert run.stderr == f"{f}: classes.TPU: unknown GPU class; give inference and training figures {known}\n"
    run = subprocess.run([sys.executable, "-m", "tide.plan", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "--inventory" in run.stdout and "train_demand" in run.stdout
