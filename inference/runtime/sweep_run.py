"""The library half of ``expertcast sweep``: cell folders, the sweep table and its plot.

A sweep is the grid benchmarks x policies x capacities; each cell is one ``expertcast eval`` run kept in
its own sub-folder ``cells/<benchmark>/<policy>@<capacity>/`` of the sweep's output folder (samples
file, settings, speed measurement, summary), so a cell resumes per sample exactly as ``eval`` does and
a finished cell is only re-read. The command (argument parsing, validation, output folder) is
:mod:`expertcast.commands.sweep`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

CELLS = "cells"
TABLE_COLUMNS = ["benchmark", "policy", "capacity", "samples", "accuracy", "hit", "adj_hit", "mb_per_token",
                 "tokens_per_s", "pct_full", "pct_full_min", "pct_full_max", "baseline", "cpu_exec",
                 "stall_ms_per_token"]


def policy_slug(spec: str) -> str:
    """A folder-safe name of a ``--policy`` spec: the policy name, plus a short hash of its options when it
    has any (``stage:cue_set=/a/b.json`` -> ``stage-3f9a1c2b``)."""
    name, _, opts = spec.partition(":")
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in name.strip().lower())
    return name if not opts.strip() else f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:8]}"


def cell_relpath(benchmark: str, spec: str, cap: dict[str, Any]) -> str:
    """The cell's folder relative to the sweep's output folder (``{"capacity": 0.25}`` -> ``...@c0.25``,
    ``{"slots": 8}`` -> ``...@s8``)."""
    from expertcast.inference.cache.expert_cache import Budget

    return f"{CELLS}/{benchmark}/{policy_slug(spec)}@{Budget.from_flags(cap).tag}"


class CellDir:
    """A cell's folder inside the sweep's claimed output folder, with the ``path`` / ``file`` / ``track``
    interface of :class:`~expertcast.utils.outdir.OutputDir` that ``eval``'s machinery writes through (the
    sweep folder records ``cells/`` as its own; the lock is the sweep's)."""

    def __init__(self, parent: Any, rel: str):
        parent.track(CELLS)
        self.path = Path(parent.path) / rel
        self.path.mkdir(parents=True, exist_ok=True)

    def track(self, *names: str | os.PathLike) -> None:
        """Everything under the cell folder is the sweep's already."""

    def file(self, name: str) -> Path:
        return self.path / name


def table_row(benchmark: str, spec: str, cap: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """One sweep row from a cell's eval summary."""
    row = {"benchmark": benchmark, "policy": spec, "capacity": next(iter(cap.values()))}
    row.update({k: summary.get(k) for k in TABLE_COLUMNS if k not in row})
    row["capacity_kind"] = next(iter(cap))
    row["tokens_match"] = (summary.get("speed") or {}).get("tokens_match")
    row["latency_model"] = summary.get("latency_model")
    return row


def plot_sweep(rows: list[dict[str, Any]], path: str | os.PathLike, title: str) -> None:
    """PNG: decode hit rate (top) and % of full-load tokens/s with its min-max (bottom) vs capacity, one
    line per policy, one column per benchmark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure

    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    fig, axes = plt.subplots(2, len(benches), figsize=(max(7.5, 5.5 * len(benches)), 7.5), squeeze=False)
    for j, b in enumerate(benches):
        top, bottom = axes[0][j], axes[1][j]
        for pol in dict.fromkeys(r["policy"] for r in rows if r["benchmark"] == b):
            pts = sorted((r for r in rows if r["benchmark"] == b and r["policy"] == pol), key=lambda r: r["capacity"])
            xs = [100 * r["capacity"] if r["capacity_kind"] == "capacity" else r["capacity"] for r in pts]
            label = pol.split(":")[0] if len(pol) > 24 else pol
            top.plot(xs, [r["hit"] for r in pts], marker="o", label=label)
            speed = [r for r in pts if r.get("pct_full") is not None]
            if speed:
                sx = [xs[pts.index(r)] for r in speed]
                mid = [r["pct_full"] for r in speed]
                err = [[m - r["pct_full_min"] for m, r in zip(mid, speed, strict=True)],
                       [r["pct_full_max"] - m for m, r in zip(mid, speed, strict=True)]]
                bottom.errorbar(sx, mid, yerr=err, marker="o", capsize=3, label=label)
        unit = "capacity (% of all experts)" if all(r["capacity_kind"] == "capacity" for r in rows) else "capacity"
        top.set_title(b)
        top.set_ylabel("decode hit rate")
        top.set_ylim(0, 1.05)
        bottom.set_ylabel("% of full-load tokens/s (median, min-max)")
        bottom.set_xlabel(unit)
        bottom.axhline(100, color="gray", ls="--", lw=0.8)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
