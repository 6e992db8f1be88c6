"""Reporting of simulation records: the table's columns and the hit-rate-vs-capacity plot.

Used by ``expertcast simulate`` (:mod:`expertcast.commands.simulate`) and by any job that wants the
same picture of :func:`expertcast.inference.sim.simulator.simulate`'s records.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence
from typing import Any

TABLE_COLUMNS = ["policy", "pool", "capacity", "slots", "hit", "adj_hit", "mb_per_token", "belady_fraction",
                 "demand_misses", "proactive_per_token", "prefetch_precision", "late_prefetches", "cpu_exec",
                 "stall_ms_per_token", "pct_full_speed"]
"""Columns of the terminal table (every record field goes to the JSON and CSV)."""


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def x_axis(records: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(record field, axis label) for the x axis: slot counts when every run was given as ``--slots`` /
    ``--slots-per-layer`` (an integer axis), else the realized fraction of all experts."""
    if records and all(_is_count(r.get("capacity_requested")) for r in records):
        if all(r.get("pool") == "per-layer" and _is_count(r.get("slots_per_layer")) for r in records):
            return "slots_per_layer", "slots per layer"
        return "slots", "slots (all layers)"
    return "capacity", "capacity (fraction of all L*E experts)"


def _line(ax: Any, xs: Sequence[float], ys: Sequence[float], **kw: Any) -> None:
    """A curve, or only a marker when there is a single point (a one-point 'curve' is invisible)."""
    if len(xs) == 1:
        kw = {**kw, "ls": "none", "marker": kw.get("marker") or "o"}
    ax.plot(xs, ys, **kw)


def plot_hit_vs_capacity(records: Sequence[dict[str, Any]], path: str | os.PathLike,
                         note: str | None = None) -> None:
    """PNG at ``path``: decode hit rate vs capacity, one line per policy, the demand-only
    ceiling (Belady with a free warm start and bypass) shaded. ``note``: an extra title line (e.g. a train/test overlap that was allowed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure
    from matplotlib.ticker import MaxNLocator

    x_key, x_label = x_axis(records)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bel = sorted({(r[x_key], r["belady_hit"]) for r in records if r.get("belady_hit") is not None})
    if bel:
        xs, ys = zip(*bel, strict=True)
        _line(ax, xs, ys, color="black", lw=2.5, ls="--", label="demand-only ceiling")
        if len(xs) > 1:
            ax.fill_between(xs, ys, 1.0, color="0.9", zorder=0)
    from expertcast.utils.io import series_colors

    shown = [p for p in dict.fromkeys(r["policy"] for r in records) if not (p == "belady" and bel)]
    for p, color in zip(shown, series_colors(len(shown)), strict=True):  # 11 policies: 11 colours
        pts = sorted((r[x_key], r["hit"]) for r in records if r["policy"] == p)
        _line(ax, [a for a, _ in pts], [b for _, b in pts], marker="o", label=p, color=color)
    if x_key != "capacity":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x_label)
    ax.set_ylabel("hit rate (1 - D/A), decode only")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    pool = records[0]["pool"] if records else ""
    batch = records[0].get("batch_size", 1) if records else 1
    lines = [f"expert-cache hit rate vs capacity ({pool} pool, batch {batch})"] + ([note] if note else [])
    ax.set_title("\n".join(textwrap.fill(s, 70) for s in lines), fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
