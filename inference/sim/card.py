"""The protocol card: the standard cache and forecast protocol on one trace set (docs/design.md, "Protocol card").

What it computes, on the evaluated sequences (``expertcast traces card``, :mod:`expertcast.commands.traces`):

* hit vs capacity, per-layer and shared pools, for ``lru``, ``lfu``, ``lrfu``, ``fifo``, ``static`` (calibrated on
  the fit set only: without one it is skipped), the oracles ``belady-k`` and ``belady``, and ``seqmoe`` / ``hybrid``
  with a forecaster export; every replay goes through :func:`~expertcast.inference.sim.simulator.run_policy` (the
  compiled kernels where a policy has one, else the driver over the cost model's link);
* per token (a batch of one: a counted step is one token): demand misses, exposed misses (the link stall over one
  expert's transfer time: each demand miss counts 1, a late prefetch the part of its transfer it waited for) and the
  share of tokens with no miss at all (no demand miss and no late prefetch), evictions, late prefetches and used
  prefetches (the :class:`~expertcast.inference.cache.counters.Counters` tallies);
* the LRU->Belady gap at each (pool, capacity), ``belady - lru`` in hit, and the share of it each policy closes,
  ``(hit - lru) / (belady - lru)`` (NaN when the gap is 0);
* recall@K by horizon of the online baselines (``repeat-last``, ``recent-freq``, ``recent-count``; with a fit set also ``frequency``,
  ``transition``, ``cross-layer`` and, with ``mlp_steps``, the MLP reference, all fitted on it) and of the forecaster
  (:func:`~expertcast.models.forecaster_recall.evaluate`).

Replay semantics: ``lifecycle="cold"`` replays each sequence on its own (an empty cache, a fresh policy state, an
oracle future of that sequence); ``"persistent"`` one stream of all sequences in order over one cache (the
simulator's serving session). ``count_prefill`` counts the prompt positions too (default: decode only, prefill
replayed through the policy uncounted); where the source did not mark the phase (``TraceMeta.phase_known`` False),
every position is decode and the header says the phase is unknown.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES, CostConfig
from expertcast.inference.cache.expert_cache import CacheConfig
from expertcast.inference.cache.policy import Policy
from expertcast.inference.sim.simulator import (
    AccessStream,
    ReplayResult,
    build_stream,
    cache_configs,
    run_policy,
    validate_traces,
)

LIFECYCLES = ("cold", "persistent")
"""``cold``: the cache (and the policy) reset for every sequence; ``persistent``: one cache across sequences."""
DEMAND_POLICIES = ("lru", "lfu", "lrfu", "fifo")
FITTED_POLICIES = ("static",)
ORACLES = ("belady-k", "belady")
FORECAST_POLICIES = ("seqmoe", "hybrid")
POOLS = ("per-layer", "shared")


@dataclass
class CardSettings:
    """What a card replays and how."""

    capacities: tuple[float, ...] = (0.10, 0.25, 0.45)
    """Fractions of the L*E experts; a per-layer capacity below top-K is skipped (noted in the header)."""
    pools: tuple[str, ...] = POOLS
    """Pools replayed at every capacity."""
    lifecycle: str = "cold"
    """``cold`` (cache reset per sequence) or ``persistent`` (one cache across the sequences, in order)."""
    count_prefill: bool = False
    """Count the prompt positions as well (default: decode only; prefill replayed uncounted)."""
    horizons: tuple[int, ...] = (1, 2, 4, 8)
    """Forecast horizons (steps ahead) of the recall table."""
    mlp_steps: int = 0
    """Training steps of the MLP reference predictor (fitted on the fit set; 0: none)."""
    mlp_hidden: int = 256
    """Hidden width of the MLP reference."""
    cost: CostConfig = field(default_factory=CostConfig)
    """The link model (:mod:`expertcast.inference.cache.cost_model`)."""

    def __post_init__(self) -> None:
        if self.lifecycle not in LIFECYCLES:
            raise ValueError(f"lifecycle must be one of {LIFECYCLES}, got {self.lifecycle!r}")
        bad = [p for p in self.pools if p not in POOLS]
        if bad or not self.pools:
            raise ValueError(f"pools must be among {POOLS}, got {list(self.pools)}")
        if not self.capacities or any(not 0 < float(c) <= 1 for c in self.capacities):
            raise ValueError(f"capacities must be fractions in (0, 1], got {list(self.capacities)}")
        if not self.horizons or min(self.horizons) < 1:
            raise ValueError(f"horizons must be positive, got {list(self.horizons)}")


# ------------------------------------------------------------------------------------------------
# Replay under a lifecycle
# ------------------------------------------------------------------------------------------------
def lifecycle_streams(meta: TraceMeta, seqs: Sequence[TraceSequence], lifecycle: str,
                      count_prefill: bool = False) -> list[AccessStream]:
    """The access streams a lifecycle replays: one per sequence (``cold``) or one of all (``persistent``), batch 1;
    with ``count_prefill`` every step is counted."""
    if lifecycle not in LIFECYCLES:
        raise ValueError(f"lifecycle must be one of {LIFECYCLES}, got {lifecycle!r}")
    parts = [[s] for s in seqs] if lifecycle == "cold" else [list(seqs)]
    streams = [build_stream(meta, p, batch_size=1) for p in parts]
    if count_prefill:
        for st in streams:
            st.step_counted[:] = True
    return streams


def merge_results(results: Sequence[ReplayResult]) -> ReplayResult:
    """The counters of several replays as one (per-layer arrays and totals summed, per-step tallies concatenated)."""
    if not results:
        raise ValueError("no replays to merge")
    first = results[0]
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(first):
        vals = [getattr(r, f.name) for r in results]
        if isinstance(vals[0], np.ndarray):
            kw[f.name] = np.sum(vals, axis=0)
        elif isinstance(vals[0], list):
            kw[f.name] = [v for x in vals for v in x]
        elif f.name in ("decoded_tokens", "decode_steps", "stall_ms", "compute_ms", "seconds"):
            kw[f.name] = sum(vals)
        elif f.name in ("resident", "timeline", "landings"):
            kw[f.name] = None
        else:
            kw[f.name] = vals[0]
    return ReplayResult(**kw)


def replay_lifecycle(streams: Sequence[AccessStream], policy: Policy, config: CacheConfig,
                     cost: CostConfig | None = None, engine: str = "auto") -> ReplayResult:
    """``policy`` replayed over each stream from an empty cache (:func:`run_policy`, which resets it), the counters
    merged."""
    return merge_results([run_policy(st, policy, config, cost, engine) for st in streams])


def token_metrics(res: ReplayResult, cost: CostConfig) -> dict[str, float | int]:
    """The per-token figures of one replay (batch 1: one counted step = one token)."""
    tokens = max(res.decoded_tokens, 1)
    tr_ms = cost.transfer_ms(res.expert_bytes)
    steps = len(res.step_demand)
    return {
        "tokens": res.decoded_tokens,
        "misses_per_token": res.D / tokens,
        "exposed_per_token": (res.stall_ms / tr_ms / tokens) if tr_ms > 0 else float("nan"),
        "no_miss_share": res.steps_without_miss / steps if steps else float("nan"),
        "evictions_per_token": int(res.evictions.sum()) / tokens,
        "late_prefetches": int(res.late.sum()),
        "prefetches_used": res.U,
        "proactive_per_token": res.proactive_per_token,
        "stall_ms_per_token": res.stall_ms / tokens,
    }


# ------------------------------------------------------------------------------------------------
# The card
# ------------------------------------------------------------------------------------------------
def _configs(meta: TraceMeta, settings: CardSettings) -> tuple[list[tuple[str, float, CacheConfig]], list[str]]:
    out, notes = [], []
    for pool in settings.pools:
        for c in settings.capacities:
            try:
                (_, cfg), = cache_configs(meta, [float(c)], pool)
            except ValueError as e:
                notes.append(f"{pool} capacity {c}: skipped ({e})")
                continue
            out.append((pool, float(c), cfg))
    if not out:
        raise ValueError("no capacity fits this trace: " + "; ".join(notes))
    return out, notes


def _policies(fit: Sequence[TraceSequence] | None, forecaster: str | None, notes: list[str],
              cost: CostConfig) -> list[tuple[str, Policy]]:
    from expertcast.inference.policies import make_policy

    pols = [(n, make_policy(n)) for n in DEMAND_POLICIES]
    if fit:
        pols.append(("static", make_policy("static", calibration=list(fit))))
    else:
        notes.append("static: skipped (it is fitted on the fit set only: pass --fit-traces)")
    pols += [(n, make_policy(n)) for n in ORACLES]
    if forecaster:  # the link and compute settings feed the forecast policies' transfer-time estimate (as simulate)
        link: dict[str, Any] = {"bandwidth_gbps": float(cost.bandwidth_gbps)}
        lc = np.atleast_1d(np.asarray(cost.layer_compute_ms, dtype=np.float64))
        if lc.size == 1:
            link["layer_compute_ms"] = float(lc[0])
        pols += [(n, make_policy(n, forecaster=str(forecaster), **link)) for n in FORECAST_POLICIES]
    return pols


def cache_rows(meta: TraceMeta, seqs: Sequence[TraceSequence], settings: CardSettings,
               fit: Sequence[TraceSequence] | None = None, forecaster: str | None = None,
               progress: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (pool, capacity, policy) and the notes (skipped capacities and policies)."""
    configs, notes = _configs(meta, settings)
    pols = _policies(fit, forecaster, notes, settings.cost)
    streams = lifecycle_streams(meta, seqs, settings.lifecycle, settings.count_prefill)
    cost = settings.cost
    runs = [(pool, c, cfg, name, pol) for pool, c, cfg in configs for name, pol in pols]
    it = runs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(runs, desc="card", unit="run", leave=False)
    rows: list[dict[str, Any]] = []
    for pool, c, cfg, name, pol in it:
        res = replay_lifecycle(streams, pol, cfg, cost)
        rows.append({"pool": pool, "capacity": c, "slots": cfg.total_slots, "policy": name, "hit": res.hit,
                     "adj_hit": res.adj_hit, **token_metrics(res, cost), "mb_per_token": res.mb_per_token,
                     "engine": res.engine, "seconds": round(res.seconds, 4)})
    add_gap(rows)
    return rows, notes


def add_gap(rows: list[dict[str, Any]]) -> None:
    """Add ``lru_belady_gap`` (belady - lru hit) and ``gap_closed`` ((hit - lru) / gap, NaN for a zero gap) to
    every row, per (pool, capacity)."""
    by = {}
    for r in rows:
        by.setdefault((r["pool"], r["capacity"]), {})[r["policy"]] = r["hit"]
    for r in rows:
        hits = by[(r["pool"], r["capacity"])]
        lru, bel = hits.get("lru"), hits.get("belady")
        if lru is None or bel is None:
            r["lru_belady_gap"] = r["gap_closed"] = float("nan")
            continue
        gap = bel - lru
        r["lru_belady_gap"] = gap
        r["gap_closed"] = (r["hit"] - lru) / gap if gap > 0 else float("nan")


def recall_rows(meta: TraceMeta, seqs: Sequence[TraceSequence], settings: CardSettings,
                fit: Sequence[TraceSequence] | None = None, forecaster: str | None = None,
                progress: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Recall@K (and @K+3) by horizon of each predictor, and their costs: the online baselines (their frequency
    prior the fit set's, else none), the fitted ones with a fit set, the forecaster with an export."""
    import torch
    from expertcast.models.forecaster_recall import (
        RecentFrequencyBaseline,
        RepeatLastBaseline,
        baseline_half_lives,
        evaluate,
        fit_baselines,
        fit_mlp_reference,
    )

    L, E = meta.num_layers, meta.num_experts
    H = max(settings.horizons)
    model, p = None, L - 1
    if forecaster:
        from expertcast.models.forecaster_export import load_forecaster

        exp = load_forecaster(forecaster)
        model, p = exp.model, exp.config.p
    costs: dict[str, Any] = {}
    if fit:
        halves = baseline_half_lives(exp.config.component_half_lives if forecaster else None)
        baselines = fit_baselines(list(fit), meta, p, halves)
        if settings.mlp_steps > 0:
            mlp = fit_mlp_reference(list(fit), meta, p, horizons=H, hidden=settings.mlp_hidden,
                                    steps=settings.mlp_steps)
            baselines.append(mlp)
            costs[mlp.name] = {"parameters": mlp.num_parameters(), "step_flops": mlp.step_flops()}
    else:
        none = torch.zeros(L, E)
        baselines = [RepeatLastBaseline(none), RecentFrequencyBaseline(none), RecentFrequencyBaseline(none, count=True)]
    with torch.no_grad():
        tables = evaluate(model, list(seqs), meta, baselines, horizons=H, trigger_layer=p, progress=progress)
    rows = []
    for name, t in tables.items():
        rk, rk3 = t.recall("k"), t.recall("k3")
        row: dict[str, Any] = {"predictor": name}
        for h in settings.horizons:
            row[f"R@K h{h}"] = float(rk[h - 1])
        for h in settings.horizons:
            row[f"R@K+3 h{h}"] = float(rk3[h - 1])
        row["targets h1"] = int(t.count[0].sum() / max(L, 1))
        rows.append(row)
    return rows, costs


def link_model(meta: TraceMeta, cost: CostConfig) -> dict[str, Any]:
    """The cost model's parameters as the card states them."""
    xbytes = int(cost.expert_bytes or meta.expert_bytes or QWEN3_30B_A3B_EXPERT_BYTES)
    return {"bandwidth_gbps": cost.bandwidth_gbps, "expert_bytes": xbytes,
            "expert_bytes_source": "--expert-bytes" if cost.expert_bytes else (
                "trace" if meta.expert_bytes else "Qwen3-30B-A3B default"),
            "transfer_ms": cost.transfer_ms(xbytes), "layer_compute_ms": cost.layer_compute_ms,
            "queue": cost.queue, "model": "one serialized link; demand transfers exposed, prefetches overlap compute "
                                          "(docs/design.md, 'Cost model')"}


def finite_or_none(x: Any) -> Any:
    """NaN and inf as None (JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def check_splits(seqs: Sequence[TraceSequence], fit: Sequence[TraceSequence] | None, forecaster: str | None,
                 fit_what: str = "the fit set", routing: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refuse (:class:`~expertcast.utils.errors.OverlapError`) evaluated sequence ids shared with the fit set or
    with the export's training ids, and (:class:`~expertcast.utils.fitted_on.ModelMismatchError`) an export fitted on
    another model's routing than ``routing`` (the carded traces' model identity), through the one guard
    :func:`~expertcast.utils.fitted_on.check_fitted_on`, with no override: a card is never contaminated; the
    checks' results for the header."""
    from expertcast.models.forecaster_export import forecaster_fitted_on
    from expertcast.utils.errors import OverlapError
    from expertcast.utils.fitted_on import ModelMismatchError, check_fitted_on
    from expertcast.utils.provenance import check_overlap

    ids = [s.seq_id for s in seqs]
    out: dict[str, Any] = {}
    try:
        if fit is not None:
            out["fit"] = check_overlap(ids, [s.seq_id for s in fit], what=fit_what)
        if forecaster:
            out["forecaster"] = check_fitted_on(forecaster_fitted_on(forecaster), ids, routing,
                                                scored="the carded traces")
    except (OverlapError, ModelMismatchError) as e:  # no override: say so instead of the guard's --allow-* hint
        raise type(e)(str(e).split(" or pass --allow-")[0] + " (a card has no override)") from None
    return out


def make_card(meta: TraceMeta, seqs: Sequence[TraceSequence], settings: CardSettings | None = None, *,
              fit: Sequence[TraceSequence] | None = None, forecaster: str | None = None,
              sources: dict[str, Any] | None = None, progress: bool = False) -> dict[str, Any]:
    """The card of ``seqs``: ``{"header", "cache", "recall", "recall_cost"}`` (see the module docstring).
    ``fit``: the fit set (static, the fitted baselines); ``forecaster``: an export directory (seqmoe, hybrid and
    the forecaster's recall); ``sources``: paths to record (traces, fit traces). Overlap of the evaluated ids with
    the fit set or the export's training ids is refused before anything is replayed."""
    import time

    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.utils.provenance import code_version

    settings = settings or CardSettings()
    seqs = list(seqs)
    if not seqs:
        raise ValueError("no sequences to card")
    if fit is not None:
        try:
            validate_traces(meta, fit)
        except ValueError as e:
            raise ValueError(f"fit set: {e}") from None
    from expertcast.utils.fitted_on import trace_set_model

    overlap = check_splits(seqs, fit, forecaster,
                           routing=trace_set_model((sources or {}).get("traces"), meta.model_id))
    export_hash = None
    if forecaster:
        from expertcast.models.forecaster_export import verify_export

        export_hash = verify_export(forecaster)
    t0 = time.perf_counter()
    rows, notes = cache_rows(meta, seqs, settings, fit, forecaster, progress)
    t_cache = time.perf_counter() - t0
    recall, costs = recall_rows(meta, seqs, settings, fit, forecaster, progress)
    t_recall = time.perf_counter() - t0 - t_cache
    tokens = sum(s.num_tokens for s in seqs)
    prompt = sum(s.prompt_len for s in seqs)
    if not meta.phase_known:
        phase = "unknown (the source does not mark prefill vs decode: every position counted as decode)"
    elif settings.count_prefill:
        phase = "known; prefill counted"
    else:
        phase = "known; decode only (prefill replayed through the policy uncounted)"
    header = {
        "traces": (sources or {}).get("traces"),
        "fingerprint": sequences_fingerprint(seqs),
        "source_format": meta.source_format or "collected",
        "source_sha256": meta.source_sha256,
        "model_id": meta.model_id,
        "shape": {"L": meta.num_layers, "E": meta.num_experts, "K": meta.top_k},
        "sequences": len(seqs), "tokens": tokens, "prompt_tokens": prompt, "decode_tokens": tokens - prompt,
        "lifecycle": settings.lifecycle,
        "lifecycle_note": ("cache and policy reset for every sequence" if settings.lifecycle == "cold"
                           else "one cache across the sequences, in order"),
        "prefill_counted": bool(settings.count_prefill) if meta.phase_known else "unknown",
        "phase": phase,
        "phase_known": meta.phase_known,
        "batch_size": 1,
        "link_model": link_model(meta, settings.cost),
        "settings": {"capacities": list(settings.capacities), "pools": list(settings.pools),
                     "horizons": list(settings.horizons), "mlp_steps": settings.mlp_steps,
                     "cost": dataclasses.asdict(settings.cost)},
        "fit_traces": (sources or {}).get("fit_traces"),
        "fit_sequences": len(fit) if fit is not None else 0,
        "fit_fingerprint": sequences_fingerprint(list(fit)) if fit else None,
        "forecaster": str(forecaster) if forecaster else None,
        "export_hash": export_hash,
        "overlap": overlap,
        "notes": notes,
        "definitions": {
            "hit": "1 - demand misses / accesses (docs/design.md, 'Counters and metrics')",
            "misses_per_token": "demand misses / counted tokens",
            "exposed_per_token": "link stall / one expert's transfer time / counted tokens",
            "no_miss_share": "counted tokens with no demand miss and no late prefetch / counted tokens",
            "gap_closed": "(hit - lru hit) / (belady hit - lru hit) at the same pool and capacity",
        },
        "seconds": {"cache": round(t_cache, 2), "recall": round(t_recall, 2)},
        "code_version": code_version(),
    }
    return {"header": header, "cache": rows, "recall": recall, "recall_cost": costs}


CACHE_COLUMNS = {"pool": "pool", "capacity": "capacity", "policy": "policy", "hit": "hit", "gap_closed": "gap closed",
                 "misses_per_token": "miss/tok", "exposed_per_token": "exposed/tok", "no_miss_share": "no-miss tok",
                 "evictions_per_token": "evict/tok", "late_prefetches": "late", "prefetches_used": "pf used"}
"""The terminal table's columns (row key -> header)."""


def header_lines(card: dict[str, Any]) -> list[str]:
    """The header as the terminal shows it."""
    h = card["header"]
    lm = h["link_model"]
    sh = h["shape"]
    lines = [f"card of {h['traces'] or 'traces'}: {h['model_id']} ({h['source_format']}), L={sh['L']} E={sh['E']} "
             f"K={sh['K']}, {h['sequences']} sequences, {h['tokens']} tokens ({h['decode_tokens']} decode), "
             f"fingerprint {h['fingerprint'][:16]}",
             f"lifecycle: {h['lifecycle']} ({h['lifecycle_note']}); phase: {h['phase']}; batch 1",
             f"link model: {lm['bandwidth_gbps']} GB/s, expert {lm['expert_bytes']} bytes ({lm['expert_bytes_source']}), "
             f"transfer {lm['transfer_ms']:.4f} ms, layer compute {lm['layer_compute_ms']} ms, queue {lm['queue']}",
             f"fit set: {h['fit_traces'] or ('given' if h['fit_sequences'] else 'none')} ({h['fit_sequences']} "
             f"sequences); forecaster: "
             f"{h['forecaster'] or 'none'}" + (f" (export {h['export_hash'][:16]})" if h["export_hash"] else "")]
    lines += [f"note: {n}" for n in h["notes"]]
    return lines


def print_card(card: dict[str, Any]) -> None:
    """Header, the cache table and the recall table in the terminal."""
    from expertcast.utils.io import print_table

    for line in header_lines(card):
        print(line)
    shown = [{head: r[key] for key, head in CACHE_COLUMNS.items()} for r in card["cache"]]
    print_table(shown, title="hit vs capacity, per token, LRU->Belady gap closed", columns=list(CACHE_COLUMNS.values()))
    print_table(card["recall"], title="recall@K by horizon (decode targets)",
                columns=["predictor", *[k for k in card["recall"][0] if k.startswith("R@K h")], "targets h1"])


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return finite_or_none(obj)


def write_card(card: dict[str, Any], out) -> list:
    """``card.json``, ``card.csv`` (the cache rows, then the recall rows) and ``card.png`` into ``out`` (an
    :class:`~expertcast.utils.outdir.OutputDir`), each written atomically; returns their paths."""
    from expertcast.utils.io import atomic_write_json, write_csv

    paths = [out.file("card.json"), out.file("card.csv"), out.file("card.png")]
    atomic_write_json(paths[0], _json_safe(card))
    csv_rows = [{"table": "cache", **r} for r in card["cache"]]
    for r in card["recall"]:
        for k, v in r.items():
            if k.startswith("R@K"):
                which, h = k.split(" h")
                csv_rows.append({"table": "recall", "predictor": r["predictor"], "metric": which.replace("R@", "recall@"),
                                 "horizon": int(h), "value": v})
    write_csv(paths[1], csv_rows)
    plot_card(card, paths[2])
    return paths


def plot_card(card: dict[str, Any], path) -> None:
    """One PNG: hit vs capacity per policy (left; per-layer solid, shared dashed) and recall@K vs horizon per
    predictor (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from expertcast.utils.io import save_figure, series_colors
    from expertcast.utils.paths import display_path

    h = card["header"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    policies = list(dict.fromkeys(r["policy"] for r in card["cache"]))
    colors = series_colors(len(policies))
    for i, pol in enumerate(policies):
        for pool, style in (("per-layer", "-o"), ("shared", "--s")):
            pts = sorted((r["capacity"], r["hit"]) for r in card["cache"] if r["policy"] == pol and r["pool"] == pool)
            if pts:
                a1.plot([c for c, _ in pts], [100 * v for _, v in pts], style, color=colors[i],
                        label=f"{pol} ({pool})", alpha=0.9 if pool == "per-layer" else 0.6)
    a1.set_xlabel("capacity (fraction of L*E experts)")
    a1.set_ylabel("hit (%)")
    a1.set_title(f"hit vs capacity ({h['lifecycle']}, prefill counted: {h['prefill_counted']})", fontsize=10)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=6, ncol=2)
    hs = [int(k.split(" h")[1]) for k in card["recall"][0] if k.startswith("R@K h")]
    for r, color in zip(card["recall"], series_colors(len(card["recall"])), strict=True):
        a2.plot(hs, [100 * r[f"R@K h{x}"] for x in hs], "-o", color=color, label=r["predictor"])
    a2.set_xscale("log", base=2)
    a2.set_xticks(hs, [str(x) for x in hs])
    a2.set_xlabel("horizon (decode steps ahead)")
    a2.set_ylabel("recall@K (%)")
    a2.set_title("recall of the true top-K by horizon", fontsize=10)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7)
    sh = h["shape"]
    fig.suptitle(f"{display_path(h['model_id'])} ({h['source_format']}): L={sh['L']} E={sh['E']} K={sh['K']}, "
                 f"{h['sequences']} "
                 f"sequences, {h['tokens']} tokens", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
