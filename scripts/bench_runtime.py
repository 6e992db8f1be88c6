"""Speed of the offloading runtime against the full-load model, measured in the same run.

A random-weight MoE (Qwen3-MoE architecture; by default a CPU size whose MoE layer takes >= 1 ms at
batch 1) replays routing traces with forced routing: recorded traces given by ``--traces`` (real
routing patterns), else synthetic staged traces (planted stages with hot experts). Both the baseline
and the runtime run the same tokens and routing, decode one token at a time (batch 1, KV cache).

(a) overhead: every expert resident in the runtime's slots (capacity 1.0, warmed) vs the plain model
    (all experts in the fused weights, transformers' grouped_mm kernel): ``overhead = full / runtime - 1``
    (target <= 10%), from the median of paired ratios (each runtime run against the mean of the full-load
    runs right before and after it).
(b) % of full-load tokens/s at 15/25/35/45% residency with the emulated host-device link (CPU: a
    throttled transfer thread) set so that one expert transfer costs 1x, 2x and 4x one MoE layer's
    compute, for LRU, the static placement, Belady (oracle bound) and each method's policy available
    (``stage``; ``seqmoe`` with ``--forecaster``). Target: the best policy at 45% and 2x >= 80%.
    SeqMoE variants: ``seqmoe`` reads forecasts precomputed per sequence before its timing starts (the
    forecaster's cost is not charged: an upper bound for a free forecaster), ``seqmoe-sync`` runs the
    forecaster online inside the hooks (decoding waits for it), ``seqmoe-async`` runs it on a worker
    thread beside decoding (:mod:`expertcast.inference.policies.async_forecast`).
    Every policy run is followed by a full-load run of the same sequences, and its % of full-load is against
    that paired run: shared machines drift by 10-20% over tens of seconds, which a single baseline measured
    minutes earlier would turn into policy differences. With ``--grid-repeats`` the median repeat is kept
    (``pct_full_min`` / ``pct_full_max`` give the spread).

On CUDA the link is the real one (pinned memory, side stream): the ratio columns give the measured
transfer/compute ratio instead. Results: a terminal table, JSON + CSV and a PNG under ``--out``.

Routing defaults to the embedded default model's recorded GSM8K traces (``DEFAULT_TRACES``, L=4, E=32,
K=4: the CPU preset's shape) and SeqMoE to the forecaster trained on that model's other GSM8K traces
(``DEFAULT_FORECASTER``) when those directories exist; ``--synthetic`` forces the synthetic staged traces.

    python scripts/bench_runtime.py [--device cpu|cuda] [--tokens 128] [--grid-repeats 2] [--quick]
        [--cue-set CUES.json] [--out runs/bench_runtime]

``--overhead [--json PATH]`` measures instead the host time per MoE layer of the two decode paths
(:mod:`expertcast.inference.runtime.graph.decode`): a model whose expert compute is negligible (hidden 16,
24 layers by default) replays the same synthetic routing under lru on the eager path and on the graph path
(its per-layer function compiled by ``GraphDecoder.compile(--compile-backend)``: by default AOTInductor on
the CPU, ``torch.compile(fullgraph=True)`` on CUDA); the wall time of every decode-layer call (residency,
transfers, expert compute; the router and attention excluded) is recorded, each repeat gives the median per
path, and the reported figures are the medians over the paired repeats, with their min-max
(``eager_us_per_layer``, ``graph_us_per_layer``; target: graph <= eager / 5 and < 30 us). On a CPU the
kernels run on the host too, so they are part of the figure; the graph path's figure is split into the time
inside the compiled function (``graph_call_us_per_layer``) and the Python dispatch to it
(``graph_python_us_per_layer``). ``OVERHEAD_DEFINITION`` (printed and written to the JSON) states this.

    python scripts/bench_runtime.py --overhead [--repeats 7] [--json overhead.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from expertcast.inference.policies import make_policy  # noqa: E402
from expertcast.inference.runtime.engine import OffloadedModel  # noqa: E402
from expertcast.inference.runtime.forced import FullLoadReplayer  # noqa: E402
from expertcast.inference.sim.simulator import build_stream  # noqa: E402
from expertcast.models.presets import build_from_config, get_config, list_presets  # noqa: E402
from expertcast.utils.io import atomic_write_json, report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = ROOT / "runs" / "traces" / "tiny-default-gsm8k-heldout"
"""Recorded routing of the embedded default model on held-out GSM8K questions (not in the forecaster's training)."""
DEFAULT_FORECASTER = ROOT / "runs" / "forecaster" / "tiny" / "export"
"""SeqMoE forecaster export trained on the embedded default model's GSM8K traces."""


def resolve_defaults(args, L: int, E: int, K: int) -> None:
    """Fill ``--traces`` / ``--forecaster`` with the recorded defaults when present and of the model's shape."""
    if args.synthetic:
        args.traces = None
        return
    if args.traces is None and (DEFAULT_TRACES / "trace_meta.json").is_file():
        from expertcast.data.traces import read_meta

        meta = read_meta(DEFAULT_TRACES)
        if (meta.num_layers, meta.num_experts, meta.top_k) == (L, E, K):
            args.traces = str(DEFAULT_TRACES)
    if args.traces and args.forecaster is None and (DEFAULT_FORECASTER / "forecaster.json").is_file():
        args.forecaster = str(DEFAULT_FORECASTER)


def bench_config(args):
    """The benchmark model's transformers config (a tiny preset, a real-shape preset or the CPU size)."""
    if args.preset:
        return get_config(args.preset)
    return get_config("qwen3_moe-tiny", hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                      intermediate_size=2 * args.moe_intermediate, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=args.hidden // 8)


def moe_layer_ms(model, device, K: int, reps: int = 60) -> float:
    """Median time of one MoE experts forward at batch 1 (K experts) with all experts resident."""
    from expertcast.inference.runtime.store import find_experts_modules

    mod = find_experts_modules(model)[0].module
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    dt = next(model.parameters()).dtype
    times = []
    for i in range(reps + 5):
        h = torch.randn(1, H, generator=g).to(device, dt)
        idx = torch.randperm(mod.num_experts, generator=g)[:K][None].to(device)
        w = torch.full((1, K), 1.0 / K, dtype=dt, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        mod(h, idx, w)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def load_or_make_traces(args, L: int, E: int, K: int, vocab: int, expert_bytes: int):
    if args.traces:
        from expertcast.data.traces import load_traces

        meta, seqs = load_traces(args.traces)
        meta.check_compatible(L, E, K, what="benchmark model")
        seqs = [s for s in seqs if s.num_tokens - s.prompt_len >= 4][: args.sequences]
        if not seqs:
            raise SystemExit(f"{args.traces}: no sequence with at least 4 decoded positions")
        return meta, seqs, None, f"recorded traces {args.traces}"
    from expertcast.data.synthetic import staged_traces

    syn = staged_traces(num_sequences=args.sequences, num_tokens=args.prompt + args.tokens, num_layers=L,
                        num_experts=E, top_k=K, num_stages=3, hot=max(K, int(round(0.2 * E))), hot_mass=0.9,
                        mean_stage_len=args.stage_len, prompt_len=args.prompt, seed=args.seed,
                        expert_bytes=expert_bytes, vocab=vocab)
    return syn.meta, syn.sequences, syn.cue_token, "synthetic staged traces"


def make_bench_policy(name: str, traces, cue_token, args, latency_model):
    """(policy, future) for one policy name, or None when it cannot run in this setting."""
    if name == "static":
        return make_policy("static", calibration=traces), None
    if name == "belady":
        return make_policy("belady"), "future"
    if name == "stage":
        if args.cue_set:
            return make_policy("stage", cue_set=args.cue_set, latency=latency_model), None
        if cue_token is None:
            return None
        cue = int(cue_token)
        return make_policy("stage", cues="Alternatively", latency=latency_model,
                           decoder=lambda i: b" Alternatively" if int(i) == cue else b" x"), None
    if name in ("seqmoe", "seqmoe-sync", "seqmoe-async"):
        fc = args.forecaster or getattr(args, "_trained_forecaster", None)
        if fc is None:
            return None
        kw = {"transfer_layers": args._ratio or 2.0, "layer_compute_ms": args._layer_ms}
        if name == "seqmoe-async":
            return make_policy("seqmoe-async", forecaster=fc, horizon=args.horizon, **kw), None
        # seqmoe: forecasts precomputed per replayed sequence before its timing starts (forecaster cost not
        # charged); seqmoe-sync: computed online inside the hooks (charged, decoding waits)
        return make_policy("seqmoe", forecaster=fc, horizon=args.horizon, precompute=name == "seqmoe", **kw), None
    return make_policy(name), None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help=f"a model preset instead of the CPU size ({', '.join(list_presets())})")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--traces", default=None, help="recorded trace directory (real routing) for forced replay "
                    f"(default: {DEFAULT_TRACES} when present and of the model's shape)")
    ap.add_argument("--synthetic", action="store_true", help="synthetic staged routing instead of recorded traces")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per sequence")
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--stage-len", type=float, default=24.0)
    ap.add_argument("--residency", type=float, nargs="+", default=[0.15, 0.25, 0.35, 0.45])
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                    help="one expert transfer = ratio x one MoE layer's compute (CPU link emulation)")
    ap.add_argument("--policies", nargs="+", default=["lru", "static", "belady", "stage", "seqmoe"])
    ap.add_argument("--pool", default="per-layer", choices=["per-layer", "shared"])
    ap.add_argument("--forecaster", default=None, help="forecaster export for the seqmoe policy (default with "
                    f"recorded routing: {DEFAULT_FORECASTER} when present)")
    ap.add_argument("--train-forecaster-epochs", type=int, default=12,
                    help="synthetic routing only: train the seqmoe forecaster on held-out traces of the same "
                         "process for this many epochs when no --forecaster is given (0: skip seqmoe)")
    ap.add_argument("--horizon", type=int, default=8, help="seqmoe forecast horizon c (rollout steps)")
    ap.add_argument("--cue-set", default=None, help="calibrated cue set for the stage policy")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of (a) (best of each kept)")
    ap.add_argument("--grid-repeats", type=int, default=1,
                    help="interleaved repeats of the whole (b) grid, the baseline re-measured before each residency "
                         "block; the best tokens/s of each cell and of the baseline are kept (CPU contention)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one ratio (2x), residencies 0.25/0.45, fewer tokens")
    ap.add_argument("--out", default="runs/bench_runtime")
    ap.add_argument("--overhead", action="store_true",
                    help="host time per MoE layer, eager vs graph decode path (see the module docstring)")
    ap.add_argument("--decode-path", default="eager", choices=["eager", "graph", "auto"],
                    help="decode path of the (b) runs (graph: lru and seqmoe on the graph-compatible path; auto: "
                         "graph where it can run, e.g. not under the CPU link emulation)")
    ap.add_argument("--json", default=None, help="--overhead: write the figures to this JSON file")
    ap.add_argument("--overhead-layers", type=int, default=24, help="--overhead: MoE layers of the tiny-hidden model")
    ap.add_argument("--compile-backend", default="auto", choices=["auto", "aoti", "inductor", "aot_eager", "none"],
                    help="--overhead: how the graph path's layer function is compiled (GraphDecoder.compile: aoti: "
                         "AOTInductor, called without guards, CPU only; inductor / aot_eager: "
                         "torch.compile(fullgraph=True); none: not compiled; auto: aoti on CPU, inductor on CUDA)")
    args = ap.parse_args(argv)
    args.command = " ".join(["scripts/bench_runtime.py", *(sys.argv[1:] if argv is None else argv)])
    if args.json:  # a new file, or this script's earlier figures only
        from expertcast.utils.outdir import claim_output_file

        args.json = claim_output_file(args.json, "--json", "bench_runtime --json")
    if args.overhead:
        return overhead_main(args)
    if args.quick:
        args.ratios, args.residency, args.tokens = [2.0], [0.25, 0.45], min(args.tokens, 32)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    cfg = bench_config(args)
    model = build_from_config(cfg, seed=args.seed, dtype=dtype).to(device)
    K = cfg.num_experts_per_tok
    from expertcast.inference.runtime.store import find_experts_modules, layout_of

    refs = find_experts_modules(model)
    L, E = len(refs), int(refs[0].module.num_experts)
    xbytes = layout_of(refs[0].module).expert_bytes
    layer_ms = moe_layer_ms(model, device, K)
    resolve_defaults(args, L, E, K)
    meta, seqs, cue_token, source = load_or_make_traces(args, L, E, K, model.get_input_embeddings().num_embeddings,
                                                        xbytes)
    print(f"model: L={L} E={E} K={K} hidden={cfg.hidden_size} expert={xbytes / 1e6:.2f} MB {str(dtype)[6:]} on "
          f"{device}; MoE layer at batch 1: {layer_ms:.2f} ms; routing: {source} ({len(seqs)} x {args.tokens} "
          "decode steps)")
    if layer_ms < 1.0 and device.type == "cpu":
        print(f"warning: the MoE layer takes {layer_ms:.2f} ms < 1 ms at batch 1; raise --hidden/--moe-intermediate")

    # ---- baseline and (a): the plain model and the all-resident runtime under the same forced routing,
    # interleaved (best of --repeats each) so that both see the same machine load
    rep = FullLoadReplayer(model)
    full = rep.replay(seqs, max_decode=args.tokens)  # warm-up
    rep.close()
    om = OffloadedModel(model, make_policy("lru"), 1.0, pool=args.pool, device=device)
    store = om.store
    om.replay(seqs, max_decode=args.tokens)  # warm: every used expert lands in its slot
    model = om.restore()  # every runtime run below ends the same way: fused weights back for the plain model
    # interleaved full, runtime, full, runtime, ..., full: each runtime run is compared with the mean of the
    # full-load runs right before and after it (the machine's speed drifts over tens of seconds on shared
    # hosts; a pair sees the same speed), the median of those paired ratios is reported
    full = best_all = None
    fulls, alls = [], []

    def _full_run():
        rep = FullLoadReplayer(model)
        r = rep.replay(seqs, max_decode=args.tokens)
        rep.close()
        return r

    fulls.append(_full_run())
    for _ in range(args.repeats):
        om = OffloadedModel(model, make_policy("lru"), 1.0, pool=args.pool, device=device, store=store)
        om.replay(seqs, max_decode=args.tokens)  # warm (not timed)
        alls.append(om.replay(seqs, max_decode=args.tokens))
        mem_all = om.memory_report()
        model = om.restore()
        fulls.append(_full_run())
    full = max(fulls, key=lambda r: r.tokens_per_s)
    best_all = max(alls, key=lambda r: r.tokens_per_s)
    paired = [a.tokens_per_s / (0.5 * (fulls[i].tokens_per_s + fulls[i + 1].tokens_per_s)) for i, a in enumerate(alls)]
    ratio_a = float(np.median(paired))
    print(f"full-load: {full.tokens_per_s:.1f} tokens/s (best of {len(fulls)}); runtime with every expert resident: "
          f"{best_all.tokens_per_s:.1f} tokens/s (best of {len(alls)}); paired ratios "
          f"{', '.join(f'{x:.3f}' for x in paired)}")
    overhead = 1.0 / ratio_a - 1.0
    rows_a = [{"config": "full-load (plain model)", "tokens_per_s": full.tokens_per_s, "ratio_vs_full": 1.0},
              {"config": "runtime, all experts resident", "tokens_per_s": best_all.tokens_per_s,
               "ratio_vs_full": ratio_a, "hit": best_all.hit, "overhead_pct": 100 * overhead,
               "paired_ratios": paired}]
    report(rows_a, title="(a) all experts resident: runtime vs plain model", json_path=out / "overhead.json",
           csv_path=out / "overhead.csv")

    # ---- the SeqMoE forecaster: trained on held-out traces of the same process (synthetic routing only)
    args._layer_ms, args._ratio = layer_ms, None
    if "seqmoe" in args.policies and not args.forecaster and cue_token is not None and args.train_forecaster_epochs > 0:
        from expertcast.data.synthetic import staged_traces
        from expertcast.train.forecaster_module import fit_forecaster

        held = staged_traces(num_sequences=24, num_tokens=args.prompt + args.tokens, num_layers=L, num_experts=E,
                             top_k=K, num_stages=3, hot=max(K, int(round(0.2 * E))), hot_mass=0.9,
                             mean_stage_len=args.stage_len, prompt_len=args.prompt, seed=args.seed,
                             expert_bytes=xbytes, vocab=model.get_input_embeddings().num_embeddings)
        # same stage profiles (same seed draws them first), new sequences: drop the benchmark's own
        held_seqs = held.sequences[len(seqs):]
        t0 = time.perf_counter()
        module, _ = fit_forecaster(held.meta, held_seqs, epochs=args.train_forecaster_epochs, batch_size=8)
        args._trained_forecaster = module.net
        print(f"trained the seqmoe forecaster on {len(held_seqs)} held-out sequences in {time.perf_counter() - t0:.1f} s")

    # ---- (b) residency x link x policy
    from expertcast.inference.saem.cpu_exec import LatencyModel

    rows = []
    ratios = args.ratios if device.type == "cpu" else [None]
    mem_rows = []
    for g in range(args.grid_repeats):
        for ratio in ratios:
            link_gbps = None if ratio is None else xbytes / (ratio * layer_ms * 1e-3) / 1e9
            transfer_ms = (ratio * layer_ms) if ratio is not None else xbytes / 25e9 * 1e3
            args._ratio = ratio
            # CPU execution of a cold expert, in the proportions of the simulator's default cost model
            # (cpu_expert_ms / transfer_ms = 0.19 / 0.38; 0.01 ms per token): charged on the CPU "device"
            lat = LatencyModel(transfer_ms=transfer_ms, cpu_expert_ms=0.5 * transfer_ms,
                               cpu_token_ms=0.5 * transfer_ms / 19)
            for res in args.residency:
                for name in args.policies:
                    try:
                        made = make_bench_policy(name, seqs, cue_token, args, lat)
                    except ValueError as e:
                        print(f"skip {name}: {e}")
                        continue
                    if made is None:
                        continue
                    pol, fut = made
                    future = build_stream(meta, [s for s in _truncate(seqs, args.tokens)], 1) if fut == "future" else None
                    pool = "per-layer" if name == "stage" else args.pool
                    try:
                        om = OffloadedModel(model, pol, float(res), pool=pool, device=device, link_gbps=link_gbps,
                                            future=future, store=store, cpu_exec_ms=lat.cpu_ms,
                                            decode_path=args.decode_path)
                    except ValueError as e:
                        print(f"skip {name} at {res}: {e}")
                        continue
                    st = om.replay(seqs, max_decode=args.tokens)
                    if name == "lru" and abs(res - max(args.residency)) < 1e-9 and not mem_rows:
                        mem_rows.append(om.memory_report().to_dict())
                    model = om.restore()
                    if hasattr(pol, "close"):  # the asynchronous forecaster's worker thread
                        pol.close()
                    m = st.metrics()
                    pair = _full_run()  # the paired baseline: same sequences, right after
                    if pair.tokens_per_s > full.tokens_per_s:
                        full = pair
                    rows.append({
                        "policy": name, "residency": res, "link_ratio": ratio if ratio is not None else "real",
                        "link_gbps": link_gbps, "tokens_per_s": st.tokens_per_s,
                        "pct_full": 100.0 * st.tokens_per_s / pair.tokens_per_s,
                        "paired_full_tokens_per_s": pair.tokens_per_s, "hit": st.hit, "adj_hit": st.adj_hit,
                        "mb_per_token": st.mb_per_token, "stall_ms_per_token": m["stall_ms_per_token"],
                        "cpu_exec": m["cpu_exec"], "late": m["late_prefetches"], "repeat": g,
                        "proactive_per_token": m["proactive_per_token"], "prefetch_precision": m["prefetch_precision"],
                        "decode_path": om.decode_path,
                    })
                    print(f"  [{g + 1}/{args.grid_repeats}] ratio={ratio} residency={res:.2f} {name:>7}: {rows[-1]['pct_full']:5.1f}% of full-load "
                          f"(hit {st.hit:.3f}, stall {m['stall_ms_per_token']:.2f} ms/token)", flush=True)
    rows = _median_of_repeats(rows)
    report(rows, title="(b) % of full-load tokens/s (decode, same routing, same run)",
           json_path=out / "residency.json", csv_path=out / "residency.csv",
           columns=["policy", "residency", "link_ratio", "tokens_per_s", "pct_full", "hit", "adj_hit", "mb_per_token",
                    "proactive_per_token", "prefetch_precision", "late", "stall_ms_per_token", "cpu_exec"])
    if mem_rows:
        atomic_write_json(out / "memory.json", {"all_resident": mem_all.to_dict(), "lru_max_residency": mem_rows[0]})
        mr = mem_rows[0]
        print(f"memory (lru @ {max(args.residency):.0%}): host experts {mr['host_expert_bytes'] / 1e6:.1f} MB; device "
              f"non-expert {mr['device_non_expert_bytes'] / 1e6:.1f} MB + slots {mr['device_slot_bytes'] / 1e6:.1f} MB "
              f"({mr['num_slots']}+{mr['num_temp_slots']} x {mr['expert_bytes'] / 1e6:.2f} MB) + workspace "
              f"{mr['device_workspace_bytes'] / 1e6:.2f} MB; expert params left in the model: "
              f"{mr['device_expert_param_bytes']} B")
    _plot(rows, out / "residency.png", args)
    # one clear line
    target = [r for r in rows if r["residency"] == max(args.residency) and r["link_ratio"] in (2.0, "real")]
    best = max(target, key=lambda r: r["pct_full"]) if target else None
    line = (f"bench_runtime {device.type}: full-load {full.tokens_per_s:.1f} tok/s; all-resident overhead "
            f"{100 * overhead:+.1f}% (target <= 10%)")
    if best:
        line += (f"; best at {best['residency']:.0%} residency, link {best['link_ratio']}x: {best['policy']} "
                 f"{best['pct_full']:.1f}% of full-load (target >= 80%)")
    print(line)
    atomic_write_json(out / "summary.json", {"line": line, "layer_ms": layer_ms, "expert_bytes": xbytes,
                                            "full_tokens_per_s": full.tokens_per_s, "overhead": overhead,
                                            "source": source, "device": str(device)})
    return 0


OVERHEAD_DEFINITION = (
    "host time per MoE layer = wall time of one decode-layer call of the engine (OffloadedModel._decode_layer: "
    "residency decisions, miss copies, expert compute and the Python that drives them; router and attention "
    "excluded), median over the calls of a repeat, then median over paired repeats. On a CPU the device work "
    "(the kernels) runs on the host too and is included; graph_call_us_per_layer is the part spent inside the "
    "compiled layer function (its kernels and the artefact's C++ runner), graph_python_us_per_layer the rest "
    "(the Python dispatch from the engine to it).")


def overhead_main(args) -> int:
    """Host time per MoE layer of the eager and the graph decode paths (``--overhead``; OVERHEAD_DEFINITION)."""
    from expertcast.data.synthetic import staged_traces

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    torch.set_num_threads(1)
    backend = args.compile_backend
    if backend == "auto":  # AOTInductor on the CPU; on CUDA torch.compile (the step is captured in a CUDA Graph)
        backend = "aoti" if device.type == "cpu" else "inductor"
    layers = args.overhead_layers
    cfg = get_config("qwen3_moe-tiny", hidden_size=16, moe_intermediate_size=16, intermediate_size=32,
                     num_experts=args.experts, num_experts_per_tok=args.top_k, num_hidden_layers=layers,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    runs, inner = {}, []
    for path in ("eager", "graph"):  # one model copy per path: both stay bound for the paired repeats
        model = build_from_config(cfg, seed=args.seed, dtype=torch.float32).to(device)
        om = OffloadedModel(model, make_policy("lru"), 0.5, pool=args.pool, device=device, decode_path=path)
        if path == "graph":
            om.graph.compile(backend)
            inner = _time_calls(om.graph, "layer_fn", cpu=False)
        runs[path] = (om, _time_calls(om, "_decode_layer"))
    syn = staged_traces(num_sequences=1, num_tokens=args.prompt + args.tokens, num_layers=layers,
                        num_experts=args.experts, top_k=args.top_k, num_stages=3, hot=max(args.top_k, args.experts // 5),
                        hot_mass=0.9, mean_stage_len=args.stage_len, prompt_len=args.prompt, seed=args.seed,
                        expert_bytes=runs["eager"][0].layout.expert_bytes, vocab=cfg.vocab_size)
    t0 = time.perf_counter()
    for om, _ in runs.values():  # warm-up (the graph path compiles here)
        om.replay(syn.sequences, max_decode=args.tokens)
    print(f"warm-up (graph layer function compiled with {backend}): {time.perf_counter() - t0:.1f} s")
    paired = []
    for _ in range(args.repeats):
        med = {}
        for path, (om, times) in runs.items():
            om.reset()
            times.clear()
            if path == "graph":
                inner.clear()
            om.replay(syn.sequences, max_decode=args.tokens)
            med[path] = 1e6 * float(np.median([t[0] for t in times]))
            med[f"{path}_cpu"] = 1e6 * float(np.median([t[1] for t in times]))
            med[f"{path}_min"] = 1e6 * float(min(t[0] for t in times))
            med[f"{path}_calls"] = len(times)
        med["graph_call"] = 1e6 * float(np.median([t[0] for t in inner]))
        med["graph_python"] = 1e6 * float(np.median([a[0] - b[0] for a, b in zip(runs["graph"][1], inner, strict=True)]))
        paired.append(med)
    hits = {p: float(om.stats.hit) for p, (om, _) in runs.items()}
    for om, _ in runs.values():
        om.close()

    def stat(k: str) -> tuple[float, float, float]:
        v = [m[k] for m in paired]
        return float(np.median(v)), float(min(v)), float(max(v))

    ratios = [m["graph"] / m["eager"] for m in paired]
    ratio = float(np.median(ratios))
    eager, graph = stat("eager")[0], stat("graph")[0]
    res = {"definition": OVERHEAD_DEFINITION,
           "eager_us_per_layer": eager, "graph_us_per_layer": graph, "graph_over_eager": ratio,
           "graph_over_eager_range": [float(min(ratios)), float(max(ratios))],
           "eager_us_per_layer_range": list(stat("eager")[1:]), "graph_us_per_layer_range": list(stat("graph")[1:]),
           "eager_cpu_us_per_layer": stat("eager_cpu")[0], "graph_cpu_us_per_layer": stat("graph_cpu")[0],
           "graph_call_us_per_layer": stat("graph_call")[0], "graph_python_us_per_layer": stat("graph_python")[0],
           "eager_min_us_per_layer": float(min(m["eager_min"] for m in paired)),
           "graph_min_us_per_layer": float(min(m["graph_min"] for m in paired)),
           "target_met": bool(ratio <= 0.2 and graph < 30.0), "paired_us": paired, "repeats": args.repeats,
           "layers": layers, "experts": args.experts, "top_k": args.top_k, "hidden": 16, "tokens": args.tokens,
           "policy": "lru", "capacity": 0.5, "pool": args.pool, "hit": hits, "device": str(device), "compile_backend": backend,
           "torch": torch.__version__, "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
           "command": args.command}
    rows = [{"path": p, "us_per_layer": v, "min_max_over_repeats": "{:.1f}-{:.1f}".format(*stat(p)[1:]),
             "thread_cpu_us_per_layer": stat(f"{p}_cpu")[0], "hit": hits[p]} for p, v in (("eager", eager),
                                                                                            ("graph", graph))]
    report(rows, title=f"host time per MoE layer (median of {args.repeats} paired repeats, {layers} layers, hidden 16, "
                       f"{args.pool} pool)")
    print(f"definition: {OVERHEAD_DEFINITION}")
    print(f"graph path split: {res['graph_call_us_per_layer']:.1f} us inside the compiled layer function "
          f"({backend}) + {res['graph_python_us_per_layer']:.1f} us Python dispatch (medians)")
    print(f"graph/eager = {ratio:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}; target <= 0.2), graph {graph:.1f} us "
          f"(target < 30 us): {'met' if res['target_met'] else 'NOT met'}; load average {res['load_avg']}")
    if args.json:
        atomic_write_json(args.json.path, res)
        args.json.written()
    return 0


def _time_calls(obj, name: str, cpu: bool = True) -> list[tuple[float, float]]:
    """Replace ``obj.name`` by a wrapper that appends (wall seconds, calling thread's CPU seconds) of each call to
    the returned list. The CPU time is the host work itself, which a loaded machine does not inflate.
    ``cpu=False``: wall time only (CPU time 0.0; a lighter wrapper, for a call nested in a timed one)."""
    fn, times = getattr(obj, name), []
    clock = time.perf_counter

    def timed(*a, **k):
        t0, c0 = clock(), time.thread_time()
        out = fn(*a, **k)
        times.append((clock() - t0, time.thread_time() - c0))
        return out

    def timed_wall(*a, **k):
        t0 = clock()
        out = fn(*a, **k)
        times.append((clock() - t0, 0.0))
        return out

    if not cpu:
        timed = timed_wall

    setattr(obj, name, timed)
    return times


def _median_of_repeats(rows: list[dict]) -> list[dict]:
    """One row per (policy, residency, link): the repeat with the median paired % of full-load (the lower middle
    one for an even count), with the spread of the cell's paired ratios."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["policy"], r["residency"], str(r["link_ratio"])), []).append(r)
    out = []
    for group in cells.values():
        ranked = sorted(group, key=lambda r: r["pct_full"])
        mid = dict(ranked[(len(ranked) - 1) // 2])
        mid["repeats"] = len(group)
        mid["pct_full_min"] = ranked[0]["pct_full"]
        mid["pct_full_max"] = ranked[-1]["pct_full"]
        mid.pop("repeat", None)
        out.append(mid)
    return out


def _truncate(seqs, tokens):
    from expertcast.data.trace_format import TraceSequence

    out = []
    for s in seqs:
        T = min(s.num_tokens, s.prompt_len + tokens)
        out.append(TraceSequence(s.seq_id, s.token_ids[:T], s.prompt_len, s.expert_ids[:T], s.expert_weights[:T]))
    return out


def _plot(rows, path: Path, args) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = sorted({r["link_ratio"] for r in rows}, key=str)
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 4), squeeze=False)
    for ax, ratio in zip(axes[0], ratios, strict=True):
        for pol in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["residency"], r["pct_full"]) for r in rows if r["policy"] == pol and r["link_ratio"] == ratio)
            if pts:
                ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
        ax.axhline(80, color="gray", ls="--", lw=0.8)
        ax.set_title(f"transfer = {ratio}x layer compute" if ratio != "real" else "real link")
        ax.set_xlabel("residency (% of experts)")
        ax.set_ylabel("% of full-load tokens/s")
        ax.set_ylim(0, 110)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
