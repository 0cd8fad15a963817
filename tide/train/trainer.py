"""DeepSpeed draft trainer: one training cycle = read the chunk window, train with training-time
test, evaluate simulated acceptance before and after, publish `drafts/vN/`.

Device-agnostic: DeepSpeed's accelerator picks CUDA, ROCm or CPU; nothing here names a device.
Run with one process or several (torchrun / deepspeed launcher): every rank reads the same files
and takes its share of the batches; rank 0 evaluates and publishes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tide.config import TideConfig, TrainConfig
from tide.draft import DraftRegistry, Eagle3Draft, init_draft, load_draft, set_vocab, target_heads
from tide.draft.acceptance import AcceptanceHistogram
from tide.model.target import Target
from tide.store import ChunkMeta, ChunkReader, Run, bf16_to_u16, is_eval
from tide.train.data import Batch, Sequence, batches, sequences
from tide.train.objective import simulate_acceptance, ttt_loss
from tide.train.precision import use_bf16

if TYPE_CHECKING:
    from tide.store.layout import RunLayout

log = logging.getLogger(__name__)


def release_memory() -> None:
    """Free what a cycle left: its tensors sit in reference cycles (DeepSpeed's engine, autograd) until
    a full collection, and glibc keeps freed heap pages. The soak's trainer grew 2.3 -> 4.1 GiB over 8
    SmolLM2 cycles on the same rows without this, and stayed at 1.10-1.13 GiB over 10 with it."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


class _Objective(nn.Module):
    """The draft plus its loss, so that DeepSpeed's engine runs the whole forward."""

    def __init__(self, draft: Eagle3Draft, depth: int, decay: float) -> None:
        super().__init__()
        self.draft, self.depth, self.decay = draft, depth, decay

    def forward(self, b: Batch) -> tuple[torch.Tensor, list[float]]:
        return ttt_loss(self.draft, b, self.depth, self.decay)


def init_distributed() -> tuple[int, int]:
    """Join (or, for a single process, create) the trainer group; returns (rank, world size)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    if "WORLD_SIZE" in os.environ:  # started by a launcher (srun, torchrun, mpirun)
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    single = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ.update(single)
    os.environ.setdefault("LOCAL_RANK", "0")  # a caller may have picked the device
    try:
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    finally:  # a child of this process must not think it joins this one-process group
        for key in single:
            os.environ.pop(key, None)
    return 0, 1


def deepspeed_config(cfg: TrainConfig, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed JSON, a pure function of the config."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def rebuild_vocab(model: Eagle3Draft, seqs: list[Sequence], target_head: torch.Tensor) -> float:
    """Make the draft vocabulary the most frequent output tokens of `seqs` (prompt tokens break
    ties, current members after them, so a quiet token keeps its trained row). Returns coverage:
    the share of output tokens inside the new vocabulary."""
    s = model.spec
    if s.draft_vocab_size == s.vocab_size or not seqs:
        return 1.0
    counts = torch.zeros(s.vocab_size, dtype=torch.float64)
    for q in seqs:
        t = torch.from_numpy(q.tokens)
        m = torch.from_numpy(q.is_output)
        counts += 1e6 * torch.bincount(t[m], minlength=s.vocab_size) + torch.bincount(t[~m], minlength=s.vocab_size)
    counts += model.t2d.to(torch.float64) * 0.5
    ids = counts.topk(s.draft_vocab_size).indices
    set_vocab(model, ids, target_head)
    out_counts = counts // 1e6
    return float(out_counts[ids].sum() / max(out_counts.sum(), 1))


@dataclass
class CycleResult:
    version: int
    al_before: float
    al_after: float
    train_tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    final_loss: float
    vocab_coverage: float
    source_chunks: list[str]
    recompute_s: float = 0.0  # train.signals = recompute: time the target spent regenerating hidden states
    base_version: int = 0  # the draft this cycle started from (al_before is its figure)
    live_version: int = 0  # the draft serving when the cycle was asked (al_live; = al_before when it is the base)
    al_live: float = 0.0
    counts_live: list[int] = field(default_factory=list)
    counts_before: list[int] = field(default_factory=list)  # the held-out walk's acceptance histograms
    counts_after: list[int] = field(default_factory=list)
    rows: int = 0  # rows of the cycle's sequences (train and held-out): each (request, position) once

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class DraftTrainer:
    """Trains the draft for `target_dir` from the chunks under `store_root`; publishes to `drafts_root`."""

    def __init__(self, cfg: TrainConfig, target_dir: Path, store_root: Path, drafts_root: Path, *,
                 expect: ChunkMeta | None = None, aux_layer_ids: tuple[int, ...] = (), draft_vocab_size: int = 0,
                 eval_fraction: float = 0.1, init_dir: str = "") -> None:
        self.cfg, self.target_dir = cfg, Path(target_dir)
        self.reader = ChunkReader(Path(store_root), expect)
        self.registry = DraftRegistry(Path(drafts_root))
        self.aux_layer_ids, self.draft_vocab_size = aux_layer_ids, draft_vocab_size
        self.eval_fraction, self.init_dir = eval_fraction, init_dir
        self.rank, self.world = init_distributed()
        self.bf16 = use_bf16(cfg.precision)
        self._recompute: Any = None  # tide.train.recompute.Recompute, built on first use
        self._recomputed: dict[tuple[str, int, int], Any] = {}
        self.recompute_s = 0.0

    @classmethod
    def from_config(cls, cfg: TideConfig, run: RunLayout) -> DraftTrainer:
        return cls(cfg.train, run.target.path, run.store, run.drafts, expect=run.target.chunk_meta(),
                   aux_layer_ids=run.target.layer_ids, draft_vocab_size=cfg.draft.draft_vocab_size,
                   eval_fraction=cfg.store.eval_fraction, init_dir=cfg.draft.init)

    def shutdown(self) -> None:
        """Leave the process group cleanly (an abrupt exit aborts now and then with gloo)."""
        if torch.distributed.is_initialized():
            _barrier()
            torch.distributed.destroy_process_group()

    def current_draft(self, base: int | None = None) -> tuple[int, Eagle3Draft]:
        """Start from published draft `base` (the one serving, so that the new draft is measured against
        it); None: resume from the newest published draft (or the configured initial one, or a fresh head)."""
        if base is not None and (self.registry.path(base) / "model.safetensors").exists():
            return base, load_draft(self.registry.path(base), self.target_dir)
        v = self.registry.latest()
        if v:
            return v, load_draft(self.registry.path(v), self.target_dir)
        if self.init_dir:
            return 0, load_draft(Path(self.init_dir), self.target_dir)
        return 0, init_draft(self.target_dir, self.aux_layer_ids, self.draft_vocab_size, seed=self.cfg.seed)

    def cycle(self, window_tokens: int | None = None, since_ns: int = 0, base: int | None = None,
              on_progress: Callable[[dict[str, Any]], None] | None = None,
              workloads: tuple[str, ...] = (), train_rows: int = 0, live: int | None = None) -> CycleResult | None:
        """One training cycle from draft `base` (see `current_draft`) over the newest `window_tokens`
        stored tokens written from `since_ns` on (only runs of `workloads`, when given; of the training
        split only the first `train_rows` rows, when given: a data-efficiency curve on one held-out
        split). Published draft `live`, when it is not the base (a chain of cycles starts from the
        newest undeployed draft), is evaluated on the same held-out data: the bar a deploy must clear.
        None if there is no data. The cycle's memory goes back to the system before it returns."""
        try:
            return self._cycle(window_tokens, since_ns, base, on_progress, workloads, train_rows, live)
        finally:
            release_memory()

    def _cycle(self, window_tokens: int | None, since_ns: int, base: int | None,
               on_progress: Callable[[dict[str, Any]], None] | None, workloads: tuple[str, ...],
               train_rows: int, live: int | None) -> CycleResult | None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        t_start, recompute_s = time.time(), self.recompute_s
        cfg = self.cfg
        report = _reporter(on_progress if self.rank == 0 else None)
        report("read")
        chunks = self.reader.list_chunks(window_tokens, since_ns)
        runs = self._signals([r for r in self.reader.load(window_tokens, since_ns=since_ns)  # read, verified once
                              if not workloads or r.workload in workloads])
        train, held = (sequences([r for r in runs if is_eval(r.request_id, self.eval_fraction) == e], cfg.seq_len)
                       for e in (False, True))
        if train_rows:
            cumulative = itertools.accumulate(len(q) for q in train)
            train = [q for q, before in zip(train, [0, *cumulative]) if before < train_rows]
        if not train or not held:
            log.warning("trainer: not enough data (%d train / %d eval sequences)", len(train), len(held))
            return None
        base_version, draft = self.current_draft(base)
        _, head = target_heads(self.target_dir)
        coverage = rebuild_vocab(draft, train, head)
        device = torch.device(get_accelerator().device_name())
        eval_batches = batches(held, cfg.batch_tokens, cfg.gamma, shuffle=False)
        report("eval")
        before = live_hist = self._evaluate(draft, eval_batches, device)
        live_version = base_version
        if live is not None and live != base_version and (self.registry.path(live) / "model.safetensors").exists():
            live_version, serving = live, load_draft(self.registry.path(live), self.target_dir)
            rebuild_vocab(serving, train, head)  # as the base: the bar is the same draft the trainer would publish
            live_hist = self._evaluate(serving, eval_batches, device)
            del serving

        train_batches = batches(train, cfg.batch_tokens, cfg.ttt_depth, shuffle=True, seed=cfg.seed + base_version,
                                prompt_loss=cfg.prompt_loss)
        mine = train_batches[self.rank :: self.world] or train_batches[:1]
        total = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(mine)))
        warm = max(1, int(total * cfg.warmup_frac))
        objective = _Objective(draft, cfg.ttt_depth, cfg.ttt_decay)
        params = [p for p in objective.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * max(0.05, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
        engine, _, _, _ = deepspeed.initialize(model=objective, optimizer=opt, lr_scheduler=sched,
                                               config=deepspeed_config(cfg, self.bf16))
        try:  # without destroy() DeepSpeed keeps every cycle's engine (draft and optimizer state) alive
            tokens, loss_v, t_train = 0, float("nan"), time.time()
            best = _Best(before.acceptance_length, cfg.patience)
            bar = _progress(total, self.rank == 0)
            for step in range(total):
                b = mine[step % len(mine)].to(device)
                loss, accs = engine(b)
                engine.backward(loss)
                engine.step()
                tokens += b.num_tokens
                loss_v = loss.item()
                rate = tokens / max(time.time() - t_train, 1e-9)
                bar.set_postfix(loss=f"{loss_v:.3f}", acc0=f"{accs[0]:.2f}", tok_s=f"{rate:.0f}", refresh=False)
                bar.update()
                report("train", step + 1, total, loss_v, rate)
                if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total:  # every rank: same data
                    al = self._evaluate(engine.module.draft, eval_batches, device).acceptance_length
                    log.info("trainer: step %d held-out AL %.3f (best %.3f)", step + 1, al, best.al)
                    if best.stop(al, engine.module.draft):
                        log.info("trainer: no gain in %d evaluations: stopping at step %d", cfg.patience, step + 1)
                        total = step + 1
                        break
            bar.close()
            train_s = time.time() - t_train
            trained = engine.module.draft
        finally:
            engine.destroy()
        best.restore(trained, self._evaluate(trained, eval_batches, device).acceptance_length if best.saved else 0.0)
        trained.float()
        result = CycleResult(version=0, al_before=before.acceptance_length, al_after=0.0,
                             counts_before=list(before.counts), train_tokens=tokens * self.world,
                             steps=total, wall_s=0.0, tokens_per_s=tokens * self.world / max(train_s, 1e-9),
                             final_loss=loss_v, vocab_coverage=coverage, source_chunks=[p.name for p in chunks],
                             recompute_s=self.recompute_s - recompute_s, base_version=base_version,
                             live_version=live_version, al_live=live_hist.acceptance_length,
                             counts_live=list(live_hist.counts),
                             rows=sum(len(q.tokens) for q in (*train, *held)))
        if self.rank == 0:
            report("publish", total, total, loss_v)
            after = self._evaluate(trained, eval_batches, device)
            result.al_after, result.counts_after = after.acceptance_length, list(after.counts)
            result.wall_s = time.time() - t_start
            target = {"target_hash": self.reader.expect.target_hash} if self.reader.expect else {}
            result.version = self.registry.publish(trained.cpu(), {**result.to_json(), **target})
            log.info("trainer: published v%d  AL %.3f -> %.3f  (%d tokens, %d steps, %.0f s)", result.version,
                     result.al_before, result.al_after, result.train_tokens, total, result.wall_s)
        _barrier()
        return result

    def _signals(self, runs: list[Run]) -> list[Run]:
        """`train.signals: recompute`: the target (transformers) regenerates each run's hidden states
        from its tokens, once per request; `recompute_s` counts the time. Captured runs pass through."""
        if self.cfg.signals == "captured":
            return runs
        if self._recompute is None:
            from tide.train.recompute import Recompute

            self._recompute = Recompute(Target.open(self.target_dir, self.aux_layer_ids))
        t0, out = time.time(), []
        for r in runs:
            key = (r.request_id, int(r.positions[0]), len(r))
            if key not in self._recomputed:
                rows = self._recompute.rows([*r.tokens.tolist(), 0])  # rows of every token given
                self._recomputed[key] = bf16_to_u16(rows)
            out.append(dataclasses.replace(r, hidden=self._recomputed[key]))
        self.recompute_s += time.time() - t0
        return out

    def evaluate(self, draft: Eagle3Draft, runs: list[Run]) -> AcceptanceHistogram:
        """The held-out walk of `draft` over `runs` (any captured requests, e.g. one domain's)."""
        from deepspeed.accelerator import get_accelerator

        held = batches(sequences(runs, self.cfg.seq_len), self.cfg.batch_tokens, self.cfg.gamma, shuffle=False)
        return self._evaluate(draft, held, torch.device(get_accelerator().device_name()))

    def _evaluate(self, draft: Eagle3Draft, eval_batches: list[Batch], device: torch.device) -> AcceptanceHistogram:
        draft = draft.to(device).eval()
        hist = simulate_acceptance(draft, [b.to(device) for b in eval_batches], self.cfg.gamma)
        draft.train()
        return hist


class _Best:
    """Early stopping: the best held-out AL seen and its weights; `stop` after `patience` evaluations
    without a gain."""

    def __init__(self, al: float, patience: int) -> None:
        self.al, self.patience, self.stale = al, patience, 0
        self.saved: dict[str, torch.Tensor] | None = None

    def stop(self, al: float, draft: Eagle3Draft) -> bool:
        if al > self.al:
            self.al, self.stale = al, 0
            self.saved = {k: v.detach().clone() for k, v in draft.state_dict().items()}
            return False
        self.stale += 1
        return self.stale >= self.patience

    def restore(self, draft: Eagle3Draft, final_al: float) -> None:
        """Put the best weights back if the last ones are worse."""
        if self.saved is not None and final_al < self.al:
            draft.load_state_dict(self.saved)


def _reporter(on_progress: Callable[[dict[str, Any]], None] | None) -> Callable[..., None]:
    """report(phase, step, steps, loss, tokens_per_s) -> on_progress(dict), or nothing without one."""

    def report(phase: str, step: int = 0, steps: int = 0, loss: float = math.nan, tokens_per_s: float = 0.0) -> None:
        if on_progress is not None:
            on_progress(dict(phase=phase, step=step, steps=steps, loss=loss, tokens_per_s=tokens_per_s))

    return report


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _progress(total: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step", disable=not show, leave=False, dynamic_ncols=True,
                mininterval=2.0)
