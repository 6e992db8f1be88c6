"""The disk tier's benchmark (docs/design.md, "Disk tier"): the machine's figures and every policy's speed, in one run.

:func:`run_bench` measures, in this order and in the same process:

(i) the disk's direct-read bandwidth: a temporary file of ``disk_mb`` in the output folder (written, flushed,
    dropped from the page cache), read with ``O_DIRECT`` (else buffered + DONTNEED, named) in blocks of one
    padded expert row at random offsets by ``readers`` threads (the reader pool's queue depth), then deleted;
(ii) RAM copy bandwidth (``torch`` copy of a 256 MB buffer, best of 5);
(iii) the expert GEMM rate at the model's expert shape and dtype (one expert's gate/up + down projections
    for 1 and 64 tokens), with the kernel oneDNN reports for a bf16 matmul of that shape
    (``ONEDNN_VERBOSE=1`` in a subprocess) and the CPU's relevant ``/proc/cpuinfo`` flags
    (:mod:`expertcast.inference.runtime.machine`);
then per policy and RAM budget a forced-routing replay of the traces through the disk store
(:class:`~expertcast.inference.runtime.disk_store.ReaderPoolEngine`), in paired passes: all-in-RAM baseline,
policy, baseline, ... (``repeats`` policy passes, each against the mean of its neighbouring baselines; median and
min-max). The all-in-RAM baseline is the runtime with every expert resident in RAM slots (capacity 1.0, warmed):
the same expert kernels as the disk runs, so the ratio is what the disk costs; the plain model's forced replay
(transformers' experts kernel, :class:`~expertcast.inference.runtime.forced.FullLoadReplayer`) is reported beside
it. The *bound* of a policy is the speed its own measured loads allow with full I/O-compute overlap:
``1 / max(reads per token x expert bytes / disk bandwidth, 1 / baseline tokens/s)``; ``achieved_vs_bound`` is
the policy's tokens/s over it. Beside it, the *dependency-aware bound* (:func:`dependency_bound_seconds`,
:data:`DEP_BOUND_FORMULA`): a demand miss's read starts when its layer is routed, so it can overlap only that
layer's compute of the experts already there (and the other reads at the pool's depth), while a prefetch may
overlap any compute; from the run's own per-layer-execution counts. ``achieved_vs_dep_bound`` is the tokens/s over
it (docs/design.md, "Compute order").
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.inference.runtime.disk_store import ALIGN, round_up
from expertcast.inference.runtime.loading import RSS_MARGIN_BYTES
from expertcast.inference.runtime.machine import (
    CPU_FLAGS,
    MachineFigures,
    cpu_info,
    disk_bandwidth,
    gemm_kernel,
    gemm_rate,
    ram_bandwidth,
)
from expertcast.inference.runtime.stats import release_memory, reset_peak_rss
from expertcast.utils.provenance import code_version


@dataclass
class BenchConfig:
    """Settings of one :func:`run_bench`."""

    out: str
    """Output folder (JSON, CSV, PNG; the disk store file and the temporary bandwidth file live here)."""
    model: str | None = None
    """A model to benchmark (preset, ``tiny-default``, local directory; loaded in RAM, its experts then written to
    the disk store) instead of the random-weight Qwen3-MoE of the shape below."""
    hidden: int = 256
    """Model hidden size (random-weight Qwen3-MoE of this shape)."""
    moe_intermediate: int = 128
    experts: int = 16
    top_k: int = 4
    layers: int = 4
    dtype: str = "bfloat16"
    policies: tuple[str, ...] = ("lru", "lfu", "static")
    budgets: tuple[float, ...] = (0.10, 0.25, 0.45)
    """RAM budgets: fractions of all L*E experts held in slots (at least top-K per layer)."""
    readers: int = 4
    repeats: int = 3
    """Policy passes per cell (each between two baseline passes)."""
    sequences: int = 2
    tokens: int = 32
    """Decode steps per sequence."""
    prompt: int = 4
    traces: str | None = None
    """Recorded trace directory of the model's shape (default: synthetic Zipf routing)."""
    forecaster: str | None = None
    """Forecaster export: adds the seqmoe policy."""
    baseline_model: str | None = None
    """A ``build-shape --layers N`` subset of ``model`` (same shape and seed: its layers are the first N of the
    model, weight for weight) for when the model's experts do not fit RAM: every policy also runs on the subset,
    in paired passes against the subset's all-in-RAM run (the like-for-like % of full speed), and the model's
    all-in-RAM speed is scaled from the subset's (:func:`scaled_full_seconds`)."""
    seq_ids: tuple[str, ...] = ()
    """Replay these sequences of ``traces`` (default: the first ``sequences``)."""
    calib_sequences: int = 16
    """Sequences of the trace set that are not replayed, on which ``static`` is calibrated (held out)."""
    full_repeats: int = 1
    """Passes per cell of the full-depth model when a ``baseline_model`` subset carries the paired %."""
    disk_mb: int = 256
    """Size of the temporary file of the disk bandwidth measurement."""
    threads: int = 1
    """torch compute threads."""
    seed: int = 0


# --------------------------------------------------------------------------------------------- the replay grid
def trim_sequence(s, prompt: int, tokens: int):
    """``s`` cut to its last ``prompt`` prompt positions and its first ``tokens`` decode positions (the prefill
    of a long prompt would read most of a real-shape store before the measured decode)."""
    from expertcast.data.trace_format import TraceSequence

    a = max(s.prompt_len - prompt, 0)
    b = min(s.num_tokens, s.prompt_len + tokens)
    return TraceSequence(s.seq_id, s.token_ids[a:b], s.prompt_len - a, s.expert_ids[a:b], s.expert_weights[a:b],
                         None if s.router_probs is None else s.router_probs[a:b])


def _traces(cfg: BenchConfig, L: int, E: int, K: int, expert_bytes: int):
    """(meta, sequences, calibration, source) at the model's L/E/K (recorded traces laid on by
    :func:`~expertcast.inference.runtime.forced.map_trace_to_model`), each replayed sequence cut to
    ``cfg.prompt`` prompt and ``cfg.tokens`` decode positions; ``calibration``: up to ``cfg.calib_sequences``
    other sequences of the same trace set (never replayed), what ``static`` is calibrated on (held out, so that
    it does not see the routing it is scored on)."""
    if cfg.traces:
        from expertcast.data.traces import load_traces
        from expertcast.inference.runtime.forced import map_trace_to_model

        meta, every = load_traces(cfg.traces)
        seqs = every
        if cfg.seq_ids:
            by_id = {s.seq_id: s for s in seqs}
            missing = [i for i in cfg.seq_ids if i not in by_id]
            if missing:
                raise ValueError(f"{cfg.traces}: no sequence {missing[0]!r}")
            seqs = [by_id[i] for i in cfg.seq_ids]
        seqs = [s for s in seqs if s.num_tokens - s.prompt_len >= 4][: len(cfg.seq_ids) or cfg.sequences]
        if not seqs:
            raise ValueError(f"{cfg.traces}: no sequence with at least 4 decoded positions")
        replayed = {s.seq_id for s in seqs}
        calib = [s for s in every if s.seq_id not in replayed][: cfg.calib_sequences]
        seqs = [trim_sequence(s, cfg.prompt, cfg.tokens) for s in seqs]
        meta_m, seqs, mapping = map_trace_to_model(meta, seqs, L, E, K)
        if calib:
            _, calib, _ = map_trace_to_model(meta, calib, L, E, K)
        return meta_m, seqs, calib, f"recorded traces {cfg.traces} ({'; '.join(mapping.lines())})"
    from expertcast.data.synthetic import zipf_traces

    # one draw of the Zipf popularity: the first ``sequences`` are replayed (the same as a draw of only those), the
    # others calibrate static
    syn = zipf_traces(num_sequences=cfg.sequences + cfg.calib_sequences, num_tokens=cfg.prompt + cfg.tokens,
                      num_layers=L, num_experts=E, top_k=K, prompt_len=cfg.prompt, seed=cfg.seed)
    every = list(syn.sequences)
    return syn.meta, every[:cfg.sequences], every[cfg.sequences:], "synthetic zipf routing"


def check_held_out(calibration, replayed) -> None:
    """ValueError (one line) unless ``calibration`` is non-empty and shares no sequence with ``replayed``."""
    if not calibration:
        raise ValueError("static: no held-out sequence to calibrate on (every sequence of the trace set is replayed; "
                         "replay fewer or use a larger set)")
    both = sorted({s.seq_id for s in calibration} & {s.seq_id for s in replayed})
    if both:
        raise ValueError(f"static: its calibration overlaps the replayed sequences ({len(both)}, e.g. {both[0]!r})")


def start_of(policy, cache_config) -> str:
    """``warm`` when the policy places experts before anything runs (:meth:`Policy.warm_start`, e.g. static's
    placement), else ``cold``; either way the prompt's routing is then replayed through it (uncounted) before the
    measured decode."""
    from expertcast.inference.cache.expert_cache import ExpertCache

    return "warm" if len(policy.warm_start(ExpertCache(cache_config))) else "cold"


def _policy(name: str, cfg: BenchConfig, meta, seqs, link_bytes_per_s: float, layer_ms: float, stream=None,
            calibration=()):
    """(policy, future): ``static`` calibrated on ``calibration`` (held-out sequences, :func:`check_held_out`),
    ``seqmoe`` told the measured disk rate and per-layer compute (its deadlines), an oracle (``belady``: the
    protect-rule plan) given the replayed access stream."""
    from expertcast.inference.policies import make_policy, policy_spec

    if name == "static":
        check_held_out(calibration, seqs)
        return make_policy("static", calibration=list(calibration)), None
    if name == "seqmoe":
        return make_policy("seqmoe", forecaster=cfg.forecaster, link_bytes_per_s=link_bytes_per_s,
                           layer_compute_ms=max(layer_ms, 1e-3)), None
    future = None
    if "future" in policy_spec(name).needs:
        if stream is None:
            raise ValueError(f"{name} is an oracle: run_bench needs stream= (e.g. simulator.build_stream) to give it "
                             f"the replayed access stream")
        future = stream(meta, seqs, 1)
    return make_policy(name), future


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for every family the runtime
    offloads)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)


def layer_share(om, seqs, repeats: int = 3) -> tuple[float, float]:
    """(seconds per decoded token, share of it spent inside the decoder layers) of ``om``'s forced replay of
    ``seqs``, medians of ``repeats`` replays. The share is timed by hooks on every decoder layer during the decode
    steps only (the prompt's prefill is not counted), so what does not grow with depth (embedding, final norm, LM
    head, the per-token driver and sampling work) is measured, not assumed."""
    layers = decoder_layers(om.model)
    acc = {"s": 0.0}
    t0: dict[int, float] = {}

    def decoding() -> bool:
        rs = getattr(om, "_run", None)
        return rs is not None and not rs.prefill

    def pre(mod, args, kwargs=None):
        if decoding():
            t0[id(mod)] = time.perf_counter()

    def post(mod, args, out, kwargs=None):
        start = t0.pop(id(mod), None)
        if start is not None:
            acc["s"] += time.perf_counter() - start

    handles = [h for m in layers for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    per_tok, shares = [], []
    try:
        for _ in range(repeats):
            acc["s"] = 0.0
            st = om.replay(seqs)
            tok = max(st.decoded_tokens, 1)
            s_tok = 1.0 / st.tokens_per_s
            per_tok.append(s_tok)
            shares.append(min(acc["s"] / tok / s_tok, 1.0))
    finally:
        for h in handles:
            h.remove()
    return float(np.median(per_tok)), float(np.median(shares))


def scaled_full_seconds(sub_seconds: float, share: float, sub_layers: int, full_layers: int) -> float:
    """Per-token seconds of the full-depth model all in RAM, from its ``sub_layers``-layer subset's ``sub_seconds``
    of which ``share`` is spent inside the decoder layers (:func:`layer_share`):
    ``subset x ((1 - share) + share x full_layers / sub_layers)`` (decoder layers cost alike: attention + the MLP a
    token computes, a dense layer's MLP about the weight of a MoE layer's active experts)."""
    return sub_seconds * ((1.0 - share) + share * full_layers / max(sub_layers, 1))


def _fingerprint(seqs) -> str:
    from expertcast.utils.provenance import trace_fingerprint

    return trace_fingerprint([s.seq_id for s in seqs], [np.asarray(s.expert_ids).tobytes() for s in seqs])


def _non_expert_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.device.type == "meta":
            continue
        seen.add(id(t))
        n += t.numel() * t.element_size()
    return n


def check_subset(model_dir: str, subset_dir: str) -> str:
    """A line saying why ``subset_dir``'s layers are the first layers of ``model_dir``, weight for weight (both
    ``build-shape`` outputs of one shape, seed, dtype and overrides; each tensor is seeded by its name,
    :func:`~expertcast.inference.runtime.real_shapes.tensor_values`); ValueError (one line) when they are not."""
    from expertcast.inference.runtime.real_shapes import read_provenance

    a, b = read_provenance(model_dir), read_provenance(subset_dir)
    if a is None or b is None:
        raise ValueError(f"--baseline-model {subset_dir}: both it and --model must be build-shape outputs "
                         f"(build_shape.json) so that the subset's weights are the model's first layers")
    for k in ("shape", "seed", "dtype", "overrides"):
        if a.get(k) != b.get(k):
            raise ValueError(f"--baseline-model {subset_dir}: {k} {b.get(k)!r} differs from the model's {a.get(k)!r}")
    la = a["config"]["num_hidden_layers"]
    lb = b["config"]["num_hidden_layers"]
    if lb >= la:
        raise ValueError(f"--baseline-model {subset_dir}: {lb} layers is not a subset of the model's {la}")
    return (f"subset: build-shape {b['shape']} --layers {lb} seed {b['seed']} (the model's first {lb} of {la} "
            f"decoder layers; every tensor seeded by its name: identical weights)")


def _load_streamed(path: str, cfg: BenchConfig, disk_path: Path, capacity: float):
    """(model with experts on the meta device, DiskExpertStore, LoadReport): ``path`` streamed to the disk store,
    never materialised."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.loading import load_offloaded

    om, _, load = load_offloaded(path, make_policy("lru"), capacity, dtype=cfg.dtype, store="disk",
                                 disk_path=disk_path, readers=cfg.readers)
    om.close()
    return om.model, om.store, load


DEP_BOUND_FORMULA = ("dependency-aware bound: 1 / max(t_RAM + sum over counted layer-executions of max(0, d x/B + c - "
                     "n c) / tokens, (D + P) x/B / tokens), t_RAM = all-in-RAM s/token, d = the layer-execution's "
                     "demand misses (their reads start when the layer is routed and overlap only that layer's compute "
                     "of the n experts it computes; the last lands after d x/B at the earliest, then one expert's "
                     "compute c follows), x/B = expert bytes / B, B = max(disk bandwidth at the reader pool's queue "
                     "depth, the run's own achieved read bandwidth), c = "
                     "one expert's measured compute at 1 token; prefetch reads (D + P counts them) overlap any compute, "
                     "late prefetches count as there")


def dependency_bound_seconds(st, xbytes: int, disk_bytes_per_s: float, expert_s: float, full_s: float) -> float:
    """Per-token seconds no run with ``st``'s counters can beat (:data:`DEP_BOUND_FORMULA`): a demand miss is read
    only once its layer is routed, so its read overlaps that layer's other experts and nothing else; from the run's
    per-layer-execution record (:attr:`~expertcast.inference.cache.counters.Counters.layer_execs`)."""
    tok = max(st.decoded_tokens, 1)
    read_s = xbytes / disk_bytes_per_s
    exposed = sum(max(0.0, d * read_s + expert_s - n * expert_s) for _, n, d in st.layer_execs if d)
    return max(full_s + exposed / tok, st.reads * read_s / tok)


def _row(name, budget, cap, st, slots, xbytes, disk_gbps, full_s, expert_s, extra):
    tok = max(st.decoded_tokens, 1)
    io_s = st.reads / tok * xbytes / (disk_gbps * 1e9)
    bound = 1.0 / max(io_s, full_s)
    m = st.metrics()
    # the disk gave this run's reads at least their achieved rate (a host-side cache of a re-read store can beat the
    # one-pass measurement): a bound at a lower rate would not bound
    rate = max(disk_gbps, m["read_gbps"] if m["read_gbps"] == m["read_gbps"] else 0.0) * 1e9
    dep = 1.0 / dependency_bound_seconds(st, xbytes, rate, expert_s, full_s)
    return {"policy": name, "budget": float(budget), "capacity": cap, "slots": slots,
            "tokens_per_s": st.tokens_per_s, "hit": st.hit,
            "exposed_misses_per_token": m["exposed_misses_per_token"],
            "miss_free_token_frac": m["miss_free_token_frac"], "read_mb_per_token": m["read_mb_per_token"],
            "read_gbps": m["read_gbps"], "read_vs_disk": m["read_gbps"] / disk_gbps, "io_overlap": m["io_overlap"],
            "reads_per_token": st.reads / tok, "bound_tokens_per_s": bound,
            "achieved_vs_bound": st.tokens_per_s / bound, "dep_bound_tokens_per_s": dep,
            "achieved_vs_dep_bound": st.tokens_per_s / dep, "reads": st.reads, "loads": st.D + st.P,
            "late_prefetches": int(st.late.sum()), "decoded_tokens": st.decoded_tokens, **extra}


def _paired_grid(cfg, model, disk, base, meta, seqs, policies, K, E, xbytes, disk_gbps, L, expert_s, stream=None,
                 calib=()):
    """Per budget and policy: ``cfg.repeats`` policy passes through ``disk``, each between two passes of the
    all-in-RAM ``base`` (the paired % of full speed: median, min-max)."""
    def baseline() -> float:
        return base.replay(seqs).tokens_per_s

    rows, skipped = [], {}
    for budget in cfg.budgets:
        cap = max(float(budget), K / E + 1e-9)
        for name in policies:
            b_prev = baseline()
            ratios, speeds, stats = [], [], []
            for _ in range(cfg.repeats):
                try:
                    pol, fut = _policy(name, cfg, meta, seqs, disk_gbps * 1e9, 1e3 / b_prev / L, stream, calib)
                    om = OffloadedModel_(model, pol, cap, store=disk, readers=cfg.readers, future=fut)
                except ValueError as e:
                    skipped[name] = " ".join(str(e).split())
                    break
                start = start_of(pol, om.cache_config)
                st = om.replay(seqs)
                om.close()
                b_next = baseline()
                speeds.append(st.tokens_per_s)
                ratios.append(st.tokens_per_s / (0.5 * (b_prev + b_next)))
                stats.append((st, om.cache.num_slots, 0.5 * (b_prev + b_next)))
                del om  # its slots go before the next pass allocates its own
                b_prev = b_next
            if not stats:
                continue
            i_med = int(np.argsort(speeds)[len(speeds) // 2])
            st, slots, b = stats[i_med]
            rows.append(_row(name, budget, cap, st, slots, xbytes, disk_gbps, 1.0 / b, expert_s, {
                "pct_full": 100 * float(np.median(ratios)), "pct_full_min": 100 * min(ratios),
                "pct_full_max": 100 * max(ratios), "full_tokens_per_s": b, "start": start}))
    return rows, skipped


def _partial(out: Path, rows: list, sub_rows: list) -> None:
    """The rows so far (``bench_disk.partial.json``, removed when the run completes): a long real-shape run
    that dies keeps what it measured."""
    from expertcast.utils.io import atomic_write_json

    atomic_write_json(out / "bench_disk.partial.json", {"rows": rows, "subset_rows": sub_rows})


def OffloadedModel_(*args, **kwargs):  # noqa: N802 (the runtime, imported late)
    from expertcast.inference.runtime.engine import OffloadedModel

    return OffloadedModel(*args, **kwargs)


def run_bench(cfg: BenchConfig, stream: Any = None) -> dict[str, Any]:
    """Measure everything (see the module docstring); write ``bench_disk.json``, ``bench_disk.csv``,
    ``bench_disk.png`` under ``cfg.out``; return the JSON record. ``stream``: ``(meta, sequences, batch) ->
    AccessStream`` for oracle policies (``simulator.build_stream``; this room does not import the simulator)."""

    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store_from
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.forced import FullLoadReplayer, map_trace_to_model
    from expertcast.inference.runtime.loading import peak_rss_bytes
    from expertcast.inference.runtime.store import HostExpertStore, find_experts_modules
    from expertcast.models.presets import build_from_config, get_config

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.dtype)
    disk_path = out / "experts.disk.safetensors"
    streamed = bool(cfg.model) and Path(cfg.model).is_dir()
    subset_note = check_subset(cfg.model, cfg.baseline_model) if (streamed and cfg.baseline_model) else None
    load_report = None
    mcfg = None
    if streamed:  # a checkpoint folder: streamed to the disk store, never materialised
        model, disk, load_report = _load_streamed(cfg.model, cfg, disk_path, min(cfg.budgets))
        c = model.config.get_text_config()
        refs = find_experts_modules(model)
        cfg.hidden, cfg.moe_intermediate = int(c.hidden_size), int(c.moe_intermediate_size)
        cfg.experts = disk.num_experts
        cfg.top_k = int(getattr(c, "num_experts_per_tok", None) or c.top_k)
        xbytes = disk.expert_bytes
        w0 = disk.views(0, 0)
    else:
        if cfg.model:
            from expertcast.models.backbone import load_moe_model

            model, _ = load_moe_model(cfg.model, dtype=dtype)
            c = model.config.get_text_config()
            cfg.hidden, cfg.moe_intermediate = int(c.hidden_size), int(c.moe_intermediate_size)
            cfg.experts, cfg.top_k = int(c.num_experts), int(c.num_experts_per_tok)
        else:
            mcfg = get_config("qwen3_moe-tiny", hidden_size=cfg.hidden, moe_intermediate_size=cfg.moe_intermediate,
                              intermediate_size=2 * cfg.moe_intermediate, num_experts=cfg.experts,
                              num_experts_per_tok=cfg.top_k, num_hidden_layers=cfg.layers, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=max(cfg.hidden // 4, 8))
            model = build_from_config(mcfg, seed=cfg.seed, dtype=dtype)
        refs = find_experts_modules(model)
        ram_store = HostExpertStore.from_model(model, refs=refs)
        xbytes = ram_store.expert_bytes
        write_disk_store_from(ram_store, disk_path, [r.name for r in refs])
        w0 = ram_store.views(0, 0)
        disk = None
    L, E, K = len(refs), cfg.experts, cfg.top_k
    cfg.layers = L
    meta, seqs, calib, source = _traces(cfg, L, E, K, xbytes)

    # (i)-(iii): the machine
    stride = round_up(xbytes, ALIGN)
    disk_gbps, disk_mode = disk_bandwidth(out, cfg.disk_mb, stride, cfg.readers, cfg.seed)
    ram_gbps = ram_bandwidth()
    g1, ms1 = gemm_rate(refs[0].module, w0, cfg.hidden, 1)
    g64, _ = gemm_rate(refs[0].module, w0, cfg.hidden, 64)
    cpu_model, flags = cpu_info()
    kernel = gemm_kernel(cfg.hidden, cfg.moe_intermediate, cfg.dtype, cfg.threads)
    mach = MachineFigures(disk_gbps, disk_mode, stride, cfg.readers, ram_gbps, g1, g64, ms1, kernel, flags, cpu_model)
    del w0
    if not streamed:
        del ram_store
    policies = list(cfg.policies) + (["seqmoe"] if cfg.forecaster and "seqmoe" not in cfg.policies else [])

    # the baseline: the all-in-RAM model under the same forced routing (the subset's when the model does not fit)
    from expertcast.models.backbone import load_moe_model

    if cfg.baseline_model:
        base_model, _ = load_moe_model(cfg.baseline_model, dtype=dtype)
    elif cfg.model:
        base_model, _ = load_moe_model(cfg.model, dtype=dtype)
    else:
        base_model = build_from_config(copy.deepcopy(mcfg), seed=cfg.seed, dtype=dtype)  # own config: the runtime
        # sets the experts implementation on its model's config
    L_b = len(find_experts_modules(base_model))
    meta_b, seqs_b, calib_b = meta, seqs, calib
    if L_b < L:
        meta_b, seqs_b, _ = map_trace_to_model(meta, seqs, L_b, E, K, truncate_layers=True)
        if calib:
            _, calib_b, _ = map_trace_to_model(meta, calib, L_b, E, K, truncate_layers=True)
    plain = FullLoadReplayer(base_model)  # the plain model (transformers' experts kernel), reported once
    plain.replay(seqs_b)
    plain_tps = plain.replay(seqs_b).tokens_per_s
    base_model = plain.close()
    n_dec_full = int(model.config.get_text_config().num_hidden_layers)
    n_dec_sub = int(base_model.config.get_text_config().num_hidden_layers)
    # the runtime with every expert resident in RAM slots (the same kernels as the disk runs, so the ratio is the
    # cost of the disk), warmed so that every routed expert is in its slot
    base = OffloadedModel(base_model, make_policy("lru"), 1.0)
    base.replay(seqs_b)

    skipped: dict[str, str] = {}
    sub_rows: list[dict[str, Any]] = []
    rss_bound = {}
    if subset_note:  # every policy also on the subset, paired against the subset's all-in-RAM run
        sub_path = out / "subset.disk.safetensors"
        sub_model, sub_disk, _ = _load_streamed(cfg.baseline_model, cfg, sub_path, min(cfg.budgets))
        sub_rows, skipped = _paired_grid(cfg, sub_model, sub_disk, base, meta_b, seqs_b, policies, K, E, xbytes,
                                         disk_gbps, L_b, ms1 * 1e-3, stream, calib_b)
        base_s, share = layer_share(base, seqs_b)
        full_s = scaled_full_seconds(base_s, share, n_dec_sub, n_dec_full)
        _partial(out, [], sub_rows)
        sub_disk.close()
        sub_path.unlink()
        del sub_model, sub_disk
        base.close()
        del base, base_model, plain
        release_memory()
        rows = []
        sub_by = {(r["policy"], r["budget"]): r for r in sub_rows}
        non_expert = _non_expert_bytes(model)
        for budget in cfg.budgets:
            cap = max(float(budget), K / E + 1e-9)
            for name in policies:
                runs = []
                for _ in range(cfg.full_repeats):
                    try:
                        pol, fut = _policy(name, cfg, meta, seqs, disk_gbps * 1e9, 1e3 * full_s / L, stream, calib)
                        om = OffloadedModel(model, pol, cap, store=disk, readers=cfg.readers, future=fut)
                    except ValueError as e:
                        skipped[f"{name} (full depth)"] = " ".join(str(e).split())
                        break
                    start = start_of(pol, om.cache_config)
                    reset_peak_rss()
                    st = om.replay(seqs)
                    om.close()
                    runs.append((st, om.cache.num_slots, om.pool.nbytes, peak_rss_bytes()))
                    del om, pol, fut  # the slots go before the next cell allocates its own
                    release_memory()
                if not runs:
                    continue
                i_med = int(np.argsort([r[0].tokens_per_s for r in runs])[len(runs) // 2])
                st, slots, pool_bytes, rss = runs[i_med]
                sub = sub_by.get((name, float(budget)), {})
                bound_b = pool_bytes + non_expert + RSS_MARGIN_BYTES
                rows.append(_row(name, budget, cap, st, slots, xbytes, disk_gbps, full_s, ms1 * 1e-3, {
                    "pct_full": sub.get("pct_full", float("nan")), "pct_full_min": sub.get("pct_full_min", float("nan")),
                    "pct_full_max": sub.get("pct_full_max", float("nan")),
                    "pct_full_scaled": 100 * st.tokens_per_s * full_s, "full_tokens_per_s": 1.0 / full_s,
                    "sub_tokens_per_s": sub.get("tokens_per_s", float("nan")),
                    "sub_achieved_vs_bound": sub.get("achieved_vs_bound", float("nan")),
                    "sub_achieved_vs_dep_bound": sub.get("achieved_vs_dep_bound", float("nan")),
                    "peak_rss_gb": rss / 1e9, "rss_bound_gb": bound_b / 1e9, "start": start}))
                rss_bound[f"{name}@{budget}"] = bound_b
                _partial(out, rows, sub_rows)
        baseline_note = (f"{subset_note}; % of full speed (pct_full) is paired on the subset: its policy passes "
                         f"through its own disk store, each between two all-in-RAM passes of it; the full-depth "
                         f"all-in-RAM speed is scaled: t_full = t_subset x ((1 - f) + f x {n_dec_full}/{n_dec_sub} decoder "
                         f"layers), f = {share:.3f} the measured share of a decode step inside the decoder layers "
                         f"(hooks on each layer; the rest: embedding, final norm, LM head, per-token work), "
                         f"t_subset = {1e3 * base_s:.2f} ms -> {1e3 * full_s:.1f} ms/token")
    else:
        disk = disk or DiskExpertStore(disk_path)
        rows, skipped = _paired_grid(cfg, model, disk, base, meta, seqs, policies, K, E, xbytes, disk_gbps, L,
                                     ms1 * 1e-3, stream, calib)
        base.close()
        baseline_note = "the runtime with every expert resident in RAM slots (same kernels), paired passes"
    disk.close()
    disk_path.unlink()  # the disk has room for one real-shape store at a time: build, measure, delete
    record = {
        "machine": asdict(mach),
        "model": {"name": cfg.model or "random-weight qwen3_moe", "L": L, "E": E, "K": K, "hidden": cfg.hidden,
                  "moe_intermediate": cfg.moe_intermediate, "dtype": cfg.dtype, "expert_bytes": xbytes,
                  "disk_store_bytes": L * E * stride, "decoder_layers": n_dec_full},
        "rows": rows,
        "subset_rows": sub_rows,
        "skipped": skipped,
        "plain_model_tokens_per_s": plain_tps,
        "baseline": baseline_note,
        "peak_rss_bytes": peak_rss_bytes(),
        "load": load_report.to_dict() if load_report is not None else None,
        "bound_definition": "1 / max(reads/token x expert bytes / disk GB/s, all-in-RAM s/token): the policy's "
                            "own loads at the measured disk bandwidth (reader pool's queue depth) with full "
                            "I/O-compute overlap (the issue's bound; a demand miss cannot have it)",
        "dep_bound_definition": DEP_BOUND_FORMULA,
        "provenance": {"settings": asdict(cfg), "routing": source, "routing_fingerprint": _fingerprint(seqs),
                       "sequences": [s.seq_id for s in seqs],
                       "static_calibration": [s.seq_id for s in calib] if "static" in policies else [],
                       "code_version": code_version(),
                       "torch": torch.__version__, "python": sys.version.split()[0],
                       "forecaster_hash": _export_hash(cfg.forecaster), "host": platform.node(),
                       "scheduling": _sched()},
    }
    _write(out, record)
    (out / "bench_disk.partial.json").unlink(missing_ok=True)
    return record


def _sched() -> str:
    try:
        pol = os.sched_getscheduler(0)
        return {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_RR: "SCHED_RR", os.SCHED_FIFO: "SCHED_FIFO"}.get(pol, str(pol)) \
            + f" priority {os.sched_getparam(0).sched_priority}"
    except (AttributeError, OSError):
        return "unknown"


def _export_hash(path: str | None) -> str | None:
    if not path:
        return None
    from expertcast.utils.provenance import sha256_files

    return sha256_files(path)


COLUMNS = ["policy", "budget", "start", "slots", "tokens_per_s", "pct_full", "pct_full_min", "pct_full_max", "pct_full_scaled",
           "sub_tokens_per_s", "hit", "reads_per_token", "exposed_misses_per_token", "miss_free_token_frac",
           "read_mb_per_token", "read_gbps", "read_vs_disk", "io_overlap", "late_prefetches", "bound_tokens_per_s",
           "achieved_vs_bound", "dep_bound_tokens_per_s", "achieved_vs_dep_bound", "sub_achieved_vs_bound",
           "sub_achieved_vs_dep_bound", "peak_rss_gb", "rss_bound_gb"]


def _write(out: Path, record: dict[str, Any]) -> None:
    from expertcast.utils.io import atomic_write_json, print_table, save_figure, write_csv

    m = record["machine"]
    print(f"disk: {m['disk_gbps']:.2f} GB/s ({m['disk_io_mode']}, {m['disk_block_bytes']} B blocks, queue depth "
          f"{m['disk_queue_depth']}); RAM copy: {m['ram_copy_gbps']:.2f} GB/s; expert GEMM: {m['gemm_gflops_1']:.1f} "
          f"GFLOP/s at 1 token ({m['expert_ms_1']:.3f} ms), {m['gemm_gflops_64']:.1f} at 64; kernel {m['gemm_kernel']}; "
          f"CPU {m['cpu_model']} flags {','.join(m['cpu_flags']) or 'none of ' + ','.join(CPU_FLAGS)}")
    print(f"all-in-RAM baseline: {record['baseline']}; the plain model's forced replay: "
          f"{record['plain_model_tokens_per_s']:.1f} tokens/s")
    print(f"routing: {record['provenance']['routing']}; sequences {record['provenance']['sequences']}; "
          f"scheduling {record['provenance']['scheduling']}")
    cal = record["provenance"].get("static_calibration")
    if cal:
        print(f"static: calibrated on {len(cal)} held-out sequences of the trace set (none replayed); start: warm = "
              f"placed before the prompt, cold = empty; every policy then replays the prompt's routing (uncounted)")
    if any(r["policy"].startswith("belady") for r in record["rows"]):
        print("belady: the protect-rule plan, starting cold with its prompt replay shaped by its own rule (not the "
              "simulator's demand-only ceiling, whose every batch's decode starts from the best cache for free)")
    print(f"bound: {record['bound_definition']}")
    if "dep_bound_definition" in record:
        print(record["dep_bound_definition"])
    for k, v in record.get("skipped", {}).items():
        print(f"not run: {k}: {v}")
    cols = [c for c in COLUMNS if any(c in r for r in record["rows"])]
    md = record["model"]
    print_table(record["rows"], title=f"disk tier: forced-routing replay through the disk store ({md['name']}, "
                f"L={md['L']} E={md['E']} K={md['K']}, {md['expert_bytes'] / 1e6:.2f} MB/expert)", columns=cols, floatfmt="{:.3g}")
    atomic_write_json(out / "bench_disk.json", record)
    write_csv(out / "bench_disk.csv", record["rows"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = record["rows"]
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        rs = [r for r in rows if r["policy"] == name]
        x = [100 * r["budget"] for r in rs]
        c = f"C{i}"
        ax.plot(x, [r["tokens_per_s"] for r in rs], "o-", color=c, label=name)
        ax.plot(x, [r["bound_tokens_per_s"] for r in rs], "--", color=c, alpha=0.6, label=f"{name} bound")
        if all("dep_bound_tokens_per_s" in r for r in rs):
            ax.plot(x, [r["dep_bound_tokens_per_s"] for r in rs], ":", color=c, alpha=0.6,
                    label=f"{name} dependency-aware bound")
    budgets = sorted({100 * r["budget"] for r in rows})
    full = [float(np.median([r["full_tokens_per_s"] for r in rows if 100 * r["budget"] == b])) for b in budgets]
    ax.plot(budgets, full, "k-", label="all experts in RAM")
    ax.set_xlabel("RAM budget (% of experts)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"disk tier, disk {m['disk_gbps']:.2f} GB/s")
    ax.legend(fontsize=7)
    save_figure(fig, out / "bench_disk.png")
    print(f"wrote {out / 'bench_disk.json'}, bench_disk.csv, bench_disk.png")


def quick_config(out: str) -> BenchConfig:
    """A tiny shape that runs in seconds (CI)."""
    return BenchConfig(out=out, hidden=64, moe_intermediate=32, experts=16, top_k=4, layers=2, sequences=1,
                       tokens=12, repeats=2, budgets=(0.25, 0.45), disk_mb=8, readers=2)

