"""Config loading: every bad file gives one line `FILE: key.path: what is wrong`."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from tide.config import ConfigError, TideConfig, from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_load(name: str) -> None:
    path = ROOT / "configs" / name
    if name.startswith("base-draft"):  # a TideConfig plus the base_draft section, read by its workflow
        from workflows.base_draft import BaseDraftConfig, load

        cfg, bd = load(path)
        assert isinstance(bd, BaseDraftConfig)
    else:
        cfg = load_config(path)
    assert isinstance(cfg, TideConfig)


def test_values_are_typed(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "train:\n  lr: 1\n  ttt_depth: 5\nmodel:\n  aux_layer_ids: [1, 2, 3]\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.ttt_depth == 5 and cfg.model.aux_layer_ids == (1, 2, 3)
    assert cfg.serve == TideConfig().serve  # untouched sections keep their defaults


def one_line_error(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    return msg


def test_unknown_key_suggests_the_valid_one(tmp_path: Path) -> None:
    p = write(tmp_path, "train:\n  ttt_dept: 3\n")
    assert one_line_error(p) == f"{p}: train.ttt_dept: unknown key; did you mean ttt_depth?"


def test_unknown_section_lists_valid_keys(tmp_path: Path) -> None:
    msg = one_line_error(write(tmp_path, "zzz: {}\n"))
    assert "zzz: unknown key" in msg and "model" in msg


def test_wrong_type_names_the_path(tmp_path: Path) -> None:
    msg = one_line_error(write(tmp_path, "serve:\n  max_num_seqs: many\n"))
    assert "serve.max_num_seqs: expected int, got str 'many'" in msg
    msg = one_line_error(write(tmp_path, "model:\n  aux_layer_ids: [1, x]\n"))
    assert "model.aux_layer_ids[1]: expected int" in msg
    msg = one_line_error(write(tmp_path, "train:\n  zero_stage: 3\n"))
    assert "train.zero_stage: must be one of [0, 1, 2]" in msg
    msg = one_line_error(write(tmp_path, "train: 5\n"))
    assert "train: expected a mapping" in msg


def test_bool_is_not_an_int(tmp_path: Path) -> None:
    assert "expected int, got bool" in one_line_error(write(tmp_path, "serve:\n  max_num_seqs: true\n"))


def test_missing_required_value() -> None:
    @dataclass(frozen=True)
    class Job:
        partition: str
        nodes: int = 1

    with pytest.raises(ConfigError, match=r"^job.yaml: partition: required value is missing$"):
        from_dict(Job, {"nodes": 2}, source="job.yaml")


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    assert "cannot read" in one_line_error(tmp_path / "absent.yaml")
    assert "not valid YAML" in one_line_error(write(tmp_path, "a: [1,\n"))


def test_a_section_check_names_the_section(tmp_path: Path) -> None:
    p = write(tmp_path, "control:\n  policy: sometimes\n")
    bad_policy = rf"^{p}: control: policy: 'sometimes' is not one of adaptive, always, frozen, nospec$"
    with pytest.raises(ConfigError, match=bad_policy):
        load_config(p)


def test_a_serving_node_needs_a_gpu_per_rank_and_tensor_parallel_shard(tmp_path: Path) -> None:
    p = write(tmp_path, "serve:\n  tensor_parallel_size: 2\n")  # the default node: 8 ranks on 8 GPUs
    assert one_line_error(p) == (f"{p}: slurm.serve.gpus_per_node = 8: must be >= ntasks_per_node (8) x "
                                 "serve.tensor_parallel_size (2): each serving rank is one vLLM instance of 2 GPU(s)")
    cfg = load_config(write(tmp_path, "serve: {tensor_parallel_size: 2}\nslurm: {serve: {ntasks_per_node: 4}}\n"))
    assert cfg.serve.tensor_parallel_size == 2
    assert "tensor_parallel_size" in one_line_error(write(tmp_path, "serve: {tensor_parallel_size: 0}\n"))


def test_a_coordinator_of_its_own_is_one_cpu_task(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "slurm: {coordinator: {partition: login}}\n"))
    assert cfg.slurm.coordinator is not None and cfg.slurm.coordinator.sbatch_options() == {
        "partition": "login", "nodes": 1, "ntasks_per_node": 1, "cpus_per_task": 2}
    assert load_config(write(tmp_path, "slurm: {}\n")).slurm.coordinator is None  # rank 0 coordinates and serves
    p = write(tmp_path, "slurm: {coordinator: {ntasks_per_node: 2}}\n")
    assert one_line_error(p) == (f"{p}: slurm.coordinator: CoordinatorComponent: one task on one node and no GPU "
                                 "(nodes 1, ntasks_per_node 1, gpus_per_node 0), got 1 x 2, 0 GPUs")


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "experiments").glob("*.yaml")))
def test_shipped_experiments_load(name: str) -> None:
    from workflows.replay.runner import load_experiment

    cfg, spec, replay = load_experiment(ROOT / "configs" / "experiments" / name)
    assert spec.phases and replay.modes and cfg.model.target
