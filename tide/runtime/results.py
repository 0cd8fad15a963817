"""Results of a serving run: per-segment figures, JSON/JSONL files and the acceptance plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from tide.draft.acceptance import AcceptanceHistogram
from tide.serve.engine import RequestResult, Window


def segment(results: list[RequestResult]) -> dict[str, float]:
    """AL and per-request decode rate (output tokens / time in service) over some requests.

    The rate is the batch-1 throughput when requests are served one at a time (the main job)."""
    hist = AcceptanceHistogram(len(results[0].accept_counts) - 1) if results else None
    for r in results:
        hist.merge(AcceptanceHistogram(len(r.accept_counts) - 1, list(r.accept_counts)))
    busy = sum(r.finish - r.arrival for r in results)
    tokens = sum(len(r.output_ids) for r in results)
    return {"acceptance_length": hist.acceptance_length if hist else 1.0,
            "tokens_per_s": tokens / busy if busy > 0 else 0.0, "requests": len(results), "tokens": tokens}


def plot_run(path: Path, windows: list[Window], events: list[Any], title: str) -> None:
    """What a user needs to read a run, over time: the live acceptance length against the break-even
    of the draft length in use (the latency model then), shading where speculation was off, each
    deployed draft's held-out figure at its deployment, when each cycle trained; tokens/s below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tide.control import LatencyModel
    from tide.draft.acceptance import PositionRates

    ev = [e if isinstance(e, dict) else asdict(e) for e in events]
    models = [(e["t"], LatencyModel.from_json(e["data"]["model"])) for e in ev if "model" in e.get("data", {})]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[3, 1])
    t = [(w.t_start + w.t_end) / 2 for w in windows]
    ax.plot(t, [w.acceptance_length if w.speculate else float("nan") for w in windows], "o-", ms=3,
            color="tab:blue", label="live acceptance length (tokens per drafting step)")
    bars, ks = [], []
    for w, tw in zip(windows, t):
        model = next((m for tm, m in reversed(models) if tm <= tw), models[0][1] if models else None)
        b = max(1, min(round(w.mean_batch), len(w.lengths) - 1)) if w.lengths else 1
        ks.append(max(w.lengths[b] if w.lengths else 0, 1))
        bars.append(model.break_even(max(w.mean_batch, 1.0), ks[-1]) if model else float("nan"))
        if not w.speculate:
            ax.axvspan(w.t_start, w.t_end, color="0.92", lw=0)
    ax.plot(t, bars, "--", color="tab:red", lw=1, label="break-even at the draft length in use")
    rates = {e["version"]: e["data"].get("eval_rates") for e in ev if e["kind"] == "trained"}
    for e in ev:
        if e["kind"] == "deploy" and rates.get(e["version"]):
            r = PositionRates(len(rates[e["version"]]), [1000] * len(rates[e["version"]]),
                              [round(1000 * x) for x in rates[e["version"]]])
            k = next((kk for kk, tw in zip(ks, t) if tw >= e["t"]), ks[-1] if ks else 1)  # the length it served at
            held = r.expected_length(k)
            ax.plot([e["t"]], [held], "*", ms=12, color="tab:green")
            ax.annotate(f"v{e['version']} {held:.2f}", (e["t"], held), fontsize=8, xytext=(3, 5),
                        textcoords="offset points")
    asked = {e["data"].get("data_cycle"): e["t"] for e in ev if e["kind"] == "train"}
    done = [e for e in ev if e["kind"] in ("trained", "train-failed")]
    y0 = ax.get_ylim()[0]
    for i, (cycle, t0) in enumerate(sorted(asked.items(), key=lambda x: x[1])):
        t1 = done[i]["t"] if i < len(done) else (windows[-1].t_end if windows else t0)
        ax.plot([t0, t1], [y0 + 0.02] * 2, "-", lw=5, color="tab:orange", alpha=0.7, solid_capstyle="butt")
        ax.annotate(f"c{cycle}", (t0, y0 + 0.02), fontsize=7, xytext=(0, 4), textcoords="offset points")
    ax.set_ylabel("tokens per step")
    handles = ax.get_legend_handles_labels()[0] + [
        plt.Line2D([], [], marker="*", ls="", ms=10, color="tab:green",
                   label="deployed draft: its held-out AL at the draft length in use"),
        plt.Line2D([], [], lw=5, color="tab:orange", alpha=0.7, label="a training cycle"),
        plt.Rectangle((0, 0), 1, 1, color="0.92", label="speculation off")]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(title)
    ax2.plot(t, [w.tokens_per_s for w in windows], "-", color="tab:gray")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
