"""`draft-learning` and `training-cycle`: SmolLM2-135M answers GSM8K itself (vLLM, greedy, as TIDE
would serve it); a fresh head learns from the hidden states of those answers."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from tide.config import ServeConfig, TrainConfig, load_config
from tide.model.target import Target
from tide.serve.engine import TideEngine
from tide.train.recompute import write_recomputed
from workflows.bench.common import DEFAULT, smollm2

log = logging.getLogger(__name__)


def answers(target: Target, work: Path, data: Path, n: int,
            max_tokens: int = 192) -> list[tuple[str, list[int], list[int]]]:
    """(id, prompt ids, greedy output ids) for the first n GSM8K train questions; cached in `work`."""
    from tide.config import WorkloadConfig
    from tide.workload import build_requests

    cache = work / f"answers-{n}-{max_tokens}.jsonl"
    if cache.exists():
        return [tuple(json.loads(line)) for line in cache.read_text().splitlines()]  # type: ignore[misc]
    reqs = build_requests(WorkloadConfig(dataset="gsm8k", path=str(data / "gsm8k" / "train.jsonl"),
                                         num_prompts=100_000, max_tokens=max_tokens), target.path, 1024)[:n]
    eng = TideEngine(target, ServeConfig(max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=2048), None,
                     dtype=load_config(DEFAULT).model.dtype)
    done = [0]

    def progress(w) -> None:
        done[0] += w.tokens
        log.info("answers: %d tokens generated, %.0f tok/s", done[0], w.tokens_per_s)

    try:
        res, _ = eng.replay(reqs, concurrency=16, window_s=30.0, on_window=progress)
    finally:
        eng.close()
    prompts = {r.request_id: r.prompt_ids for r in reqs}
    out = [(r.request_id, prompts[r.request_id], r.output_ids) for r in res]
    work.mkdir(parents=True, exist_ok=True)
    cache.write_text("".join(json.dumps(o) + "\n" for o in out))
    return out


def _train_cfg() -> TrainConfig:
    """The embedded default's trainer settings (its cycle), evaluated at gamma 3 (the issue's and the
    paper's figure) whatever K the default serves with."""
    return dataclasses.replace(load_config(DEFAULT).train, gamma=3)


# draft-learning trains with the draft-recipe curve's best recipe (16 epochs at lr 1e-3, held-out early
# stopping) on the first 64k training rows of the curve's 400 questions (its held-out set: 15% of them):
# what a draft learns from that much of one domain
RECIPE = TrainConfig(lr=1e-3, epochs=16.0, eval_every=100, patience=2, gamma=3)
RECIPE_ROWS, RECIPE_QUESTIONS = 64_000, 400


def _cycle(target: Target, store: Path, drafts: Path, cfg: TrainConfig, train_rows: int = 0):
    from tide.train import DraftTrainer

    shutil.rmtree(drafts, ignore_errors=True)
    trainer = DraftTrainer(cfg, target.path, store, drafts, expect=target.chunk_meta(), aux_layer_ids=target.layer_ids,
                           draft_vocab_size=8192, eval_fraction=0.15)
    return trainer.cycle(train_rows=train_rows)


def _recompute_and_train(target: Target, work: Path, reqs: list, cfg: TrainConfig, train_rows: int = 0):
    """Hidden states of `reqs` regenerated into a fresh store, then one cycle; (seconds, result)."""
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.time()
    write_recomputed(target, store, reqs, workload="gsm8k")
    return time.time() - t0, _cycle(target, store, work / "drafts", cfg, train_rows)


def draft_learning(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    target = smollm2()
    reqs = answers(target, work, data, 80 if quick else RECIPE_QUESTIONS)
    recompute_s, r = _recompute_and_train(target, work, reqs, RECIPE, RECIPE_ROWS)
    return {"al_before": r.al_before, "al_after": r.al_after, "gamma": RECIPE.gamma,
            "recipe": dataclasses.asdict(RECIPE),
            "max_train_rows": RECIPE_ROWS, "train_tokens": r.train_tokens, "wall_s": r.wall_s, "train_steps": r.steps,
            "train_tokens_per_s": r.tokens_per_s, "vocab_coverage": r.vocab_coverage,
            "questions": len(reqs), "output_tokens": sum(len(o) for _, _, o in reqs),
            "recompute_s": recompute_s, "draft": str(work / "drafts" / f"v{r.version}")}


def training_cycle(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """One draft update from the same fresh tokens: TIDE trains on chunks captured while serving;
    the recompute baseline first regenerates their hidden states with the target, then trains the
    same way. Ratio = recompute time / TIDE time."""
    target = smollm2()
    reqs = answers(target, work.parent / "draft-learning", data, 80 if quick else 200)
    regenerate_s, r = _recompute_and_train(target, work, reqs, _train_cfg())
    tide_s = r.wall_s
    recompute_s = regenerate_s + r.wall_s
    return {"fresh_tokens": sum(len(p) + len(o) - 1 for _, p, o in reqs), "tide_s": tide_s,
            "recompute_s": recompute_s, "regenerate_s": regenerate_s, "recompute_over_tide": recompute_s / tide_s,
            "train_steps": r.steps, "al_after": r.al_after}


def _captured(target: Target, work: Path, data: Path, n: int) -> Path:
    """A store of the hidden states serving captured for the first n GSM8K train questions (TIDE's
    engine, speculation off, the embedded default's dtype); built once in `work`."""
    from tide.config import WorkloadConfig
    from tide.draft import init_draft, save_draft
    from tide.workload import build_requests

    store = work / f"captured-{n}"
    if (store / ".done").exists():
        return store
    shutil.rmtree(store, ignore_errors=True)
    reqs = build_requests(WorkloadConfig(dataset="gsm8k", path=str(data / "gsm8k" / "train.jsonl"),
                                         num_prompts=100_000, max_tokens=192), target.path, 1024)[:n]
    save_draft(init_draft(target.path, target.layer_ids, 8192), work / "v0")
    eng = TideEngine(target, ServeConfig(num_speculative_tokens=1, max_num_seqs=16, max_model_len=2048,
                                         max_num_batched_tokens=2048), work / "v0", store_root=store, chunk_tokens=2048,
                     dtype=load_config(DEFAULT).model.dtype, max_pending_chunks=1 << 16)
    try:
        eng.set_speculation(False)
        eng.replay(reqs, concurrency=16, window_s=60.0)
        eng.flush()
    finally:
        eng.close()
    (store / ".done").touch()
    return store


def draft_recipe(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """What lifts a draft's held-out AL (gamma 3) for SmolLM2 on GSM8K, from rows TIDE captured:
    a data-efficiency curve (8k / 16k / 32k / 64k training rows; captured against recomputed hidden
    states at the same rows), then one change at a time at 32k rows: lr, epochs (with held-out early
    stopping), TTT depth, loss on prompt rows, draft vocabulary (with its token coverage). Every run
    evaluates on the same held-out requests. Each run's row is kept in `work` with what it ran: a
    bench stopped part-way (a time limit) goes on from the next run."""
    from tide.train import DraftTrainer

    target = smollm2()
    store = _captured(target, work, data, 120 if quick else RECIPE_QUESTIONS)
    base = dataclasses.replace(load_config(DEFAULT).train, gamma=3, epochs=4.0, eval_every=100, patience=2)
    sizes = (4000, 8000) if quick else (8000, 16000, 32000, 64000)
    at = sizes[-2]

    def cycle(name: str, rows: int, cfg: TrainConfig, vocab: int = 8192) -> dict[str, Any]:
        done = work / "recipe" / f"{name}.json"
        key = {"store": store.name, "rows": rows, "vocab": vocab, "train": dataclasses.asdict(cfg)}
        if done.exists() and json.loads(done.read_text())["key"] == key:  # the same run, finished before
            return json.loads(done.read_text())["row"]
        drafts = work / "drafts" / name
        shutil.rmtree(drafts, ignore_errors=True)
        t0 = time.time()
        trainer = DraftTrainer(cfg, target.path, store, drafts, expect=target.chunk_meta(),
                               aux_layer_ids=target.layer_ids, draft_vocab_size=vocab, eval_fraction=0.15)
        r = trainer.cycle(train_rows=rows)
        row = {"run": name, "rows": rows, "al": r.al_after, "steps": r.steps, "train_tokens": r.train_tokens,
               "vocab": vocab, "coverage": r.vocab_coverage, "recompute_s": r.recompute_s, "wall_s": time.time() - t0,
               "first_draft_acceptance": 1 - r.counts_after[0] / max(sum(r.counts_after), 1)}
        log.info("draft-recipe: %s", row)
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps({"key": key, "row": row}))
        shutil.rmtree(drafts, ignore_errors=True)  # only the figures are kept
        return row

    curve = [cycle(f"captured-{n}", n, base) for n in sizes]
    curve += [cycle(f"recompute-{n}", n, dataclasses.replace(base, signals="recompute")) for n in sizes]
    sweeps = [cycle(name, at, dataclasses.replace(base, **change), vocab) for name, change, vocab in [
        ("lr-1e-3", {"lr": 1e-3}, 8192), ("lr-4e-3", {"lr": 4e-3}, 8192),
        ("epochs-2", {"epochs": 2.0, "eval_every": 0}, 8192), ("epochs-8", {"epochs": 8.0}, 8192),
        ("ttt-1", {"ttt_depth": 1}, 8192), ("prompt-loss", {"prompt_loss": True}, 8192),
        ("vocab-4k", {}, 4096), ("vocab-16k", {}, 16384)]]
    # the levers that lifted the curve, together, at the most rows
    sweeps += [cycle(name, sizes[-1], dataclasses.replace(base, **change)) for name, change in [
        ("epochs-8-at-max", {"epochs": 8.0}), ("epochs-8-lr-1e-3-at-max", {"epochs": 8.0, "lr": 1e-3}),
        ("epochs-16-lr-1e-3-at-max", {"epochs": 16.0, "lr": 1e-3})]]
    return {"gamma": 3, "defaults": dataclasses.asdict(base), "curve": curve, "sweeps_at_rows": at, "sweeps": sweeps,
            "questions": 120 if quick else RECIPE_QUESTIONS}
