"""The disk benchmark's report (docs/design.md, "Disk tier"): the printed machine figures and table, the JSON and
CSV, and the figures (tokens/s against budget, per expert format; tokens/s against the oracle forecast's recall,
per budget, with the learned forecaster's measured recall on the same curve). :func:`finish_bounds` makes every
row's full-overlap bound use one disk figure that bounds every run of the process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COLUMNS = ["policy", "format", "budget", "budget_kind", "start", "slots", "tokens_per_s", "sim_tokens_per_s", "vs_ref", "vs_ref_min", "vs_ref_max", "pct_full", "pct_full_min",
           "pct_full_max", "pct_full_scaled", "pct_full_format", "pct_resident", "sub_tokens_per_s", "hit", "reads_per_token", "exposed_misses_per_token",
           "miss_free_token_frac", "sim_hit", "sim_reads_per_token", "read_mb_per_token", "read_gbps", "read_vs_disk", "io_overlap",
           "disk_busy_ms_per_token", "disk_idle_ms_per_token", "late_prefetches", "bound_tokens_per_s",
           "achieved_vs_bound", "dep_bound_tokens_per_s", "achieved_vs_dep_bound", "sub_achieved_vs_bound",
           "sub_achieved_vs_dep_bound", "forecaster_ms_per_step", "forecaster_share", "forecaster_cpu_ms_per_step",
           "forecaster_path_share", "forecasts_dropped", "peak_rss_gb", "rss_bound_gb"]


def bound_disk_gbps(measured_gbps: float, rows: list[dict[str, Any]]) -> tuple[float, str]:
    """(GB/s, source): the disk figure of the full-overlap bound, the largest of the one-pass measurement and every
    run's achieved read rates (over its read-busy time and over its wall time): the disk gave each run at least
    that, so a bound at a lower rate would not bound (docs/results.md,
    "Disk tier: recall axis, expert formats, a bound that bounds")."""
    best, source = float(measured_gbps), "one-pass measurement"
    for r in rows:
        busy = r.get("read_gbps", float("nan"))
        wall = r["reads_per_token"] * r["expert_bytes"] * r["tokens_per_s"] / 1e9
        for v, what in ((busy, "read-busy"), (wall, "wall")):
            if v == v and v > best:
                best, source = float(v), f"achieved by {r['policy']} @ {r['budget']:g} {r.get('format', '')} ({what})"
    return best, source


def finish_bounds(rows: list[dict[str, Any]], measured_gbps: float, dep_bound=None) -> tuple[float, str]:
    """Set every row's ``bound_tokens_per_s`` / ``achieved_vs_bound`` (and, given ``dep_bound(row, B)`` -> s/token,
    the dependency-aware pair) at the disk figure of :func:`bound_disk_gbps` over all ``rows``; the compute floor
    is the faster of the all-in-RAM run and the row's own run (a policy pass that beat its noisy baseline), so
    ``achieved_vs_bound`` <= 1 by construction. Returns (GB/s, source)."""
    gbps, source = bound_disk_gbps(measured_gbps, rows)
    for r in rows:
        own_s = 1.0 / r["tokens_per_s"]
        floor_s = min(r["compute_floor_s"], own_s)
        io_s = r["reads_per_token"] * r["expert_bytes"] / (gbps * 1e9)
        r["bound_tokens_per_s"] = 1.0 / max(io_s, floor_s)
        r["achieved_vs_bound"] = r["tokens_per_s"] / r["bound_tokens_per_s"]
        r["read_vs_disk"] = r.get("read_gbps", float("nan")) / gbps
        r["disk_gbps_bound"] = gbps
        if dep_bound is not None:
            dep = 1.0 / min(dep_bound(r, gbps * 1e9), own_s) if r.get("_dep") is not None else float("nan")
            r["dep_bound_tokens_per_s"] = dep
            r["achieved_vs_dep_bound"] = r["tokens_per_s"] / dep
    return gbps, source


def write_report(out: Path, record: dict[str, Any]) -> None:
    from expertcast.inference.runtime.machine import CPU_FLAGS
    from expertcast.utils.io import atomic_write_json, print_table, write_csv

    m = record["machine"]
    print(f"disk: {m['disk_gbps']:.2f} GB/s ({m['disk_io_mode']}, {m['disk_block_bytes']} B blocks, queue depth "
          f"{m['disk_queue_depth']}, {m.get('disk_seconds', float('nan')):.1f} s); RAM copy: {m['ram_copy_gbps']:.2f} "
          f"GB/s; expert GEMM: {m['gemm_gflops_1']:.1f} GFLOP/s at 1 token ({m['expert_ms_1']:.3f} ms), "
          f"{m['gemm_gflops_64']:.1f} at 64; kernel {m['gemm_kernel']}; CPU {m['cpu_model']} flags "
          f"{','.join(m['cpu_flags']) or 'none of ' + ','.join(CPU_FLAGS)}")
    for fmt, g in (m.get("format_gemm") or {}).items():
        print(f"expert GEMM {fmt}: {g['gflops_1']:.1f} GFLOP/s at 1 token ({g['ms_1']:.3f} ms), {g['gflops_64']:.1f} "
              f"at 64 (bf16-equivalent FLOPs)")
    for k in m.get("kernel_table") or []:
        print(f"kernel that ran: {k}")
    if "disk_gbps_bound" in record:
        print(f"bound's disk figure: {record['disk_gbps_bound']:.2f} GB/s ({record['disk_gbps_source']})")
        if any("sim_tokens_per_s" in r for r in record["rows"]):
            print("sim_*: the simulator's replay of each row's cell, its link at the bound's disk figure, the policy "
                  "armed as the runtime's (link estimate at the one-pass rate); no cost of the runtime's own is "
                  "charged (planner, hand-over, reads contending with compute): for prefetching policies an upper "
                  "bound")
    print(f"all-in-RAM baseline: {record['baseline']}; the plain model's forced replay: "
          f"{record['plain_model_tokens_per_s']:.1f} tokens/s")
    for f, tps in (record.get("format_all_in_ram_tokens_per_s") or {}).items():
        print(f"all-in-RAM {f} (every expert resident in its format, warmed; the compute floor of its rows' bound, "
              f"pct_full_format): {tps:.2f} tokens/s" + (" on the subset" if record.get("subset_rows") else ""))
    print(f"routing: {record['provenance']['routing']}; sequences {record['provenance']['sequences']}; "
          f"scheduling {record['provenance']['scheduling']}")
    cal = record["provenance"].get("static_calibration")
    if cal:
        print(f"static: calibrated on {len(cal)} held-out sequences of the trace set (none replayed); start: warm = "
              f"placed before the prompt, cold = empty; every policy then replays the prompt's routing (uncounted)")
    if any(r["policy"].startswith("belady") for r in record["rows"]):
        print("belady: the protect-rule plan, starting cold with its prompt replay shaped by its own rule (not the "
              "simulator's demand-only ceiling, whose every batch's decode starts from the best cache for free)")
    fr = record.get("forecaster_recall")
    if fr:
        print(f"learned forecaster: measured recall@K h1 {fr['h1']:.3f} on the replayed sequences ({fr['guard']})")
    print(f"bound: {record['bound_definition']}")
    if "dep_bound_definition" in record:
        print(record["dep_bound_definition"])
    for k, v in record.get("skipped", {}).items():
        print(f"not run: {k}: {v}")
    cols = [c for c in COLUMNS if any(c in r for r in record["rows"])]
    md = record["model"]
    print_table(record["rows"], title=f"disk tier: forced-routing replay through the disk store ({md['name']}, "
                f"L={md['L']} E={md['E']} K={md['K']}, {md['expert_bytes'] / 1e6:.2f} MB/expert bf16)", columns=cols,
                floatfmt="{:.3g}")
    atomic_write_json(out / "bench_disk.json", record)
    write_csv(out / "bench_disk.csv", record["rows"])
    plot_budget(out / "bench_disk.png", record)
    if any(r.get("recall") is not None for r in record["rows"]):
        plot_recall(out / "bench_disk_recall.png", record)
    print(f"wrote {out / 'bench_disk.json'}, bench_disk.csv, bench_disk*.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_budget(path: Path, record: dict[str, Any]) -> None:
    """tokens/s against the RAM budget, one line per policy and expert format, its full-overlap bound dashed."""
    from expertcast.utils.io import save_figure

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = record["rows"]
    keys = list(dict.fromkeys((r["policy"], r.get("format", ""), r.get("budget_kind", "")) for r in rows))
    for i, key in enumerate(keys):
        rs = [r for r in rows if (r["policy"], r.get("format", ""), r.get("budget_kind", "")) == key]
        x = [100 * r["budget"] for r in rs]
        c = f"C{i % 10}"
        name = " ".join(k for k in key if k and k != "experts")
        ax.plot(x, [r["tokens_per_s"] for r in rs], "o-", color=c, label=name)
        ax.plot(x, [r["bound_tokens_per_s"] for r in rs], "--", color=c, alpha=0.5)
    budgets = sorted({100 * r["budget"] for r in rows})
    full = [float(np.median([r["full_tokens_per_s"] for r in rows if 100 * r["budget"] == b])) for b in budgets]
    ax.plot(budgets, full, "k-", label="all experts in RAM (bf16)")
    for j, f in enumerate(sorted(record.get("format_all_in_ram_tokens_per_s") or {})):
        fr = [float(np.median([r["full_format_tokens_per_s"] for r in rows
                               if 100 * r["budget"] == b and r.get("format") == f])) for b in budgets]
        ax.plot(budgets, fr, "k" + (":", "-.")[j % 2], label=f"all experts in RAM ({f})")
    ax.set_xlabel("RAM budget (% of experts; bf16 bytes for 'bf16 bytes' rows)")
    ax.set_ylabel("tokens/s (dashed: full-overlap bound)")
    ax.set_title(f"disk tier, bound's disk {record.get('disk_gbps_bound', record['machine']['disk_gbps']):.2f} GB/s")
    ax.legend(fontsize=6)
    save_figure(fig, path)


def plot_recall(path: Path, record: dict[str, Any]) -> None:
    """tokens/s against the oracle forecast's recall@K, per budget and format (one curve per oracle setting but its
    recall: break-even on and off, two-execution planning, ...), with the
    demand-only policies as horizontal lines and the learned forecaster's seqmoe at its measured recall."""
    from expertcast.utils.io import save_figure

    plt = _plt()
    rows = [r for r in record["rows"] if r.get("budget_kind", "experts") == "experts"]
    cells = list(dict.fromkeys((r["budget"], r.get("format", "")) for r in rows))
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4), squeeze=False)
    fr = (record.get("forecaster_recall") or {}).get("h1")
    for ax, (b, fmt) in zip(axes[0], cells, strict=True):
        rs = [r for r in rows if (r["budget"], r.get("format", "")) == (b, fmt)]
        series = list(dict.fromkeys(r["oracle_series"] for r in rs if r.get("recall") is not None))
        for j, ser in enumerate(series):  # one curve per oracle setting but its recall
            orc = sorted((r for r in rs if r.get("oracle_series") == ser), key=lambda r: r["recall"])
            ax.plot([r["recall"] for r in orc], [r["tokens_per_s"] for r in orc], "o-", color=f"C{j}",
                    label=ser.replace("seqmoe:forecast=oracle", "oracle").replace(",", " ").strip())
        for k, r in enumerate(r for r in rs if r.get("recall") is None):
            if r["policy"].startswith("seqmoe") and fr is not None:
                ax.plot([fr], [r["tokens_per_s"]], "*", ms=12, color=f"C{k + len(series)}",
                        label=f"{r['policy']} (learned)")
            else:
                ax.axhline(r["tokens_per_s"], ls=":", color=f"C{k + len(series)}", label=r["policy"])
        ax.axhline(rs[0]["full_tokens_per_s"], color="k", label="all in RAM (bf16)")
        ax.set_title(f"{100 * b:g}% budget {fmt}")
        ax.set_xlabel("forecast recall@K")
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=6)
    save_figure(fig, path)
