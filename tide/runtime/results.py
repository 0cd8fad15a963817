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
    """Acceptance length and tokens/s over time, with hot-swaps and other decisions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [(w.t_start + w.t_end) / 2 for w in windows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(t, [w.acceptance_length if sum(w.accept_counts) else float("nan") for w in windows],
            "o-", color="tab:blue", label="acceptance length")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("acceptance length (tokens / target step)")
    ax2 = ax.twinx()
    ax2.plot(t, [w.tokens_per_s for w in windows], "-", color="tab:gray", alpha=0.6, label="tokens/s")
    ax2.set_ylabel("tokens/s")
    colors = {"swap": "tab:green", "rollback": "tab:red", "train": "tab:orange", "speculation-off": "tab:purple",
              "speculation-on": "tab:purple"}
    for e in events:
        e = e if isinstance(e, dict) else asdict(e)
        if e["kind"] in colors:
            ax.axvline(e["t"], color=colors[e["kind"]], ls="--", lw=1)
            if e["kind"] == "swap":
                ax.annotate(f"v{e['version']}", (e["t"], ax.get_ylim()[1]), fontsize=8, ha="left", va="top")
    ax.set_title(title)
    handles = [plt.Line2D([], [], color=c, ls="--", label=k) for k, c in colors.items() if k != "speculation-on"]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0] + handles,
              loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
