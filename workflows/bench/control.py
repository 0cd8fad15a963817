"""The speculation gate against measured serving: `controller-accuracy`, `never-worse`, `off-cost`
and `adaptive-k`. Every comparison runs in alternating pairs (the order flipped every pair, so that
drift cancels) on the same prompts and cores; controller-accuracy and off-cost step two engines in
lockstep within each run. Each figure comes with its per-pair spread."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tide.config import load_config
from tide.control import LatencyModel, SpecAction, SpeculationGate, SpeculationObservation, cost_key
from tide.draft.acceptance import PositionRates, RecentRates
from tide.runtime.processes import bind_serving
from tide.serve.engine import Request, TideEngine, step_costs
from workflows.bench.common import (
    DEFAULT,
    alternating_pairs,
    default_setup,
    requests,
    serve_closed_loop,
    spread,
)


def controller_accuracy(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """Eq. 5, generalised, against measured speedup: the live position rates and a latency model
    predict drafting k = 1 and 3 at batch 1, 2 and 4. Measured is drafting k over the same engine
    type with speculation off, on the same GSM8K test prompts, the two engines in lockstep
    (`_lockstep`: the machine's drift, which moved one point's whole-run pairs from 0.84x to 1.04x
    here, falls on both alike); the pairs alternate which engine steps first. Two models: the
    start-up profile alone, and the profile refit from every step served so far (the gate's: in a
    server it has seen the steps of the batch sizes and draft lengths it serves)."""
    bind_serving(load_config(DEFAULT).runtime.serve_cores)  # both engines in this process, as TIDE serves
    cfg, target, drafts = default_setup(work, 3)
    eng = TideEngine(target, cfg.serve, drafts["untrained"], dtype=cfg.model.dtype, capture=False)
    off = TideEngine(target, cfg.serve, drafts["untrained"], dtype=cfg.model.dtype, capture=False)
    off.set_speculation(False)
    rows = []
    try:
        models = {"profile": eng.profile(cfg.serve.max_num_seqs)}
        models["refit"] = LatencyModel.from_json(models["profile"].to_json())
        _lockstep((eng, off), requests(target, data, "gsm8k", "gsm8k/test.jsonl", 2, 32, "warm"), 2)  # not measured
        for v, (name, path) in enumerate(drafts.items()):
            eng.swap(path, v)
            for b in (1, 2, 4):
                reqs = requests(target, data, "gsm8k", "gsm8k/test.jsonl", 2 * b, 64 if quick else 96, f"{name}{b}")
                for k in (1, 3):
                    rows.append({"draft": name, "batch": b, "k": k,
                                 **_accuracy_point((eng, off), reqs, b, k, 2 if quick else 3, models)})
                    r = rows[-1]
                    print(f"{name:>10} b={b} k={k} rates {[round(x, 2) for x in r['rates']]}: measured "
                          f"{r['measured']['mean']:.3f}x ({r['measured']['min']:.3f}-{r['measured']['max']:.3f}) "
                          f"predicted {r['predicted_speedup']:.3f}x ({r['rel_error']:.1%}; profile alone "
                          f"{r['predicted_by_profile']:.3f}x, {r['rel_error_profile']:.1%})", flush=True)
    finally:
        eng.close()
        off.close()
    errors, profile_errors = [r["rel_error"] for r in rows], [r["rel_error_profile"] for r in rows]
    model, refit = models["profile"], models["refit"]
    return {"max_rel_error": max(errors), "mean_rel_error": statistics.fmean(errors),
            "max_rel_error_profile": max(profile_errors), "mean_rel_error_profile": statistics.fmean(profile_errors),
            "pairs": len(rows[0]["pair_ratios"]), "model": model.to_json(), "refit_model": refit.to_json(),
            "rows": rows, "dtype": cfg.model.dtype,
            "draft_step_over_target_step": model.draft_latency(1, 1) / model.target_latency(1),
            "draft_step_over_target_step_refit": refit.draft_latency(1, 1) / refit.target_latency(1)}


def _accuracy_point(engines: tuple[TideEngine, TideEngine], reqs: list[Request], b: int, k: int, pairs: int,
                    models: dict[str, LatencyModel]) -> dict[str, Any]:
    """`pairs` lockstep runs of the drafting engine (k) against the one with speculation off, then
    each model's prediction: the plain engine's decode steps priced at their batch sizes (a closed
    loop's tail runs smaller batches than b), drafting at the runs' rates, the prefill time kept."""
    eng, off = engines
    most = eng.most_tokens
    eng.set_draft_lengths([k] * len(eng.lengths))
    rates, plain_steps, measured, prefill = PositionRates(eng.gamma), Counter[int](), [], []
    for i in range(pairs):
        walls = _lockstep(engines, reqs, b, flip=i % 2 == 1)
        on, plain = (e.stats(reset=True) for e in engines)
        # the refit sees both engines' steps as one window: they ran at the same moments
        models["refit"].observe_costs(step_costs(on["step_costs"] + plain["step_costs"], walls[0] + walls[1], most),
                                      most)
        rates.merge(PositionRates(eng.gamma, list(on["rates"]["tried"]), list(on["rates"]["accepted"])))
        plain_costs = step_costs(plain["step_costs"], walls[1], most)["target"]
        for key, (n, _) in plain_costs.items():
            if cost_key(key)[1] <= most:
                plain_steps[cost_key(key)[0]] += n
        measured.append(sum(walls[1]) / sum(walls[0]))  # equal tokens: greedy output is the same
        prefill.append(sum(s for key, (_, s) in plain_costs.items() if cost_key(key)[1] > most) / sum(walls[1]))
    m, length, share = statistics.fmean(measured), rates.expected_length(k), statistics.fmean(prefill)
    decode = {name: length * sum(n * lm.target_latency(bb) for bb, n in plain_steps.items())
              / sum(n * lm.step_cost(bb, k) for bb, n in plain_steps.items()) for name, lm in models.items()}
    predicted = {name: 1 / (share + (1 - share) / s) for name, s in decode.items()}
    return {"mean_batch": sum(bb * n for bb, n in plain_steps.items()) / plain_steps.total(),
            "rates": rates.rates(), "expected_length": length, "prefill_share": share,
            "measured": spread(measured), "pair_ratios": measured, "predicted_decode_speedup": decode["refit"],
            "predicted_speedup": predicted["refit"], "predicted_by_profile": predicted["profile"],
            "rel_error": abs(predicted["refit"] - m) / m, "rel_error_profile": abs(predicted["profile"] - m) / m}


def _built(plain_first: bool, tide: Callable[[], TideEngine],
           plain: Callable[[], TideEngine]) -> tuple[TideEngine, TideEngine]:
    """(tide, plain) engines, the plain one built first or second. Of two identical plain engines
    built in one process, the second steps 1.4-2.4% faster here (in lockstep, 476 step pairs, twice,
    2026-12-06): a comparison that always built TIDE's engine first charged that to the off path.
    So never-worse and off-cost run half their pairs in each build order."""
    if plain_first:
        p = plain()
        return tide(), p
    t = tide()
    return t, plain()


def never_worse(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """A useless draft (untrained, no trainer) under TIDE's gate against plain vLLM (no speculative
    config): `ratio_vs_nospec` = TIDE tokens/s over plain, in alternating pairs on the same prompts,
    half of them with each engine built first (`_built`): each half is a server started afresh whose
    gate keeps its state from pair to pair, so each half's first pair includes the seconds before the
    untrained draft is turned off. Both engines serve in this process on core 0, as TIDE serves: the
    coordinator's work between steps falls on the serving core, and no second engine-core process
    shares it."""
    from tide.runtime.coordinator import Coordinator

    bind_serving(load_config(DEFAULT).runtime.serve_cores)
    cfg, target, drafts = default_setup(work, load_config(DEFAULT).serve.num_speculative_tokens)
    reqs = requests(target, data, "humaneval", "humaneval/HumanEval.jsonl.gz", 8 if quick else 16,
                    cfg.workload.max_tokens, "nw")
    runs, orders = [], {}
    for plain_first in (False, True):
        eng, plain = _built(plain_first,
                            lambda: TideEngine(target, cfg.serve, drafts["untrained"], dtype=cfg.model.dtype,
                                               capture=False),
                            lambda: TideEngine(target, cfg.serve, None, dtype=cfg.model.dtype))
        try:
            coord = Coordinator(cfg, eng, None, trainer_ranks=[], drafts_root=str(work / "drafts"))
            coord.start()  # profiles before the clock starts, like the main job
            coord.serving_starts()
            hooks = dict(between_steps=coord.between_steps, on_window=coord.on_window, on_result=coord.on_result,
                         window_s=cfg.runtime.window_s)
            half = alternating_pairs(2 if quick else 3,
                                     lambda e=eng, h=hooks: serve_closed_loop(e, reqs, 1, "tide", **h),
                                     lambda p=plain: serve_closed_loop(p, reqs, 1, "plain"))
        finally:
            eng.close()
            plain.close()
        runs += half
        off = next((e for e in coord.events if e.kind == "spec-off"), None)
        ratios = [t.tokens_per_s / p.tokens_per_s for t, p in half]
        orders["plain_built_first" if plain_first else "tide_built_first"] = {
            "ratio_vs_nospec": statistics.fmean(ratios), "pair_ratios": ratios,
            "spec_off_at_s": off.t if off else None, "spec_off_reason": off.reason if off else None}
        print(f"{'plain' if plain_first else 'TIDE'} built first: ratio {statistics.fmean(ratios):.3f} "
              f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    ratios = [t.tokens_per_s / p.tokens_per_s for t, p in runs]
    return {"ratio_vs_nospec": statistics.fmean(ratios), "pairs": spread(ratios), "pair_ratios": ratios,
            "tokens_per_s_tide": statistics.fmean(t.tokens_per_s for t, _ in runs),
            "tokens_per_s_nospec": statistics.fmean(p.tokens_per_s for _, p in runs),
            "build_orders": orders, "requests_per_run": len(reqs)}


def off_cost(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """What a speculative engine costs with speculation off, against a plain engine (no speculative
    config): at batch 1 with capture off (the engine's own per-step cost) and at batch 4 with capture
    off and on (the shift replay's setting while TIDE's gate has speculation off and collection goes
    on). Both engines serve in this process on core 0, as TIDE serves (`bind_serving`), and step in
    turn on the same requests: every step of one has a step of the same shape of the other beside it
    in time, so the machine's drift, which moves whole runs by ~10% here, cancels step by step. Half
    the requests run with each engine built first (`_built`); the ratio is over all step pairs."""
    bind_serving(load_config(DEFAULT).runtime.serve_cores)
    cfg, target, drafts = default_setup(work, load_config(DEFAULT).serve.num_speculative_tokens)
    settings = ((1, False), (4, False), (4, True))
    walls: dict[tuple[int, bool], list[tuple[list[float], list[float]]]] = {s: [] for s in settings}
    for plain_first in (False, True):
        eng, plain = _built(plain_first,
                            lambda: TideEngine(target, cfg.serve, drafts["untrained"], dtype=cfg.model.dtype,
                                               store_root=work / "store", max_pending_chunks=1 << 16),
                            lambda: TideEngine(target, cfg.serve, None, dtype=cfg.model.dtype))
        try:
            eng.set_speculation(False)
            for b, capture in settings:
                reqs = requests(target, data, "humaneval", "humaneval/HumanEval.jsonl.gz", b if quick else 4 * b,
                                cfg.workload.max_tokens, f"oc{b}{int(plain_first)}")
                eng.set_capture(capture)
                walls[(b, capture)].append(_lockstep((eng, plain), reqs, b))
        finally:
            eng.close()
            plain.close()
    out: dict[str, Any] = {}
    for (b, capture), halves in walls.items():
        off = [w for o, _ in halves for w in o]
        on = [w for _, p in halves for w in p]
        diffs = [a - p for a, p in zip(off, on)]
        key = f"batch{b}_capture_{'on' if capture else 'off'}"
        out[key] = {"ratio_off_over_plain": sum(on) / sum(off), "steps": len(off),
                    "ratio_by_build_order": {"tide_built_first": sum(halves[0][1]) / sum(halves[0][0]),
                                             "plain_built_first": sum(halves[1][1]) / sum(halves[1][0])},
                    "step_ms_off": 1e3 * statistics.median(off), "step_ms_plain": 1e3 * statistics.median(on),
                    "paired_step_diff_ms": {k: 1e3 * v for k, v in spread(diffs).items()}}
        by = out[key]["ratio_by_build_order"]
        print(f"{key}: off/plain {out[key]['ratio_off_over_plain']:.3f} over {len(off)} step pairs (TIDE built "
              f"first {by['tide_built_first']:.3f}, plain first {by['plain_built_first']:.3f}); median step "
              f"{out[key]['step_ms_off']:.2f} vs {out[key]['step_ms_plain']:.2f} ms, paired difference "
              f"{1e3 * statistics.median(diffs):.2f} ms", flush=True)
    out["ratio_off_over_plain"] = min(v["ratio_off_over_plain"] for v in out.values())
    return out


def _lockstep(engines: tuple[TideEngine, TideEngine], reqs: list[Request], b: int,
              flip: bool = False) -> tuple[list[float], ...]:
    """Both engines serve `reqs` as a closed loop of `b`, stepping in turn: the one that has emitted
    fewer tokens steps next (ties: the order flipped every other step, `flip` starts with the
    second), so both are at the same point of the same work at every moment. Stepping alike (off-cost)
    they alternate step by step, and step i has the same batch and tokens on both (greedy outputs are
    equal); one drafting against one that does not, the plain one steps about E times for each of the
    other's. Returns the wall of every step of each, with their engines' stats and `step_walls` reset
    at the start."""
    todo = [[Request(f"ls{j}-{time.monotonic_ns()}-{r.request_id}", r.prompt_ids, r.max_tokens, None, r.workload)
             for r in reqs] for j in (0, 1)]
    live, emitted, walls = [0, 0], [0, 0], ([], [])  # type: ignore[var-annotated]
    for e in engines:
        e.stats(reset=True)
        e.step_walls = []
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    while any(todo) or any(live):
        order = (0, 1) if ((len(walls[0]) + len(walls[1])) // 2 + flip) % 2 == 0 else (1, 0)
        j = min((j for j in order if todo[j] or live[j]), key=lambda j: emitted[j])
        while todo[j] and live[j] < b:
            engines[j].submit(todo[j].pop(0), now())
            live[j] += 1
        start = time.perf_counter()
        tokens, _, done = engines[j].step(now)
        walls[j].append(time.perf_counter() - start)
        emitted[j] += tokens
        live[j] -= len(done)
    return walls


def adaptive_k(work: Path, data: Path, quick: bool = False) -> dict[str, Any]:
    """The base draft with the gate choosing k per step against each fixed k (1, 2, 3), at batch 1 and
    4, in rounds that alternate the order; the gate is warmed up (its rates and refit latencies) on
    unmeasured runs first, until its rates hold `min_steps`, as a server that has been running a while.
    The engine serves in this process on core 0, as TIDE serves (and as never-worse and off-cost
    do): with vLLM's engine-core process busy-waiting beside a worker process, the bench's own work
    between steps (the windows, the gate) ran beside the engine on this 2-core VM."""
    bind_serving(load_config(DEFAULT).runtime.serve_cores)
    cfg, target, drafts = default_setup(work, 3)
    if "base" not in drafts:
        raise ValueError("adaptive-k: needs the base draft (python -m workflows.base_draft)")
    eng = TideEngine(target, cfg.serve, drafts["base"], dtype=cfg.model.dtype, capture=False)
    rows = []
    try:
        model = eng.profile(cfg.serve.max_num_seqs)
        for b in (1, 4):
            reqs = requests(target, data, "gsm8k", "gsm8k/test.jsonl", 2 * b, 64 if quick else 128, f"ak{b}")
            rows.append(_adaptive_row(cfg, eng, model, reqs, b, 2 if quick else 5))
    finally:
        eng.close()
    return {"rows": rows}


def _adaptive_row(cfg: Any, eng: TideEngine, model: LatencyModel, reqs: list[Request], b: int,
                  rounds: int) -> dict[str, Any]:
    gate = SpeculationGate(cfg.control.speculation, LatencyModel.from_json(model.to_json()), cfg.serve.max_num_seqs)
    steps, live = [0], RecentRates(eng.gamma, cfg.control.speculation.min_steps)

    def adapt(w: Any) -> None:  # what the coordinator does with each window: refit, then decide
        steps[0] += w.steps
        if w.costs:
            gate.model.observe_costs(w.costs, eng.most_tokens)
        if w.rates:
            live.add(w.position_rates())
        d = gate.decide(SpeculationObservation(steps[0], time.monotonic(), max(w.mean_batch, 1.0), live.merged()))
        if d.action in (SpecAction.ENABLE, SpecAction.DISABLE):  # requests spanning it draft from a stale KV
            live.clear()
        eng.set_draft_lengths(gate.lengths)
        eng.set_probe(gate.probe_gap(steps[0]))

    order = ["adaptive", "k1", "k2", "k3"]
    rates = {name: PositionRates(eng.gamma) for name in order}  # what each setting's steps accepted
    batch: dict[str, list[float]] = {name: [] for name in order}

    def run(name: str) -> float:
        if name == "adaptive":  # with the coordinator's probes
            eng.set_draft_lengths(gate.lengths)
            eng.set_probe(gate.probe_gap(steps[0]))
            served = serve_closed_loop(eng, reqs, b, name, on_window=adapt, window_s=2.0)
        else:
            eng.set_probe(0)
            eng.set_draft_lengths([int(name[1])] * len(eng.lengths))
            served = serve_closed_loop(eng, reqs, b, name)
        rates[name].merge(served.rates)
        batch[name].append(served.batch)
        return served.tokens_per_s

    for _ in range(4):  # warm-up: the gate learns the rates (and the engine's caches warm) until it
        run("adaptive")  # decides on full evidence (batch 1 drafts ~190 steps a run, min_steps is 256)
        if live.merged().steps >= cfg.control.speculation.min_steps:
            break
    rates["adaptive"], batch["adaptive"] = PositionRates(eng.gamma), []
    runs: dict[str, list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            runs[name].append(run(name))
    means = {name: statistics.fmean(v) for name, v in runs.items()}
    best = max(("k1", "k2", "k3"), key=lambda k: means[k])
    default = f"k{load_config(DEFAULT).serve.num_speculative_tokens}"
    # the gate's model against the fixed runs: its predicted speedup of each k at the batch size the
    # gate reads for the run's mean batch, and the run's rates, beside the measured tokens/s (where a
    # wrong choice comes from: the costs or the rates)
    predicted = {name: gate.model.speedup(gate.batch(statistics.fmean(batch[name])), int(name[1]),
                                          rates[name].expected_length(int(name[1]))) for name in order[1:]}
    row = {"batch": b, "tokens_per_s": means, "runs": runs, "lengths": list(gate.lengths), "best_fixed": best,
           "rates": {name: r.rates() for name, r in rates.items()},
           "mean_batch": {name: statistics.fmean(v) for name, v in batch.items()}, "predicted_speedup": predicted,
           "model": gate.model.to_json(),
           "adaptive_over_best_fixed": means["adaptive"] / means[best],
           "by_round_over_best_fixed": [a / f for a, f in zip(runs["adaptive"], runs[best])],
           "adaptive_over_default": means["adaptive"] / means[default]}
    print(f"b={b}: " + ", ".join(f"{k} {v:.1f}" for k, v in means.items()) +
          f" tok/s; adaptive/best fixed ({best}) {row['adaptive_over_best_fixed']:.3f}; the gate's model predicts " +
          ", ".join(f"{k} {v:.2f}x" for k, v in predicted.items()), flush=True)
    return row
