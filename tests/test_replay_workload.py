"""Workloads for replay: published prompt sets, phases, arrival processes, and one-line errors."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tide.config import ConfigError, UntilConfig, WorkloadConfig
from tide.workload import (
    Arrivals,
    Phase,
    WorkloadError,
    WorkloadSpec,
    build_requests,
    build_workload,
    draw_requests,
    load_prompts,
    load_workload,
)
from tide.workload.arrivals import schedule

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
HUMANEVAL = str(DATA / "humaneval" / "HumanEval.jsonl.gz")
SPEC_BENCH = str(DATA / "spec_bench" / "question.jsonl")
GSM8K = str(DATA / "gsm8k" / "test.jsonl")


def spec(*phases: Phase, arrivals: Arrivals = Arrivals("closed", concurrency=2), seed: int = 0) -> WorkloadSpec:
    return WorkloadSpec(tuple(phases), arrivals, seed)


def code(n: int = 6, duration_s: float | None = None) -> Phase:
    return Phase("code", "humaneval", 32, HUMANEVAL, num_prompts=None if duration_s else n,
                 duration_s=duration_s)


def translation(n: int = 6, duration_s: float | None = None) -> Phase:
    return Phase("translation", "spec_bench:translation", 16, SPEC_BENCH, num_prompts=None if duration_s else n,
                 duration_s=duration_s)


def write_trace(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "experiments").glob("*.yaml")))
def test_shipped_experiment_workloads_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # their data paths are relative to the repository root
    s = load_workload(Path("configs") / "experiments" / name)
    reqs = draw_requests(s)
    assert len(reqs) == sum(p.num_prompts for p in s.phases)  # type: ignore[misc]
    assert [r.phase for r in reqs] == [p.name for p in s.phases for _ in range(p.num_prompts)]  # type: ignore[arg-type]


@pytest.mark.parametrize("dataset, file, count, first_id, start", [
    ("humaneval", "humaneval/HumanEval.jsonl.gz", 164, "HumanEval/0", "Complete this Python function.\n\n"),
    ("gsm8k", "gsm8k/test.jsonl", 1319, "gsm8k-1", "Janet"),
    ("spec_bench:translation", "spec_bench/question.jsonl", 80, "translation-161", "Translate German to English"),
    ("spec_bench", "spec_bench/question.jsonl", 480, "writing-81", "Compose an engaging travel blog"),
    ("mt_bench:coding", "mt_bench/question.jsonl", 10, "coding-121", "Develop a Python program"),
    ("sharegpt", "sharegpt/sharegpt_v3_sample500_seed0.json", 500, "dUOQwiS_0",
     "do you know anything about brownfield"),
])
def test_loaders_read_the_published_formats(dataset: str, file: str, count: int, first_id: str, start: str) -> None:
    prompts = load_prompts(dataset, str(DATA / file))
    assert len(prompts) == count and len({i for i, _ in prompts}) == count
    assert prompts[0][0] == first_id and prompts[0][1].startswith(start)


def test_hub_ids_go_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(repo: str, config: str | None, split: str) -> list[dict]:
        calls.append((repo, config, split))
        return [{"question": "What is 2 + 2?", "answer": "#### 4"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_prompts("gsm8k", "hf:openai/gsm8k:main@train") == (("gsm8k-1", "What is 2 + 2?"),)
    load_prompts("gsm8k", "hf:openai/gsm8k:main")
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]


def test_chat_template_is_applied_and_long_prompts_keep_their_end(tiny_target) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target.path)
    s = spec(code(3), translation(3))
    texts = draw_requests(s)
    reqs = build_workload(s, tiny_target.path, max_prompt_tokens=10_000)
    for t, r in zip(texts, reqs):
        rendered = tok.apply_chat_template([{"role": "user", "content": t.text}], add_generation_prompt=True,
                                           tokenize=False)
        assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
        assert r.prompt_ids == tok(rendered, add_special_tokens=False)["input_ids"]
        assert (r.request_id, r.max_tokens, r.arrival, r.workload) == (t.request_id, t.max_tokens, None, t.phase)
    short = build_workload(s, tiny_target.path, max_prompt_tokens=8)
    assert [r.prompt_ids for r in short] == [r.prompt_ids[-8:] for r in reqs]


def test_same_seed_same_requests_other_seed_other_requests(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [{"timestamp": t} for t in range(12)])

    def draw(seed: int, arrivals: Arrivals) -> list:
        return draw_requests(spec(code(), translation(duration_s=3.0), arrivals=arrivals, seed=seed))

    poisson = Arrivals("poisson", rate=2.0)
    assert draw(3, poisson) == draw(3, poisson)
    other = draw(4, poisson)
    assert [r.request_id for r in other] != [r.request_id for r in draw(3, poisson)]
    assert [r.arrival for r in other] != [r.arrival for r in draw(3, poisson)]
    # the arrival process has its own stream: the same seed draws the same code prompts whatever the arrivals
    code_ids = [r.request_id for r in draw(3, poisson) if r.phase == "code"]
    assert code_ids == [r.request_id for r in draw(3, Arrivals("trace", trace=trace)) if r.phase == "code"]


@pytest.mark.parametrize("seed", range(4))
def test_poisson_arrivals_have_the_configured_rate(seed: int) -> None:
    rate = 4.0
    count_phase, timed_phase = schedule(Arrivals("poisson", rate=rate), [(4000, None), (None, 1000.0)], seed)
    times = [s.arrival for s in count_phase]
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert abs(statistics.mean(gaps) * rate - 1) < 0.06  # 4 sigma of the mean of 4000 exponential gaps
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1) < 0.1  # exponential: cv = 1
    start = times[-1]
    assert all(start < s.arrival < start + 1000 for s in timed_phase)  # type: ignore[operator]
    assert abs(len(timed_phase) - rate * 1000) < 4 * (rate * 1000) ** 0.5


def test_closed_loop_has_no_arrival_times() -> None:
    reqs = draw_requests(spec(code(5), translation(4)))
    assert [r.arrival for r in reqs] == [None] * 9


def test_phases_follow_each_other_with_their_labels_and_never_repeat_a_prompt() -> None:
    again = Phase("code-again", "humaneval", 8, HUMANEVAL, num_prompts=164 - 6)
    reqs = draw_requests(spec(code(6), translation(80), again, arrivals=Arrivals("poisson", rate=50.0)))
    assert [r.phase for r in reqs] == ["code"] * 6 + ["translation"] * 80 + ["code-again"] * 158
    assert [r.max_tokens for r in reqs] == [32] * 6 + [16] * 80 + [8] * 158
    times = [r.arrival for r in reqs]
    assert times == sorted(times) and len(set(times)) == len(times)
    ids = [r.request_id for r in reqs]
    assert len(set(ids)) == len(ids) and len({r.text for r in reqs if "code" in r.phase}) == 164
    # taking every prompt left keeps file order
    assert ids[86:] == [i for i, _ in load_prompts("humaneval", HUMANEVAL) if i not in ids[:6]]


def test_shared_ids_of_two_sources_get_a_suffix(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"question": f"from {name}"}) + "\n")
    reqs = draw_requests(spec(Phase("a", "gsm8k", 8, str(tmp_path / "a.jsonl"), num_prompts=1),
                              Phase("b", "gsm8k", 8, str(tmp_path / "b.jsonl"), num_prompts=1)))
    assert [(r.request_id, r.text) for r in reqs] == [("gsm8k-1", "from a"), ("gsm8k-1#2", "from b")]


def test_trace_timestamps_are_honoured(tmp_path: Path) -> None:
    t0 = 1_700_000_000.0  # absolute times start at 0; lines out of order are sorted; other fields are ignored
    rows = [{"timestamp": t0 + t, "max_tokens": m, "ContextTokens": 100} for t, m in
            [(0.5, 4), (0.0, 100), (1.25, 8), (2.0, 20), (3.5, 1), (9.0, 2), (9.5, 3)]]
    trace = write_trace(tmp_path / "trace.jsonl", rows)
    reqs = draw_requests(spec(code(3), translation(duration_s=3.0), arrivals=Arrivals("trace", trace=trace)))
    # code takes the first 3 arrivals and ends at 1.25 s; translation takes those before 1.25 + 3 s
    assert [(r.phase, r.arrival, r.max_tokens) for r in reqs] == [
        ("code", 0.0, 32), ("code", 0.5, 4), ("code", 1.25, 8), ("translation", 2.0, 16), ("translation", 3.5, 1)]


def test_embedded_default_workload_is_the_same_sample_as_before(tiny_target) -> None:
    cfg = WorkloadConfig(dataset="humaneval", path=HUMANEVAL, num_prompts=8, max_tokens=16, seed=1)
    reqs = build_requests(cfg, tiny_target.path, 256)
    expected = random.Random(1).sample(load_prompts("humaneval", HUMANEVAL), 8)  # the request ids pick the eval split
    assert [r.request_id for r in reqs] == [i for i, _ in expected]
    assert {(r.workload, r.arrival, r.max_tokens) for r in reqs} == {("humaneval", None, 16)}
    everything = build_requests(WorkloadConfig(dataset="spec_bench:translation", path=SPEC_BENCH, num_prompts=10_000),
                                tiny_target.path, 256)
    assert [r.request_id for r in everything] == [i for i, _ in load_prompts("spec_bench:translation", SPEC_BENCH)]
    with pytest.raises(WorkloadError, match=r"^workload\.dataset: unknown dataset 'humaneva'; did you mean humaneval"):
        build_requests(WorkloadConfig(dataset="humaneva"), tiny_target.path, 256)


CLOSED = {"kind": "closed", "concurrency": 1}


def phase(**change: object) -> dict:
    """A good phase with some fields changed (None removes one)."""
    good = {"name": "code", "dataset": "humaneval", "path": HUMANEVAL, "num_prompts": 4, "max_tokens": 8}
    return {k: v for k, v in {**good, **change}.items() if v is not None}


def write_experiment(path: Path, phases: list[dict], arrivals: dict | None = CLOSED, **extra: object) -> Path:
    workload = {"phases": phases, **({"arrivals": arrivals} if arrivals else {}), **extra}
    path.write_text(yaml.safe_dump({"model": {"target": "tiny"}, "workload": workload}))  # runner sections: not read
    return path


def one_line_error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_workload(path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("phases, arrivals, extra, expected", [
    ([phase(max_tokens=None)], CLOSED, {}, "workload.phases[0].max_tokens: required value is missing"),
    ([phase()], None, {}, "workload.arrivals: required value is missing"),
    ([], CLOSED, {}, "workload: phases: at least one phase"),
    ([phase()], CLOSED, {"sed": 1}, "workload.sed: unknown key; did you mean seed?"),
    ([{**phase(), "num_prompt": 4}], CLOSED, {}, "workload.phases[0].num_prompt: unknown key; did you mean"),
    ([phase(dataset="humaneva")], CLOSED, {}, "workload.phases[0]: dataset: unknown dataset 'humaneva'; did you mean"),
    ([phase(dataset="gsm8k:hard", path=GSM8K)], CLOSED, {}, "workload.phases[0]: dataset: 'gsm8k:hard': a category"),
    ([phase(dataset="gsm8k", path=None)], CLOSED, {}, "workload.phases[0]: path: dataset 'gsm8k' needs a file or hf:"),
    ([phase(num_prompts=0)], CLOSED, {}, "workload.phases[0]: num_prompts: must be >= 1, got 0"),
    ([phase(num_prompts=None, duration_s=5)], CLOSED, {}, "workload: phases[0].duration_s: a closed loop has no clock"),
    ([phase(duration_s=5)], {"kind": "poisson", "rate": 1}, {}, "workload.phases[0]: num_prompts/duration_s: give "
                                                                 "exactly one"),
    ([phase(), phase()], CLOSED, {}, "workload: phases[1].name: 'code' is already the name of phases[0]"),
    ([phase()], {"kind": "closed", "rate": 2}, {}, "workload.arrivals: concurrency: required for closed arrivals"),
    ([phase()], {**CLOSED, "rate": 2}, {}, "workload.arrivals: rate: applies to poisson arrivals only, these are"),
    ([phase()], {"kind": "poisson", "rate": 0}, {}, "workload.arrivals: rate: must be > 0"),
    ([phase()], {"kind": "burst"}, {}, "workload.arrivals.kind: must be one of ['poisson', 'closed', 'trace']"),
    ([phase(dataset="spec_bench:translaton", path=SPEC_BENCH)], CLOSED, {},
     f"workload.phases[0].dataset: no prompts for 'spec_bench:translaton' in {SPEC_BENCH} (categories: coding, "),
    ([phase(path=HUMANEVAL + ".absent")], CLOSED, {}, "workload.phases[0].path: cannot read "),
    ([phase(num_prompts=200)], CLOSED, {}, "workload.phases[0].num_prompts: needs 200 prompts, humaneval has 164 left"),
    ([phase(path="hf:openai/openai_humaneval")], CLOSED, {},
     "workload.phases[0].path: hf:openai/openai_humaneval needs the `datasets` package"),
])
def test_bad_workload_files_fail_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phases: list[dict],
                                               arrivals: dict | None, extra: dict, expected: str) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without it
    path = write_experiment(tmp_path / "exp.yaml", phases, arrivals, **extra)
    assert one_line_error(path).startswith(f"{path}: {expected}")


def test_bad_data_files_name_the_line_and_field(tmp_path: Path) -> None:
    (tmp_path / "math.jsonl").write_text('{"question": "1 + 1?"}\n{"answer": "#### 2"}\n')
    (tmp_path / "broken.jsonl").write_text('{"question": "1 + 1?"\n')
    for name, why in [("math", "line 2: missing field 'question' (gsm8k format)"), ("broken", "line 1: not JSON")]:
        data = tmp_path / f"{name}.jsonl"
        p = write_experiment(tmp_path / f"{name}.yaml", [phase(dataset="gsm8k", path=str(data), num_prompts=1)])
        assert one_line_error(p).startswith(f"{p}: workload.phases[0].path: {data}: {why}")


@pytest.mark.parametrize("trace, second, expected", [
    (None, {}, "workload.arrivals.trace: cannot read "),
    ('{"timestamp": 0}\nnot json\n', {}, "trace.jsonl: line 2: not JSON"),
    ('{"timestamp": 0}\n{"ts": 1}\n', {}, "trace.jsonl: line 2: 'timestamp' must be a number of seconds, got None"),
    ('{"timestamp": 0, "max_tokens": 0}\n', {}, "trace.jsonl: line 1: 'max_tokens' must be an int >= 1, got 0"),
    ("\n", {}, "trace.jsonl: no arrivals in the file"),
    ('{"timestamp": 0}\n', {"num_prompts": 2}, "workload.phases[1].num_prompts: the trace "),
    ('{"timestamp": 0}\n{"timestamp": 50}\n', {"num_prompts": None, "duration_s": 10},
     "workload.phases[1].duration_s: no arrival in the trace"),
])
def test_bad_traces_fail_with_one_line(tmp_path: Path, trace: str | None, second: dict, expected: str) -> None:
    path = tmp_path / "trace.jsonl"
    if trace is not None:
        path.write_text(trace)
    phases = [phase(name="a", num_prompts=1)] + ([phase(name="b", **second)] if second else [])
    p = write_experiment(tmp_path / "exp.yaml", phases, {"kind": "trace", "trace": str(path)})
    msg = one_line_error(p)
    assert msg.startswith(f"{p}: ") and expected in msg


def test_the_prompt_sets_in_the_repository_match_their_checksums() -> None:
    p = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=DATA, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    listed = {line.split(maxsplit=1)[1] for line in (DATA / "SHA256SUMS").read_text().splitlines()}
    assert listed == {str(f.relative_to(DATA)) for f in DATA.rglob("*") if f.is_file()} - {"SHA256SUMS", "README.md"}


def test_a_phase_repeats_until_a_cycle_started_in_it_has_trained() -> None:
    """`until: {event: trained}` waits for a cycle that trained on the phase: one still in flight from
    the phase before does not end it; requests are served again as `ID~k` meanwhile."""
    from tide.runtime.coordinator import Event
    from tide.serve.engine import Request, RequestResult
    from tide.workload.source import RequestSource, Segment

    reqs = [Request(f"t{i}", [1, 2], 4, None, "translation") for i in range(2)]
    events: list[Event] = []
    src = RequestSource([Segment(reqs, UntilConfig(event="trained", event_requests=1, max_s=60))], events, True)
    served = []
    for req in src:
        served.append(req.request_id)
        src.observe(RequestResult(req.request_id, "translation", 2, [0], 0.0, 0.0, [], 0, True))
        if len(served) == 3:
            events.append(Event(1.0, "trained", "cycle 1, started before the phase"))
        elif len(served) == 5:
            events += [Event(2.0, "train", "cycle 2"), Event(3.0, "trained", "cycle 2")]
        assert len(served) < 20
    assert served[:6] == ["t0", "t1", "t0~1", "t1~1", "t0~2", "t1~2"] and len(served) == 6
    assert src.outcomes[0]["until_met"]


def test_a_phase_that_waits_for_the_loop_is_refused_on_more_than_one_instance() -> None:
    """`until` needs the coordinator's own instance to serve the phase: one line names the phase."""
    from tide.workload import check_spread

    spec = load_workload(ROOT / "configs" / "experiments" / "ci-shift.yaml")  # translation has `until`
    check_spread(spec, 1, "exp.yaml")
    with pytest.raises(ConfigError, match=r"^exp.yaml: workload.phases\[1\].until: .* this run has 2$"):
        check_spread(spec, 2, "exp.yaml")
    with pytest.raises(ConfigError, match=r"this run has 1 and a coordinator of its own$"):
        check_spread(spec, 1, "exp.yaml", dedicated=True)


def test_a_mode_served_by_two_instances_is_read_on_one_clock(tmp_path: Path) -> None:
    """A mode's Slurm job: rank 0's files and instance 1's (instances/1/), each counting from its own
    start (`started_unix`), are read together, the instance's times moved by the difference."""
    from workflows.replay.runner import load_mode, write_mode_record

    def request(rid: str, arrival: float) -> dict:
        return {"request_id": rid, "workload": "code", "prompt_tokens": 3, "output_ids": [1, 2], "arrival": arrival,
                "finish": arrival + 1.0, "accept_counts": [1, 1], "draft_version": 0, "speculate": True}

    def window(t: float) -> dict:
        return {"t_start": t, "t_end": t + 1.0, "tokens": 2, "steps": 2, "mean_batch": 1.0, "accept_counts": [1, 1],
                "draft_version": 0, "speculate": True}

    for d, rid, started in ((tmp_path, "a", 100.0), (tmp_path / "instances" / "1", "b", 102.5)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "requests.jsonl").write_text(json.dumps(request(rid, 0.5)) + "\n")
        (d / "windows.jsonl").write_text(json.dumps(window(0.0)) + "\n")
        (d / "summary.json").write_text(json.dumps({"started_unix": started}))
    (tmp_path / "instances" / "2").mkdir()  # an instance of an earlier run in the same dir: not this mode's
    (tmp_path / "instances" / "2" / "requests.jsonl").write_text(json.dumps(request("old", 0.0)) + "\n")
    (tmp_path / "events.json").write_text(json.dumps([{"t": 1.0, "kind": "swap", "reason": "", "version": 1}]))
    write_mode_record(tmp_path, "static", [], [1])
    m = load_mode(tmp_path, "static")
    assert m.instances == 2 and [(r.request_id, r.arrival) for r in m.results] == [("a", 0.5), ("b", 3.0)]
    assert [w.t_end for w in m.windows] == [1.0, 3.5] and m.events[0].t == 1.0
