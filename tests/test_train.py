"""The DeepSpeed trainer: learns, publishes atomically, resumes, and runs with two processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tide.config import TrainConfig
from tide.draft import DraftRegistry
from tide.train import DraftTrainer
from tide.train.recompute import write_recomputed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tiny_target, tiny_requests, tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "store"
    write_recomputed(tiny_target, path, tiny_requests, workload="tiny", chunk_tokens=1024)
    return path


def make_trainer(tiny_target, store, drafts, steps):
    cfg = TrainConfig(max_steps=steps, batch_tokens=512, lr=3e-3, seq_len=256)
    return DraftTrainer(cfg, tiny_target.path, store, drafts, expect=tiny_target.chunk_meta(),
                        aux_layer_ids=tiny_target.layer_ids, draft_vocab_size=256, eval_fraction=0.2)


def test_training_raises_acceptance_and_resumes(tiny_target, store, tmp_path):
    trainer = make_trainer(tiny_target, store, tmp_path / "drafts", steps=150)
    r1 = trainer.cycle()
    assert r1 is not None and r1.version == 1
    assert r1.al_before < 1.1
    assert r1.al_after >= r1.al_before + 0.25, r1  # a clear margin, not a time
    reg = DraftRegistry(tmp_path / "drafts")
    meta = reg.meta(1)
    assert meta["al_after"] == r1.al_after and meta["steps"] == 150 and meta["source_chunks"]
    assert (reg.path(1) / "model.safetensors").exists()

    again = make_trainer(tiny_target, store, tmp_path / "drafts", steps=20)  # a restarted trainer
    r2 = again.cycle()
    assert r2.version == 2 and reg.meta(2)["base_version"] == 1
    assert abs(r2.al_before - r1.al_after) < 0.05  # it resumed from v1, not from scratch
    assert (r2.live_version, r2.al_live, r2.counts_live) == (1, r2.al_before, r2.counts_before)  # live = base

    r3 = again.cycle(base=2, live=1)  # a chain: from the newest draft, measured against the serving one
    assert (r3.base_version, r3.live_version) == (2, 1) and reg.meta(3)["live_version"] == 1
    assert abs(r3.al_before - r2.al_after) < 0.05 and abs(r3.al_live - r1.al_after) < 0.05


def test_a_long_lived_trainer_keeps_no_cycle_behind(tiny_target, store, tmp_path):
    """Every cycle's DeepSpeed engine (the draft, its optimizer state) and tensors are released when the
    cycle returns, not at some later collection: the soak found a trainer process that kept them all
    and grew by ~300 MB a SmolLM2 cycle until the OOM killer came, and then one that grew by tensors
    waiting in reference cycles. (No gc.collect() here: what is not freed is still among gc's objects.)"""
    import gc

    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    trainer = make_trainer(tiny_target, store, tmp_path / "drafts", steps=5)
    tensors = []
    for _ in range(3):
        assert trainer.cycle() is not None
        assert not [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]
        tensors.append(sum(torch.is_tensor(o) for o in gc.get_objects()))
    assert tensors[2] == tensors[0], tensors


def test_no_data_is_not_an_error(tiny_target, tmp_path):
    assert make_trainer(tiny_target, tmp_path / "empty", tmp_path / "drafts", steps=5).cycle() is None


def test_two_processes_with_torchrun(tiny_target, store, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(store, out / "store")
    cfg = {"model": {"target": str(tiny_target.path), "aux_layer_ids": list(tiny_target.layer_ids)},
           "draft": {"draft_vocab_size": 256}, "store": {"eval_fraction": 0.2},
           "train": {"max_steps": 20, "batch_tokens": 512, "seq_len": 256}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tide.train",
                        "--config", str(tmp_path / "c.yaml"), "--out", str(out), "--json", str(tmp_path / "r.json")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["version"] == 1 and result["steps"] == 20
    assert DraftRegistry(out / "drafts").latest() == 1


def test_bad_config_is_one_line(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  ttt_depht: 2\n")
    cmd = [sys.executable, "-m", "tide.train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path)]
    p = subprocess.run(cmd,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (f"tide.train: error: {tmp_path / 'c.yaml'}: train.ttt_depht: "
                                                 "unknown key; did you mean ttt_depth?")


def test_a_row_stored_twice_is_trained_once_from_its_newest_copy():
    """A requeued or restarted job serves its workload again under the same request ids, and the
    store splits a request into runs at other places: a cycle joins a request's runs by position,
    the newest chunk's copy first (ChunkReader.load lists newest first)."""
    import numpy as np

    from tide.store import Run
    from tide.train.data import sequences

    def run(first: int, n: int, mark: int) -> Run:
        pos = np.arange(first, first + n, dtype=np.int32)
        return Run("HumanEval/1", pos.copy(), pos, np.full((n, 6), mark, np.uint16), np.ones(n, bool))

    (seq,) = sequences([run(5, 10, 2), run(0, 8, 1)], max_len=64)  # newest first, overlapping 5..7
    assert seq.tokens.tolist() == list(range(15))
    assert seq.aux[:, 0].tolist() == [1] * 5 + [2] * 10
