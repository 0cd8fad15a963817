"""An experiment's results: summary.json, windows.jsonl, report.md and two plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tide.draft.acceptance import AcceptanceHistogram
from tide.model.files import write_json, write_jsonl
from tide.serve.engine import RequestResult
from tide.workload.phases import WorkloadSpec
from workflows.replay.runner import ModeRun


def _rate(results: list[RequestResult]) -> dict[str, float]:
    """Tokens/s over the span the requests were in the system, and their mean acceptance length
    (speculating steps only; a request served with speculation off has none)."""
    if not results:
        return {"tokens_per_s": 0.0, "acceptance_length": float("nan"), "requests": 0, "tokens": 0}
    hist = AcceptanceHistogram(len(results[0].accept_counts) - 1)
    for r in results:
        hist.merge(AcceptanceHistogram(hist.gamma, list(r.accept_counts)))
    tokens = sum(len(r.output_ids) for r in results)
    span = max(r.finish for r in results) - min(r.arrival for r in results)
    return {"tokens_per_s": tokens / span if span > 0 else 0.0,
            "acceptance_length": hist.acceptance_length if hist.steps else float("nan"),
            "requests": len(results), "tokens": tokens}


def mode_summary(m: ModeRun, phases: list[str]) -> dict[str, Any]:
    from tide.runtime.serve_role import spec_on_fraction

    trained = [e for e in m.events if e.kind == "trained"]
    stored = sum(f.stat().st_size for f in m.store.glob("*.h5")) if m.store and m.store.exists() else 0
    return {
        "overall": _rate(m.results), "phases": {p: _rate([r for r in m.results if r.workload == p]) for p in phases},
        "speculation_on_fraction": spec_on_fraction(m.windows) if m.mode != "nospec" else 0.0,
        "versions_deployed": [e.version for e in m.events if e.kind == "deploy"],
        "rollbacks": sum(e.kind == "rollback" for e in m.events),
        "training_wall_s": sum(e.data.get("wall_s", 0.0) for e in trained), "training_cycles": len(trained),
        "bytes_stored": stored, "wall_s": m.windows[-1].t_end if m.windows else 0.0, "workload": m.workload,
        "latency": m.latency, "instances": m.instances, "spread": "round-robin" if m.instances > 1 else None,
    }


def phase_starts(m: ModeRun, phases: list[str]) -> dict[str, float]:
    return {p: min((r.arrival for r in m.results if r.workload == p), default=float("nan")) for p in phases}


def write_report(runs: list[ModeRun], spec: WorkloadSpec, out: Path, command: str) -> dict[str, Any]:
    phases = [p.name for p in spec.phases]
    modes = {m.mode: mode_summary(m, phases) for m in runs}
    base = modes.get("nospec", {}).get("overall", {}).get("tokens_per_s")
    for s in modes.values():
        s["speedup_vs_nospec"] = s["overall"]["tokens_per_s"] / base if base else None
    summary = {"command": command, "phases": phases, "modes": modes,
               "events": {m.mode: [e.__dict__ for e in m.events] for m in runs}}
    write_json(out / "summary.json", summary)
    write_jsonl(out / "windows.jsonl", ({"mode": m.mode, **w.to_json()} for m in runs for w in m.windows))
    (out / "report.md").write_text(_markdown(summary))
    _plots(runs, phases, out)
    return summary


def _markdown(s: dict[str, Any]) -> str:
    phases, modes = s["phases"], s["modes"]
    f = lambda x, d=1: "-" if x is None or x != x else f"{x:.{d}f}"  # noqa: E731
    lines = [f"# Replay: {' -> '.join(phases)}", "", f"`{s['command']}`", ""]
    if any(m["instances"] > 1 for m in modes.values()):
        lines += ["Serving instances: " + ", ".join(f"{name} {m['instances']}" for name, m in modes.items()) +
                  " (each phase's requests spread round-robin over them)", ""]
    lines += ["| mode | tokens/s | vs nospec | AL | spec on | drafts deployed | rollbacks | training s | stored MB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, m in modes.items():
        lines.append(f"| {name} | {f(m['overall']['tokens_per_s'])} | {f(m['speedup_vs_nospec'], 3)} | "
                     f"{f(m['overall']['acceptance_length'], 2)} | {m['speculation_on_fraction']:.0%} | "
                     f"{m['versions_deployed'] or '-'} | {m['rollbacks']} | {m['training_wall_s']:.0f} | "
                     f"{m['bytes_stored'] / 1e6:.1f} |")
    lines += ["", "Per phase: tokens/s (acceptance length)", "",
              "| mode | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, m in modes.items():
        cells = (f"{f(m['phases'][p]['tokens_per_s'])} ({f(m['phases'][p]['acceptance_length'], 2)})" for p in phases)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seen = {name: m["latency"] for name, m in modes.items() if m["latency"]}
    if seen:
        lines += ["", "Through HTTP (the client's clock)", "",
                  "| mode | TTFT p50 ms | TTFT p90 ms | ITL mean ms | errors |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {f(x['ttft_p50_s'] * 1e3)} | {f(x['ttft_p90_s'] * 1e3)} | "
                  f"{f(x['itl_mean_s'] * 1e3, 2)} | {x['errors']} |" for name, x in seen.items()]
    return "\n".join(lines) + "\n"


def _plots(runs: list[ModeRun], phases: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.8 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], runs):
        t = [w.t_end for w in m.windows]
        ax.plot(t, [w.acceptance_length if w.speculate and sum(w.accept_counts) else float("nan") for w in m.windows],
                ".-", label="AL (speculating)")
        ax.plot(t, [w.tokens_per_s / max(max(x.tokens_per_s for x in m.windows), 1e-9) * 4 for w in m.windows],
                color="0.7", lw=0.8, label="tokens/s (scaled)")
        for p, t0 in phase_starts(m, phases).items():
            ax.axvline(t0, color="k", ls=":", lw=0.8)
            ax.text(t0, 4.05, p, fontsize=7)
        for e in m.events:
            if e.kind in ("swap", "spec-off", "spec-on", "rollback"):
                ax.axvline(e.t, color={"swap": "g", "spec-off": "r", "spec-on": "b", "rollback": "m"}[e.kind],
                           lw=0.8, alpha=0.6)
        ax.set_ylim(0.8, 4.4)
        ax.set_ylabel(m.mode, fontsize=8)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[0, 0].set_title("acceptance length over time (green swap, red spec off, blue spec on, magenta rollback)",
                         fontsize=9)
    axes[-1, 0].set_xlabel("s")
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(runs)
    for i, m in enumerate(runs):
        rates = [_rate([r for r in m.results if r.workload == p])["tokens_per_s"] for p in phases]
        ax.bar([j + i * width for j in range(len(phases))], rates, width, label=m.mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases)
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
