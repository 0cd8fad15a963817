"""Slurm plumbing: the rendered het-job script (pure), then real jobs on the local 4-node test cluster.

Most cluster tests (marked `slurm`) run the MPI probe tests/cluster/mpi_probe.py in place of
`python -m tide.runtime` on 2 serving ranks (gpu_infer, n0) and 2 training ranks (gpu_train, n2+n3),
and assert on what each rank printed: one MPI_COMM_WORLD of 4, group 0's ranks first, each group in its
partition and on its nodes, with its fake GPUs. Every job has a 2-minute limit, srun a 60 s deadline
and every wait one too; srun's occasional hang after a het step (about 1 job in 75 here) costs
TIDE_STEP_GRACE (5 s here) through `tide_step`, which has its own tests with a fake srun.
The last tests run TIDE itself end to end, about 100 s each: once from `sbatch
slurm/tide_hetjob.sh`, once from `python -m tide.launch --executor slurm`. (Faults on the cluster:
tests/test_faults.py.) Regenerate the expected script with TIDE_UPDATE_EXPECTED=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster.jobs import TWO_INSTANCES, ci_config, run_results, submit_run

from tide.cluster import commands, script, submit
from tide.cluster.script import JobSpec
from tide.cluster.submit import Job, SlurmError
from tide.config import (
    Component,
    ConfigError,
    CoordinatorComponent,
    ServeComponent,
    SlurmConfig,
    TrainComponent,
    load_config,
)
from tide.draft import DraftRegistry
from tide.draft.acceptance import AcceptanceHistogram
from tide.store import read_chunk
from tide.store.layout import RunLayout

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = ROOT / "tests" / "expected" / "hetjob.sbatch"
STANDALONE = ROOT / "slurm" / "tide_hetjob.sh"
PROBE = ROOT / "tests" / "cluster" / "mpi_probe.py"
WAIT_S = 150  # > srun's 60 s deadline + 30 s to KILL, so a stuck job still ends on its own


def ci_slurm() -> SlurmConfig:
    """The test cluster's shape: 2 ranks with 1 GPU each on one serving node, 1 rank with 2 GPUs on each
    of two training nodes."""
    serve = ServeComponent("gpu_infer", nodes=1, ntasks_per_node=2, gpus_per_node=1, cpus_per_task=1)
    train = TrainComponent("gpu_train", nodes=2, ntasks_per_node=1, gpus_per_node=2, cpus_per_task=2)
    return SlurmConfig(job_name="tide-ci", time=2, srun_timeout_s=60, env={"TIDE_CI": "1"}, serve=serve, train=train)


def probe_spec(out: Path, *probe_args: str) -> JobSpec:
    return JobSpec(ci_slurm(), (sys.executable, str(PROBE), *probe_args), str(out))


def probe_lines(text: str) -> dict[int, dict]:
    """rank -> the probe's JSON line; srun's `--label` prefix, when there, must equal the rank."""
    ranks = {}
    for m in re.finditer(r"^(?:(\d+): )?PROBE (\{.*\})$", text, re.M):
        d = json.loads(m.group(2))
        assert m.group(1) is None or int(m.group(1)) == d["rank"], m.group(0)
        ranks[d["rank"]] = d
    return ranks


def assert_one_world_over_both_groups(ranks: dict[int, dict], job_id: str) -> None:
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    for r, d in ranks.items():
        assert (d["size"], d["allreduce"], d["job_id"], d["group_size"]) == (4, 4, job_id, 2), d
        serving = r < 2  # group 0's ranks come first
        assert d["group"] == (0 if serving else 1), d
        assert d["partition"] == ("gpu_infer" if serving else "gpu_train"), d
        assert d["node"] in (("n0", "n1") if serving else ("n2", "n3")), d
        assert d["gpus"] == ("0" if serving else "0,1"), d
    assert {ranks[2]["node"], ranks[3]["node"]} == {"n2", "n3"}  # --nodes=2 --ntasks-per-node=1


# ---- pure: no cluster -----------------------------------------------------------------------------


def expected_spec() -> JobSpec:
    """Defaults (8 H100 serve, 4 MI250 train) with fixed paths, for the stored expected script."""
    return JobSpec.for_runtime(SlurmConfig(env={"NCCL_DEBUG": "WARN"}), "/shared/tide/configs/ci.yaml",
                               "/shared/tide/runs/ci", python="/shared/tide/.venv/bin/python")


def test_render_matches_expected_file() -> None:
    text = script.render_hetjob_script(expected_spec())
    if os.environ.get("TIDE_UPDATE_EXPECTED") == "1":
        EXPECTED.parent.mkdir(exist_ok=True)
        EXPECTED.write_text(text)
    assert text == EXPECTED.read_text(), f"regenerate with TIDE_UPDATE_EXPECTED=1 if intended: {EXPECTED}"


def test_a_coordinator_of_its_own_is_het_group_0_of_three() -> None:
    """`slurm.coordinator`: its one CPU task first (rank 0), then serving and training; one srun over all."""
    coord = CoordinatorComponent("login")
    spec = JobSpec.for_runtime(SlurmConfig(coordinator=coord), "/c.yaml", "/runs/x", python="python")
    text = script.render_hetjob_script(spec)
    assert [line for line in text.splitlines() if line.startswith("# het group")] == [
        "# het group 0: coordinator", "# het group 1: serving", "# het group 2: draft training"]
    first = sbatch_options(text)[0]  # with the job-wide --requeue and --open-mode
    asked = ["partition=login", "nodes=1", "ntasks-per-node=1", "cpus-per-task=2"]
    assert {f"#SBATCH --{o}" for o in asked} < set(first)
    assert not [line for line in first if "gpus" in line]
    assert re.search(r"^tide_step \d+ \S+ srun --het-group=0,1,2 --mpi=pmix ", text, re.M)


def sbatch_options(text: str) -> list[list[str]]:
    """Per het component, its `#SBATCH --opt=value` lines (job-wide name and log paths left out)."""
    comps: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH --") and not re.match(r"#SBATCH --(job-name|output|error|signal)=", line):
            comps[-1].append(line)
    return [sorted(c) for c in comps]


def test_standalone_script_asks_for_the_default_config() -> None:
    """slurm/tide_hetjob.sh's #SBATCH lines (which users edit) start equal to SlurmConfig's defaults
    (but --signal: a rendered script sizes it from its time; the standalone one's guard reads the time
    left instead, which follows an --time given to sbatch)."""
    assert sbatch_options(STANDALONE.read_text()) == sbatch_options(script.render_hetjob_script(expected_spec()))


def test_config_section_is_strict(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("slurm:\n  time: 30\n  train: {partition: mi250x, nodes: 2}\n  env: {NCCL_DEBUG: INFO}\n")
    cfg = script.load_slurm_config(p)
    assert cfg.time == 30 and cfg.serve == ServeComponent()
    assert cfg.train == TrainComponent(partition="mi250x", nodes=2)  # the rest: MI250 defaults
    assert (cfg.train.ntasks_per_node, cfg.train.gpus_per_node) == (4, 4)
    assert cfg.env == {"NCCL_DEBUG": "INFO"}
    p.write_text("slurm:\n  serve: {gpus_pre_node: 4}\n")
    with pytest.raises(ConfigError, match="slurm.serve.gpus_pre_node: unknown key; did you mean gpus_per_node"):
        script.load_slurm_config(p)
    with pytest.raises(ValueError, match="Component.nodes: must be >= 1"):
        Component("h100", nodes=0)


def test_cli_dry_run_prints_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slurm:\n  time: 30\n  train: {partition: gpu_train}\n")
    out = tmp_path / "out"
    assert submit.main(["--config", str(cfg), "--out", str(out), "--executor", "sbatch", "--dry-run"]) == 0
    spec = JobSpec.for_runtime(SlurmConfig(time=30, train=TrainComponent("gpu_train")), cfg, out)
    assert capsys.readouterr().out == script.render_hetjob_script(spec) + "\n"
    assert not out.exists()  # nothing submitted, nothing made
    cfg.write_text("slurm:\n  serve: {nodes: 0}\n")
    assert submit.main(["--config", str(cfg), "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tide.cluster: error: {cfg}: slurm"), err
    assert err.endswith(": Component.nodes: must be >= 1, got 0\n"), err


def test_submitit_script_is_a_het_job(tmp_path: Path) -> None:
    if not shutil.which("srun"):
        pytest.skip("submitit's SlurmExecutor insists on finding srun")
    text = submit.dry_run(probe_spec(tmp_path), "slurm")
    train = ["time=2", "partition=gpu_train", "nodes=2", "ntasks-per-node=1", "gpus-per-node=2", "cpus-per-task=2"]
    assert sbatch_options(text)[1] == sorted(f"#SBATCH --{o}" for o in train)
    (srun,) = [line for line in text.splitlines() if line.startswith("tide_step ")]
    assert srun.startswith(f'tide_step 60 "{tmp_path}/submitit/.step-${{SLURM_JOB_ID}}" srun --het-group=0,1 '
                           "--mpi=pmix --unbuffered -- bash -c ")
    assert script.STEP_GUARD in text
    assert "%j" not in srun and "%t" not in srun  # srun expands both per component: see HetSlurmExecutor
    assert f"{tmp_path}/submitit/${{SLURM_JOB_ID}}_${{SLURM_PROCID}}_log.err" in srun


FAKE_SRUN = """#!/bin/bash
# runs its command as ranks 0..2 here (0 and 1 serve, 2 trains), then returns (ok), exits 9 (fail)
# or never returns, ignoring TERM (hang)
while [[ $1 == --* ]]; do shift; done
for r in 0 1 2; do SLURM_PROCID=$r "$@" >/dev/null 2>&1 & done
[[ $FAKE_MODE == hang ]] && trap '' TERM
wait
case $FAKE_MODE in hang) exec sleep 300;; fail) exit 9;; esac
"""


@pytest.mark.parametrize("groups, mode, rank_cmd, timeout_s, rc, message", [*[("2,1", *case) for case in [
    ("ok", "true", 0, 0, None),
    ("fail", "true", 0, 0, None),  # every rank exited 0: srun's own code does not count
    ("hang", "true", 0, 0, "the ranks are done, srun did not return (Slurm het-step hang)"),
    ("ok", "exit $((SLURM_PROCID == 0 ? 5 : 0))", 0, 5, "rank 0 (the coordinator) exited 5: stopping the job"),
    ("ok", "exit $((SLURM_PROCID == 1 ? 5 : 0))", 0, 0, "serving instance 1 exited 5: the other instances go on"),
    ("hang", "[ $SLURM_PROCID = 0 ] && exit 6 || sleep 8", 0, 6, "srun still running 3 s after TERM: killing it"),
    ("fail", "exit $((SLURM_PROCID == 2 ? 7 : 0))", 0, 0,
     "training rank 2 exited 7: training degraded, serving goes on"),
    ("ok", "[ $SLURM_PROCID = 2 ] && sleep 8 || true", 0, 0, "serving is done, ranks still running after 1 s"),
    ("ok", "[ $SLURM_PROCID = 1 ] && sleep 8 || true", 0, 0, "serving is done, ranks still running after 1 s"),
    ("ok", "sleep 3", 1, 143, "srun still running after 1 s: stopping it"),
]], *[("1,1,1", *case) for case in [  # a coordinator of its own: rank 1 serves, rank 2 trains
    ("ok", "exit $((SLURM_PROCID == 1 ? 5 : 0))", 0, 0, "serving instance 1 exited 5: the other instances go on"),
    ("ok", "exit $((SLURM_PROCID == 2 ? 7 : 0))", 0, 0, "training rank 2 exited 7: training degraded"),
    ("ok", "exit $((SLURM_PROCID == 0 ? 5 : 0))", 0, 5, "rank 0 (the coordinator) exited 5: stopping the job"),
]]])
def test_step_guard(tmp_path: Path, groups: str, mode: str, rank_cmd: str, timeout_s: int, rc: int,
                    message: str | None) -> None:
    """tide_step with a fake srun: rank 0 (the coordinator) decides the job's code, a failed serving
    instance or training rank does not end it, and srun's hang after the ranks exit costs
    TIDE_STEP_GRACE, not the job."""
    srun = tmp_path / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    text = (f"{script.STEP_GUARD}\ntide_step {timeout_s} {tmp_path}/step {srun} --label -- bash -c {rank_cmd!r}\n"
            "echo rc=$?\n")
    env = {"PATH": os.environ["PATH"], "FAKE_MODE": mode, "TIDE_STEP_GRACE": "1", "TIDE_TRAIN_GRACE": "1",
           **{f"SLURM_NTASKS_HET_GROUP_{i}": n for i, n in enumerate(groups.split(","))}}
    p = subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=30)
    assert p.stdout.splitlines()[-1] == f"rc={rc}", p
    if message:
        assert message in p.stderr
    else:
        assert "tide:" not in p.stderr, p.stderr
    assert not (tmp_path / "step").exists()


def test_standalone_script_sources_the_one_step_guard() -> None:
    """slurm/tide_hetjob.sh sources the guard the rendered scripts embed: one source for both."""
    assert 'source "${TIDE_HOME:-$SLURM_SUBMIT_DIR}/tide/cluster/tide_step.sh"' in STANDALONE.read_text()
    assert script.STEP_GUARD == script.STEP_GUARD_FILE.read_text() and "tide_step() {" in script.STEP_GUARD


def test_srun_timeout_leaves_a_margin() -> None:
    spec = expected_spec()
    assert spec.srun_timeout_s == 120 * 60 - 300
    assert probe_spec(Path("/x")).srun_timeout_s == 60


def test_states_fold_het_components(monkeypatch: pytest.MonkeyPatch) -> None:
    """scontrol lists one line per component; sacct (after slurmctld forgot the job) rows <id>+k."""
    answers = {
        "scontrol": {"7": (0, "JobId=7 HetJobId=7 HetJobOffset=0 JobState=FAILED\n"
                              "JobId=8 HetJobId=7 HetJobOffset=1 JobState=COMPLETED\n"),
                     "9": (1, "")},
        "sacct": (0, "9+0|COMPLETED\n9+1|CANCELLED by 0\n12|COMPLETED\n"),
    }

    def fake_run(cmd, env=None):
        rc, out = answers["sacct"] if cmd[0] == "sacct" else answers["scontrol"].get(cmd[-1], (1, ""))
        return commands.subprocess.CompletedProcess(cmd, rc, out, "")

    monkeypatch.setattr(commands, "_run", fake_run)
    assert commands.job_states(["7", "9", "12", "13"]) == {"7": "FAILED", "9": "CANCELLED", "12": "COMPLETED",
                                                        "13": "UNKNOWN"}


def test_wait_goes_on_through_states_that_are_not_an_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGNALING (a `--signal` on its way to the ranks) and STAGE_OUT come and go in a moment, too fast
    to catch on the local cluster on demand (the time-limit test in test_faults met SIGNALING once):
    the states are given here."""
    states = iter(["PENDING", "RUNNING", "SIGNALING", "COMPLETING", "STAGE_OUT", "COMPLETED"])
    monkeypatch.setattr(submit, "job_states", lambda ids: {ids[0]: next(states)})
    job = submit.Job("5", Path("o"), Path("e"), Path("."))
    assert submit.wait(job, 60, progress=False, poll_s=0).state == "COMPLETED"


# ---- on the local cluster -------------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_standalone_script_runs_both_groups(cluster: dict[str, str], tmp_path: Path) -> None:
    """`sbatch slurm/tide_hetjob.sh CONFIG OUT` as-is; per-component sizes given on sbatch's command line."""
    serve = ["-p", "gpu_infer", "-N", "1", "--ntasks-per-node=2", "--gpus-per-node=1", "--cpus-per-task=1"]
    train = ["-p", "gpu_train", "-N", "2", "--ntasks-per-node=1", "--gpus-per-node=2", "--cpus-per-task=2"]
    logs = [f"--output={tmp_path}/tide-%j.out", f"--error={tmp_path}/tide-%j.err"]
    out = tmp_path / "out"
    env = {"TIDE_CMD": f"{sys.executable} {PROBE}", "TIDE_PYTHON": sys.executable, "TIDE_SRUN_TIMEOUT": "60"}
    options = [*logs, "--time=2", *serve, ":", "--time=2", *train]
    jid = commands.sbatch(STANDALONE, ["configs/ci.yaml", str(out)], options, env)
    job = Job(jid, tmp_path / f"tide-{jid}.out", tmp_path / f"tide-{jid}.err", out)
    res = submit.wait(job, WAIT_S)
    text = res.stdout.read_text()
    assert res.state == "COMPLETED" and out.is_dir()
    assert f"tide: job {jid}: serving on n0 (gpu_infer), training on n[2-3] (gpu_train)" in text
    assert_one_world_over_both_groups(probe_lines(text), jid)


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_standalone_script_runs_a_coordinator_of_its_own_first(cluster: dict[str, str], tmp_path: Path) -> None:
    """`sbatch [coordinator] : [serving] : [training] slurm/tide_hetjob.sh`: three components on the command
    line, each given in full (the script's #SBATCH lines describe two, and fill in by position what a
    component leaves out: --gpus-per-node=0 keeps the serving GPUs off the coordinator); one world over
    the three, the coordinator rank 0."""
    coordinator = ["-p", "gpu_train", "-N", "1", "--ntasks-per-node=1", "--gpus-per-node=0", "--cpus-per-task=1"]
    serve = ["-p", "gpu_infer", "-N", "1", "--ntasks-per-node=2", "--gpus-per-node=1", "--cpus-per-task=1"]
    train = ["-p", "gpu_train", "-N", "1", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]
    logs = [f"--output={tmp_path}/tide-%j.out", f"--error={tmp_path}/tide-%j.err"]
    out = tmp_path / "out"
    env = {"TIDE_CMD": f"{sys.executable} {PROBE}", "TIDE_PYTHON": sys.executable, "TIDE_SRUN_TIMEOUT": "60"}
    options = [*logs, "--time=2", *coordinator, ":", "--time=2", *serve, ":", "--time=2", *train]
    jid = commands.sbatch(STANDALONE, ["configs/ci.yaml", str(out)], options, env)
    job = Job(jid, tmp_path / f"tide-{jid}.out", tmp_path / f"tide-{jid}.err", out)
    res = submit.wait(job, WAIT_S)
    text = res.stdout.read_text()
    assert res.state == "COMPLETED"
    assert re.search(rf"tide: job {jid}: coordinator on n[23] \(gpu_train\), serving on n0 \(gpu_infer\), "
                     r"training on n[23] \(gpu_train\)", text), text
    ranks = probe_lines(text)
    assert [(r, ranks[r]["group"], ranks[r]["partition"]) for r in sorted(ranks)] == [
        (0, 0, "gpu_train"), (1, 1, "gpu_infer"), (2, 1, "gpu_infer"), (3, 2, "gpu_train")]
    assert all((d["size"], d["allreduce"], d["job_id"]) == (4, 4, jid) for d in ranks.values())


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_rendered_script_runs_both_groups(cluster: dict[str, str], tmp_path: Path) -> None:
    job = submit.submit(probe_spec(tmp_path), executor="sbatch")
    res = submit.wait(job, WAIT_S)
    assert res.state == "COMPLETED"
    assert (tmp_path / "tide_hetjob.sbatch").read_text() == script.render_hetjob_script(probe_spec(tmp_path))
    assert_one_world_over_both_groups(probe_lines(res.stdout.read_text()), job.job_id)


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_submitit_executor_runs_both_groups(cluster: dict[str, str], tmp_path: Path) -> None:
    """submitit sees the het job as one job of 4 tasks: state COMPLETED (from scontrol, no accounting),
    one result (the probe's stdout) and one log per rank, named by global rank."""
    job = submit.submit(probe_spec(tmp_path), executor="slurm")
    res = submit.wait(job, WAIT_S)
    sjob = job.submitit_job
    assert res.state == "COMPLETED" and sjob is not None
    # submitit's `state` is a cached value (refreshed every few seconds); get_info() forces a refresh
    assert sjob.done() and sjob.get_info(mode="force")["State"] == "COMPLETED" and sjob.state == "COMPLETED"
    results = sjob.results()
    assert len(results) == 4
    ranks = probe_lines("\n".join(results))
    assert_one_world_over_both_groups(ranks, job.job_id)
    for r in range(4):
        assert probe_lines(sjob.task(r).stdout() or "") == {r: ranks[r]}


@pytest.mark.slurm
@pytest.mark.timeout(180)
@pytest.mark.parametrize("executor", ["sbatch", "slurm"])
def test_failure_carries_evidence(cluster: dict[str, str], tmp_path: Path, executor: str) -> None:
    """The serving group fails: tide_step stops the training ranks (blocked in an allreduce) at once."""
    job = submit.submit(probe_spec(tmp_path, "--fail-group", "0"), executor=executor)  # type: ignore[arg-type]
    with pytest.raises(SlurmError) as e:
        submit.wait(job, WAIT_S)
    msg = str(e.value)
    assert e.value.state == "FAILED"
    assert f"Slurm job {job.job_id} did not complete: state FAILED; log {job.stderr}" in msg
    assert re.search(r"mpi_probe: deliberate failure on rank [01] \(het group 0\)", msg)
    # the first serving rank seen to fail; its code is 1 under submitit's runner
    assert re.search(r"tide: (rank 0 \(the coordinator\)|serving instance 1) exited (3|1)", msg)
    if executor == "slurm":
        assert job.submitit_job is not None and job.submitit_job.get_info(mode="force")["State"] == "FAILED"


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_wait_deadline_cancels(cluster: dict[str, str], tmp_path: Path) -> None:
    job = submit.submit(JobSpec(ci_slurm(), ("sleep", "100"), str(tmp_path)), executor="sbatch")
    with pytest.raises(SlurmError, match=rf"Slurm job {job.job_id} still (PENDING|RUNNING) after 5 s, cancelled"):
        submit.wait(job, 5, progress=False)
    for _ in range(60):  # scancel is asynchronous
        state = commands.job_states([job.job_id])[job.job_id]
        if state not in ("PENDING", "RUNNING"):
            break
        time.sleep(0.5)
    assert state in ("CANCELLED", "COMPLETING"), state  # a loaded machine's slurmd can take a minute to clean up


# ---- TIDE itself on the local cluster ------------------------------------------------------------
# configs/ci.yaml under the `always` policy (every trained draft is deployed: the gates are the
# controller tests' business), with 60-step cycles and 64 tokens a request; serving goes on until a
# trained draft has served 32 requests (ci.yaml's `workload.until`), however slow training is that
# day. No no-speculation baseline after serving: it measures nothing these tests look at.
E2E = {"control": {"policy": "always"}, "train": {"max_steps": 60},
       "workload": {"max_tokens": 64, "nospec_baseline": False}}
RUN_WAIT_S = 540  # > the config's srun_timeout_s (480 s) + 30 s to KILL


def assert_trained_draft_served(out: Path) -> None:
    """A draft trained in component 1 (version >= 1) was deployed on rank 0 and served requests, whose
    acceptance was recorded: above one token per step, where the untrained v0 accepts none. (What
    the controller did later, roll back or train again, is the controller tests' business.)"""
    s, reqs = run_results(out)
    deployed = [e["version"] for e in s["events"] if e["kind"] == "deploy"]
    assert s["training"] == "ok" and deployed and min(deployed) >= 1, s["events"]
    assert len(reqs) == s["requests"] >= 128 and s["workload"][0]["until_met"], s["workload"]
    # no second process busy-waiting on a core; one thread per CPU Slurm gave the task (--cpus-per-task=1)
    assert s["serving"]["engine_core"] == "in-process" and s["serving"]["threads"] == 1, s["serving"]
    served = [r for r in reqs if r["draft_version"] >= 1 and r["speculate"]]
    assert served, "no request was served by a trained draft"
    live = AcceptanceHistogram(3, [sum(c) for c in zip(*(r["accept_counts"] for r in served))])
    assert live.acceptance_length > 1.05, live
    meta = DraftRegistry(out / "drafts").meta(min(deployed))
    assert meta["al_after"] > meta["al_before"], meta


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_tide_from_the_standalone_script(cluster: dict[str, str], tmp_path: Path) -> None:
    """`sbatch [sizes of 0] : [sizes of 1] slurm/tide_hetjob.sh CONFIG OUT`: rank 0 serves on gpu_infer,
    rank 1 trains on gpu_train, and the draft rank 1 published is the one rank 0 swapped in."""
    serve = ["-p", "gpu_infer", "-N", "1", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]
    train = ["-p", "gpu_train", "-N", "1", "--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1"]
    logs = [f"--output={tmp_path}/tide-%j.out", f"--error={tmp_path}/tide-%j.err"]
    config, out = ci_config(tmp_path / "ci.yaml", **E2E), tmp_path / "out"
    env = {"TIDE_PYTHON": sys.executable, "TIDE_SRUN_TIMEOUT": "480"}
    options = [*logs, "--time=10", *serve, ":", "--time=10", *train]
    jid = commands.sbatch(STANDALONE, [str(config), str(out)], options, env)
    job = Job(jid, tmp_path / f"tide-{jid}.out", tmp_path / f"tide-{jid}.err", out)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    assert re.search(rf"^tide: job {jid}: serving on n[01] \(gpu_infer\), training on n[23] \(gpu_train\)",
                     job.stdout.read_text(), re.M)
    err = job.stderr.read_bytes().decode()  # not read_text(): it would cut lines at tqdm's \r, before srun's labels
    assert re.search(r"^1: .* trainer: published v1 ", err, re.M), err[-3000:]
    assert re.search(r"^0: .* decision: deploy v1: ", err, re.M), err[-3000:]
    assert not re.search(r"^tide: (serving|training) rank", err, re.M)  # every rank exited 0
    assert_trained_draft_served(out)




def plain_outputs(config: Path, out: Path, served: list[dict]) -> dict[str, list[int]]:
    """The greedy output of a plain vLLM engine (no speculative config) for requests a run served
    (a repeat `ID~k` is the prompt of `ID`)."""
    from tide.serve.engine import Request, TideEngine
    from tide.store.layout import RunLayout
    from tide.workload import build_requests

    cfg = load_config(config)
    run = RunLayout.open(cfg, out)
    prompts = {r.request_id: r for r in build_requests(cfg.workload, run.target.path,
                                                        cfg.serve.max_model_len - cfg.workload.max_tokens - 8)}
    asked = [Request(r["request_id"], prompts[r["request_id"].split("~")[0]].prompt_ids, cfg.workload.max_tokens)
             for r in served]
    engine = TideEngine(run.target, cfg.serve, None, dtype=cfg.model.dtype)
    try:
        results, _ = engine.replay(asked, concurrency=cfg.workload.concurrency, window_s=1e9)
    finally:
        engine.close()
    return {r.request_id: r.output_ids for r in results}


def instance_requests(out: Path, rank: int) -> list[dict]:
    path = out / "instances" / str(rank) / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_instances_share_the_loop(config: Path, out: Path, rows: dict[int, list[dict]],
                                    versions: dict[int, list[int]]) -> None:
    """Each prompt went to one instance; the one trainer learned from every instance's rows; every
    instance swapped to the same trained draft; six requests of each, served by a trained draft,
    have a plain engine's greedy output."""
    base = {rank: {r["request_id"].split("~")[0] for r in reqs} for rank, reqs in rows.items()}
    assert all(base[a].isdisjoint(base[b]) for a in base for b in base if a < b)  # each prompt has one instance
    meta = RunLayout.open(load_config(config), out).target.chunk_meta()
    reg = DraftRegistry(out / "drafts")
    trained = {run.request_id.split("~")[0] for v in range(1, reg.latest() + 1)
               for name in reg.meta(v)["source_chunks"] for run in read_chunk(out / "store" / name, meta)}
    assert all(trained & prompts for prompts in base.values())
    both = set.intersection(*(set(v) for v in versions.values()))
    assert both and min(both) >= 1, versions
    picked = [r for reqs in rows.values() for r in [x for x in reqs if x["speculate"] and x["draft_version"] >= 1][:6]]
    assert len(picked) == 6 * len(rows)
    plain = plain_outputs(config, out, picked)
    assert all(r["output_ids"] == plain[r["request_id"]] for r in picked)


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 120)
def test_two_serving_instances_share_the_store_the_trainer_and_the_drafts(cluster: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """Two serving ranks on two nodes (one vLLM instance each, rank 0 also coordinates) and one trainer
    rank: the workload is split round-robin, both instances capture into the one store, the trainer
    trains on both instances' rows, both swap to the same drafts, and each instance's greedy output
    is a plain engine's."""
    job, config, out = submit_run(tmp_path, slurm={"serve": TWO_INSTANCES}, **E2E)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    err = job.stderr.read_bytes().decode()
    assert re.search(r"^1: .* engine: started in ", err, re.M) and not re.search(r"^tide: (serving|training)", err,
                                                                                 re.M)
    s, reqs = run_results(out)
    first, second = s["instances"]
    assert (first["state"], second["state"], s["spread"]) == ("coordinator", "done", "round-robin")
    other = instance_requests(out, 1)
    assert len(reqs) == first["requests"] and len(other) == second["requests"] > 0
    assert s["total"]["requests"] == len(reqs) + len(other)
    swapped = [e for e in s["events"] if e["kind"] == "swap" and e["data"].get("instance") == 1]
    assert {e["version"] for e in swapped} == set(second["versions"])  # reported to the coordinator
    assert_instances_share_the_loop(config, out, {0: reqs, 1: other}, {0: first["versions"], 1: second["versions"]})


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 120)
def test_a_coordinator_of_its_own_drives_two_instances(cluster: dict[str, str], tmp_path: Path) -> None:
    """`slurm.coordinator`: rank 0, a het group of one CPU task, serves nothing; ranks 1 and 2 (two
    nodes) are the instances and rank 3 trains. Both capture, the trainer trains on both instances'
    rows, both swap to the same drafts, their greedy output is a plain engine's, and the run ends once
    `workload.until` holds over both instances' requests together."""
    coordinator = {"partition": "gpu_train", "cpus_per_task": 1}
    job, config, out = submit_run(tmp_path, slurm={"serve": TWO_INSTANCES, "coordinator": coordinator}, **E2E)
    assert submit.wait(job, RUN_WAIT_S).state == "COMPLETED"
    err = job.stderr.read_bytes().decode()
    assert not re.search(r"^0: .* engine: started in ", err, re.M)  # rank 0 has no engine
    assert re.search(r"^1: .* engine: started in ", err, re.M) and re.search(r"^2: .* engine: started in ", err, re.M)
    assert not re.search(r"^tide: (rank 0|serving|training)", err, re.M)  # every rank exited 0
    s = json.loads((out / "summary.json").read_text())
    assert (s["coordinator"], s["training"], s["until_met"], s["spread"]) == ("dedicated", "ok", True, "round-robin")
    assert [(r["rank"], r["state"]) for r in s["instances"]] == [(1, "done"), (2, "done")]
    rows = {rank: instance_requests(out, rank) for rank in (1, 2)}
    assert s["total"]["requests"] == sum(map(len, rows.values())) and all(rows.values())
    assert any(e["kind"] == "stop" and "until met over all instances" in e["reason"] for e in s["events"])
    assert_instances_share_the_loop(config, out, rows, {r["rank"]: r["versions"] for r in s["instances"]})


@pytest.fixture(scope="module")
def launched(cluster: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """`python -m tide.launch --executor slurm --config CONFIG --out OUT` (sized by ci.yaml's slurm section):
    the config, the run dir and the launcher's stderr."""
    tmp = tmp_path_factory.mktemp("launch-slurm")
    config, out = ci_config(tmp / "ci.yaml", **E2E), tmp / "out"
    p = subprocess.run([sys.executable, "-m", "tide.launch", "--executor", "slurm", "--config", str(config),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=RUN_WAIT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    return config, out, p.stderr


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 60)
def test_tide_from_launch_with_the_slurm_executor(launched: tuple[Path, Path, str]) -> None:
    """Through submitit: one log per rank, named by global rank."""
    _, out, stderr = launched
    (jid,) = re.findall(r"job (\d+) COMPLETED after \d+ s; results in ", stderr)
    assert re.search(r"trainer: published v1 ", (out / "submitit" / f"{jid}_1_log.err").read_text())
    assert re.search(r"decision: deploy v1: ", (out / "submitit" / f"{jid}_0_log.err").read_text())
    assert_trained_draft_served(out)


@pytest.mark.slurm
@pytest.mark.timeout(RUN_WAIT_S + 360)  # the run itself, when this test is the first to ask for it
def test_a_restarted_trainer_resumes_from_the_newest_draft(launched: tuple[Path, Path, str], tmp_path: Path) -> None:
    """A trainer started afresh on the run's files, beside the leftovers of a trainer killed while
    publishing, trains on from the newest published draft, not from scratch."""
    config, out, _ = launched
    reg = DraftRegistry(out / "drafts")
    newest = reg.latest()
    (out / "drafts" / f".v{newest + 1}.tmp-99999").mkdir()  # what a publish cut short leaves behind
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one CPU, as the test cluster gives a training task
    p = subprocess.run([sys.executable, "-m", "tide.train", "--config", str(config), "--out", str(out),
                        "--json", str(tmp_path / "cycle.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads((tmp_path / "cycle.json").read_text())
    assert r["version"] == newest + 1 and reg.meta(newest + 1)["base_version"] == newest
    # a fresh head scores 1.0 on the same data (v1's al_before). The newest draft's own al_after is no
    # bar: it was scored on another held-out set of a few hundred tokens (2.0-3.7 in runs of this test)
    assert r["al_before"] > 1.5 and reg.meta(1)["al_before"] < 1.1, (r["al_before"], reg.meta(1)["al_before"])


def test_the_server_options_reach_every_rank_of_the_job() -> None:
    """`tide.launch --executor slurm --serve`: the ranks get the server's options; rank 0 parses them
    back (bound to every address of the serving node, for clients on the login node)."""
    import argparse

    from tide.runtime import server_options
    from tide.runtime.server_options import HttpOptions

    http = HttpOptions(host="0.0.0.0", port=8100, served_model_name="smol", vllm_args=("--api-key=k",))
    spec = JobSpec.for_runtime(SlurmConfig(), "c.yaml", "/shared/out", extra=http.to_argv())
    assert spec.command[:3] == (sys.executable, "-m", "tide.runtime") and "--serve" in spec.command
    p = argparse.ArgumentParser()
    server_options.add_arguments(p, host="0.0.0.0")
    args, rest = p.parse_known_args(list(spec.command[3:]))
    assert server_options.from_args(args) == http and rest == ["--config", str(Path("c.yaml").absolute()),
                                                               "--out", "/shared/out"]
