"""The only module that touches vLLM internals: a worker extension (vLLM `worker_extension_cls`).

vLLM appends this class to its worker's bases, so the `tide_*` methods run inside the worker
process with `self` = the worker and are called by name through `collective_rpc` (primitive
arguments only: no pickled callables, no insecure serialization; bulk data moves through files).

Hook points (vLLM 0.32, see the seam notes):
- `runner.execute_model`: marks the start of a step (its scheduled tokens and batch size).
- `runner._sample`: a step in which no request verifies drafts samples as a plain engine does (vLLM
  would take it through the rejection sampler, since a speculative engine always builds spec-decode
  metadata).
- `runner.propose_draft_token_ids` (outer): per-step accepted counts from `sampled_token_ids`
  (-1 marks rejected slots), per request and per draft position; picks this step's draft length k
  from the batch size (`lengths[b]`, set by the speculation gate; every `probe_every`-th step 0, a
  plain step for the latency model); times the step.
- `runner.drafter.propose` (inner): sees the EAGLE-3 aux rows of every scheduled token,
  `target_hidden_states` [N, k*H]. Rows of request i are `query_start_loc[i]:query_start_loc[i+1]`;
  its last `num_rejected[i]` rows are rejected drafts. Kept: prompt rows and accepted rows. It then
  drafts k tokens: vLLM's proposer runs exactly k passes when given `num_speculative_tokens=k`
  (the scheduler and the rejection sampler take any count up to K per request). With k = 0 it
  returns no drafts without running the draft at all; with k = 0 and capture off the outer hook
  returns before vLLM prepares the drafter's inputs, so "off" costs what plain decoding costs up to
  what vLLM's runner and engine core do for any speculative config (spec-decode metadata, the aux
  hidden-state outputs, fetching the empty draft ids: ~0.2 ms a step on CPU). The price of k = 0:
  the draft's KV cache misses the positions decoded while off, so requests that span a switch back
  on draft a little worse until they finish (verification keeps the output exact either way).

Each step's cost is split into the target's part (the step without the draft) and the draft's, by
(batch, scheduled tokens) and by (batch, k): the observations the latency model learns from.

Draft GEMMs in bfloat16 (`ServeConfig.draft_dtype`): vLLM builds the draft in the target's dtype, and
a CPU target serves in float32 (bf16 verify steps round differently from plain ones under batching).
A draft only proposes, so its linear layers can read bf16 weights without changing any output; after
install and every hot-swap (vLLM's reload repacks them in float32) each is repacked as a bf16 oneDNN
GEMM, its float32 weight read back exactly through the layer itself (x = I).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tide.draft.acceptance import AcceptanceHistogram, PositionRates
from tide.draft.io import checked_weights, weight_shapes
from tide.store import ChunkMeta, ChunkWriter, Run, bf16_to_u16


@dataclass
class _Pending:
    """Rows captured so far for one live request (internal vLLM id)."""

    prompt_len: int
    positions: list[np.ndarray] = field(default_factory=list)
    tokens: list[np.ndarray] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)


class _State:
    def __init__(self, gamma: int, max_batch: int) -> None:
        self.gamma = gamma
        self.speculate = True  # master switch; when on, a step at batch b drafts lengths[b]
        self.lengths = [gamma] * (max_batch + 1)
        self.probe_every = 0  # while drafting, every n-th step is a plain one (0: never)
        self.capture = True
        self.version = 0
        self.writer: ChunkWriter | None = None
        self.pending: dict[str, _Pending] = {}  # captured rows of live requests
        self.accepted: dict[str, list[int]] = {}  # accepted drafts per drafting step of live requests
        self.hist = AcceptanceHistogram(gamma)  # since the last tide_stats(reset=True)
        self.rates = PositionRates(gamma)  # the same steps by draft position
        self.steps = 0
        self.captured_rows = 0
        self.target_hash, self.shapes = "", {}  # what a draft swapped in must match
        self.step_start, self.step_tokens, self.step_start_wall = 0.0, 0, 0.0  # of the step in flight
        self.k_next, self.draft_s = 0, 0.0  # this step's draft length, and what drafting took
        # per step: [scheduled tokens, batch, k drafted, seconds without the draft, seconds drafting]
        self.step_costs: list[list[float]] = []
        self.generated = 0  # tokens sampled (bonus + accepted drafts) since the last window
        # closing finished requests in the worker (a server: nobody calls tide_finish): what was closed
        self.auto_close, self.closed = False, []  # type: ignore[var-annotated]
        self.started: dict[str, float] = {}  # wall clock of each live request's first step (for closed ones)
        self.draft_dtype = "target"  # ServeConfig.draft_dtype: the dtype of the draft's GEMMs

    def reset_window(self) -> None:
        self.hist, self.rates = AcceptanceHistogram(self.gamma), PositionRates(self.gamma)
        self.step_costs, self.generated, self.closed = [], 0, []


class TideWorkerExtension:
    _tide: _State

    # ------------------------------------------------------------------ set-up
    def tide_install(self, store_root: str = "", meta: dict[str, Any] | None = None, chunk_tokens: int = 2048,
                     max_pending_chunks: int = 4, retention_tokens: int = 0, capture: bool = True,
                     speculate: bool = True, version: int = 0, auto_close: bool = False,
                     draft_dtype: str = "target") -> dict[str, Any]:
        """Wrap the runner's hooks once; (re)configure capture. Returns what was hooked.

        `auto_close`: the worker closes each request itself when the scheduler drops it (finished,
        aborted, its client gone), with the lengths the scheduler kept; `tide_stats` reports them. For a
        server, where no caller sees every request finish; an engine driven step by step calls
        `tide_finish` with the exact lengths instead. `draft_dtype`: `ServeConfig.draft_dtype`.
        """
        runner = self.model_runner  # type: ignore[attr-defined]
        gamma = self.vllm_config.speculative_config.num_speculative_tokens  # type: ignore[attr-defined]
        if not hasattr(self, "_tide"):
            self._tide = _State(gamma, self.vllm_config.scheduler_config.max_num_seqs)  # type: ignore[attr-defined]
            self._tide_wrap(runner)
            shutdown = self.shutdown  # type: ignore[attr-defined]

            def flush_then_shutdown() -> None:  # an engine stopped by a signal: keep what was captured
                self.tide_flush(close_pending=True)
                self.tide_close()
                shutdown()

            self.shutdown = flush_then_shutdown
        st = self._tide
        st.capture, st.speculate, st.version, st.auto_close = capture, speculate, version, auto_close
        st.draft_dtype = draft_dtype
        st.target_hash = (meta or {}).get("target_hash", "")
        st.shapes = weight_shapes(self.vllm_config.speculative_config.model)  # type: ignore[attr-defined]
        # every worker of a tensor-parallel group holds the same (all-reduced) hidden states: one writes
        if store_root and st.writer is None and getattr(self, "rank", 0) == 0:
            m = meta or {}
            st.writer = ChunkWriter(store_root, ChunkMeta(m["target_id"], m["target_hash"], int(m["hidden_size"]),
                                                          tuple(m["layer_ids"])),
                                    chunk_tokens=chunk_tokens, max_pending_chunks=max_pending_chunks,
                                    retention_tokens=retention_tokens or None)
        return dict(gamma=gamma, drafter=type(runner.drafter).__name__,
                    aux_layers=list(getattr(runner.model, "aux_hidden_state_layers", ()) or ()),
                    draft_gemms=self._tide_draft_gemms())

    def _tide_wrap(self, runner: Any) -> None:
        st = self._tide
        execute_orig = runner.execute_model
        sample_orig = runner._sample
        outer_orig = runner.propose_draft_token_ids
        propose_orig = runner.drafter.propose
        sync = _synchronizer(runner.device)

        def execute_model(scheduler_output, *args, **kwargs):
            if st.auto_close:  # vLLM drops these from runner.requests in this call: close them first
                for rid in scheduler_output.finished_req_ids:
                    self._tide_end_dropped(rid, runner.requests.get(rid))
            st.step_start, st.step_tokens = time.perf_counter(), scheduler_output.total_num_scheduled_tokens
            st.step_start_wall = time.time()
            st.draft_s = 0.0
            return execute_orig(scheduler_output, *args, **kwargs)

        def sample(logits, spec_decode_metadata):
            # vLLM builds spec-decode metadata for every step of a speculative engine and then samples
            # through the rejection sampler, drafts or none: a step without drafts samples as a plain one
            if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
                spec_decode_metadata = None
            return sample_orig(logits, spec_decode_metadata)

        def outer(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                  aux_hidden_states, spec_decode_metadata, common_attn_metadata, slot_mappings):
            req_ids = runner.input_batch.req_ids
            if spec_decode_metadata is None or spec_decode_metadata.max_spec_len == 0:  # one token each
                st.generated += len(req_ids)
            else:  # some request verified drafts this step
                valid = (sampled_token_ids != -1).sum(1).tolist()  # [n] = 1 + accepted
                st.generated += sum(valid)
                for rid, nd, v in zip(req_ids, spec_decode_metadata.num_draft_tokens, valid):
                    if nd > 0:
                        st.hist.add(v - 1)
                        st.rates.add(nd, v - 1)
                        st.accepted.setdefault(rid, []).append(v - 1)
            st.steps += 1
            b = len(req_ids)
            if st.auto_close:
                for rid in req_ids:
                    st.started.setdefault(rid, st.step_start_wall)
            st.k_next = st.lengths[min(b, len(st.lengths) - 1)] if st.speculate else 0
            if st.k_next and st.probe_every and st.steps % st.probe_every == 0:
                st.k_next = 0  # a probe: the next step is plain, T(b, b) measured beside the verify steps
            if st.k_next == 0 and not st.capture:  # nothing to draft or keep: skip vLLM's drafter inputs
                out = torch.empty(b, 0, dtype=torch.int64, device=hidden_states.device)
            else:
                out = outer_orig(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                 sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                 common_attn_metadata, slot_mappings)
            sync()
            took = time.perf_counter() - st.step_start
            st.step_costs.append([st.step_tokens, b, st.k_next, took - st.draft_s, st.draft_s])
            return out

        def propose(**kw):
            if st.capture:
                self._tide_capture(runner, kw)
            if st.k_next == 0:  # no draft's forward at all: off costs what plain decoding costs
                n = kw["common_attn_metadata"].batch_size()
                return torch.empty(n, 0, dtype=torch.int64, device=kw["next_token_ids"].device)
            kw["num_speculative_tokens"] = st.k_next
            sync()
            t0 = time.perf_counter()
            drafts = propose_orig(**kw)
            sync()
            st.draft_s = time.perf_counter() - t0
            return drafts

        runner.execute_model = execute_model
        runner._sample = sample
        runner.propose_draft_token_ids = outer
        runner.drafter.propose = propose

    def _tide_capture(self, runner: Any, kw: dict[str, Any]) -> None:
        """Keep prompt rows and accepted rows: [qsl[i], qsl[i+1] - num_rejected[i]) per request i."""
        cad = kw["common_attn_metadata"]
        n = cad.num_reqs
        qsl = cad.query_start_loc_cpu[: n + 1].tolist()
        nrej_t = kw.get("num_rejected_tokens_gpu")
        nrej = nrej_t[:n].tolist() if nrej_t is not None else [0] * n
        spans = [(qsl[i], qsl[i + 1] - nrej[i]) for i in range(n)]
        idx = torch.cat([torch.arange(a, b) for a, b in spans]) if n else torch.empty(0, dtype=torch.long)
        if idx.numel() == 0:
            return
        hid = _copy_rows(kw["target_hidden_states"], idx)
        pos = kw["target_positions"].index_select(0, idx.to(kw["target_positions"].device)).cpu().numpy()
        tok = kw["target_token_ids"].index_select(0, idx.to(kw["target_token_ids"].device)).cpu().numpy()
        st, at = self._tide, 0
        for rid, (a, b) in zip(runner.input_batch.req_ids[:n], spans):
            m = b - a
            p = st.pending.get(rid)
            if p is None:
                p = st.pending[rid] = _Pending(len(runner.requests[rid].prompt_token_ids))
            p.positions.append(pos[at : at + m])
            p.tokens.append(tok[at : at + m])
            p.hidden.append(hid[at : at + m])
            at += m
        st.captured_rows += at

    # ------------------------------------------------------------------ control
    def tide_set_speculation(self, on: bool) -> bool:
        self._tide.speculate = bool(on)
        return self._tide.speculate

    def tide_set_draft_lengths(self, lengths: list[int]) -> list[int]:
        """The draft length of each batch size (index 0 unused), each clamped to 0..K."""
        st = self._tide
        st.lengths = [min(max(int(k), 0), st.gamma) for k in lengths] or st.lengths
        return st.lengths

    def tide_set_probe(self, every: int) -> int:
        self._tide.probe_every = max(int(every), 0)
        return self._tide.probe_every

    def tide_set_capture(self, on: bool) -> bool:
        self._tide.capture = bool(on)
        return self._tide.capture

    def tide_finish(self, finished: dict[str, list[Any]]) -> dict[str, dict[str, Any]]:
        """Close finished requests: {external id: [num_prompt, num_output, workload]}. Returns per
        request its acceptance histogram and the rows handed to the chunk writer."""
        by_ext = {_external(rid): rid for rid in {*self._tide.pending, *self._tide.accepted}}
        return {ext: self._tide_end_request(by_ext.get(ext, ext), n_prompt, n_output, str(workload))
                for ext, (n_prompt, n_output, workload) in finished.items()}

    def _tide_end_request(self, rid: str, n_prompt: int, n_output: int, workload: str) -> dict[str, Any]:
        """Hand a request's rows to the chunk writer. Rows are trimmed to positions < num_prompt +
        num_output - 1: the last step can see accepted drafts that the scheduler then drops at
        max_tokens or a stop token."""
        st = self._tide
        p = st.pending.pop(rid, None)
        hist = AcceptanceHistogram(st.gamma)
        for a in st.accepted.pop(rid, []):
            hist.add(a)
        rows = 0
        if p and p.positions and st.writer is not None:
            pos = np.concatenate(p.positions)
            keep = pos < n_prompt + n_output - 1
            rows = int(keep.sum())
            run = Run(request_id=_external(rid), tokens=np.concatenate(p.tokens)[keep].astype(np.int32),
                      positions=pos[keep].astype(np.int32), hidden=np.concatenate(p.hidden)[keep],
                      is_output=pos[keep] >= n_prompt, workload=workload,
                      acceptance=hist.acceptance_length if hist.steps else float("nan"),
                      draft_version=st.version if st.speculate else -1)
            if rows and not st.writer.add(run):
                rows = 0
        return dict(accept_counts=hist.counts, rows=rows)

    def _tide_end_dropped(self, rid: str, state: Any) -> None:
        """Close a request the scheduler dropped, with the lengths it kept: its runner state holds
        every sampled token, a final step's surplus included, so cut at max_tokens, the model length
        and the first stop token, as the scheduler does (stop strings are the frontend's: rows past
        one are still the target's own continuation)."""
        st = self._tide
        if rid not in st.pending and rid not in st.accepted:
            return
        if state is None:  # no runner state left (an engine shutting down): keep every row
            p = st.pending.get(rid)
            self._tide_end_request(rid, p.prompt_len if p else 0, 1 << 30, "server")
            return
        sp, out = state.sampling_params, list(state.output_token_ids)
        n_prompt = len(state.prompt_token_ids)
        n = min(len(out), sp.max_tokens or len(out), self.vllm_config.model_config.max_model_len - n_prompt)  # type: ignore[attr-defined]
        stops = set(sp.stop_token_ids or ()) | ({sp.eos_token_id} if sp.eos_token_id is not None else set())
        n = next((i + 1 for i, t in enumerate(out[:n]) if t in stops and i + 1 >= (sp.min_tokens or 0)), n)
        workload = str((sp.extra_args or {}).get("tide_workload", "server"))
        rec = self._tide_end_request(rid, n_prompt, n, workload)
        st.closed.append(dict(request_id=_external(rid), workload=workload, prompt_tokens=n_prompt,
                              output_ids=[int(t) for t in out[:n]], draft_version=st.version,
                              started=st.started.pop(rid, time.time()), finished=time.time(), **rec))

    def tide_stats(self, reset: bool = True) -> dict[str, Any]:
        st = self._tide
        s = dict(accept_counts=list(st.hist.counts), rates=dict(tried=st.rates.tried, accepted=st.rates.accepted),
                 steps=st.steps, captured_rows=st.captured_rows, version=st.version, speculate=st.speculate,
                 lengths=list(st.lengths), capture=st.capture, writer=st.writer.stats() if st.writer else {},
                 step_costs=st.step_costs, generated=st.generated, closed=st.closed)
        if reset:
            st.reset_window()
        return s

    def tide_stored_since(self, since_ns: int) -> int:
        """Rows this worker's writer has on disk in chunks named from `since_ns` on."""
        return self._tide.writer.tokens_since(int(since_ns)) if self._tide.writer is not None else 0

    def tide_flush(self, close_pending: bool = False) -> dict[str, int]:
        """Write whatever the chunk writer buffers (a partial chunk) and wait for it; with
        `close_pending`, first close every request still open (a server stopping: nothing is live)."""
        if close_pending:
            runner = self.model_runner  # type: ignore[attr-defined]
            for rid in {*self._tide.pending, *self._tide.accepted}:
                self._tide_end_dropped(rid, runner.requests.get(rid))
        if self._tide.writer is None:
            return {}
        self._tide.writer.flush()
        return self._tide.writer.stats()

    def tide_close(self) -> None:
        if self._tide.writer is not None:
            self._tide.writer.close()
            self._tide.writer = None

    # ------------------------------------------------------------------ hot-swap
    def tide_load_draft(self, draft_dir: str, version: int) -> dict[str, Any]:
        """Swap the draft's weights in place, between two engine steps.

        vLLM-CPU repacks linear weights after loading, so copying into the parameters alone would
        not change what the model computes; vLLM's layerwise reload re-runs that processing.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        weights = checked_weights(draft_dir, self._tide.shapes, self._tide.target_hash)  # before touching the live one
        model = self.model_runner.get_draft_model()  # type: ignore[attr-defined]
        cfg = self.vllm_config  # type: ignore[attr-defined]
        with set_current_vllm_config(cfg):
            initialize_layerwise_reload(model)
            model.load_weights(list(weights.items()))
            finalize_layerwise_reload(model, cfg.speculative_config.draft_model_config)
        gemms = self._tide_draft_gemms()
        self._tide.version = int(version)
        return dict(version=self._tide.version, pause_ms=(time.perf_counter() - t0) * 1e3, draft_gemms=gemms)

    def _tide_draft_gemms(self) -> str:
        """Repack the draft's float32 linear layers as bf16 GEMMs where `draft_dtype` asks for it ("auto":
        on a CPU with bf16 matmul units); returns the dtype they now compute in. Modules the draft shares
        with the target (the embedding) are left alone."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_draft_model()
        layers = [m for m in model.modules() if callable(getattr(m, "cpu_linear", None))]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        want = self._tide.draft_dtype
        if not layers or dtype != torch.float32 or want == "target" or want == "auto" and not _cpu_bf16_units():
            return str(dtype).removeprefix("torch.")
        target = runner.get_model()
        modules, weights = {id(m) for m in target.modules()}, {p.data_ptr() for p in target.parameters() if p.numel()}
        for layer in layers:
            if id(layer) not in modules and not (layer.weight.numel() and layer.weight.data_ptr() in weights):
                layer.cpu_linear = _bf16_linear(layer)
        return "bfloat16"


def _copy_rows(hidden: torch.Tensor, idx: torch.Tensor) -> np.ndarray:
    """Selected rows as uint16 bf16 bits [m, D] on the host.

    On an accelerator the gather runs on the current stream and the device-to-host copy on a side
    stream into pinned memory. vLLM has already synchronised the step (the sampled tokens went to
    the host) when the drafter is called, so the wait here is the copy itself, which overlaps the
    draft's own kernels; the H200 bench measured such a copy beside a target forward below noise.
    """
    if hidden.device.type == "cpu":
        return bf16_to_u16(hidden.index_select(0, idx))
    rows = hidden.index_select(0, idx.to(hidden.device))
    side = torch.cuda.Stream(device=hidden.device)
    side.wait_stream(torch.cuda.current_stream(hidden.device))
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        rows.record_stream(side)
        host.copy_(rows, non_blocking=True)
    side.synchronize()
    return bf16_to_u16(host)


def _cpu_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): without, a bf16 GEMM is
    slower than a float32 one (docs/BENCHMARKS.md, cpu-gemm)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _bf16_linear(layer: torch.nn.Module) -> Any:
    """A `cpu_linear` for `layer` that computes x W^T + b with W in bf16.

    vLLM-CPU packs a linear layer's float32 weight and drops it. The first time, W is read back through
    that GEMM (x = I: one product per sum, exact) and kept, with vLLM's flag for a layer it leaves
    unpacked: a hot-swap's reload then keeps the new float32 weight too (it copies into the tensors the
    layer had), and the repack after it needs no read-back (~40 ms of GEMMs for SmolLM2's draft)."""
    from vllm import _custom_ops as ops

    if not layer.weight.numel():
        eye = torch.eye(getattr(layer, "input_size_per_partition", layer.input_size))
        layer.weight.data = layer.cpu_linear(eye, layer.weight, None).t().contiguous()  # [N, K]
        layer._cpu_skip_gemm_dispatch = True
    w = layer.weight.detach().to(torch.bfloat16).contiguous()
    bias = layer.bias if getattr(layer, "bias", None) is not None and layer.bias.numel() else None
    try:
        handler = ops.create_onednn_mm(w.t(), 32)  # vLLM's own packing, from a [K, N] view as it passes
        mm = lambda x: ops.onednn_mm(handler, x, None)  # noqa: E731
    except (RuntimeError, AttributeError):  # no oneDNN bf16 primitive on this CPU
        mm = lambda x: torch.nn.functional.linear(x, w)  # noqa: E731

    def linear(x: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        y = mm(x.to(torch.bfloat16)).to(x.dtype)
        return y + bias if bias is not None else y

    return linear


def _external(rid: str) -> str:
    """The id a client gave: vLLM's engine appends "-<random>" to it."""
    return rid.rsplit("-", 1)[0]


def _synchronizer(device: torch.device) -> Any:
    """Waits for the device's queued work, so that a wall clock times it (a no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
