"""Planner: the paper's 8 H100 + 4 MI250 figures, who trains, and one-line errors for bad inventories.
Simulator: recovery after shifts, storage saturation, trainers, validation against a measured run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tide.config import ConfigError
from tide.plan import KNOWN, load_inventory, parse_inventory, plan
from tide.plan.__main__ import main
from tide.plan.scenario import draft_params, load_scenario, parse_scenario, trainer_tokens_per_s, with_training
from tide.plan.simulate import simulate

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
    assert out == "" and err == f"tide.plan: error: {f}: classes.H100.count: must be >= 0\n"
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
    assert run.stderr.splitlines()[-1] == (f"tide.plan: error: {f}: classes.TPU: unknown GPU class; "
                                           f"give inference and training figures {known}")
    run = subprocess.run([sys.executable, "-m", "tide.plan", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "--inventory" in run.stdout and "train_demand" in run.stdout


# --------------------------------------------------------------------------- simulator

CLUSTER = ROOT / "configs/simulate/cluster-64h100-16mi250.yaml"
PIPELINE = ROOT / "configs/simulate/pipeline-h200x2.yaml"


def scenario(**over: object) -> dict:
    """Plain data for a small cluster: 4 instances at 1000 tokens/s, H 4096, one shift at 100 s to
    AL 1.1, where speculation loses (1.1 / 1.15) and the gate serves plainly."""
    data: dict = {"hidden_size": 4096, "duration_s": 600.0, "al_aligned": 2.0, "detect_s": 2.0,
                  "serving": {"tokens_per_s": 1000.0, "instances": 4, "draft_cost": 0.05},
                  "training": {"count": 2, "gpu": "MI250", "n_threshold": 20_000, "retention_tokens": 100_000},
                  "shifts": [{"at_s": 100.0, "al": 1.1}]}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            data[section] = {**data[section], field: value}
        else:
            data[section] = value
    return data


def test_shipped_scenarios_run_and_recover() -> None:
    for f in sorted((ROOT / "configs" / "simulate").glob("*.yaml")):
        r = simulate(load_scenario(f))
        assert r.shifts and all(sh.published_s is not None for sh in r.shifts), f


def test_no_drift_keeps_acceptance_steady() -> None:
    s = parse_scenario(scenario(shifts=[]))
    r = simulate(s)
    assert {seg.al for seg in r.timeline} == {2.0} and r.offered_tokens == 0 and r.dropped_tokens == 0
    assert r.served_tokens == pytest.approx(4 * 1000 * 2.0 / (3 * 0.05 + 1) * 600)
    assert r.served_tokens == simulate(with_training(s, count=0)).served_tokens


def test_shift_then_recovery_along_the_curve() -> None:
    s = parse_scenario(scenario())
    r = simulate(s)
    (sh,) = r.shifts
    rate = 4 * 1000 * 1.0  # AL 1.1: speculation off, plain rate, every row kept
    assert sh.threshold_s == pytest.approx(2.0 + 20_000 / rate)  # nothing dropped: 98 MB/s < 693 MB/s
    assert r.dropped_tokens == 0 and not sh.storage_limited
    assert sh.published_s == pytest.approx(sh.threshold_s + sh.cycle_s) and sh.recovered_s == sh.published_s
    # fixed cost + reading the 20k rows stored since the shift (every rank reads all of them) + 2 epochs
    # over their train split
    read_s = 20_000 * (6 * 4096 + 9) / 307.5e6
    assert sh.cycle_s == pytest.approx(7.65 + read_s + 2 * 20_000 * 0.9 / r.train_tokens_per_s)
    # 20k rows on the default curve (0 -> 0, 37.1k -> 0.40): 0.216 of the lost 0.9 AL comes back
    assert sh.al_final == pytest.approx(1.1 + 0.9 * 0.40 * 20_000 / 37_100)
    assert [seg.al for seg in r.timeline][0] == 2.0 and r.timeline[-1].al == pytest.approx(sh.al_final)
    static = simulate(with_training(s, count=0))
    assert static.shifts[0].bottleneck == "none" and static.offered_tokens == 0
    assert r.served_tokens > static.served_tokens


def test_more_trainers_never_slow_recovery() -> None:
    base = load_scenario(CLUSTER)
    for threshold in (131_072, 1_000_000):
        runs = [simulate(with_training(base, count=n, n_threshold=threshold)) for n in (1, 2, 4, 8, 16, 32)]
        for a, b in zip(runs, runs[1:]):
            for sa, sb in zip(a.shifts, b.shifts):
                assert sb.published_s <= sa.published_s and sb.recovered_s <= sa.recovered_s
            assert b.served_tokens >= a.served_tokens


def test_storage_saturation_drops_capture() -> None:
    # 4 writers at B(4) = 564 + 906 * 3/7 = 952.3 MB/s; each offers 1000 rows/s x 24,585 B = 24.6 MB/s
    s = parse_scenario(scenario())
    bpt, bw = 6 * 4096 + 9, 564e6 + (1.47e9 - 564e6) * 3 / 7
    assert simulate(s).dropped_tokens == 0
    fast = parse_scenario(scenario(serving__tokens_per_s=20_000.0))  # 4 x 20k x 24.6 kB = 1.97 GB/s > B
    r = simulate(fast)
    (sh,) = r.shifts
    assert sh.storage_limited and r.storage_saturated_s > 0 and r.bandwidth_bytes_per_s == pytest.approx(bw)
    assert r.dropped_tokens / r.offered_tokens == pytest.approx(1 - bw / (4 * 20_000 * bpt))
    assert sh.threshold_s == pytest.approx(2.0 + 20_000 * bpt / bw)  # the store, not capture, sets the pace
    # a bigger H at the same rates crosses the bandwidth too
    assert simulate(parse_scenario(scenario(hidden_size=16_384, serving__tokens_per_s=5_000.0))).dropped_tokens > 0
    assert simulate(parse_scenario(scenario(hidden_size=2_880, serving__tokens_per_s=5_000.0))).dropped_tokens == 0


def test_bottleneck_names_the_longest_phase() -> None:
    slow_store = scenario(serving__tokens_per_s=20_000.0, storage={"bandwidth": [[1, 5e6]]},
                          training={"count": 8, "n_threshold": 20_000, "retention_tokens": 100_000})
    assert simulate(parse_scenario(slow_store)).shifts[0].bottleneck == "storage"
    slow_serving = scenario(serving__tokens_per_s=10.0)
    assert simulate(parse_scenario(slow_serving)).shifts[0].bottleneck == "capture"
    one_slow_trainer = scenario(training={"count": 1, "tokens_per_s_per_gpu": 100.0, "n_threshold": 20_000,
                                          "retention_tokens": 100_000})
    assert simulate(parse_scenario(one_slow_trainer)).shifts[0].bottleneck == "training"
    slow_read = scenario(training={"read_bytes_per_s": 1e6, "n_threshold": 20_000, "retention_tokens": 100_000})
    assert simulate(parse_scenario(slow_read)).shifts[0].bottleneck == "read"  # 20k rows x 24.6 kB at 1 MB/s


def test_cycle_of_an_earlier_workload_is_discarded() -> None:
    # the second shift comes while the first shift's cycle trains: that draft never deploys
    s = parse_scenario(scenario(shifts=[{"at_s": 100.0, "al": 1.1}, {"at_s": 110.0, "al": 1.05}]))
    first, second = simulate(s).shifts
    assert first.cycles == 1 and first.threshold_s < 10 and first.recovered_s is None and first.al_final == 1.1
    assert second.recovered_s is not None and second.al_final > 1.05
    # its rows were stored 2 + 5 s after it, but the trainer was busy: waiting counts as training
    assert second.threshold_s == pytest.approx(2.0 + 20_000 / 4000) and second.bottleneck == "training"


def test_a_cycle_trains_only_on_the_rows_since_its_shift() -> None:
    # as Coordinator._train: min(retention_tokens, rows stored since collection started). Collection
    # stays on while the first cycle trains, so the store holds ~60k rows of the first workload when
    # the second shift comes; the second cycle still reads and trains on its own 20k rows only
    s = parse_scenario(scenario(shifts=[{"at_s": 100.0, "al": 1.1}, {"at_s": 300.0, "al": 1.05}]))
    first, second = simulate(s).shifts
    assert first.recovered_s is not None and second.recovered_s is not None
    assert first.train_tokens == second.train_tokens == pytest.approx(20_000 * 0.9)
    assert second.cycle_s == pytest.approx(first.cycle_s)
    # a shift whose rows pile up while the trainers finish a discarded cycle: capped at retention
    busy = scenario(shifts=[{"at_s": 100.0, "al": 1.1}, {"at_s": 110.0, "al": 1.05}],
                    training={"count": 2, "n_threshold": 20_000, "retention_tokens": 30_000,
                              "tokens_per_s_per_gpu": 2_000.0})
    first, second = simulate(parse_scenario(busy)).shifts
    started = second.published_s - second.cycle_s  # after the shift; 30k rows are stored 9.5 s after it
    assert first.recovered_s is None and started > 2.0 + 30_000 / 4000
    assert second.train_tokens == pytest.approx(30_000 * 0.9)


def test_steady_state_matches_the_planner() -> None:
    # the paper's testbed without drift: 8 H100 serve at s = 1.15, 4 MI250 train (planner: 1.071x)
    data = {"hidden_size": 2880, "duration_s": 100.0, "al_aligned": 1.15,
            "serving": {"tokens_per_s": 1000.0, "instances": 8, "draft_cost": 0.0},
            "training": {"count": 4, "gpu": "MI250"}}
    summary = simulate(parse_scenario(data))
    p = plan(parse_inventory(inventory(1.15)))
    assert summary.served_tokens / summary.plain_tokens == pytest.approx(p.ratio)


def test_trainer_estimate_scales_with_class_and_draft_size() -> None:
    assert draft_params(4096) == pytest.approx(425e6, rel=0.01)  # the benchmarked head
    assert trainer_tokens_per_s("H100", 4096) == pytest.approx(46.3e3)
    assert trainer_tokens_per_s("MI250", 8192) == pytest.approx(46.3e3 / 2.44 / 3.30, rel=0.01)
    assert trainer_tokens_per_s("B200", 4096) is None


def test_pipeline_scenario_predicts_the_measured_runs() -> None:
    """The reference run (its rates are the scenario's; its cycle costs were fitted on two other runs)
    and the 131072-row rerun (left out of the fit; its own capture, training and start-up rates)."""
    from tide.plan.simreport import compare, predictions, with_overrides

    def errors(s, measured: str) -> dict:
        m = json.loads((ROOT / "docs/bench" / measured).read_text())
        return {r["figure"]: r for r in compare(predictions(s, simulate(s)), m)}

    ref = errors(load_scenario(PIPELINE), "gpu-h200x2-pipeline.json")
    assert abs(ref["shift_to_published_s"]["error"]) < 0.10 and abs(ref["shift_to_threshold_s"]["error"]) < 0.03
    assert abs(ref["bytes_per_token"]["error"]) < 0.01
    rerun = with_overrides(PIPELINE, [("serving.tokens_per_s", 6011), ("training.tokens_per_s_per_gpu", 39724),
                                      ("detect_s", 12.5)])
    new = errors(rerun, "simulate-measured-pipeline-t131072.json")
    assert abs(new["shift_to_published_s"]["error"]) < 0.10 and new["keeps_up"]["match"]


def sim_error(data: object) -> str:
    with pytest.raises(ConfigError) as e:
        parse_scenario(data, source="s.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("s.yaml: ")
    return msg


def test_bad_scenarios_give_one_line() -> None:
    assert sim_error(scenario(training={"cont": 2})) == "s.yaml: training.cont: unknown key; did you mean count?"
    assert sim_error({**scenario(), "serving": {"instances": 4}}) == \
        "s.yaml: serving.tokens_per_s: required value is missing"
    assert sim_error(scenario(serving__instances=0)) == "s.yaml: serving.instances: must be >= 1, got 0"
    late = scenario(shifts=[{"at_s": 300.0, "al": 1.2}, {"at_s": 200.0, "al": 1.1}])
    assert sim_error(late).startswith("s.yaml: shifts[1].at_s: must increase")
    assert sim_error(scenario(shifts=[{"at_s": 10.0, "al": 0.5}])) == "s.yaml: shifts[0].al: must be >= 1, got 0.5"
    assert sim_error(scenario(training={"gpu": "B200"})).startswith(
        "s.yaml: training.gpu: unknown GPU class B200; give training.tokens_per_s_per_gpu")
    assert "storage.bandwidth[1]: writers must increase" in sim_error(
        scenario(storage={"bandwidth": [[8, 1e9], [1, 5e8]]}))
    assert "recovery[1]: rows must increase" in sim_error(scenario(recovery=[[10, 0.1], [5, 0.2]]))
    assert "training.retention_tokens: must be >= n_threshold" in sim_error(
        scenario(training={"n_threshold": 10, "retention_tokens": 5}))


def test_cli_simulate_bad_inputs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("hidden_size: 4096\nduration_s: 60\nal_aligned: 2\nserving: {tokens_per_s: -1}\n")
    assert main(["simulate", "--scenario", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"tide.plan simulate: error: {f}: serving.tokens_per_s: must be > 0, got -1.0\n"
    assert main(["simulate", "--scenario", str(CLUSTER), "--set", "training.cont=3"]) == 2
    err = capsys.readouterr().err
    assert err == f"tide.plan simulate: error: {CLUSTER}: training.cont: unknown key; did you mean count?\n"
    assert main(["simulate", "--scenario", str(CLUSTER), "--sweep", "training.count"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_simulate_run_sweep_and_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    assert main(["simulate", "--scenario", str(CLUSTER), "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "the static draft" in text and "bottleneck" in text and png.stat().st_size > 0
    data = json.loads(out.read_text())
    assert data["summary"]["tide_over_static"] > 1 and len(data["summary"]["shifts"]) == 2 and data["timeline"]
    sweep = tmp_path / "sweep.json"
    assert main(["simulate", "--scenario", str(CLUSTER), "--sweep", "training.count=1,4,16", "--json", str(sweep),
                 "--plot", str(tmp_path / "sweep.png")]) == 0
    rows = json.loads(sweep.read_text())["sweep"]["rows"]
    assert [r["value"] for r in rows] == [1, 4, 16] and rows[0]["recovered_s"] >= rows[-1]["recovered_s"]
    capsys.readouterr()
    assert main(["simulate", "--scenario", str(PIPELINE), "--measured",
                 str(ROOT / "docs/bench/gpu-h200x2-pipeline.json")]) == 0
    assert "shift_to_published_s" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))


def test_simulate_help_explains() -> None:
    run = subprocess.run([sys.executable, "-m", "tide.plan", "simulate", "--help"], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0 and "--scenario" in run.stdout and "--sweep" in run.stdout
    assert "bottleneck" in run.stdout and "docs/SIMULATOR.md" in run.stdout
