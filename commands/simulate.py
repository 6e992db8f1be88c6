"""``expertcast simulate``: replay routing traces through cache policies at several capacities.

    expertcast simulate --traces runs/traces/gsm8k --policies lru,lfu,lrfu:lam=0.01,belady \\
        --capacity 0.15,0.25,0.35,0.45 --out runs/simulate
    expertcast simulate --list-policies          # every policy with its options (type, default, help)

``--capacity`` is always a fraction of all L*E experts (``1`` = every expert); ``--slots`` is always a
slot count (per layer for the per-layer pool, in all for the shared pool). Without either (or
``--slots-per-layer``) the capacities are 0.15, 0.25, 0.35 and 0.45.

Writes into ``--out`` (claimed for this command: a second concurrent run on it fails at once):
``simulate.json`` (one record per (policy, capacity), each with the hash of its settings),
``simulate.csv``, ``hit_vs_capacity.png`` and ``simulate.settings.json`` (every setting that
determines the records). Accounting is decode-only from the post-prefill cache state (prefill
replayed through the policy, uncounted); ``belady_fraction`` is relative to the demand-only ceiling (Belady with a free warm start and bypass) at
the same capacity (docs/design.md).

Resume: finished records are kept in ``simulate.partial.json``; a rerun on the same ``--out`` reuses
them only when every setting matches (traces, cost model, pool, batch size, engine, Belady flag,
calibration traces, forecaster export, file options of the policies); otherwise it stops naming the
setting. ``--overwrite`` starts over.

Generalisation protocol: ``--fit-traces DIR`` names the fit set (``--fit-sequences N``: its first N
sequences by id hash, nested 10 of 50 of all); the fitted baselines (``static``) calibrate on it, the
online policies (LRU, LFU, Belady, seqmoe's forecasts) run on the replayed ``--traces`` alone, and a
sequence id in both sets is refused unless ``--allow-overlap``. Train the seqmoe forecaster on the same
fit set (``expertcast fit ... --data.init_args.train_sequences N``). Each record carries ``fit_sequences``.

Leakage: a forecaster (``--forecaster`` or ``seqmoe:forecaster=``) trained on some of the replayed
sequences is refused unless ``--allow-overlap``; the overlap then appears in the table title, the
plot and each of its records (``train_overlap``).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    add_config_arg,
    capacities_from_args,
    config_record,
    nonneg_float,
    parse_and_run,
    parse_counts,
    positive_float,
    positive_int,
)
from expertcast.recipes.lineage import log_results
from expertcast.utils.errors import ResumeMismatchError, UsageError
from expertcast.utils.tracking import add_wandb_args

PROG = "expertcast simulate"
DEFAULT_CAPACITIES = (0.15, 0.25, 0.35, 0.45)
SETTINGS_FILE = "simulate.settings.json"
PARTIAL_FILE = "simulate.partial.json"
FIT_SET = "fit set"
"""Key of the generalisation protocol's fit-set header among the overlap checks (``--fit-traces``)."""
SERIES_METRICS = ("hit", "adj_hit", "mb_per_token", "belady_fraction", "stall_ms_per_token", "pct_full_speed")
"""Record fields logged to W&B as per-capacity series, one curve per policy (``--wandb``)."""
TIMING_FIELDS = ("seconds", "accesses_per_s")
"""Record fields that measure this machine, not the simulation (they differ between identical runs)."""


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description="Replay routing traces through cache policies at several capacities.",
                       epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--traces", help="trace directory written by `expertcast collect` / `expertcast traces import`")
    ap.add_argument("--synthetic", choices=["random", "zipf", "markov"],
                    help="replay synthetic traces instead of --traces (demo/smoke test; see --synthetic-shape)")
    ap.add_argument("--synthetic-shape", default="4,32,2,8,256",
                    help="L,E,K,sequences,tokens of --synthetic traces (8 prompt tokens each)")
    ap.add_argument("--max-sequences", type=positive_int, default=None, help="replay only the first N sequences")
    ap.add_argument("--policies", default="lru,lfu,belady",
                    help="comma list of policies, options as name:key=value,key=value (see --list-policies)")
    ap.add_argument("--list-policies", action="store_true", help="print every policy with its options and exit")
    add_capacity_args(ap, multiple=True, budget_gb=True)
    ap.add_argument("--slots-per-layer", default=None, help="comma list of per-layer budgets B (per-layer pool)")
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"],
                    help="one slot pool per MoE layer, or one pool shared by all layers")
    ap.add_argument("--batch-size", type=positive_int, default=1, help="consecutive sequences decoded in lockstep")
    ap.add_argument("--bandwidth-gbps", type=positive_float, default=25.0, help="host-device link GB/s (PCIe 4.0 x16)")
    ap.add_argument("--layer-compute-ms", default="0.15", help="per-layer compute ms: one value or L comma values")
    ap.add_argument("--expert-bytes", type=positive_int, default=None,
                    help="override the traces' bytes per expert")
    ap.add_argument("--queue", default="fifo", choices=["fifo", "edf"], help="order of queued prefetches")
    ap.add_argument("--cpu-expert-ms", type=nonneg_float, default=0.19, help="CPU ms to execute one expert")
    ap.add_argument("--cpu-token-ms", type=nonneg_float, default=0.01, help="CPU ms per token of a CPU-run expert")
    ap.add_argument("--engine", default="auto", choices=["auto", "kernel", "python"],
                    help="compiled kernels where available (auto), only kernels, or the generic engine")
    ap.add_argument("--no-belady-fraction", action="store_true", help="skip the demand-only ceiling reference runs (belady_fraction)")
    ap.add_argument("--calibration", default=None,
                    help="trace directory calibrating `static` (unset: the replayed traces, in-sample)")
    ap.add_argument("--fit-traces", default=None,
                    help="generalisation protocol: the fit set (trace directory); fitted baselines (static) calibrate "
                         "on it, online policies run on the replayed --traces (the evaluated set); shared sequence "
                         "ids are refused unless --allow-overlap")
    ap.add_argument("--fit-sequences", type=positive_int, default=None,
                    help="use only N fit sequences (first N by sequence-id hash: 10 of 50 of all; data efficiency)")
    ap.add_argument("--forecaster", default=None,
                    help="forecaster export for the `seqmoe` policies (same as seqmoe:forecaster=PATH)")
    ap.add_argument("--allow-overlap", action="store_true",
                    help="accept a forecaster trained on some replayed sequences (the overlap is reported)")
    ap.add_argument("--allow-model-mismatch", action="store_true",
                    help="accept a forecaster or cue set fitted on another model's routing (reported)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar over the (policy, capacity) runs")
    ap.add_argument("--out", default="runs/simulate", help="output folder")
    add_wandb_args(ap)
    ap.add_argument("--overwrite", action="store_true", help="discard this folder's earlier simulate output first")
    add_config_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, run)


# ------------------------------------------------------------------------------------------------
# --list-policies
# ------------------------------------------------------------------------------------------------
def list_policies() -> str:
    """Every registered policy: its one-line description and options (name, type, default, help)."""
    from expertcast.inference.policies import policy_import_errors, registry

    lines = []
    for name, spec in registry().items():
        lines.append(f"{name}: {_summary(spec.load().__doc__)}")
        opts = spec.options.describe()
        if not opts:
            lines.append("    (no options)")
        for o in opts:
            default = "none" if o["default"] is None else str(o["default"]).lower() if isinstance(o["default"], bool) \
                else str(o["default"])
            lines.append(f"    {o['name']:<20} {o['type']:<14} default {default:<8} {o['help']}")
    for module, err in policy_import_errors().items():
        lines.append(f"{module}: UNAVAILABLE ({err})")
    return "\n".join(lines)


def _summary(doc: str | None) -> str:
    """First sentence of a docstring's first paragraph, on one line, without reST markup."""
    para = " ".join((doc or "").strip().split("\n\n")[0].split())
    para = para.replace("``", "").replace(":class:", "").replace("`", "")
    return para.split(". ")[0].rstrip(".") + "."


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def _floats(text: str, flag: str) -> list[float]:
    out = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            out.append(nonneg_float(part))
        except argparse.ArgumentTypeError:
            raise UsageError(f"{flag}: {part!r} is not a finite non-negative number") from None
    if not out:
        raise UsageError(f"{flag}: no value given")
    return out


def _capacities(args) -> tuple[list[Any], list[int] | None]:
    """(capacities for :func:`simulate`: :class:`~expertcast.inference.cache.expert_cache.Budget`s; per-layer
    budgets)."""
    from expertcast.inference.cache.expert_cache import Budget

    caps: list[Any] = capacities_from_args(args, multiple=True)
    spl = parse_counts(args.slots_per_layer, "--slots-per-layer") if args.slots_per_layer is not None else None
    if spl and args.pool != "per-layer":
        raise UsageError("--slots-per-layer gives per-layer budgets: use --pool per-layer")
    if not caps and not spl:
        caps = [Budget.fraction(c) for c in DEFAULT_CAPACITIES]
    return caps, spl


def _policy_options(args) -> list:
    """Validated options of every ``--policies`` entry (``--forecaster`` filled into the ones that need one)."""
    from expertcast.inference.cache.options import check_file, split_policy_list
    from expertcast.inference.policies import parse_policy_options, policy_spec

    specs = split_policy_list(args.policies)
    if args.forecaster:
        check_file("forecaster", args.forecaster, f"--forecaster {args.forecaster}")
    opts = [parse_policy_options(s, _forecaster_options(s, args)) for s in specs]
    seen: set[str] = set()
    for o in opts:
        if not policy_spec(o.policy).runs_on("driver") and args.engine == "python":
            raise UsageError(f"{o.policy} runs only on the compiled engine: use --engine auto or kernel")
        if o.spec() in seen:
            raise UsageError(f"policy {o.spec()} is given twice in --policies")
        seen.add(o.spec())
    return opts


def _forecaster_options(spec: str, args) -> dict[str, Any]:
    """The typed options ``--forecaster`` adds to a policy that needs a forecaster and names none in ``spec``:
    ``forecaster``, ``bandwidth_gbps`` and ``layer_compute_ms`` (the link and compute settings feed its
    transfer-time estimate)."""
    from expertcast.inference.policies import policy_spec

    if not args.forecaster or "forecaster" not in policy_spec(spec.split(":")[0]).needs or "forecaster=" in spec:
        return {}
    extra: dict[str, Any] = {"forecaster": args.forecaster, "bandwidth_gbps": float(args.bandwidth_gbps)}
    lc = _floats(args.layer_compute_ms, "--layer-compute-ms")
    if len(lc) == 1:
        extra["layer_compute_ms"] = lc[0]
    return extra


def _load_traces(args):
    """(meta, sequences) of ``--traces`` or ``--synthetic``, cut to ``--max-sequences``."""
    if bool(args.traces) == bool(args.synthetic):
        raise UsageError("give exactly one of --traces DIR or --synthetic KIND (or --list-policies)")
    if args.synthetic:
        from expertcast.data import synthetic

        shape = parse_counts(args.synthetic_shape, "--synthetic-shape")
        if len(shape) != 5:
            raise UsageError(f"--synthetic-shape: expected 5 values L,E,K,sequences,tokens, got {args.synthetic_shape}")
        L, E, K, n, T = shape
        if K > E:
            raise UsageError(f"--synthetic-shape: top-K {K} exceeds the {E} experts per layer")
        gen = {"random": synthetic.random_traces, "zipf": synthetic.zipf_traces, "markov": synthetic.markov_traces}
        tr = gen[args.synthetic](num_sequences=n, num_tokens=T, num_layers=L, num_experts=E, top_k=K)
        meta, seqs = tr.meta, list(tr.sequences)
    else:
        meta, seqs = _read_traces(args.traces, "--traces")
    if args.max_sequences:
        seqs = seqs[: args.max_sequences]
    from expertcast.data.traces import require_decode_tokens

    require_decode_tokens(meta, seqs, args.traces or f"--synthetic {args.synthetic} {args.synthetic_shape}")
    return meta, seqs


def _read_traces(path: str, flag: str):
    from expertcast.data.traces import load_traces
    from expertcast.inference.cache.options import check_file

    check_file("traces", path, f"{flag} {path}")
    return load_traces(path)


def _cost(args, num_layers: int):
    from expertcast.inference.cache.cost_model import CostConfig

    lc = _floats(args.layer_compute_ms, "--layer-compute-ms")
    if len(lc) not in (1, num_layers):
        raise UsageError(f"--layer-compute-ms: give one value or one per MoE layer ({num_layers}), got {len(lc)}")
    return CostConfig(bandwidth_gbps=args.bandwidth_gbps, layer_compute_ms=lc[0] if len(lc) == 1 else lc,
                      expert_bytes=args.expert_bytes, queue=args.queue, cpu_expert_ms=args.cpu_expert_ms,
                      cpu_token_ms=args.cpu_token_ms)


def _calibration(args, meta, seqs):
    """(selection counts [L, E] of ``--calibration`` or ``--fit-traces``, their fingerprint, the fit-set header)
    or (None, None, None)."""
    if args.fit_sequences and not args.fit_traces:
        raise UsageError("--fit-sequences picks sequences of the fit set: give --fit-traces DIR")
    if args.fit_traces and args.calibration:
        raise UsageError("--fit-traces is the calibration of the fitted baselines: drop --calibration")
    path, flag = (args.fit_traces, "--fit-traces") if args.fit_traces else (args.calibration, "--calibration")
    if not path:
        return None, None, None
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.inference.policies.static import selection_counts

    cmeta, cseqs = _read_traces(path, flag)
    try:
        cmeta.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what="replayed trace")
    except ValueError as e:
        raise UsageError(f"{flag} {path}: {e}") from None
    fit = _fit_header(args, cseqs, seqs) if args.fit_traces else None
    if fit is not None:
        cseqs = fit.pop("sequences")
    return selection_counts(cseqs, meta.num_layers, meta.num_experts), sequences_fingerprint(cseqs), fit


def _fit_header(args, fit_seqs, seqs) -> dict[str, Any]:
    """The generalisation protocol's fit set (cut to ``--fit-sequences``), checked for shared ids with the evaluated
    sequences; ``{"fit_traces", "fit_sequences", "evaluated", "overlap", "sequences"}``."""
    from expertcast.train.forecaster_data import training_subset
    from expertcast.utils.provenance import check_overlap

    if args.fit_sequences and args.fit_sequences > len(fit_seqs):
        raise UsageError(f"--fit-sequences {args.fit_sequences}: the fit set {args.fit_traces} has only "
                         f"{len(fit_seqs)} sequences")
    chosen = training_subset(fit_seqs, args.fit_sequences)
    ov = check_overlap([s.seq_id for s in seqs], [s.seq_id for s in chosen], what=f"the fit set {args.fit_traces}",
                       allow_overlap=args.allow_overlap)
    return {"fit_traces": str(Path(args.fit_traces).resolve()), "fit_sequences": len(chosen),
            "evaluated": len(seqs), "overlap": ov["overlap"], "sequences": chosen}


def _make_policies(options: list, calibration, meta) -> list:
    """One policy object per options entry (``static`` gets ``--calibration`` unless it names its own),
    checked against the traces' L/E/K before any replay."""
    from expertcast.inference.policies import build_policy, object_names, policy_spec

    out = []
    for o in options:
        spec = policy_spec(o.policy)
        objects = {}
        if calibration is not None and "calibration" not in o.given and "calibration" in object_names(spec.load()):
            objects["calibration"] = calibration  # a calibrated policy (static) without its own calibration
        try:
            pol = build_policy(spec, o, **objects)
            if hasattr(pol, "check_compatible"):
                pol.check_compatible(meta.num_layers, meta.num_experts, meta.top_k, what="replayed trace")
        except ValueError as e:
            raise UsageError(f"policy {o.spec()}: {e}") from None
        out.append(pol)
    return out


# ------------------------------------------------------------------------------------------------
# provenance: settings, file fingerprints, leakage
# ------------------------------------------------------------------------------------------------
def file_fingerprint(kind: str, path: str) -> str:
    """Content hash of a policy's file option: the export hash of a forecaster (its manifest, verified),
    the sequences of a trace set, the bytes of a cue set or a router replay."""
    from expertcast.utils.provenance import sha256_file, sha256_files

    if kind == "forecaster":
        from expertcast.models.forecaster_export import verify_export

        return verify_export(path)
    if kind == "traces":
        from expertcast.data.trace_format import sequences_fingerprint

        return sequences_fingerprint(_read_traces(path, "static option calibration")[1])
    return sha256_file(path) if Path(path).is_file() else sha256_files(path)


def _policy_files(options: list, policies: list) -> dict[str, dict[str, dict[str, str]]]:
    """``{run label: {option: {"path", "sha256"}}}`` for the file options of each policy."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for o, pol in zip(options, policies, strict=True):
        kinds = o.file_options()
        out[pol.label] = {k: {"path": str(Path(v).resolve()), "sha256": file_fingerprint(kinds[k], v)}
                          for k, v in o.files().items()}
    return out


def _overlaps(options: list, policies: list, seqs, args, meta) -> dict[str, dict[str, Any]]:
    """``{run label: check_fitted_on result}`` for every policy that reads a forecaster export or a cue set: its
    fit sequences must not be replayed (``--allow-overlap``), nor another model's routing
    (``--allow-model-mismatch``)."""
    from expertcast.models.forecaster_export import forecaster_fitted_on
    from expertcast.utils.fitted_on import check_fitted_on, trace_set_model

    ids = [s.seq_id for s in seqs]
    routing = trace_set_model(args.traces, meta.model_id)
    out = {}
    for o, pol in zip(options, policies, strict=True):
        files = o.files()
        fitted = None
        if files.get("forecaster"):
            fitted = forecaster_fitted_on(files["forecaster"])
        elif getattr(pol, "cue_set", None) is not None and files.get("cue_set"):
            fitted = pol.cue_set.fitted_on(f"the cue set {files['cue_set']}")
        if fitted is not None:
            out[pol.label] = check_fitted_on(fitted, ids, routing, scored=f"the replayed traces {args.traces or ''}",
                                             allow_overlap=args.allow_overlap,
                                             allow_model_mismatch=args.allow_model_mismatch)
    return out


def run_settings(args, meta, seqs, cost, calibration_fp: str | None) -> dict[str, Any]:
    """Everything besides the policies that determines a record (see :func:`settings_key`)."""
    import hashlib

    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.models.forecaster_export import verify_export
    from expertcast.utils.provenance import settings_key

    weights = hashlib.sha256()
    for s in sorted(seqs, key=lambda s: s.seq_id):
        weights.update(s.seq_id.encode() + b"\0" + s.expert_weights.tobytes())
    return settings_key(
        command="simulate", traces=sequences_fingerprint(seqs), trace_weights=weights.hexdigest(),
        sequences=len(seqs), model_id=meta.model_id, num_layers=meta.num_layers, num_experts=meta.num_experts,
        top_k=meta.top_k, trace_expert_bytes=meta.expert_bytes, **dataclasses.asdict(cost), pool=args.pool,
        batch_size=args.batch_size, engine=args.engine, belady_fraction=not args.no_belady_fraction,
        calibration=calibration_fp, forecaster=verify_export(args.forecaster) if args.forecaster else None)


def _record_hash(settings: dict[str, Any], label: str, files: dict[str, Any]) -> str:
    from expertcast.utils.provenance import sha256_json

    return sha256_json({"settings": settings, "policy": label, "files": files.get(label, {})})


# ------------------------------------------------------------------------------------------------
# resume
# ------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable or corrupt ({e}); use --overwrite to start over") from None


def previous_records(out: Path, settings: dict[str, Any], files: dict[str, Any]) -> dict[str, dict]:
    """Records of earlier runs on ``out`` made with exactly these settings, keyed by record key.

    Raises ResumeMismatchError naming the first setting (or the file option of a policy) that differs.
    """
    from expertcast.utils.provenance import check_resume

    saved_file, partial, final = out / SETTINGS_FILE, out / PARTIAL_FILE, out / "simulate.json"
    if not saved_file.exists():
        if partial.exists() or final.exists():
            check_resume(None, settings, out)
        return {}
    saved = _read_json(saved_file)
    check_resume(saved.get("settings") if isinstance(saved, dict) else None, settings, out)
    for label, opts in (saved.get("policy_files") or {}).items():
        for opt, now in files.get(label, {}).items():
            before = opts.get(opt)
            if before and before != now:
                raise ResumeMismatchError(f"cannot resume {out}: {label}'s {opt} ({now['path']}) differs from the one "
                                          f"its saved records were made with; use --overwrite to start over or "
                                          f"another --out")
    records: list[dict] = []
    for path in (final, partial):
        if path.exists():
            data = _read_json(path)
            records += data if isinstance(data, list) else data.get("records", [])
    return {r["key"]: r for r in records if isinstance(r, dict) and "key" in r
            and r.get("settings_sha256") == _record_hash(settings, r.get("policy", ""), files)}


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------
def run(args) -> int:
    if args.list_policies:
        print(list_policies())
        return 0
    capacities, spl = _capacities(args)
    options = _policy_options(args)
    meta, seqs = _load_traces(args)
    cost = _cost(args, meta.num_layers)
    if any(c.kind == "bytes" for c in capacities) and not meta.expert_bytes:
        raise UsageError(f"--budget-gb: the trace's meta does not record the bytes of one expert (expert_bytes) "
                         f"of {meta.model_id}; import it with `traces import --expert-bytes N`, or give --capacity or --slots")
    from expertcast.inference.sim.simulator import cache_configs

    try:
        cache_configs(meta, capacities, args.pool, spl)  # capacities below top-K or above E fail here
    except ValueError as e:
        raise UsageError(str(e)) from None
    counts, calibration_fp, fit = _calibration(args, meta, seqs)
    policies = _make_policies(options, counts, meta)
    overlaps = _overlaps(options, policies, seqs, args, meta)
    settings = run_settings(args, meta, seqs, cost, calibration_fp)
    if fit is not None:
        overlaps[FIT_SET] = {"overlap": fit["overlap"], "evaluated": fit["evaluated"], "allowed": args.allow_overlap,
                             "fit_sequences": fit["fit_sequences"], "fit_traces": fit["fit_traces"]}
        print(f"generalisation protocol: fit set {fit['fit_traces']} ({fit['fit_sequences']} sequences) calibrates "
              f"the fitted baselines; online policies run on the {fit['evaluated']} evaluated sequences")
    files = _policy_files(options, policies)

    from expertcast.utils.outdir import claim_output_dir

    inputs = _inputs(args, settings, options, files, policies, calibration_fp) if args.wandb else []
    with claim_output_dir(args.out, "simulate", overwrite=args.overwrite) as od:
        return _simulate(od, args, meta, seqs, policies, capacities, spl, cost, counts, settings, files, overlaps,
                         inputs)


def _inputs(args, settings, options, policies_files, policies, calibration_fp) -> list[tuple[str, str, str | None]]:
    """The ``(path, kind, digest)`` inputs of the run for W&B lineage: the replayed traces, the calibration or
    fit set, ``--forecaster`` and every policy's file options, with the hashes the outputs record."""
    from expertcast.data.lineage import policy_inputs

    out = []
    if args.traces:
        out.append((args.traces, "traces", settings["traces"]))
    if args.calibration or args.fit_traces:
        out.append((args.calibration or args.fit_traces, "traces", None if args.fit_sequences else calibration_fp))
    if args.forecaster:
        out.append((args.forecaster, "forecaster", settings["forecaster"]))
    for o, pol in zip(options, policies, strict=True):
        got = policies_files.get(pol.label, {})
        out += policy_inputs({k: v["path"] for k, v in got.items()}, o.file_options(),
                             {k: v["sha256"] for k, v in got.items()})
    return out


def _simulate(od, args, meta, seqs, policies, capacities, spl, cost, counts, settings, files, overlaps,
              inputs=()) -> int:
    from expertcast.inference.sim.report import TABLE_COLUMNS, plot_hit_vs_capacity
    from expertcast.inference.sim.simulator import simulate
    from expertcast.utils.io import atomic_write_json, report
    from expertcast.utils.provenance import sha256_json

    out = od.path
    done = previous_records(out, settings, files)
    config = {"config": config_record(args)} if args.config else {}  # the settings stay what the flags give
    atomic_write_json(od.file(SETTINGS_FILE), {"settings": settings, "settings_sha256": sha256_json(settings),
                                               "policy_files": files, "train_overlap": overlaps, **config})
    if done:
        print(f"resuming: {len(done)} finished runs with the same settings in {out}")
    finished = list(done.values())
    partial = od.file(PARTIAL_FILE)

    def save(rec: dict) -> None:
        rec["settings_sha256"] = _record_hash(settings, rec["policy"], files)
        if FIT_SET in overlaps:
            rec["fit_sequences"] = overlaps[FIT_SET]["fit_sequences"]
        if rec["policy"] in overlaps:
            rec["train_overlap"] = overlaps[rec["policy"]]["overlap"]
        finished.append(rec)
        atomic_write_json(partial, {"settings_sha256": sha256_json(settings), "records": finished})

    print(f"replaying {len(seqs)} sequences of {meta.model_id} (L={meta.num_layers}, E={meta.num_experts}, "
          f"K={meta.top_k}), batch {args.batch_size}, {args.pool} pool; decode-only accounting, prefill "
          f"replayed uncounted; belady_fraction vs the demand-only ceiling")
    try:
        records = simulate((meta, seqs), policies, capacities or None, pool=args.pool, slots_per_layer=spl,
                           batch_size=args.batch_size, cost=cost, belady_fraction=not args.no_belady_fraction,
                           engine=args.engine, calibration=counts, done=done, on_record=save,
                           progress=not args.no_progress)
    except ValueError as e:  # a policy refusing this cache or trace (e.g. router R above the budget B)
        raise UsageError(f"simulation stopped: {e}") from None
    note = overlap_note(overlaps)
    if note:
        print(f"note: {note}")
    columns = [c for c in TABLE_COLUMNS if c != "belady_fraction" or not args.no_belady_fraction]
    report(records, title="expert-cache simulation (decode only)" + (f"; {note}" if note else ""),
           json_path=od.file("simulate.json"), csv_path=od.file("simulate.csv"), columns=columns)
    png = od.file("hit_vs_capacity.png")
    plot_hit_vs_capacity(records, png, note=note)
    partial.unlink(missing_ok=True)
    print(f"wrote {out / 'simulate.json'}, {out / 'simulate.csv'}, {png}")
    if args.wandb:
        log_results(args.wandb_project, "simulate", f"simulate-{Path(args.traces or 'synthetic').name}", vars(args),
                    tables={"simulate": records}, images={"hit_vs_capacity": png}, inputs=inputs,
                    series=[(records, "capacity", "policy", SERIES_METRICS)])
    return 0


def overlap_note(overlaps: dict[str, dict[str, Any]]) -> str | None:
    """One line naming each allowed train/test overlap and model mismatch, or None when there is none."""
    from expertcast.utils.fitted_on import describe_model

    parts = []
    for label, o in overlaps.items():
        if label == FIT_SET:
            if o["overlap"]:
                parts.append(f"the fit set shares {o['overlap']} of the {o['evaluated']} replayed sequences "
                             f"(--allow-overlap)")
        else:
            if o.get("overlap") is None:
                parts.append(f"{label.split('(')[0]}'s forecaster records no training ids (--allow-overlap)")
            elif o["overlap"]:
                parts.append(f"{label.split('(')[0]}'s forecaster was trained on {o['overlap']} of the "
                             f"{o['evaluated']} replayed sequences (--allow-overlap)")
            if o.get("model_match") is False:
                parts.append(f"{label.split('(')[0]} was fitted on model {describe_model(o.get('fitted_model'), True)}, "
                             f"replayed on {describe_model(o.get('scored_model'), True)} (--allow-model-mismatch)")
    return "; ".join(parts) or None
