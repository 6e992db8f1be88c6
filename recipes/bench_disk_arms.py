"""The disk benchmark's arms (docs/design.md, "Disk tier"): the policies of a run built through the policy option
parser (lru/lfu/belady/static, seqmoe with the learned forecaster, the oracle forecast per recall with the break-even
rule on and off), the budget cells per expert format, the learned forecaster's overlap/model guard and measured
recall, and one pass's per-layer timeline (``--trace-timeline``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.utils.errors import UsageError

BenchConfig = Any  # :class:`expertcast.recipes.bench_disk.BenchConfig` (that module imports this one)


def check_held_out(calibration, replayed) -> None:
    """ValueError (one line) unless ``calibration`` is non-empty and shares no sequence with ``replayed``."""
    if not calibration:
        raise ValueError("static: no held-out sequence to calibrate on (every sequence of the trace set is replayed; "
                         "replay fewer or use a larger set)")
    both = sorted({s.seq_id for s in calibration} & {s.seq_id for s in replayed})
    if both:
        raise ValueError(f"static: its calibration overlaps the replayed sequences ({len(both)}, e.g. {both[0]!r})")


READER_OPTIONS = {"chunk": "prefetch_chunk_kb"}
"""An arm's reader-pool options after ``@`` (``lru@chunk=0``): ``chunk`` = the KiB blocks in which prefetch reads
yield the disk to demand reads, 0 = whole reads that do not yield (the reader pool's A/B baseline)."""


def split_arm(arm: str) -> tuple[str, dict[str, int]]:
    """(policy spec, OffloadedModel reader-pool keywords) of an arm ``spec[@key=value,...]``; UsageError (one line)
    on an unknown key or a value that is not a non-negative integer."""
    spec, _, rest = arm.partition("@")
    kw: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if key.strip() not in READER_OPTIONS or not eq or not value.strip().isdigit():
            raise UsageError(f"arm {arm!r}: reader option {item!r} is not one of "
                             f"{', '.join(k + '=N' for k in READER_OPTIONS)} (N >= 0)")
        kw[READER_OPTIONS[key.strip()]] = int(value)
    return spec.strip(), kw


def arm_policy(spec: str, cfg: BenchConfig, meta, seqs, link_bytes_per_s: float, layer_ms: float, stream=None,
            calibration=()):
    """(policy, future) of ``spec`` (a policy name or ``name:key=value,...``, through the policy option parser):
    ``static`` calibrated on ``calibration`` (held-out sequences, :func:`check_held_out`), a forecasting policy
    (``seqmoe``, also ``forecast=oracle``) told the measured disk rate and per-layer compute (its deadlines) and given
    ``cfg.forecaster`` unless ``spec`` names one (an oracle then shares its trigger layer), an oracle (``belady``:
    the protect-rule plan) given the replayed access stream."""
    from expertcast.inference.policies import (
        build_policy,
        parse_policy_options,
        policy_spec,
        split_policy_text,
    )

    spec = split_arm(spec)[0]
    name = spec.partition(":")[0].strip().lower()
    pspec = policy_spec(name)
    given = set(split_policy_text(spec)[1])  # not validated yet: a plain "seqmoe" gets its forecaster below
    names = pspec.options.option_names()
    extra: dict[str, Any] = {}
    if "link_bytes_per_s" in names and "link_bytes_per_s" not in given:
        extra.update(link_bytes_per_s=link_bytes_per_s)
    if "layer_compute_ms" in names and "layer_compute_ms" not in given:
        extra.update(layer_compute_ms=max(layer_ms, 1e-3))
    if "forecaster" in names and cfg.forecaster and "forecaster" not in given:
        extra.update(forecaster=cfg.forecaster)
    opts = parse_policy_options(spec, extra)
    objects: dict[str, Any] = {}
    if name == "static":
        check_held_out(calibration, seqs)
        objects["calibration"] = list(calibration)
    future = None
    if "future" in pspec.needs:
        if stream is None:
            raise ValueError(f"{name} is an oracle: run_bench needs stream= (e.g. simulator.build_stream) to give it "
                             f"the replayed access stream")
        future = stream(meta, seqs, 1)
    return build_policy(pspec, opts, **objects), future


def policy_arms(cfg: BenchConfig) -> list[str]:
    """The policy specs of a run: ``cfg.policies``, ``seqmoe`` with the learned forecaster when one is given, and
    per ``cfg.recall`` the oracle forecast at that recall with the break-even rule on and off (it shuts prefetch
    off below ~0.9 recall)."""
    arms = list(cfg.policies)
    for a in arms:
        split_arm(a)  # a bad reader option fails before the run
    if cfg.forecaster and "seqmoe" not in arms:
        arms.append("seqmoe")
    for r in cfg.recall:
        if not 0.0 <= r <= 1.0:
            raise UsageError(f"--recall: {r} is not in [0, 1]")
        arms += [f"seqmoe:forecast=oracle,recall={r:g},breakeven={b}" for b in ("true", "false")]
    return arms


def budgets_of(cfg: BenchConfig, fmt: str, K: int, E: int, L: int, bf16_bytes: int) -> list[tuple[float, str, Any]]:
    """(budget, kind, capacity) cells of format ``fmt``: a fraction of the L*E experts (at least top-K per layer);
    with ``cfg.equal_bytes`` and a quantized format also the bytes that fraction holds in bf16 (``Budget.bytes``: the
    format buys more slots)."""
    from expertcast.inference.cache.expert_cache import Budget

    out = []
    for b in cfg.budgets:
        out.append((float(b), "experts", max(float(b), K / E + 1e-9)))
        if cfg.equal_bytes and fmt != "bfloat16":
            out.append((float(b), "bf16 bytes", Budget.bytes(int(b * L * E * bf16_bytes))))
    return out


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for every family the runtime
    offloads)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)


def oracle_of(spec: str) -> dict[str, Any]:
    """``{"recall", "breakeven", "oracle_series"}`` of a ``seqmoe:forecast=oracle,...`` arm (empty for any other
    policy); ``oracle_series`` is the spec without its recall: the arms of one recall curve share every other
    setting."""
    from expertcast.inference.policies import parse_policy_options

    policy, reader = split_arm(spec)[0], spec.partition("@")[2].strip()
    if not policy.startswith("seqmoe:") or "forecast=oracle" not in policy:
        return {}
    o = parse_policy_options(policy)
    name, _, opts = policy.partition(":")
    rest = [x.strip() for x in opts.split(",") if x.strip() and x.split("=")[0].strip() != "recall"]
    return {"recall": float(o.recall), "breakeven": bool(o.breakeven),
            "oracle_series": f"{name}:{','.join(rest)}" + (f"@{reader}" if reader else "")}


def formats_of(cfg: BenchConfig) -> list[str]:
    """The expert formats of a run, canonical names (:class:`~expertcast.inference.runtime.quant.ExpertFormat`)."""
    from expertcast.inference.runtime.quant import ExpertFormat

    return list(dict.fromkeys(ExpertFormat.parse(f).name for f in cfg.expert_dtypes))


def timeline_arm(cfg: BenchConfig) -> str:
    """The policy whose first pass ``--trace-timeline`` records: the oracle arm (``--recall`` or ``--policies``) at
    the highest recall, break-even off before on, when there is one, else the first policy."""
    arms = policy_arms(cfg)
    oracles = [(o["recall"], not o["breakeven"], i) for i, a in enumerate(arms) if (o := oracle_of(a))]
    return arms[max(oracles)[2]] if oracles else arms[0]


class Timeline:
    """One pass's per-layer timeline (``--trace-timeline``): each decoder layer's compute start/end during decode
    (forward hooks), each read's submit/start/end and each blocking wait (the reader pool's own timestamps,
    :attr:`~expertcast.inference.runtime.transfer.WorkerWaits.timeline`)."""

    def __init__(self, om) -> None:
        self.om = om
        self.events: list[tuple] = []
        om.transfer.timeline = self.events
        layers = decoder_layers(om.model)
        t0: dict[int, float] = {}

        def decoding() -> bool:
            rs = getattr(om, "_run", None)
            return rs is not None and not rs.prefill

        def pre(mod, args):
            if decoding():
                t0[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            start = t0.pop(id(mod), None)
            if start is not None:
                self.events.append(("layer", layers.index(mod), start, time.perf_counter()))

        self.handles = [h for m in layers for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]

    def save(self, path: str, what: str) -> None:
        """Write the events as JSON (seconds from the first event) and detach."""
        from expertcast.utils.io import atomic_write_json

        for h in self.handles:
            h.remove()
        self.om.transfer.timeline = None
        self.om = None  # the traced pass's model (its slots) goes with its pass, not with the next one's allocation
        ev = list(self.events)
        first = min((e[2] if e[0] != "read" else e[3]) for e in ev) if ev else 0.0

        def key(k):
            return None if k is None else [int(x) for x in k]

        out = {"what": what, "unit": "seconds from the first event", "keys": "layers[].layer: decoder layer index "
               "(decode steps only); reads[].key / waits[].key: [MoE layer, expert] (None: a wait for any of a "
               "layer's reads)", "layers": [], "reads": [], "waits": []}
        for e in ev:
            if e[0] == "layer":
                out["layers"].append({"layer": e[1], "start": e[2] - first, "end": e[3] - first})
            elif e[0] == "read":
                out["reads"].append({"key": key(e[1]), "demand": bool(e[2]), "submit": e[3] - first,
                                     "start": e[4] - first, "end": e[5] - first})
            else:
                out["waits"].append({"key": key(e[1]), "start": e[2] - first, "end": e[3] - first})
        for k in ("layers", "reads", "waits"):
            out[k].sort(key=lambda r: r.get("submit", r["start"]))
        out["reads_overlapping_compute"] = sum(
            any(ly["start"] < r["end"] and r["start"] < ly["end"] for ly in out["layers"]) for r in out["reads"])
        atomic_write_json(Path(path), out)


def forecaster_guard(cfg: BenchConfig, meta, seqs) -> dict[str, Any] | None:
    """The overlap and model guard of ``cfg.forecaster`` against the replayed sequences (docs/design.md,
    "Provenance"): refuses its own fit sequences or another model's routing unless allowed; None without a forecaster."""
    if not cfg.forecaster:
        return None
    from expertcast.models.forecaster_export import forecaster_fitted_on
    from expertcast.utils.fitted_on import check_fitted_on, trace_set_model

    return check_fitted_on(forecaster_fitted_on(cfg.forecaster), [s.seq_id for s in seqs],
                           trace_set_model(cfg.traces, getattr(meta, "model_id", None)),
                           scored="the replayed sequences", allow_overlap=cfg.allow_overlap,
                           allow_model_mismatch=cfg.allow_model_mismatch,
                           mismatch_hint="fit it on this model's traces or pass --allow-model-mismatch")


def forecaster_recall(cfg: BenchConfig, seqs, guard) -> dict[str, Any]:
    """The learned forecaster's measured recall@K at horizon 1 on the replayed sequences (its top-K per layer
    against the true experts, :func:`~expertcast.inference.policies.oracle_forecast.forecast_recall`): where it
    sits on the oracle's recall axis."""
    from expertcast.inference.policies.forecast_tables import precompute_forecasts
    from expertcast.inference.policies.oracle_forecast import forecast_recall
    from expertcast.models.forecaster_export import load_forecaster

    fc = load_forecaster(cfg.forecaster)
    model = getattr(fc, "model", fc)
    c = model.config
    hits = []
    for s in seqs:
        tab = precompute_forecasts(model, s.expert_ids, s.expert_weights, 1)
        top = np.argpartition(-tab, c.top_k - 1, axis=-1)[..., : c.top_k]
        named = np.zeros_like(tab)
        np.put_along_axis(named, top, 1.0, axis=-1)
        hits.append(forecast_recall(named, s.expert_ids, c.p, c.num_layers)[0])
    note = "no overlap" if guard and not guard.get("overlap") else f"guard {guard}"
    return {"h1": float(np.nanmean(hits)), "per_sequence": [float(h) for h in hits], "guard": note}
