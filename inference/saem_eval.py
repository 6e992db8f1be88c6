"""SAEM evaluation in the trace-driven simulator (`expertcast stages eval`).

Policies: ``stage`` (stage-aware + CPU execution), ``stage-oracle`` (next stage's true frequencies at
the same boundaries), the ablations ``stage-nocpu`` (temporary slot only) and ``stage-noupdate``
(static calibration placement + CPU execution), and the baselines ``lru`` and ``static`` (static
frequency placement, misses through a temporary slot). Per batch size and capacity (fraction of the
experts of each layer, per-layer pools) the table gives:

- ``hit``: resident hits / accesses (a CPU-executed access is not a hit, nor a transfer);
- ``cpu_share``: CPU-executed accesses / accesses; ``transfers``: demand + proactive loads per token;
- ``speed``: the cost model's % of full-load speed;
- ``oracle_eff_hit`` / ``oracle_eff_speed``: stage-aware / oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.io import report


def synthetic_cue_decoder(cue_token: int):
    """Token decoder for :func:`expertcast.inference.synthetic.staged_traces`: the cue token reads
    " Wait", every other token " x"."""

    def dec(i: int) -> bytes:
        return b" Wait" if int(i) == cue_token else b" x"

    return dec


def make_policies(cues: list[str], decoder: Any, static_frequency: np.ndarray, calibration: np.ndarray,
                  ignore_case: bool = False) -> list[Any]:
    from expertcast.inference.policies.stage_aware import StageAwarePolicy, StageOraclePolicy
    from expertcast.inference.policies.static import StaticFrequencyPolicy

    kw = dict(cues=cues, decoder=decoder, static_frequency=static_frequency)
    pols = [StageAwarePolicy(**kw), StageOraclePolicy(**kw), StageAwarePolicy(cpu_exec=False, **kw),
            StageAwarePolicy(stage_updates=False, **kw)]
    for p, lab in zip(pols, ["stage", "stage-oracle", "stage-nocpu", "stage-noupdate"], strict=True):
        p.label = lab
        p.ignore_case = ignore_case
    st = StaticFrequencyPolicy(calibration=calibration)
    st.label = "static"
    return [*pols, "lru", st]


def run_grid(name: str, traces: tuple[Any, list[Any]], cues: list[str], decoder: Any, static_frequency: np.ndarray,
             calibration: np.ndarray, batch_sizes: list[int], capacities: list[float],
             ignore_case: bool = False) -> list[dict[str, Any]]:
    from expertcast.inference.simulator import simulate

    rows = []
    for bs in batch_sizes:
        pols = make_policies(cues, decoder, static_frequency, calibration, ignore_case)
        recs = simulate(traces, pols, capacities=capacities, batch_size=bs, belady_fraction=False, progress=True)
        by_cap: dict[float, dict[str, dict]] = {}
        for r in recs:
            by_cap.setdefault(r["capacity_requested"], {})[r["policy"]] = r
        for cap, group in by_cap.items():
            orc = group.get("stage-oracle")
            for pol, r in group.items():
                A = max(r["accesses"], 1)
                row = {"traces": name, "batch": bs, "capacity": cap, "slots_per_layer": r["slots_per_layer"],
                       "policy": pol, "hit": r["resident_hit"], "cpu_share": r["cpu_exec"] / A,
                       "demand_per_token": r["demand_misses"] / max(r["decoded_tokens"], 1),
                       "transfers_per_token": (r["demand_misses"] + r["proactive_loads"]) / max(r["decoded_tokens"], 1),
                       "mb_per_token": r["mb_per_token"], "speed_pct": r["pct_full_speed"]}
                if pol == "stage" and orc is not None:
                    row["oracle_eff_hit"] = r["resident_hit"] / orc["resident_hit"] if orc["resident_hit"] else float("nan")
                    row["oracle_eff_speed"] = r["pct_full_speed"] / orc["pct_full_speed"]
                rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["traces"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(2, len(keys), figsize=(5 * len(keys), 7), squeeze=False)
    for j, (tr, bs) in enumerate(keys):
        sub = [r for r in rows if r["traces"] == tr and r["batch"] == bs]
        for pol in dict.fromkeys(r["policy"] for r in sub):
            pts = sorted((r["capacity"], r["hit"], r["speed_pct"]) for r in sub if r["policy"] == pol)
            x = [p[0] for p in pts]
            axes[0, j].plot(x, [p[1] for p in pts], "o-", label=pol)
            axes[1, j].plot(x, [p[2] for p in pts], "o-", label=pol)
        axes[0, j].set_title(f"{tr}, batch {bs}")
        axes[0, j].set_ylabel("resident hit")
        axes[1, j].set_ylabel("modelled % of full-load speed")
        axes[1, j].set_xlabel("capacity (fraction of experts per layer)")
        for a in axes[:, j]:
            a.set_xscale("log")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: Any) -> int:
    from expertcast.inference.cues import CueSet, load_tokenizer
    from expertcast.inference.policies.static import selection_counts
    from expertcast.inference.stages import TokenDecoder

    batch_sizes = [int(x) for x in str(args.batch_sizes).split(",")]
    capacities = [float(x) for x in str(args.capacities).split(",")]
    rows: list[dict[str, Any]] = []
    out = Path(args.out_dir)
    if args.traces:
        from expertcast.data.traces import load_traces

        meta, seqs = load_traces(args.traces, max_sequences=args.max_sequences)
        cs = CueSet.load(args.cues)
        cs.check_compatible(meta.num_layers, meta.num_experts)
        tok = load_tokenizer(args.tokenizer or cs.tokenizer or meta.model_id)
        calib = np.asarray(cs.expert_frequency) if cs.expert_frequency is not None else None
        if calib is None:
            raise ValueError(f"cue set {args.cues} has no expert_frequency (recalibrate with expertcast stages calibrate)")
        rows += run_grid("cot", (meta, seqs), list(cs.cues), TokenDecoder(tok), calib, calib, batch_sizes, capacities,
                         cs.ignore_case)
    if args.synthetic:
        from expertcast.inference.synthetic import staged_traces

        syn = staged_traces(num_sequences=16, num_tokens=512, num_layers=8, num_experts=64, top_k=2, num_stages=4,
                            hot=8, mean_stage_len=64.0, seed=1)
        # calibration (static placement) on 4 held-out sequences of the same generator run
        freq = selection_counts(syn.sequences[:4], syn.meta.num_layers, syn.meta.num_experts).astype(np.float64)
        rows += run_grid("synthetic", (syn.meta, syn.sequences[4:]), ["Wait"], synthetic_cue_decoder(syn.cue_token),
                         freq, freq, batch_sizes, capacities)
    if not rows:
        raise ValueError("nothing to evaluate: give --traces (with --cues) and/or --synthetic")
    report(rows, title="SAEM: stage-aware vs LRU vs static (per-layer pools, decode-only)",
           json_path=out / "saem_eval.json", csv_path=out / "saem_eval.csv")
    plot(rows, out / "saem_eval.png")
    print(f"wrote {out}")
    return 0
