"""What `python -m tide.plan simulate` prints and writes: one run's figures against the static-draft
and plain-inference baselines, sweeps over one scenario key, and predictions next to a measured run."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import yaml

from tide.config import ConfigError, to_dict
from tide.plan.scenario import Scenario, load_scenario, parse_scenario, with_training
from tide.plan.simulate import Result, simulate


def parse_assignment(text: str, flag: str) -> tuple[str, list[Any]]:
    """`KEY.PATH=V1[,V2...]` -> (key path, values as YAML reads them); one-line error otherwise."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ConfigError(f"{flag} {text}: expected KEY.PATH=VALUE, e.g. training.count=8")
    try:
        return key, [yaml.safe_load(v) for v in values.split(",")]
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {text}: not a YAML value: {str(e).splitlines()[0]}") from None


def with_overrides(path: str | Path, sets: list[tuple[str, Any]]) -> Scenario:
    """The scenario file with `key.path = value` changes, checked by the same strict loader, so a
    misspelled key fails as `FILE: training.cont: unknown key; did you mean count?`."""
    base = load_scenario(path)
    if not sets:
        return base
    data = json.loads(json.dumps(to_dict(base)))  # tuples -> lists, so items can be set
    for key, value in sets:
        *parents, last = [int(k) if k.isdigit() else k for k in re.split(r"[.\[\]]+", key) if k]
        node = data
        for k in parents:
            try:
                node = node[k]
            except (KeyError, IndexError, TypeError):
                raise ConfigError(f"{path}: {key}: no such key to set") from None
        node[last] = value
    return parse_scenario(data, str(path))


def summarize(s: Scenario) -> tuple[dict[str, Any], Result, Result]:
    """The run's figures, with the same scenario's static draft (no trainers) as a baseline;
    returns (figures, the run, the static run)."""
    r, static = simulate(s), simulate(with_training(s, count=0))
    peak = max((seg.demand_bytes_per_s for seg in r.timeline), default=0.0)
    out = {
        "mean_tokens_per_s": r.served_tokens / s.duration_s,
        "tide_over_static": r.served_tokens / static.served_tokens,
        "tide_over_plain": None if r.plain_tokens is None else r.served_tokens / r.plain_tokens,
        "dropped_fraction": r.dropped_tokens / r.offered_tokens if r.offered_tokens else 0.0,
        "peak_demand_bytes_per_s": peak,
        **{k: v for k, v in dataclasses.asdict(r).items() if k != "timeline"},
        "static_tokens": static.served_tokens,
    }
    return out, r, static


def sweep_row(value: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """One sweep value: the worst shift decides (slowest recovery, lowest final AL)."""
    shifts = summary["shifts"]

    def worst(key: str) -> float | None:  # None: some shift never got there, or no shifts
        times = [sh[key] for sh in shifts]
        return None if not times or None in times else max(times)

    return {"value": value, "mean_tokens_per_s": summary["mean_tokens_per_s"],
            "tide_over_static": summary["tide_over_static"], "tide_over_plain": summary["tide_over_plain"],
            "dropped_fraction": summary["dropped_fraction"], "threshold_s": worst("threshold_s"),
            "published_s": worst("published_s"), "recovered_s": worst("recovered_s"),
            "al_final": min((sh["al_final"] for sh in shifts), default=None),
            "bottleneck": ",".join(sh["bottleneck"] for sh in shifts)}


def predictions(s: Scenario, r: Result) -> dict[str, Any]:
    """The first shift's figures under the names `workflows.bench.pipeline` writes, for `--measured`."""
    if not r.shifts:
        return {}
    sh = r.shifts[0]
    seg = next((g for g in r.timeline if g.demand_bytes_per_s > 0), None)
    capture = seg.demand_bytes_per_s / r.bytes_per_token if seg else 0.0
    out: dict[str, Any] = {"shift_to_threshold_s": sh.threshold_s, "cycle_s": sh.cycle_s,
                           "shift_to_published_s": sh.published_s, "capture_tokens_per_s": capture,
                           "store_write_bytes_per_s": seg.write_bytes_per_s if seg else 0.0,
                           "bytes_per_token": r.bytes_per_token, "train_tokens": sh.train_tokens}
    if sh.cycle_s and sh.train_tokens:
        out["cycle_tokens_per_s"] = sh.train_tokens * s.training.epochs / sh.cycle_s
        out["keeps_up"] = out["cycle_tokens_per_s"] >= capture
    return out


def measured_value(m: dict[str, Any], key: str) -> Any:
    """A figure of a measured JSON; bytes per token also from a pipeline run's store totals."""
    if key == "bytes_per_token" and key not in m and "producer" in m:
        stored = m["producer"]["stored"]
        return stored["bytes"] / stored["tokens"] if stored["tokens"] else None
    return m.get(key)


def compare(pred: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Predicted vs measured for every figure both have; error = (predicted - measured) / measured."""
    rows = []
    for key, p in pred.items():
        m = measured_value(measured, key)
        if m is None or p is None:
            continue
        if isinstance(m, bool):
            rows.append({"figure": key, "predicted": bool(p), "measured": m, "error": None, "match": bool(p) == m})
        else:
            rows.append({"figure": key, "predicted": p, "measured": m, "error": (p - m) / m if m else None})
    return rows


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, (bool, str)):
        return str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{nd}g}"


def format_summary(s: Scenario, summary: dict[str, Any]) -> str:
    """The printed result: throughput against both baselines, storage, then one row per shift."""
    sv, tr = s.serving, s.training
    rows = [f"{sv.instances} x {sv.gpus_per_instance} {sv.gpu} serve (H = {s.hidden_size}), "
            f"{tr.count} {tr.gpu} train at {_fmt(summary['train_tokens_per_s'])} tokens/s; {s.duration_s:g} s",
            f"mean throughput   {_fmt(summary['mean_tokens_per_s'])} tokens/s  = "
            f"{summary['tide_over_static']:.3f}x the static draft, " + (
                "every GPU plain: n/a (no inference figure for the trainers' class)"
                if summary["tide_over_plain"] is None else f"{summary['tide_over_plain']:.3f}x every GPU plain"),
            f"capture           {_fmt(summary['offered_tokens'])} rows offered, "
            f"{_fmt(summary['dropped_tokens'])} dropped "
            f"({100 * summary['dropped_fraction']:.1f}%); {summary['bytes_per_token']} B/row",
            f"storage           peak demand {summary['peak_demand_bytes_per_s'] / 1e9:.2f} GB/s vs bandwidth "
            f"{summary['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s at {sv.instances} writers; "
            f"saturated {summary['storage_saturated_s']:.0f} s",
            f"{'shift at s':>10}{'AL drop':>14}{'threshold':>11}{'published':>11}{'recovered':>11}{'AL final':>10}"
            f"{'cycles':>8}  bottleneck"]
    for sh in summary["shifts"]:
        rows.append(f"{sh['at_s']:>10g}{sh['al_before']:>7.2f} ->{sh['al_shifted']:>5.2f}{_fmt(sh['threshold_s']):>11}"
                    f"{_fmt(sh['published_s']):>11}{_fmt(sh['recovered_s']):>11}{sh['al_final']:>10.3f}"
                    f"{sh['cycles']:>8}  {sh['bottleneck']}")
    rows.append("times in seconds after the shift; '-' = not before the next shift or the end")
    return "\n".join(rows)


def format_sweep(key: str, rows: list[dict[str, Any]]) -> str:
    """One line per swept value."""
    cols = ["value", "threshold_s", "published_s", "recovered_s", "al_final", "dropped_fraction",
            "tide_over_static", "tide_over_plain", "bottleneck"]
    out = [f"sweep {key}", "".join(f"{c:>17}" for c in cols[:-1]) + f"  {cols[-1]}"]
    out += ["".join(f"{_fmt(r[c]):>17}" for c in cols[:-1]) + f"  {r[cols[-1]]}" for r in rows]
    return "\n".join(out)


def format_compare(rows: list[dict[str, Any]]) -> str:
    """Predicted vs measured, one line per figure."""
    out = [f"{'figure':<24}{'predicted':>14}{'measured':>14}{'error':>9}"]
    for r in rows:
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else ("same" if r.get("match") else "differs")
        out.append(f"{r['figure']:<24}{_fmt(r['predicted'], 4):>14}{_fmt(r['measured'], 4):>14}{err:>9}")
    return "\n".join(out)
