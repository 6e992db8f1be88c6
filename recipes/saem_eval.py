"""The SAEM stages study in the trace-driven simulator: the recipe of `expertcast stages eval`.

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

:func:`run_grid` is the entry point: the ``expertcast stages eval`` command (:mod:`expertcast.commands.stages`)
loads traces and cue set, runs the grid of each trace set (the traces and/or :func:`synthetic_runs`) and writes the
table and the plot. The library parts live in :mod:`expertcast.inference.saem` (a cue set's calibration counts,
:func:`~expertcast.inference.saem.cues.cue_set_calibration`; the synthetic sets' token decoder,
:func:`~expertcast.inference.saem.stages.synthetic_cue_decoder`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.errors import UsageError
from expertcast.utils.io import atomic_write_json
from expertcast.utils.provenance import check_resume, settings_key

RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "stage": ("stage", {}),
    "stage-oracle": ("stage-oracle", {}),
    "stage-nocpu": ("stage", {"cpu_exec": False}),
    "stage-noupdate": ("stage", {"stage_updates": False}),
    "lru": ("lru", {}),
    "static": ("static", {}),
}
"""Label of the evaluation -> (registered policy, its options): the stage policies, their ablations, baselines."""
POLICIES = tuple(RUNS)
"""Policy labels of the evaluation, in table order."""


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
    from expertcast.inference.policies import make_policy, object_names, policy_class, policy_spec

    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise UsageError(f"unknown SAEM eval policies {unknown}; choose from {', '.join(POLICIES)}")
    calib = np.asarray(calibration)
    if calib.ndim != 2 or not np.issubdtype(calib.dtype, np.integer):
        raise ValueError(f"static calibration must be int selection counts [L, E], got {calib.dtype} {calib.shape}")
    out = []
    for label in names:
        name, opts = RUNS[label]
        objects: dict[str, Any] = {}
        staged = "cues" in policy_spec(name).needs
        if staged:
            opts = {"cues": cues if isinstance(cues, str) or cues is None else tuple(cues), **opts}
            objects = dict(decoder=decoder, static_frequency=static_frequency, cost=cost)
        elif "calibration" in object_names(policy_class(name)):
            objects = {"calibration": calib}
        p = make_policy(name, **opts, **objects)
        p.label = label
        if staged:
            p.ignore_case = ignore_case
        out.append(p)
    return out


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
