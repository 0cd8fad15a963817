"""Plots of `python -m tide.plan simulate`: a run's timeline, or a sweep's answers (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tide.plan.scenario import Scenario
from tide.plan.simulate import Result


def _steps(r: Result, value: str) -> tuple[list[float], list[float]]:
    """Segments as a step line: each constant interval drawn flat from t0 to t1."""
    xs, ys = [], []
    for seg in r.timeline:
        v = getattr(seg, value)
        xs += [seg.t0, seg.t1]
        ys += [v, v]
    return xs, ys


def plot_timeline(s: Scenario, r: Result, static: Result, path: Path) -> None:
    """Top: served tokens/s (TIDE, static draft, every GPU plain) and the live AL. Bottom: what capture
    offers the store vs what it writes and its bandwidth. Dotted lines: shifts; ticks: deploys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for res, label, style in [(r, "TIDE", "-"), (static, "static draft", "--")]:
        x, y = _steps(res, "served_per_s")
        top.plot(x, [v / 1e3 for v in y], style, label=label)
    if r.plain_tokens is not None:
        top.axhline(r.plain_tokens / s.duration_s / 1e3, color="grey", lw=0.8, label="every GPU plain")
    top.set_ylabel("served, k tokens/s")
    al = top.twinx()
    x, y = _steps(r, "al")
    al.plot(x, y, color="tab:green", lw=0.8, alpha=0.7)
    al.set_ylabel("live AL (TIDE)", color="tab:green")
    x, y = _steps(r, "demand_bytes_per_s")
    bottom.plot(x, [v / 1e9 for v in y], color="tab:red", label="capture offers")
    x, y = _steps(r, "write_bytes_per_s")
    bottom.fill_between(x, [v / 1e9 for v in y], color="tab:blue", alpha=0.4, label="store writes")
    bottom.axhline(r.bandwidth_bytes_per_s / 1e9, color="k", lw=0.8, ls=":", label="bandwidth")
    bottom.set_ylabel("GB/s")
    bottom.set_xlabel("time, s")
    for sh in r.shifts:
        for ax in (top, bottom):
            ax.axvline(sh.at_s, color="k", ls=":", lw=0.8)
        if sh.recovered_s is not None:
            top.annotate(f"+{sh.recovered_s:.0f} s", (sh.at_s + sh.recovered_s, top.get_ylim()[0]),
                         fontsize=8, ha="left", va="bottom")
    top.legend(loc="lower right", fontsize=8)
    bottom.legend(loc="upper right", fontsize=8)
    sv, tr = s.serving, s.training
    gpus = sv.instances * sv.gpus_per_instance
    top.set_title(f"{gpus} {sv.gpu} serve, {tr.count} {tr.gpu} train, H = {s.hidden_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(key: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Left: time from a shift to the first published draft and to full recovery (worst shift).
    Right: throughput over the static draft and over every GPU plain, and the share of capture dropped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["value"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for col, label in [("published_s", "shift -> first draft published"), ("recovered_s", "shift -> last deploy")]:
        left.plot(xs, [r[col] if r[col] is not None else float("nan") for r in rows], "o-", label=label)
    left.set_xlabel(key)
    left.set_ylabel("seconds after the shift")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    for col, label in [("tide_over_static", "TIDE / static draft"), ("tide_over_plain", "TIDE / every GPU plain")]:
        if any(r[col] is not None for r in rows):
            right.plot(xs, [r[col] if r[col] is not None else float("nan") for r in rows], "o-", label=label)
    right.set_xlabel(key)
    right.set_ylabel("throughput ratio")
    drop = right.twinx()
    drop.plot(xs, [100 * r["dropped_fraction"] for r in rows], "s--", color="tab:red", label="capture dropped")
    drop.set_ylabel("capture dropped, %", color="tab:red")
    drop.set_ylim(0, 100)
    right.legend(loc="lower left", fontsize=8)
    if all(isinstance(x, (int, float)) and x > 0 for x in xs) and max(xs) >= 8 * min(xs):
        for ax in (left, right):  # counts, sizes and bandwidths double from point to point
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:,g}" for x in xs])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
