"""``expertcast replay``: forced-routing replay of any trace through the offloaded runtime (docs/design.md,
"Real shapes").

Each token's top-K at each MoE layer comes from the trace (collected here, imported with ``expertcast traces
import``, e.g. the granite fixture, or ``--synthetic`` at the model's shape), and so do the token ids; the
model computes with its own weights (random for a ``build-shape`` folder), its real shape, real transfers
(or reads, ``--store disk``) and the runtime's real hooks. The greedy tokens are meaningless and not
reported. The trace's L/E/K is laid onto the model's as the header states
(:func:`~expertcast.inference.runtime.forced.map_trace_to_model`: layers identity, cycled when the trace has
fewer, refused when it has more unless ``--truncate-trace``; expert ids as recorded, refused when the trace
names more experts than the model has; K highest-weight experts when the trace records more than the model's
K, refused when fewer).

    expertcast replay --model DIR (--traces DIR | --synthetic zipf) [--policy lru --policy lfu ...]
                      [--capacity 0.1,0.25] [--store ram|disk] [--tokens 32] [--json PATH] [--csv PATH]
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path
from typing import Any

from expertcast.commands.common import (
    CommandParser,
    add_capacity_args,
    add_config_arg,
    capacities_from_args,
    nonneg_int,
    parse_and_run,
    parse_counts,
    positive_int,
    resolve_model,
)
from expertcast.utils.errors import UsageError

PROG = "expertcast replay"
SYNTHETIC = ("random", "zipf", "markov")
COLUMNS = ["policy", "capacity", "store", "sequences", "decoded_tokens", "tokens_per_s", "hit", "demand_misses",
           "misses_per_token", "late_prefetches", "mb_per_token", "stall_ms_per_token", "load_s", "peak_rss_gb"]
READ_COLUMNS = ["read_mb_per_token", "read_gbps", "exposed_misses_per_token", "rss_bound_gb"]
"""The disk store's read counters, shown with ``--store disk`` where the runtime reports them."""


def build_parser() -> CommandParser:
    ap = CommandParser(prog=PROG, description="forced-routing replay of a trace through the offloaded runtime "
                                              "(token ids and every layer's top-K from the trace)")
    ap.add_argument("--model", required=True,
                    help="model folder (e.g. an `expertcast build-shape` output), preset name or Hub id")
    ap.add_argument("--traces", default=None, help="trace set folder (`expertcast traces import` for other formats)")
    ap.add_argument("--synthetic", choices=SYNTHETIC, default=None,
                    help="replay synthetic traces of the model's L/E/K instead of --traces")
    ap.add_argument("--synthetic-size", default="2,40", help="sequences,tokens of --synthetic traces (8 prompt tokens)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --synthetic traces (and of a random-init preset)")
    ap.add_argument("--max-sequences", type=positive_int, default=None, help="replay only the first N sequences")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="decode at most N positions per sequence after its prompt (None = the whole trace)")
    ap.add_argument("--truncate-trace", action="store_true",
                    help="a trace with more MoE layers than the model: replay its first L layers (else refused)")
    ap.add_argument("--policy", action="append", default=None,
                    help="cache policy with options (repeat the flag for several; default lru); oracles (belady) "
                         "read the replayed trace; static is calibrated in-sample on it")
    add_capacity_args(ap, multiple=True, default=None, budget_gb=True)
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"], help="slot pools")
    ap.add_argument("--store", default="ram", choices=["ram", "disk"],
                    help="where the experts live: host RAM, or a direct-read file on disk (--disk-path)")
    ap.add_argument("--disk-path", default=None, help="--store disk: the expert store file")
    ap.add_argument("--readers", type=positive_int, default=None,
                    help="--store disk: reader threads (default 4, the reader pool's)")
    ap.add_argument("--prefetch-chunk-kb", type=nonneg_int, default=None,
                    help="--store disk: a prefetch read reads in blocks of this many KiB and yields the disk to "
                         "demand reads between them (0: whole reads, no yielding; default 2048, the reader pool's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="model dtype (auto = the checkpoint's)")
    ap.add_argument("--expert-dtype", default="bfloat16",
                    help="experts' format in the stores, slots and reads: bfloat16 (unquantized), int8, int4 "
                         "(group 64), int4-g32/g128, int8-g128")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (None = torch's default)")
    ap.add_argument("--json", default=None, help="write the rows and the run's provenance as JSON here")
    ap.add_argument("--csv", default=None, help="write the rows as CSV here")
    add_config_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    return parse_and_run(build_parser(), argv, PROG, replay)


# -- inputs ------------------------------------------------------------------------------------------------
def model_shape(resolved: str):
    """(config, MoESpec) of ``resolved`` from its config alone (no weights)."""
    from expertcast.models.presets import get_config, is_preset
    from expertcast.models.spec import MoESpec

    if is_preset(resolved):
        config = get_config(resolved)
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(resolved, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {resolved}: cannot read its config ({' '.join(str(e).split())[:200]})") from None
    try:
        return config, MoESpec.from_config(config)
    except ValueError as e:  # UnsupportedModelError: another family, or config values that cannot run
        raise UsageError(f"--model {resolved}: {' '.join(str(e).split())}") from None


def load_replay_traces(args: Any, L: int, E: int, K: int):
    """(meta, sequences, source) of ``--traces`` or ``--synthetic`` (at the model's L/E/K)."""
    if bool(args.traces) == bool(args.synthetic):
        raise UsageError("give exactly one of --traces DIR or --synthetic KIND")
    if args.synthetic:
        from expertcast.data import synthetic

        size = parse_counts(args.synthetic_size, "--synthetic-size")
        if len(size) != 2:
            raise UsageError(f"--synthetic-size: expected sequences,tokens, got {args.synthetic_size}")
        n, T = size
        if T < 9:
            raise UsageError(f"--synthetic-size: {T} tokens leave no decode position after the 8 prompt tokens")
        gen = {"random": synthetic.random_traces, "zipf": synthetic.zipf_traces, "markov": synthetic.markov_traces}
        tr = gen[args.synthetic](num_sequences=n, num_tokens=T, num_layers=L, num_experts=E, top_k=K, seed=args.seed)
        return tr.meta, list(tr.sequences), f"synthetic {args.synthetic} {n}x{T} seed {args.seed}"
    from expertcast.data.traces import load_traces

    meta, seqs = load_traces(args.traces)
    return meta, seqs, str(Path(args.traces).resolve())


def _given(spec: str) -> set[str]:
    """The option names ``--policy spec`` sets itself."""
    from expertcast.inference.policies import parse_policy_options

    return set(parse_policy_options(spec).given)


def make_policy_for(spec: str, meta: Any, seqs: list, pool_future: Any):
    """The policy of ``--policy spec``: an oracle gets the replayed trace's access stream, ``static`` (without a
    calibration of its own) its selection counts (in-sample)."""
    from expertcast.inference.policies import build_policy, object_names, parse_policy_options, policy_spec
    from expertcast.inference.policies.static import selection_counts

    try:
        parsed = parse_policy_options(spec)
        pspec = policy_spec(parsed.policy)
    except (KeyError, ValueError) as e:
        raise UsageError(f"--policy {spec}: {' '.join(str(e).split())}") from None
    if not pspec.runs_on("driver"):
        raise UsageError(f"--policy {parsed.policy} runs only on the simulator's compiled engine, not in the runtime")
    objects: dict[str, Any] = {}
    if "calibration" not in parsed.given and "calibration" in object_names(pspec.load()):
        objects["calibration"] = selection_counts(seqs, meta.num_layers, meta.num_experts)
    try:
        policy = build_policy(pspec, parsed, **objects)
    except UsageError:
        raise
    except (TypeError, AttributeError, ValueError) as e:
        raise UsageError(f"--policy {spec}: cannot build {parsed.policy}: {e}") from None
    future = pool_future() if "future" in pspec.needs else None
    return policy, parsed.policy, future


READER_KEYS = ("readers", "prefetch_chunk_kb")
"""The keys of :func:`_store_kwargs` that a later row's OffloadedModel takes for its own reader pool (absent: the
runtime's defaults, not restated here)."""


def _store_kwargs(args: Any) -> dict[str, Any]:
    """The keyword arguments of ``load_offloaded`` that select the expert store (``--store``)."""
    if args.store == "ram":
        if args.disk_path or args.readers or args.prefetch_chunk_kb is not None:
            raise UsageError("--disk-path, --readers and --prefetch-chunk-kb apply to --store disk")
        return {}
    from expertcast.inference.runtime.loading import load_offloaded

    params = inspect.signature(load_offloaded).parameters
    if "store" not in params:
        raise UsageError("--store disk: this expertcast has no disk store (load_offloaded takes no store=)")
    if not args.disk_path:
        raise UsageError("--store disk needs --disk-path FILE (the expert store file)")
    kw: dict[str, Any] = {"store": "disk", "disk_path": args.disk_path}
    if args.readers is not None:
        kw["readers"] = args.readers
    if args.prefetch_chunk_kb is not None:
        kw["prefetch_chunk_kb"] = args.prefetch_chunk_kb
    return kw


def _quant_kernels() -> list[dict]:
    """The kernel table of the run's quantized projections: per shape and token count the measured ms and
    the path that ran (empty for unquantized experts)."""
    from expertcast.inference.runtime import quant

    return quant.TABLE.to_list()


# -- run ---------------------------------------------------------------------------------------------------
def replay(args: Any) -> int:
    import torch
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.inference.cache.expert_cache import Budget
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.forced import map_trace_to_model
    from expertcast.inference.runtime.loading import load_offloaded
    from expertcast.inference.runtime.real_shapes import read_provenance
    from expertcast.inference.runtime.stats import RowPeak, forecaster_line
    from expertcast.inference.sim.simulator import build_stream
    from expertcast.utils.io import atomic_write_json, report
    from expertcast.utils.outdir import DISK_STORE_KIND, claim_output_file
    from expertcast.utils.provenance import code_version

    outs = {flag: claim_output_file(path, flag, kind) for flag, path, kind in
            (("--json", args.json, "replay --json"), ("--csv", args.csv, "replay --csv"),
             ("--disk-path", args.disk_path, DISK_STORE_KIND)) if path}
    if args.threads:
        torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    config, spec = model_shape(resolved)
    L, E, K = spec.num_layers, spec.num_experts, spec.top_k
    meta, seqs, source = load_replay_traces(args, L, E, K)
    if args.max_sequences:
        seqs = seqs[: args.max_sequences]
    if args.tokens is not None:
        from dataclasses import replace

        seqs = [replace(s, token_ids=s.token_ids[:s.prompt_len + args.tokens],
                        expert_ids=s.expert_ids[:s.prompt_len + args.tokens],
                        expert_weights=s.expert_weights[:s.prompt_len + args.tokens],
                        router_probs=None if s.router_probs is None else s.router_probs[:s.prompt_len + args.tokens])
                for s in seqs]
    try:
        meta, seqs, mapping = map_trace_to_model(meta, seqs, L, E, K, truncate_layers=args.truncate_trace)
    except ValueError as e:
        raise UsageError(f"--traces: {e}") from None
    from expertcast.data.traces import require_decode_tokens

    require_decode_tokens(meta, seqs, source)
    caps = (capacities_from_args(args, multiple=True) if (args.capacity or args.slots or args.budget_gb)
            else [Budget.fraction(0.25)])
    policies = args.policy or ["lru"]
    store_kw = _store_kwargs(args)
    from expertcast.inference.runtime import quant

    xfmt = quant.ExpertFormat.parse(getattr(args, "expert_dtype", "bfloat16")).name
    quant.set_kernel_mode(quant.TABLE.mode)  # this run's kernel table (measured as its shapes first run)
    if xfmt != "bfloat16":
        store_kw["expert_dtype"] = xfmt
    built = read_provenance(resolved) if Path(resolved).is_dir() else None
    decode = sum(s.num_tokens - s.prompt_len for s in seqs)
    print(f"replay: model {resolved} ({spec.family}, L={L} MoE layers, E={E}, K={K}, "
          f"{spec.expert_bytes / 1e6:.2f} MB per expert, {spec.total_expert_bytes / 1e9:.2f} GB of experts"
          + (f"; random weights, build-shape {built['shape']} seed {built['seed']}" if built else "") + ")")
    print(f"replay: routing and token ids from {source}: {len(seqs)} sequences, {decode} decode positions "
          f"(trace L={mapping.trace_shape[0]}, E={mapping.trace_shape[1]}, K={mapping.trace_shape[2]})")
    for line in mapping.lines():
        print(f"replay: {line}")
    print("replay: greedy tokens are not reported (forced routing: the trace decides every layer's experts)")

    rows: list[dict[str, Any]] = []
    model = store = load = None
    for budget in caps:
        for pspec_text in policies:
            policy, name, future = make_policy_for(pspec_text, meta, seqs, lambda: build_stream(meta, seqs, 1))
            with RowPeak() as peak:  # this row's own peak: the last row's slots are gone before this one loads
                t0 = time.perf_counter()
                try:
                    if model is None:  # loaded once; every later row reuses the model and its store (RAM or disk)
                        om, _, load = load_offloaded(resolved, policy, budget, device=args.device, dtype=args.dtype,
                                                     pool=args.pool, future=future, seed=args.seed, **store_kw)
                        model, store = om.model, om.store
                        load_s = load.load_seconds
                        if "--disk-path" in outs:
                            outs["--disk-path"].written()
                    else:
                        om = OffloadedModel(model, policy, budget, pool=args.pool, device=args.device, future=future,
                                            store=store, **{k: store_kw[k] for k in READER_KEYS if k in store_kw})
                        load_s = time.perf_counter() - t0  # the store of the first load is reused
                except ValueError as e:
                    raise UsageError(f"--policy {pspec_text} at {budget.tag}: {' '.join(str(e).split())}") from None
                link = None
                if store_kw and not {"link_bytes_per_s", "layer_compute_ms"} & _given(pspec_text):
                    link = om.use_measured_link()  # seqmoe's deadlines from this disk and this compute, not a default
                    if link is not None:
                        print(f"replay: {name}: link measured on the disk store: {link['bytes_per_s'] / 1e9:.2f} GB/s "
                              f"({link['reads']} reads at queue depth {link['queue_depth']}), "
                              f"{link['layer_compute_ms']:.3f} ms of expert compute per layer")
                if xfmt != "bfloat16" and not rows:
                    print(f"replay: experts stored as {xfmt}: {om.layout.expert_bytes / 1e6:.2f} MB per expert "
                          f"(kernel mode {quant.TABLE.mode}; the kernels that ran are in the JSON's quant_kernels)")
                try:
                    st = om.replay(seqs)
                finally:
                    om.close()
                slots, pool_bytes = om.cache.num_slots, om.pool.nbytes
                if budget.kind == "bytes":
                    print(f"replay: {budget.label} of {xfmt} experts ({om.layout.expert_bytes / 1e6:.3f} MB each): "
                          f"{slots} slots ({args.pool} pool)")
                om.pool = om.workspace = None  # the slots go now
                del om
            m = st.metrics()
            n = max(st.decoded_tokens, 1)
            gb = budget.row() if budget.kind == "bytes" else {}  # {"budget_gb": g}: the slots it bought are `slots`
            rows.append({"policy": pspec_text if pspec_text != name else name,
                         "capacity": gb["budget_gb"] if gb else budget.requested, **gb,
                         "store": args.store, "expert_dtype": xfmt, "sequences": len(seqs), "decoded_tokens": st.decoded_tokens,
                         "tokens_per_s": st.tokens_per_s, "hit": m["hit"], "demand_misses": m["demand_misses"],
                         "misses_per_token": m["demand_misses"] / n, "late_prefetches": m["late_prefetches"],
                         "mb_per_token": m["mb_per_token"], "stall_ms_per_token": m["stall_ms_per_token"],
                         "load_s": load_s, "peak_rss_gb": peak.bytes / 1e9, "peak_rss_scope": peak.scope,
                         "slots": slots, **{k: v for k, v in m.items() if k in READ_COLUMNS}, "metrics": m,
                         **({"link_measured": link} if link is not None else {})})
            bound = getattr(load, "rss_bound_bytes", None)  # the disk store's stated host RSS bound (first row's)
            if bound is not None:  # this row's: its own slots in place of the first row's, on the CPU
                if str(args.device) == "cpu":
                    bound += pool_bytes - load.plan.slot_bytes
                rows[-1]["rss_bound_gb"] = bound / 1e9
    cols = COLUMNS + [c for c in READ_COLUMNS if args.store == "disk" and any(c in r for r in rows)]
    report(rows, title=f"forced-routing replay on {Path(resolved).name} ({args.store} store, {args.device})",
           csv_path=args.csv, columns=cols)
    for r in rows:  # a forecasting policy's cost per decode step
        if (line := forecaster_line(r["metrics"])) is not None:
            print(f"replay: {r['policy']} @ {r['capacity']}: {line}")
    if args.csv:
        outs["--csv"].written()
    if args.json:
        atomic_write_json(args.json, {
            "rows": rows, "load": load.to_dict() if load is not None else None, "model": resolved, "model_build": built, "spec": spec.to_dict(),
            "traces": source, "trace_model": meta.model_id, "trace_fingerprint": sequences_fingerprint(seqs),
            "mapping": mapping.to_dict(), "settings": {k: v for k, v in vars(args).items()},
            "quant_kernels": _quant_kernels(),
            "code": code_version()})
        outs["--json"].written()
        print(f"json: {args.json}", file=sys.stderr)
    return 0
