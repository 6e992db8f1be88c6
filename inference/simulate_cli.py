"""``expertcast simulate``: replay routing traces through cache policies at several capacities.

    expertcast simulate --traces runs/traces/gsm8k --policies lru,lfu,lrfu:lam=0.01,belady \\
        --capacity 0.15,0.25,0.35,0.45 [--pool per-layer|shared] [--slots-per-layer 2,4]
        [--batch-size 4] [--bandwidth-gbps 25] [--layer-compute-ms 0.15] [--out runs/simulate]
        [--json PATH]

Prints a table and writes ``simulate.json`` (one record per (policy, capacity)), ``simulate.csv`` and
``hit_vs_capacity.png`` (hit rate vs capacity per policy, Belady drawn as the ceiling) under ``--out``.
Accounting is decode-only from the post-prefill cache state (prefill replayed through the policy,
uncounted); ``belady_fraction`` is relative to protect-rule Belady at the same capacity. An
interrupted run resumes from ``simulate.partial.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from expertcast.utils.io import atomic_write_json, report

TABLE_COLUMNS = ["policy", "pool", "capacity", "slots", "hit", "adj_hit", "mb_per_token", "belady_fraction",
                 "demand_misses", "proactive_loads", "late_prefetches", "cpu_exec", "stall_ms_per_token",
                 "pct_full_speed"]


def split_policies(text: str) -> list[str]:
    """``"lru,lrfu:lam=0.1,history=in-cache,belady"`` -> ``["lru", "lrfu:lam=0.1,history=in-cache",
    "belady"]`` (a ``key=value`` part without ``:`` belongs to the previous policy)."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part and ":" not in part:
            if not out:
                raise ValueError(f"policy option {part!r} has no policy before it")
            out[-1] += "," + part
        else:
            out.append(part)
    if not out:
        raise ValueError("no policy given")
    return out


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="expertcast simulate", description="trace-driven expert-cache simulation")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", help="trace directory written by `expertcast collect` / `expertcast traces import`")
    src.add_argument("--synthetic", choices=["random", "zipf", "markov"],
                     help="replay synthetic traces instead (demo/smoke test; see --synthetic-shape)")
    ap.add_argument("--synthetic-shape", default="4,32,2,8,256",
                    help="L,E,K,sequences,tokens of --synthetic traces (default 4,32,2,8,256)")
    ap.add_argument("--max-sequences", type=int, default=None, help="replay only the first N sequences")
    ap.add_argument("--policies", default="lru,lfu,belady", help="comma list; options as name:key=value")
    ap.add_argument("--capacity", default=None, help="fractions of L*E, e.g. 0.15,0.25,0.35,0.45")
    ap.add_argument("--slots", default=None, help="slot counts (per layer, or in all for --pool shared)")
    ap.add_argument("--slots-per-layer", default=None, help="per-layer budgets B, e.g. 2,4 (per-layer pool)")
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"])
    ap.add_argument("--batch-size", type=int, default=1, help="consecutive sequences decoded in lockstep")
    ap.add_argument("--bandwidth-gbps", type=float, default=25.0, help="host-device link GB/s (PCIe 4.0 x16)")
    ap.add_argument("--layer-compute-ms", default="0.15", help="per-layer compute ms: one value or L values")
    ap.add_argument("--expert-bytes", type=int, default=None, help="override the trace's bytes per expert")
    ap.add_argument("--queue", default="fifo", choices=["fifo", "edf"], help="order of queued prefetches")
    ap.add_argument("--cpu-expert-ms", type=float, default=0.19)
    ap.add_argument("--cpu-token-ms", type=float, default=0.01)
    ap.add_argument("--engine", default="auto", choices=["auto", "kernel", "python"])
    ap.add_argument("--no-belady-fraction", action="store_true", help="skip the Belady reference runs")
    ap.add_argument("--calibration", default=None, help="trace directory calibrating `static` (default in-sample)")
    ap.add_argument("--out", default="runs/simulate", help="output directory")
    ap.add_argument("--json", default=None, help="JSON path (default OUT/simulate.json)")
    ap.add_argument("--no-resume", action="store_true", help="ignore OUT/simulate.partial.json")
    ap.add_argument("--forecaster", default=None,
                    help="forecaster export for the `seqmoe` policy (same as seqmoe:forecaster=PATH)")
    return ap


def _load_traces(args):
    if args.synthetic:
        from expertcast.inference import synthetic

        L, E, K, n, T = _ints(args.synthetic_shape)
        gen = {"random": synthetic.random_traces, "zipf": synthetic.zipf_traces, "markov": synthetic.markov_traces}
        tr = gen[args.synthetic](num_sequences=n, num_tokens=T, num_layers=L, num_experts=E, top_k=K)
        meta, seqs = tr.meta, tr.sequences
    else:
        from expertcast.data.traces import load_traces

        p = Path(args.traces)
        if not p.exists():
            raise FileNotFoundError(f"trace directory {p} does not exist (record traces with `expertcast collect`)")
        meta, seqs = load_traces(p)
    if args.max_sequences:
        seqs = seqs[: args.max_sequences]
    return meta, seqs


def plot_hit_vs_capacity(records: list[dict[str, Any]], path: Path, x_key: str = "capacity") -> None:
    """PNG: hit rate vs capacity, one line per policy, Belady as the (shaded) ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pols = list(dict.fromkeys(r["policy"] for r in records))
    bel = sorted({(r[x_key], r["belady_hit"]) for r in records if r.get("belady_hit") is not None})
    if bel:
        xs, ys = zip(*bel, strict=True)
        ax.plot(xs, ys, color="black", lw=2.5, ls="--", label="belady (ceiling)")
        ax.fill_between(xs, ys, 1.0, color="0.9", zorder=0)
    for p in pols:
        if p == "belady" and bel:
            continue
        pts = sorted((r[x_key], r["hit"]) for r in records if r["policy"] == p)
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p)
    ax.set_xlabel("capacity (fraction of L*E experts)" if x_key == "capacity" else "slots per layer")
    ax.set_ylabel("hit rate (1 - D/A), decode only")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    pool = records[0]["pool"] if records else ""
    ax.set_title(f"expert-cache hit rate vs capacity ({pool} pool, batch {records[0]['batch_size'] if records else 1})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        import sys

        print(f"expertcast simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from expertcast.inference.cost_model import CostConfig
    from expertcast.inference.simulator import simulate

    lc = _floats(args.layer_compute_ms)
    cost = CostConfig(bandwidth_gbps=args.bandwidth_gbps, layer_compute_ms=lc[0] if len(lc) == 1 else lc,
                      expert_bytes=args.expert_bytes, queue=args.queue, cpu_expert_ms=args.cpu_expert_ms,
                      cpu_token_ms=args.cpu_token_ms)
    capacities: list[Any] = []
    if args.capacity:
        capacities += _floats(args.capacity)
    if args.slots:
        capacities += _ints(args.slots)
    spl = _ints(args.slots_per_layer) if args.slots_per_layer else None
    if not capacities and not spl:
        capacities = [0.15, 0.25, 0.35, 0.45]
    policies = split_policies(args.policies)
    if args.forecaster:  # seqmoe reads its forecaster export (and the link, for its transfer-time estimate)
        extra = f"forecaster={args.forecaster},bandwidth_gbps={args.bandwidth_gbps}"
        if len(_floats(args.layer_compute_ms)) == 1:
            extra += f",layer_compute_ms={_floats(args.layer_compute_ms)[0]}"
        policies = [p + ("," if ":" in p else ":") + extra
                    if p.split(":")[0].strip().lower() == "seqmoe" and "forecaster=" not in p else p for p in policies]
    from expertcast.inference.policies import parse_policy_spec, policy_class

    for p in policies:  # unknown names fail before any trace is loaded
        policy_class(parse_policy_spec(p)[0])
    meta, seqs = _load_traces(args)
    calibration = None
    if args.calibration:
        from expertcast.data.traces import load_traces
        from expertcast.inference.policies.static import selection_counts

        cmeta, cseqs = load_traces(args.calibration)
        cmeta.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what="replayed trace")
        calibration = selection_counts(cseqs, meta.num_layers, meta.num_experts)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "simulate.partial.json"
    signature = {"model_id": meta.model_id, "sequences": len(seqs), "tokens": int(sum(s.num_tokens for s in seqs)),
                 "bandwidth_gbps": cost.bandwidth_gbps, "layer_compute_ms": lc, "queue": cost.queue,
                 "expert_bytes": cost.expert_bytes, "engine": args.engine}
    done: dict[str, dict] = {}
    if partial.exists() and not args.no_resume:
        saved = json.loads(partial.read_text())
        if saved.get("signature") == signature:
            done = {r["key"]: r for r in saved.get("records", [])}
            if done:
                print(f"resuming: {len(done)} finished runs in {partial}")
    finished = list(done.values())

    def save(rec: dict) -> None:
        finished.append(rec)
        atomic_write_json(partial, {"signature": signature, "records": finished})

    print(f"replaying {len(seqs)} sequences of {meta.model_id} (L={meta.num_layers}, E={meta.num_experts}, "
          f"K={meta.top_k}), batch {args.batch_size}, {args.pool} pool; decode-only accounting, prefill "
          f"replayed uncounted; belady_fraction vs protect-rule Belady")
    records = simulate((meta, seqs), policies, capacities or None, pool=args.pool, slots_per_layer=spl,
                       batch_size=args.batch_size, cost=cost, belady_fraction=not args.no_belady_fraction,
                       engine=args.engine, calibration=calibration, done=done, on_record=save)
    json_path = Path(args.json) if args.json else out / "simulate.json"
    report(records, title="expert-cache simulation (decode only)", json_path=json_path,
           csv_path=out / "simulate.csv", columns=[c for c in TABLE_COLUMNS if c != "belady_fraction"
                                                   or not args.no_belady_fraction])
    png = out / "hit_vs_capacity.png"
    plot_hit_vs_capacity(records, png, "capacity")
    partial.unlink(missing_ok=True)
    print(f"wrote {json_path}, {out / 'simulate.csv'}, {png}")
    return 0
