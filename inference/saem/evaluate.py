"""SAEM evaluation in the trace-driven simulator (`expertcast stages eval`).

Policies (``--policies``): ``stage`` (stage-aware + CPU execution), ``stage-oracle`` (next stage's true
frequencies at the same boundaries), the ablations ``stage-nocpu`` (temporary slot only) and
``stage-noupdate`` (static calibration placement + CPU execution), and the baselines ``lru``
(demand-loading, Mixtral-offloading style) and ``static`` (static-frequency placement from the
calibration traces, misses through a temporary slot). Per batch size and capacity (a fraction of the
experts, or a slot count per layer; per-layer pools; budgets below top-K are accepted, the excess of a
selection then goes to the temporary slot or the CPU) the table gives:

- ``hit``: resident hits / accesses (a CPU-executed access is not a hit, nor a transfer);
- ``cpu_share``: CPU-executed accesses / accesses; ``transfers_per_token``: demand + proactive loads
  per decoded token (``demand_per_token`` and ``proactive_per_token`` separately);
- ``speed_pct``: the cost model's % of full-load speed, ``speedup_vs_lru``: speed / LRU's speed;
- ``oracle_eff_hit`` / ``oracle_eff_speed``: stage-aware / oracle (rows of ``stage``);
- ``updates``: stage updates (cache refills) of the stage policies.

Costs: the traces' routing is replayed with the cost of an expert of ``--expert-bytes`` (default one
Qwen3-30B-A3B expert in bf16, 9.44 MB), not the traced model's own expert size: the tiny default
model's experts (0.2 MB) would make every transfer free. The policies' CPU-vs-transfer decisions use the
same :class:`~expertcast.inference.cache.cost_model.CostConfig` as the simulator's clock. CPU-executed experts run
in parallel with the layer's transfers (``cpu_parallel``, SAEM IV-2) unless ``--cpu-serial`` is given.

Long runs resume: finished (policy, capacity, batch) records are kept in ``partial-<traces>.json`` of the
output folder (written atomically after each record, with the settings key of everything they depend
on) and reused on the next invocation only when that key matches exactly.

:func:`evaluate_saem` is the library entry point (``expertcast stages eval`` parses the flags, loads
traces and cue set, and calls it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json, report
from expertcast.utils.provenance import check_resume, settings_key

POLICIES = ("stage", "stage-oracle", "stage-nocpu", "stage-noupdate", "lru", "static")
"""Policy labels of the evaluation, in table order."""


def synthetic_cue_decoder(cue_token: int):
    """Token decoder for :func:`expertcast.data.synthetic.staged_traces`: the cue token reads
    " Wait", every other token " x"."""

    def dec(i: int) -> bytes:
        return b" Wait" if int(i) == cue_token else b" x"

    return dec


def make_policies(cues: list[str], decoder: Any, static_frequency: np.ndarray, calibration: np.ndarray,
                  ignore_case: bool = False, cost: Any = None, names: tuple[str, ...] | list[str] = POLICIES,
                  ) -> list[Any]:
    """The policies named in ``names`` (labels of :data:`POLICIES`).

    Args:
        static_frequency: float [L, E] calibration frequencies (stage policies: seed placement, tie-break,
            the no-update ablation's placement).
        calibration: int [L, E] calibration selection counts (the ``static`` baseline's placement).
        cost: the :class:`~expertcast.inference.cache.cost_model.CostConfig` the simulator uses.
    """
    from expertcast.inference.policies.classic import LRUPolicy
    from expertcast.inference.policies.stage_aware import StageAwarePolicy, StageOraclePolicy
    from expertcast.inference.policies.static import StaticFrequencyPolicy

    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise UsageError(f"unknown SAEM eval policies {unknown}; choose from {', '.join(POLICIES)}")
    kw = dict(cues=cues, decoder=decoder, static_frequency=static_frequency, cost=cost)
    calib = np.asarray(calibration)
    if calib.ndim != 2 or not np.issubdtype(calib.dtype, np.integer):
        raise ValueError(f"static calibration must be int selection counts [L, E], got {calib.dtype} {calib.shape}")
    build = {
        "stage": lambda: StageAwarePolicy(**kw),
        "stage-oracle": lambda: StageOraclePolicy(**kw),
        "stage-nocpu": lambda: StageAwarePolicy(cpu_exec=False, **kw),
        "stage-noupdate": lambda: StageAwarePolicy(stage_updates=False, **kw),
        "lru": LRUPolicy,
        "static": lambda: StaticFrequencyPolicy(calibration=calib),
    }
    out = []
    for name in names:
        p = build[name]()
        p.label = name
        if name.startswith("stage"):
            p.ignore_case = ignore_case
        out.append(p)
    return out


def counts_from_frequency(freq: np.ndarray, tokens: int) -> np.ndarray:
    """int64 [L, E] selection counts from per-token selection frequencies [L, E] over ``tokens`` tokens."""
    return np.rint(np.asarray(freq, np.float64) * max(int(tokens), 1)).astype(np.int64)


def run_settings(name: str, traces: tuple[Any, list[Any]], cues: list[str], static_frequency: np.ndarray,
                 calibration: np.ndarray, ignore_case: bool, cost: Any) -> dict[str, Any]:
    """What a partial result depends on beyond (policy, capacity, batch): traces, cues, calibration, costs
    (a :func:`~expertcast.utils.provenance.settings_key`)."""
    import dataclasses
    import hashlib

    meta, seqs = traces
    h = hashlib.sha256()
    for s in seqs:
        h.update(str(s.seq_id).encode())
        h.update(np.ascontiguousarray(s.token_ids).tobytes())
        h.update(np.ascontiguousarray(s.expert_ids).tobytes())
    h.update(np.ascontiguousarray(static_frequency, np.float64).tobytes())
    h.update(np.ascontiguousarray(calibration, np.int64).tobytes())
    return settings_key(traces=name, model=meta.model_id, sequences=len(seqs), data_sha256=h.hexdigest(),
                        cues=list(cues), ignore_case=bool(ignore_case), cost=dataclasses.asdict(cost))


def _row(name: str, bs: int, r: dict[str, Any]) -> dict[str, Any]:
    A = max(r["accesses"], 1)
    T = max(r["decoded_tokens"], 1)
    req = r["capacity_requested"]
    cap = req if isinstance(req, float) else r["capacity"]  # a slot count: the fraction it realises
    row = {"traces": name, "batch": bs, "capacity": cap, "slots_per_layer": r["slots_per_layer"],
           "policy": r["policy"], "hit": r["resident_hit"], "cpu_share": r["cpu_exec"] / A,
           "demand_per_token": r["demand_misses"] / T, "proactive_per_token": r["proactive_loads"] / T,
           "transfers_per_token": (r["demand_misses"] + r["proactive_loads"]) / T,
           "mb_per_token": r["mb_per_token"], "stall_ms_per_token": r["stall_ms_per_token"],
           "speed_pct": r["pct_full_speed"]}
    if "updates" in r:
        row["updates"] = r["updates"]
    return row


def run_grid(name: str, traces: tuple[Any, list[Any]], cues: list[str], decoder: Any, static_frequency: np.ndarray,
             calibration: np.ndarray, batch_sizes: list[int], capacities: Sequence[float], ignore_case: bool = False,
             cost: Any = None, policies: tuple[str, ...] | list[str] = POLICIES, partial: Path | None = None,
             progress: bool = True, slots: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Every policy at every batch size and capacity; one table row per run (see the module docstring).

    ``capacities``: fractions of the experts; ``slots``: slot counts per layer (both per-layer pools).
    ``partial``: JSON file of finished simulator records, reused when present and its settings key
    matches (a ResumeMismatchError when it does not), rewritten after each new record."""
    from expertcast.inference.cache.cost_model import CostConfig
    from expertcast.inference.sim.simulator import simulate

    cost = cost or CostConfig()
    settings = run_settings(name, traces, cues, static_frequency, calibration, ignore_case, cost)
    done: dict[str, dict] = {}
    if partial is not None and partial.is_file():
        try:
            saved = json.loads(partial.read_text(encoding="utf-8"))
            old, records = saved["settings"], saved["records"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise UsageError(f"partial results {partial} are corrupt ({e}): use --overwrite to start over") from None
        check_resume(old, settings, partial)
        done = {r["key"]: r for r in records}
    rows = []
    for bs in batch_sizes:
        pols = make_policies(cues, decoder, static_frequency, calibration, ignore_case, cost, policies)
        by_label = {p.label: p for p in pols}

        def on_record(rec: dict[str, Any], by_label: dict[str, Any] = by_label) -> None:
            pol = by_label.get(rec["policy"])
            if pol is not None and hasattr(pol, "n_updates"):
                rec["updates"] = int(pol.n_updates)
            done[rec["key"]] = rec
            if partial is not None:
                atomic_write_json(partial, {"settings": settings, "records": list(done.values())})

        recs = simulate(traces, pols, capacities=list(capacities), slots_per_layer=list(slots) or None, batch_size=bs,
                        cost=cost, belady_fraction=False, progress=progress, done=done, on_record=on_record,
                        allow_below_top_k=True)
        by_cap: dict[Any, dict[str, dict]] = {}
        for r in recs:  # a fraction 1.0 and a slot count 1 are different capacities
            req = r["capacity_requested"]
            by_cap.setdefault((type(req).__name__, req), {})[r["policy"]] = r
        for group in by_cap.values():
            orc, lru = group.get("stage-oracle"), group.get("lru")
            for pol, r in group.items():
                row = _row(name, bs, r)
                if lru is not None:
                    row["speedup_vs_lru"] = r["pct_full_speed"] / lru["pct_full_speed"]
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
    fig, axes = plt.subplots(3, len(keys), figsize=(5 * len(keys), 10), squeeze=False)
    for j, (tr, bs) in enumerate(keys):
        sub = [r for r in rows if r["traces"] == tr and r["batch"] == bs]
        for pol in dict.fromkeys(r["policy"] for r in sub):
            pts = sorted((r["capacity"], r["hit"], r["speed_pct"], r["transfers_per_token"]) for r in sub
                         if r["policy"] == pol)
            x = [p[0] for p in pts]
            for i in range(3):
                axes[i, j].plot(x, [p[i + 1] for p in pts], "o-", label=pol)
        axes[0, j].set_title(f"{tr}, batch {bs}")
        axes[0, j].set_ylabel("resident hit")
        axes[1, j].set_ylabel("modelled % of full-load speed")
        axes[2, j].set_ylabel("transfers per decoded token")
        axes[2, j].set_xlabel("capacity (fraction of the experts)")
        caps = sorted({r["capacity"] for r in sub})
        for a in axes[:, j]:
            a.set_xscale("log")
            a.minorticks_off()
            a.set_xticks(caps)
            a.set_xticklabels([f"{c:g}" for c in caps])
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cue_set_calibration(cue_set: Any) -> tuple[np.ndarray, np.ndarray]:
    """(frequency float [L, E], selection counts int64 [L, E]) of a cue set's calibration traces (the
    stage policies' seed placement and the ``static`` baseline)."""
    if cue_set.expert_frequency is None:
        raise UsageError("the cue set has no expert_frequency (recalibrate it with `expertcast stages calibrate`)")
    freq = np.asarray(cue_set.expert_frequency, np.float64)
    return freq, counts_from_frequency(freq, cue_set.calibration.get("decode_tokens", 1))


def synthetic_runs() -> list[tuple[str, Any, np.ndarray, np.ndarray]]:
    """(tag, evaluated traces, calibration frequency [L, E], calibration counts [L, E]) of the two
    synthetic trace sets with planted "Wait" stages (cue token: ``traces.cue_token``).

    ``synthetic``: every stage draws a profile different from the finished one (SAEM's premise
    violated); ``synthetic-drift``: a boundary swaps 2 of a layer's 8 hot experts (adjacent stages
    coherent). Calibration (static placement) uses 4 held-out sequences of the same generator run."""
    from expertcast.data.synthetic import drifting_stage_traces, staged_traces
    from expertcast.inference.policies.static import selection_counts

    shape = dict(num_sequences=16, num_tokens=512, num_layers=8, num_experts=64, top_k=2, hot=8,
                 mean_stage_len=64.0, seed=1)
    out = []
    for tag, syn in (("synthetic", staged_traces(num_stages=4, **shape)),
                     ("synthetic-drift", drifting_stage_traces(keep=6, **shape))):
        cnt = selection_counts(syn.sequences[:4], syn.meta.num_layers, syn.meta.num_experts)
        freq = cnt / max(sum(s.num_tokens for s in syn.sequences[:4]), 1)
        out.append((tag, syn, freq, cnt))
    return out


def evaluate_saem(*, batch_sizes: Sequence[int], capacities: Sequence[float] = (), slots: Sequence[int] = (),
                  policies: Sequence[str] = POLICIES, cost: Any = None,
                  traces: tuple[Any, list[Any]] | None = None, tag: str = "cot", cue_set: Any = None,
                  decoder: Any = None, synthetic: bool = False,
                  partial: Callable[[str], Path] | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """SAEM evaluation rows (module docstring) on ``traces`` (with their ``cue_set`` and token
    ``decoder``) and/or the synthetic trace sets.

    Args:
        batch_sizes: sequences decoded in lockstep, one grid per value.
        capacities / slots: fractions of the experts / slot counts per layer.
        cost: the :class:`~expertcast.inference.cache.cost_model.CostConfig` of the simulator and the policies.
        tag: name of ``traces`` in the table.
        partial: the resume file of a trace set's tag (None: no resume).
    """
    rows: list[dict[str, Any]] = []
    if traces is not None:
        freq, counts = cue_set_calibration(cue_set)
        rows += run_grid(tag, traces, list(cue_set.cues), decoder, freq, counts, list(batch_sizes), capacities,
                         cue_set.ignore_case, cost, list(policies), partial(tag) if partial else None, progress, slots)
    if synthetic:
        for name, syn, freq, cnt in synthetic_runs():
            rows += run_grid(name, (syn.meta, syn.sequences[4:]), ["Wait"], synthetic_cue_decoder(syn.cue_token),
                             freq, cnt, list(batch_sizes), capacities, False, cost, list(policies),
                             partial(name) if partial else None, progress, slots)
    if not rows:
        raise UsageError("nothing to evaluate: give --traces (with a cue set) and/or --synthetic")
    return rows


def write_results(rows: list[dict[str, Any]], json_path: Path, csv_path: Path, png_path: Path, expert_bytes: int) -> None:
    """The table in the terminal, JSON, CSV and the plot of :func:`evaluate_saem`'s rows."""
    report(rows, title=f"SAEM: stage-aware vs LRU vs static (per-layer pools, decode-only; costs of a "
           f"{int(expert_bytes) / 1e6:.2f} MB expert)", json_path=json_path, csv_path=csv_path,
           columns=["traces", "batch", "capacity", "slots_per_layer", "policy", "hit", "cpu_share",
                    "transfers_per_token", "proactive_per_token", "speed_pct", "speedup_vs_lru", "oracle_eff_hit",
                    "oracle_eff_speed", "updates"])
    plot(rows, png_path)
