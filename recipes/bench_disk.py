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
policy, baseline, ... (``repeats`` rounds, each running every policy once, in an order rotated and reversed by round: :func:`round_order`; each
pass against the mean of its neighbouring baselines; median and min-max). ``vs_ref`` is a policy's tokens/s over
``lru``'s in the same round (median, min-max over rounds: :func:`paired_vs_ref`), the side-by-side ratio; the
``sim_*`` columns are the simulator's figures for the same cell (:func:`simulated`). The all-in-RAM baseline is the
runtime with every expert resident in RAM slots (capacity 1.0, warmed):
the same expert kernels as the disk runs, so the ratio is what the disk costs; the plain model's forced replay
(transformers' experts kernel, :class:`~expertcast.inference.runtime.forced.FullLoadReplayer`) is reported beside
it. The *bound* of a policy
is the speed its own measured loads allow with full I/O-compute overlap:
``1 / max(reads per token x expert bytes / B, min(baseline s/token, the run's own))``, B the largest of the
one-pass disk measurement (read for at least ``disk_seconds`` at the reader pool's depth) and every run's achieved
read rate (``disk_gbps_source`` names which): a figure any run beat would not bound. ``achieved_vs_bound`` is
the policy's tokens/s over it. Beside it, the *dependency-aware bound* (:func:`dependency_bound_seconds`,
:data:`DEP_BOUND_FORMULA`): a demand miss's read starts when its layer is routed, so it can overlap only that
layer's compute of the experts already there (and the other reads at the pool's depth), while a prefetch may
overlap any compute; from the run's own per-layer-execution counts. ``achieved_vs_dep_bound`` is the tokens/s over
it (docs/design.md, "Compute order").

Dimensions beside policy and budget: the oracle forecast's recall (``recall``: ``seqmoe:forecast=oracle,recall=R``,
break-even on and off, :mod:`expertcast.recipes.bench_disk_arms`) and the expert format (``expert_dtypes``: the disk
store, slots and reads in each format, the all-in-RAM baseline bf16). Each row also reports the disk's busy and idle
time per token from the reader pool's own timestamps; the report and figures: :mod:`expertcast.recipes.bench_disk_report`.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.inference.runtime.disk_store import ALIGN, READERS, round_up
from expertcast.inference.runtime.loading import RSS_MARGIN_BYTES
from expertcast.inference.runtime.machine import (
    MachineFigures,
    cpu_info,
    disk_read_rate,
    gemm_kernel,
    gemm_rate,
    ram_bandwidth,
)
from expertcast.inference.runtime.stats import release_memory, reset_peak_rss
from expertcast.recipes.bench_disk_arms import (  # noqa: F401 (check_held_out, decoder_layers: this module's API)
    Timeline,
    arm_policy,
    budgets_of,
    check_held_out,
    decoder_layers,
    forecaster_guard,
    forecaster_recall,
    formats_of,
    oracle_of,
    policy_arms,
    split_arm,
    timeline_arm,
)
from expertcast.recipes.bench_disk_report import finish_bounds, write_report
from expertcast.utils.provenance import code_version, pin_code_version


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
    readers: int = READERS
    repeats: int = 3
    """Rounds per cell: each round runs every policy once (order rotated and reversed by round: :func:`round_order`), each pass between two
    baseline passes; ``vs_ref`` pairs a policy with the reference (``lru``) of the same round."""
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
    """Rounds per cell of the full-depth model when a ``baseline_model`` subset carries the paired %: each round runs
    every policy once (order rotated and reversed by round); ``vs_ref`` pairs a policy with ``lru`` of the same round."""
    disk_mb: int = 256
    """Size of the temporary file of the disk bandwidth measurement."""
    threads: int = 1
    """torch compute threads."""
    seed: int = 0
    recall: tuple[float, ...] = ()
    """Recalls of the oracle forecast (``seqmoe:forecast=oracle,recall=R``, break-even on and off) run per budget."""
    expert_dtypes: tuple[str, ...] = ("bfloat16",)
    """Expert formats (:class:`~expertcast.inference.runtime.quant.ExpertFormat`): the disk store, slots and reads of
    each; the all-in-RAM baseline stays bf16."""
    equal_bytes: bool = False
    """Quantized formats also at the bytes each budget holds in bf16 (``Budget.bytes``)."""
    disk_seconds: float = 2.0
    """The disk measurement reads its file again until at least this long has passed."""
    trace_timeline: str | None = None
    """Write one pass's per-layer timeline here (JSON; :class:`Timeline`): the first pass of :func:`timeline_arm` at
    ``timeline_budget``, first format, at the model's full depth (the subset's only without a subset)."""
    timeline_budget: float | None = None
    """The budget of the timeline's pass (None: the first of ``budgets``)."""
    allow_overlap: bool = False
    """Replay sequences the forecaster was fitted on (reported)."""
    allow_model_mismatch: bool = False
    """Replay another model's routing with the forecaster (reported)."""
    truncate_trace: bool = False
    """Replay the first L layers of a trace with more MoE layers than the model."""


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
        meta_m, seqs, mapping = map_trace_to_model(meta, seqs, L, E, K, truncate_layers=cfg.truncate_trace)
        if calib:
            _, calib, _ = map_trace_to_model(meta, calib, L, E, K, truncate_layers=cfg.truncate_trace)
        return meta_m, seqs, calib, f"recorded traces {cfg.traces} ({'; '.join(mapping.lines())})"
    from expertcast.data.synthetic import zipf_traces

    # one draw of the Zipf popularity: the first ``sequences`` are replayed (the same as a draw of only those), the
    # others calibrate static
    syn = zipf_traces(num_sequences=cfg.sequences + cfg.calib_sequences, num_tokens=cfg.prompt + cfg.tokens,
                      num_layers=L, num_experts=E, top_k=K, prompt_len=cfg.prompt, seed=cfg.seed)
    every = list(syn.sequences)
    return syn.meta, every[:cfg.sequences], every[cfg.sequences:], "synthetic zipf routing"


def start_of(policy, cache_config) -> str:
    """``warm`` when the policy places experts before anything runs (:meth:`Policy.warm_start`, e.g. static's
    placement), else ``cold``; either way the prompt's routing is then replayed through it (uncounted) before the
    measured decode."""
    from expertcast.inference.cache.expert_cache import ExpertCache

    return "warm" if len(policy.warm_start(ExpertCache(cache_config))) else "cold"


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


def format_all_in_ram(model, disk, seqs, readers: int) -> tuple[float, float]:
    """(seconds per decoded token, decoder-layer share) of ``model`` with every expert of ``disk``'s format resident
    in RAM slots (capacity 1.0, warmed by one replay, then :func:`layer_share`): the all-in-RAM speed of that format,
    the compute floor of its rows' bound (a faster kernel on fewer bytes moves it; docs/design.md, "Disk tier").
    ``disk`` None: the model's own experts in a RAM store."""
    from expertcast.inference.policies import make_policy

    om = OffloadedModel_(model, make_policy("lru"), 1.0, store=disk, readers=readers)
    try:
        om.replay(seqs)
        return layer_share(om, seqs)
    finally:
        om.close()


def resident_routing(seqs, slots: int) -> list:
    """``seqs`` with every layer's routing folded onto experts ``0 .. slots - 1``: expert ``e`` becomes ``e % slots``,
    the next free id where that repeats one of the same position's earlier choices (the K choices stay distinct;
    weights and token ids unchanged). The routing varies from token to token as the trace's does, over no more experts
    per layer than a per-layer pool of ``slots`` holds, so a pass reads nothing once they are resident
    (:func:`resident_ceiling`)."""
    from dataclasses import replace

    def fold(s):
        ids = np.asarray(s.expert_ids)
        if ids.shape[-1] > slots:
            raise ValueError(f"{slots} slots per layer cannot hold top-{ids.shape[-1]}")
        out = np.empty_like(ids)
        for idx in np.ndindex(*ids.shape[:-1]):
            taken: list[int] = []
            for e in ids[idx].tolist():
                f = e % slots
                while f in taken:
                    f = (f + 1) % slots
                taken.append(f)
            out[idx] = taken
        return replace(s, expert_ids=out, router_probs=None)

    return [fold(s) for s in seqs]


def resident_ceiling(model, disk, capacity, seqs, readers: int, repeats: int = 2) -> tuple[float, int]:
    """(seconds per decoded token, reads counted) of the full-depth model itself, through the same runtime, store
    and slots as a cell's passes, with one thing changed: the routing is folded onto the experts the cell's slots
    hold (:func:`resident_routing`), so after a warm-up replay every expert a step computes is resident and no read
    happens; median of ``repeats`` replays. The expert and attention FLOPs per token are the cell's, the routing
    varies as the trace's: it measures the full depth's own compute per token, which the subset's scaled all-in-RAM
    figure assumes from a few layers (docs/results.md, "The all-in-RAM figure at full depth")."""
    from expertcast.inference.policies import make_policy

    om = OffloadedModel_(model, make_policy("lru"), capacity, store=disk, readers=readers)
    try:
        folded = resident_routing(seqs, om.cache.num_slots // om.L)
        om.replay(folded)
        runs = [om.replay(folded) for _ in range(repeats)]
    finally:
        om.close()
        del om
        release_memory()
    return float(np.median([1.0 / st.tokens_per_s for st in runs])), int(sum(st.reads for st in runs))


def subset_all_in_ram(path: str, seqs, dtype) -> tuple[float, float]:
    """(seconds per decoded token, decoder-layer share) of the ``--baseline-model`` subset at ``path`` with every
    expert resident in RAM slots (bf16, capacity 1.0, warmed by one replay, then :func:`layer_share`), loaded afresh
    and released: the measurement that brackets each full-depth cell in time (docs/design.md, "Disk tier")."""
    from expertcast.models.backbone import load_moe_model

    model, _ = load_moe_model(path, dtype=dtype)
    try:
        return format_all_in_ram(model, None, seqs, readers=1)  # a RAM store: no reader pool
    finally:
        del model
        release_memory()


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


def _load_streamed(path: str, cfg: BenchConfig, disk_path: Path, capacity: float, fmt: str = "bfloat16"):
    """(model with experts on the meta device, DiskExpertStore, LoadReport): ``path`` streamed to the disk store in
    expert format ``fmt``, never materialised."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.loading import load_offloaded

    om, _, load = load_offloaded(path, make_policy("lru"), capacity, dtype=cfg.dtype, store="disk",
                                 disk_path=disk_path, readers=cfg.readers,
                                 expert_dtype=fmt)
    om.close()
    return om.model, om.store, load


DEP_BOUND_FORMULA = ("dependency-aware bound: 1 / max(t_RAM + sum over counted layer-executions of max(0, d x/B + c - "
                     "n c) / tokens, (D + P) x/B / tokens), t_RAM = all-in-RAM s/token, d = the layer-execution's "
                     "demand misses (their reads start when the layer is routed and overlap only that layer's compute "
                     "of the n experts it computes; the last lands after d x/B at the earliest, then one expert's "
                     "compute c follows), x/B = expert bytes / B, B = the full-overlap bound's disk figure (the "
                     "one-pass measurement or any run's achieved rate, the largest), c = "
                     "one expert's measured compute at 1 token; prefetch reads (D + P counts them) overlap any compute, "
                     "late prefetches count as there; never below the run's own speed")


def dependency_bound_seconds(st, xbytes: int, disk_bytes_per_s: float, expert_s: float, full_s: float) -> float:
    """Per-token seconds no run with ``st``'s counters can beat (:data:`DEP_BOUND_FORMULA`): a demand miss is read
    only once its layer is routed, so its read overlaps that layer's other experts and nothing else; from the run's
    per-layer-execution record (:attr:`~expertcast.inference.cache.counters.Counters.layer_execs`)."""
    tok = max(st.decoded_tokens, 1)
    read_s = xbytes / disk_bytes_per_s
    exposed = sum(max(0.0, d * read_s + expert_s - n * expert_s) for _, n, d in st.layer_execs if d)
    return max(full_s + exposed / tok, st.reads * read_s / tok)


FORECASTER_COLUMNS = ("forecaster_ms_per_step", "forecaster_share", "forecaster_cpu_ms_per_step",
                      "forecaster_path_ms_per_step",
                      "forecaster_path_share", "forecasts_dropped", "forecaster_precomputed_elements",
                      "forecaster_precompute_ms_per_element")
"""The forecaster's cost per decode step a row carries when its policy runs one (the runtime's own report), and the
forecast tables it computed before the decode (replayed routing; not in tokens/s)."""


def _row(name, budget, cap, st, slots, xbytes, disk_gbps, full_s, expert_s, extra):
    """One cell's row; its full-overlap and dependency-aware bounds are provisional (the measured disk figure) until
    :func:`~expertcast.recipes.bench_disk_report.finish_bounds` sets them at the figure that bounds every run."""
    tok = max(st.decoded_tokens, 1)
    m = st.metrics()
    busy_ms = 1e3 * st.read_busy_seconds / tok  # the reader pool's own timestamps: time >= 1 read was in progress
    row = {"policy": name, "budget": float(budget), "capacity": cap, "slots": slots,
           "tokens_per_s": st.tokens_per_s, "hit": st.hit,
           "exposed_misses_per_token": m["exposed_misses_per_token"],
           "miss_free_token_frac": m["miss_free_token_frac"], "read_mb_per_token": m["read_mb_per_token"],
           "read_gbps": m["read_gbps"], "io_overlap": m["io_overlap"], "reads_per_token": st.reads / tok,
           "disk_busy_ms_per_token": busy_ms, "disk_idle_ms_per_token": max(0.0, 1e3 / st.tokens_per_s - busy_ms),
           "expert_bytes": xbytes, "compute_floor_s": full_s, "reads": st.reads, "loads": st.D + st.P,
           "late_prefetches": int(st.late.sum()), "decoded_tokens": st.decoded_tokens,
           **{k: m[k] for k in FORECASTER_COLUMNS if k in m}, **extra}
    row.update({"recall": None, "breakeven": None, **oracle_of(name)})
    finish_bounds([row], disk_gbps)
    row["_dep"] = (st, expert_s)
    return row


def simulated(name: str, cfg, meta, seqs, cache_config, stream, layer_ms: float, full_s: float, disk_gbps: float,
              xbytes: int, calib=(), link_gbps: float | None = None) -> dict[str, Any]:
    """The simulator's figures for the cell a row measured (docs/design.md, "Disk tier"): the same policy spec,
    cache configuration and sequences, replayed by :func:`~expertcast.inference.sim.simulator.replay` under the cost
    model of this run's own machine figures: a link at ``link_gbps`` (default ``disk_gbps``; a run's rows take the
    disk figure of its bounds, :func:`finish_sims`), ``layer_ms`` of compute per MoE layer-execution, the store's
    bytes per expert; the policy armed as the runtime arms it (link estimate ``disk_gbps``, the one-pass rate).
    ``sim_tokens_per_s`` = 1 / (the all-in-RAM ``full_s`` + the modelled stall per token): what a card predicts,
    beside what the runtime measured. Empty without ``stream``."""
    if stream is None:
        return {}
    from expertcast.inference.cache.cost_model import CostConfig
    from expertcast.inference.sim.simulator import replay

    pol, future = arm_policy(name, cfg, meta, seqs, disk_gbps * 1e9, layer_ms, stream, calib)
    link = link_gbps or disk_gbps
    try:
        res = replay(future if future is not None else stream(meta, seqs, 1), pol, cache_config,
                     CostConfig(bandwidth_gbps=link, layer_compute_ms=max(layer_ms, 1e-3), expert_bytes=xbytes))
    finally:
        close = getattr(pol, "close", None)
        if close is not None:
            close()
    tok = max(res.decoded_tokens, 1)
    return {"sim_hit": res.hit, "sim_reads_per_token": (res.D + res.P) / tok, "sim_disk_gbps": link,
            "sim_stall_ms_per_token": res.stall_ms / tok, "sim_tokens_per_s": 1.0 / (full_s + res.stall_ms / 1e3 / tok)}


def defer_sim(row: dict[str, Any], name: str, cfg, meta, seqs, cache_config, stream, layer_ms: float,
              disk_gbps: float, xbytes: int, calib=()) -> dict[str, Any]:
    """Attach to ``row`` the :func:`simulated` replay of its cell, run by :func:`finish_sims` once the run's disk
    figure is known (nothing without ``stream``); returns ``row``."""
    if stream is not None:
        row["_sim"] = partial(simulated, name, cfg, meta, seqs, cache_config, stream, layer_ms, disk_gbps=disk_gbps,
                              xbytes=xbytes, calib=calib)
    return row


def finish_sims(rows: list[dict[str, Any]], link_gbps: float) -> None:
    """Run the simulator replays :func:`defer_sim` attached to ``rows``, every one on a link at ``link_gbps`` (the
    run's bound figure, the highest rate the disk gave any of its runs: the one-pass measurement reads data the host
    has never cached, the replays re-read a store it partly has, so a card fed the one-pass rate under-predicted
    every row by 27-45%; docs/results.md, "The simulator's link at the run's disk figure"), over each row's own
    all-in-RAM floor (its format's, after :func:`set_format_floor`)."""
    for r in rows:
        job = r.pop("_sim", None)
        if job is not None:
            r.update(job(full_s=r["compute_floor_s"], link_gbps=link_gbps))


def resimulate(record: dict[str, Any], link_gbps: float, stream: Any) -> list[dict[str, Any]]:
    """The :func:`simulated` figures of a run's full-depth rows (``record``: its ``bench_disk.json``, or a stopped run's
    ``bench_disk.partial.json``: the cells it finished) again,
    on a link at ``link_gbps``: the same settings, routing (checked against the record's fingerprint), cache
    configuration (the row's slots per layer) and policy arming (link estimate at the record's one-pass rate),
    compute per layer-execution = the one the row was armed with (``armed_layer_ms``; older records: its floor / L).
    Returns one dict per row: policy, budget, format, measured tokens/s, the recorded ``sim_tokens_per_s`` (None in
    records older than the columns) and the new ``sim_*`` figures. Needs the record's traces and forecaster where it names them."""
    from expertcast.inference.cache.expert_cache import Budget, CacheConfig

    prov = record["provenance"]
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in prov["settings"].items()})
    md = record["model"]
    L, E, K = int(md["L"]), int(md["E"]), int(md["K"])
    meta, seqs, calib, _ = _traces(cfg, L, E, K, int(md["expert_bytes"]))
    if _fingerprint(seqs) != prov["routing_fingerprint"]:
        raise ValueError("the routing the record names is not the routing it replayed (fingerprint differs): the "
                         "traces changed since the run")
    one = float(record["machine"]["disk_gbps"])
    out = []
    for r in record["rows"]:
        xb = int((md.get("expert_bytes_by_format") or {}).get(r["format"], md["expert_bytes"]))
        cc = CacheConfig(num_layers=L, num_experts=E, top_k=K, pool="per-layer",
                         budget=Budget.slots(int(r["slots"]) // L), expert_bytes=xb)
        floor_s = float(r["compute_floor_s"])
        layer_ms = float(r.get("armed_layer_ms", 1e3 * floor_s / L))  # records before the bracketed figure: floor / L
        sim = simulated(r["policy"], cfg, meta, seqs, cc, stream, layer_ms, floor_s, one, xb, calib,
                        link_gbps=link_gbps)
        out.append({"policy": r["policy"], "budget": r["budget"], "format": r["format"],
                    "tokens_per_s": r["tokens_per_s"], "recorded_sim_tokens_per_s": r.get("sim_tokens_per_s"),
                    **sim, "sim_vs_measured": sim["sim_tokens_per_s"] / r["tokens_per_s"]})
    return out


def round_order(arms: list[str], rnd: int) -> list[str]:
    """The arms of one round of a cell: every arm runs once per round. Round 2j runs them rotated by j, round 2j + 1
    the same rotation reversed, so that in every pair of rounds two arms stand as far apart once each way (a drift
    of the machine that is linear over the pair cancels in their paired ratio) and over 2n rounds (n arms) every arm
    runs in every place twice, at the ends of the rounds as often as in their middle (with reversal alone the same
    two arms took the ends, where a V-shaped drift favours both: docs/results.md, "Prefetch reads that yield the
    disk, and a re-plan at half its cost"). Run an even number of rounds."""
    j = (rnd // 2) % max(len(arms), 1)
    order = list(arms[j:]) + list(arms[:j])
    return order if rnd % 2 == 0 else order[::-1]


def reference_arm(arms: list[str]) -> str:
    """The arm every other is paired against per round: ``lru`` when it runs, else the first arm."""
    return "lru" if "lru" in arms else arms[0]


def paired_vs_ref(speeds: dict[str, list[float]], ref: str) -> dict[str, dict[str, Any]]:
    """Per arm, its tokens/s over the reference arm's in the same round (``vs_ref``: median, min, max over the
    rounds both ran; ``vs_ref_rounds`` how many): the ratio of two passes made side by side, not of two medians
    taken at different times. Empty when the reference did not run."""
    base = speeds.get(ref) or []
    out = {}
    for name, sp in speeds.items():
        r = [a / b for a, b in zip(sp, base, strict=False) if b > 0]  # the rounds both ran
        if r:
            out[name] = {"ref_policy": ref, "vs_ref": float(np.median(r)), "vs_ref_min": min(r),
                         "vs_ref_max": max(r), "vs_ref_rounds": len(r)}
    return out


def set_format_floor(rows: list[dict[str, Any]], format_s: float) -> None:
    """Give ``rows`` (one quantized format's) the all-in-RAM speed of their own format, ``format_s`` s/token: the
    compute floor of their bounds and ``pct_full_format``, % of it (``pct_full`` stays against bf16)."""
    for r in rows:
        r["compute_floor_s"] = format_s
        r["full_format_tokens_per_s"] = 1.0 / format_s
        r["pct_full_format"] = 100 * r["tokens_per_s"] * format_s


def dep_bound_of(row: dict[str, Any], disk_bytes_per_s: float) -> float:
    st, expert_s = row["_dep"]
    return dependency_bound_seconds(st, row["expert_bytes"], disk_bytes_per_s, expert_s, row["compute_floor_s"])


def is_timeline_cell(cfg, name: str, budget: float, kind: str, fmt: str) -> bool:
    """Whether ``--trace-timeline`` records this cell's first pass (:attr:`BenchConfig.trace_timeline`)."""
    at = cfg.budgets[0] if cfg.timeline_budget is None else cfg.timeline_budget
    return bool(cfg.trace_timeline) and name == timeline_arm(cfg) and kind == "experts" and \
        math.isclose(float(budget), float(at)) and fmt == formats_of(cfg)[0]


def _paired_grid(cfg, model, disk, base, meta, seqs, policies, K, E, xbytes, disk_gbps, L, expert_s, stream=None,
                 calib=(), fmt="bfloat16", bf16_bytes=None, full_depth_timeline=False):
    """Per budget and policy: ``cfg.repeats`` policy passes through ``disk`` (experts in format ``fmt``), each
    between two passes of the all-in-RAM ``base`` (the paired % of full speed: median, min-max)."""
    def baseline() -> float:
        return base.replay(seqs).tokens_per_s

    rows, skipped = [], {}
    for budget, kind, cap in budgets_of(cfg, fmt, K, E, L, bf16_bytes or xbytes):
        runs: dict[str, list] = {name: [] for name in policies}  # per round (st, slots, ratio, base, start, config)
        dead: set[str] = set()
        b_prev = baseline()
        for rep in range(cfg.repeats):
            for name in round_order(policies, rep):
                if name in dead:
                    continue
                try:
                    pol, fut = arm_policy(name, cfg, meta, seqs, disk_gbps * 1e9, 1e3 / b_prev / L, stream, calib)
                    om = OffloadedModel_(model, pol, cap, store=disk, readers=cfg.readers, future=fut,
                                         **split_arm(name)[1])
                except ValueError as e:
                    skipped[f"{name} {fmt} {kind}"] = " ".join(str(e).split())
                    dead.add(name)
                    continue
                start = start_of(pol, om.cache_config)
                traced = (not full_depth_timeline and is_timeline_cell(cfg, name, budget, kind, fmt) and
                          not runs[name])
                timeline = Timeline(om) if traced else None
                st = om.replay(seqs)
                om.close()
                if timeline is not None:
                    timeline.save(cfg.trace_timeline, f"{name}, {fmt}, budget {budget:g}")
                b_next = baseline()
                b = 0.5 * (b_prev + b_next)
                runs[name].append((st, om.cache.num_slots, st.tokens_per_s / b, b, start, om.cache_config))
                del om  # its slots go before the next pass allocates its own
                b_prev = b_next
        vs = paired_vs_ref({n: [r[0].tokens_per_s for r in rs] for n, rs in runs.items()}, reference_arm(policies))
        for name in policies:
            if not runs[name]:
                continue
            speeds = [r[0].tokens_per_s for r in runs[name]]
            ratios = [r[2] for r in runs[name]]
            st, slots, _, b, start, cache_config = runs[name][int(np.argsort(speeds)[len(speeds) // 2])]
            rows.append(defer_sim(_row(name, budget, float(cap) if kind == "experts" else slots / (L * E), st, slots, xbytes,
                             disk_gbps, 1.0 / b, expert_s, {
                                 "format": fmt, "budget_kind": kind,
                                 "pct_full": 100 * float(np.median(ratios)), "pct_full_min": 100 * min(ratios),
                                 "pct_full_max": 100 * max(ratios), "full_tokens_per_s": b, "start": start,
                                 "pct_full_format": 100 * float(np.median(ratios)), "full_format_tokens_per_s": b,
                                 "passes": len(runs[name]), **vs.get(name, {})}),
                                  name, cfg, meta, seqs, cache_config, stream, 1e3 / b / L, disk_gbps, xbytes, calib))
    return rows, skipped


PARTIAL_FILE = "bench_disk.partial.json"
"""The record of a run's finished cells (:func:`_partial`), replaced by ``bench_disk.json`` when the run completes."""

PARTIAL_STATUS = ("partial: the rows of the cells finished so far, written after each cell; the run stopped or is still "
                  "running. Bounds at the disk figure that bounds every row so far (disk_gbps_bound); no simulated "
                  "cards, CSV or PNG (written when a run completes)")


def _partial(out: Path, rows: list, sub_rows: list, head: dict[str, Any], disk_gbps: float) -> None:
    """The rows so far (``bench_disk.partial.json``, removed when the run completes) beside ``head`` (the machine
    figures, model and provenance, as the final record has them): a long real-shape run that dies keeps what it
    measured and what produced it. The rows' bounds are set on copies at the disk figure that bounds them all (as
    the final record does over every row), never the one-pass figure a faster run could exceed."""
    from expertcast.utils.io import atomic_write_json

    rows, sub_rows = [dict(r) for r in rows], [dict(r) for r in sub_rows]
    gbps, source = finish_bounds(rows + sub_rows, disk_gbps, dep_bound_of)
    atomic_write_json(out / PARTIAL_FILE, {"status": PARTIAL_STATUS, **head, "disk_gbps_bound": gbps,
                                           "disk_gbps_source": source, "rows": _public(rows),
                                           "subset_rows": _public(sub_rows)})


def _model_record(cfg: BenchConfig, L: int, E: int, K: int, xbytes: int, fmt_bytes: dict[str, int],
                  decoder_layers: int) -> dict[str, Any]:
    """The record's ``model`` section."""
    return {"name": cfg.model or "random-weight qwen3_moe", "L": L, "E": E, "K": K, "hidden": cfg.hidden,
            "moe_intermediate": cfg.moe_intermediate, "dtype": cfg.dtype, "expert_bytes": xbytes,
            "expert_bytes_by_format": dict(fmt_bytes), "disk_store_bytes": L * E * round_up(xbytes, ALIGN),
            "decoder_layers": decoder_layers}


def _provenance(cfg: BenchConfig, source: str, seqs, calib, arms: list[str], guard) -> dict[str, Any]:
    """The record's ``provenance`` section: the settings, the routing and its sequences, the code, the forecaster."""
    return {"settings": asdict(cfg), "routing": source, "routing_fingerprint": _fingerprint(seqs),
            "sequences": [s.seq_id for s in seqs],
            "static_calibration": [s.seq_id for s in calib] if "static" in arms else [],
            "forecaster_guard": guard,
            "code_version": code_version(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "forecaster_hash": _export_hash(cfg.forecaster), "host": platform.node(),
            "scheduling": _sched()}


def OffloadedModel_(*args, **kwargs):  # noqa: N802 (the runtime, imported late)
    from expertcast.inference.runtime.engine import OffloadedModel

    return OffloadedModel(*args, **kwargs)


def run_bench(cfg: BenchConfig, stream: Any = None) -> dict[str, Any]:
    """Measure everything (see the module docstring); write ``bench_disk.json``, ``bench_disk.csv``,
    ``bench_disk.png`` (and ``bench_disk_recall.png`` with ``cfg.recall``) under ``cfg.out``; return the JSON record.
    ``stream``: ``(meta, sequences, batch) -> AccessStream`` for oracle policies (``simulator.build_stream``; this
    room does not import the simulator)."""
    try:
        return _run_bench(cfg, stream)
    except BaseException:  # a failed run takes its disk stores (tens of GB at real shape) with it: nothing resumes
        for path in disk_stores(cfg.out):  # from them, and they would fill the disk the next run needs
            path.unlink(missing_ok=True)
        raise


STORE_GLOBS = ("experts.*.disk.safetensors", "subset.*.disk.safetensors")
"""The names of a run's disk stores in its ``out`` folder, one per format: the model's (:func:`_run_bench`'s
``store_path``) and its subset baseline's."""


def disk_stores(out: str | Path) -> list[Path]:
    """The disk stores a run has in its ``out`` folder now (:data:`STORE_GLOBS`), sorted."""
    return sorted(p for pattern in STORE_GLOBS for p in Path(out).glob(pattern))


def _run_bench(cfg: BenchConfig, stream: Any = None) -> dict[str, Any]:
    """:func:`run_bench`'s measurements."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime import quant
    from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store_from
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.forced import FullLoadReplayer, map_trace_to_model
    from expertcast.inference.runtime.loading import peak_rss_bytes
    from expertcast.inference.runtime.store import HostExpertStore, find_experts_modules
    from expertcast.models.presets import build_from_config, get_config

    pin_code_version()  # read at the start: the record names the code this run loaded
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.dtype)
    formats = formats_of(cfg)
    arms = policy_arms(cfg)

    def store_path(fmt: str) -> Path:
        return out / STORE_GLOBS[0].replace("*", fmt)

    streamed = bool(cfg.model) and Path(cfg.model).is_dir()
    subset_note = check_subset(cfg.model, cfg.baseline_model) if (streamed and cfg.baseline_model) else None
    load_report = None
    mcfg = None
    first = None  # (model, disk store) of formats[0] when streamed
    fmt_bytes: dict[str, int] = {}
    fmt_views: dict[str, Any] = {}
    if streamed:  # a checkpoint folder: streamed to the disk store, never materialised
        model, disk, load_report = _load_streamed(cfg.model, cfg, store_path(formats[0]), min(cfg.budgets),
                                                  formats[0])
        first = (model, disk)
        c = model.config.get_text_config()
        refs = find_experts_modules(model)
        cfg.hidden, cfg.moe_intermediate = int(c.hidden_size), int(c.moe_intermediate_size)
        cfg.experts = disk.num_experts
        cfg.top_k = int(getattr(c, "num_experts_per_tok", None) or c.top_k)
        lay = disk.layout
        xbytes = (lay.base or lay).expert_bytes  # bf16 bytes per expert (the model's own)
        fmt_bytes[formats[0]], fmt_views[formats[0]] = lay.expert_bytes, disk.views(0, 0)
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
        xbytes = 0
        for fmt in formats:  # every format's store written before a run releases the model's experts
            ram_store = HostExpertStore.from_model(model, refs=refs, fmt=fmt)
            write_disk_store_from(ram_store, store_path(fmt), [r.name for r in refs])
            fmt_bytes[fmt], fmt_views[fmt] = ram_store.expert_bytes, ram_store.views(0, 0)
            xbytes = (ram_store.layout.base or ram_store.layout).expert_bytes
            del ram_store
    L, E, K = len(refs), cfg.experts, cfg.top_k
    cfg.layers = L
    meta, seqs, calib, source = _traces(cfg, L, E, K, xbytes)
    guard = forecaster_guard(cfg, meta, seqs)

    # (i)-(iii): the machine
    stride = round_up(fmt_bytes[formats[0]], ALIGN)
    disk_gbps, disk_mode, disk_s = disk_read_rate(out, cfg.disk_mb, stride, cfg.readers, cfg.seed,
                                                  min_seconds=cfg.disk_seconds)
    ram_gbps = ram_bandwidth()
    w0 = fmt_views[formats[0]]
    g1, ms1 = gemm_rate(refs[0].module, w0, cfg.hidden, 1, dtype=dtype)
    g64, _ = gemm_rate(refs[0].module, w0, cfg.hidden, 64, dtype=dtype)
    cpu_model, flags = cpu_info()
    kernel = gemm_kernel(cfg.hidden, cfg.moe_intermediate, cfg.dtype, cfg.threads)
    mach = MachineFigures(disk_gbps, disk_mode, stride, cfg.readers, ram_gbps, g1, g64, ms1, kernel, flags, cpu_model,
                          disk_seconds=disk_s)
    expert_s = {}
    n_dec_full = int(model.config.get_text_config().num_hidden_layers)
    provenance = _provenance(cfg, source, seqs, calib, arms, guard)

    def head() -> dict[str, Any]:
        """The machine, model and provenance sections, as measured so far (a partial record carries them too)."""
        return {"machine": asdict(mach), "model": _model_record(cfg, L, E, K, xbytes, fmt_bytes, n_dec_full),
                "provenance": provenance}

    def format_figures(fmt: str, views) -> None:
        ga, ma = gemm_rate(refs[0].module, views, cfg.hidden, 1, dtype=dtype)
        gb, _ = gemm_rate(refs[0].module, views, cfg.hidden, 64, dtype=dtype)
        mach.format_gemm[fmt] = {"gflops_1": ga, "ms_1": ma, "gflops_64": gb, "expert_bytes": fmt_bytes[fmt]}
        expert_s[fmt] = ma * 1e-3

    for fmt, v in fmt_views.items():
        format_figures(fmt, v)
    fmt_views.clear()
    del w0

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
    n_dec_sub = int(base_model.config.get_text_config().num_hidden_layers)
    # the runtime with every expert resident in RAM slots, bf16 (the same kernels as the disk runs, so the ratio is
    # the cost of the disk and the format), warmed so that every routed expert is in its slot
    base = OffloadedModel(base_model, make_policy("lru"), 1.0)
    base.replay(seqs_b)

    def model_store(fmt: str):
        """(model, disk store) of format ``fmt``; the caller closes the store and deletes its file."""
        nonlocal first
        if not streamed:
            return model, DiskExpertStore(store_path(fmt))
        if first is not None and fmt == formats[0]:
            got, first = first, None
            return got
        m, d, _ = _load_streamed(cfg.model, cfg, store_path(fmt), min(cfg.budgets), fmt)
        if fmt not in mach.format_gemm:
            fmt_bytes[fmt] = d.layout.expert_bytes
            format_figures(fmt, d.views(0, 0))
        return m, d

    skipped: dict[str, str] = {}
    fmt_full: dict[str, tuple[float, float]] = {}  # format -> its all-in-RAM (s/token, decoder share), bf16 aside
    sub_rows: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    rss_bound = {}
    if subset_note:  # every policy also on the subset, paired against the subset's all-in-RAM run
        for fmt in formats:
            sub_path = out / STORE_GLOBS[1].replace("*", fmt)
            sub_model, sub_disk, _ = _load_streamed(cfg.baseline_model, cfg, sub_path, min(cfg.budgets), fmt)
            r, sk = _paired_grid(cfg, sub_model, sub_disk, base, meta_b, seqs_b, arms, K, E, sub_disk.expert_bytes,
                                 disk_gbps, L_b, expert_s.get(fmt, ms1 * 1e-3), stream, calib_b, fmt, xbytes,
                                 full_depth_timeline=True)
            if fmt != "bfloat16":  # this format's own all-in-RAM speed (the bf16 one is the paired baseline)
                fmt_full[fmt] = format_all_in_ram(sub_model, sub_disk, seqs_b, cfg.readers)
                set_format_floor(r, fmt_full[fmt][0])
            sub_rows += r
            skipped.update(sk)
            _partial(out, [], sub_rows, head(), disk_gbps)
            sub_disk.close()
            sub_path.unlink()
            del sub_model, sub_disk
            release_memory()
        base_s, share = layer_share(base, seqs_b)
        full_s = scaled_full_seconds(base_s, share, n_dec_sub, n_dec_full)
        brackets = [(base_s, share)]  # the subset's all-in-RAM before the first full-depth cell, then after each
        full_s_of = {f: scaled_full_seconds(s_f, sh_f, n_dec_sub, n_dec_full) for f, (s_f, sh_f) in fmt_full.items()}
        base.close()
        del base, base_model, plain
        release_memory()
        sub_by = {(r["policy"], r["budget"], r["format"], r["budget_kind"]): r for r in sub_rows}
        non_expert = _non_expert_bytes(model)
        for fmt in formats:
            model, disk = model_store(fmt)
            fx = disk.expert_bytes
            for budget, kind, cap in budgets_of(cfg, fmt, K, E, L, xbytes):
                cell: dict[str, list] = {name: [] for name in arms}  # per round (st, slots, pool, rss, start, config,
                # round)
                ceiling: dict[int, tuple[float, int]] = {}  # per round that ran an arm: the ceiling's (s/token, reads)
                dead: set[str] = set()
                for rep in range(cfg.full_repeats):
                    ran = False
                    for name in round_order(arms, rep):
                        if name in dead:
                            continue
                        try:
                            pol, fut = arm_policy(name, cfg, meta, seqs, disk_gbps * 1e9, 1e3 * full_s / L, stream, calib)
                            om = OffloadedModel(model, pol, cap, store=disk, readers=cfg.readers, future=fut,
                                                **split_arm(name)[1])
                        except ValueError as e:
                            skipped[f"{name} {fmt} {kind} (full depth)"] = " ".join(str(e).split())
                            dead.add(name)
                            continue
                        start = start_of(pol, om.cache_config)
                        reset_peak_rss()
                        traced = not cell[name] and is_timeline_cell(cfg, name, budget, kind, fmt)
                        timeline = Timeline(om) if traced else None
                        st = om.replay(seqs)
                        om.close()
                        if timeline is not None:
                            timeline.save(cfg.trace_timeline, f"{name}, {fmt}, budget {budget:g}, full depth")
                        cell[name].append((st, om.cache.num_slots, om.pool.nbytes, peak_rss_bytes(), start,
                                           om.cache_config, rep))
                        print(f"bench_disk: {fmt} {budget:g} full depth, round {rep + 1}/{cfg.full_repeats}, {name}: "
                              f"{st.tokens_per_s:.3f} tokens/s, hit {st.hit:.3f}", flush=True)  # a plain progress line
                        del om, pol, fut  # the slots go before the next cell allocates its own
                        release_memory()
                        ran = True
                    if ran:  # the full depth's own no-read ceiling in the same round: each arm's pct_resident is
                        # paired with it (its passes minutes apart moved by 10%: docs/results.md, "Reads beside
                        # compute at the DeepSeek-V2-Lite shape")
                        ceiling[rep] = resident_ceiling(model, disk, cap, seqs, cfg.readers, repeats=1)
                        print(f"bench_disk: {fmt} {budget:g} full depth, round {rep + 1}/{cfg.full_repeats}, the "
                              f"no-read ceiling: {1 / ceiling[rep][0]:.3f} tokens/s", flush=True)
                if not any(cell.values()):  # every arm skipped at this budget: nothing to bracket or compare
                    continue
                vs = paired_vs_ref({n: [r[0].tokens_per_s for r in rs] for n, rs in cell.items()}, reference_arm(arms))
                # the subset's all-in-RAM measured again now: this cell's figure is the mean of the two that bracket
                # it in time, so that a drift of the host since the first is seen, not assumed away (0.7-3% in runs
                # L-N)
                brackets.append(subset_all_in_ram(cfg.baseline_model, seqs_b, dtype))
                res_s = float(np.median([c[0] for c in ceiling.values()]))
                res_reads = int(sum(c[1] for c in ceiling.values()))
                (s0, f0), (s1, f1) = brackets[-2], brackets[-1]
                cell_s = scaled_full_seconds((s0 + s1) / 2, (f0 + f1) / 2, n_dec_sub, n_dec_full)
                before_s, after_s = (scaled_full_seconds(s_, f_, n_dec_sub, n_dec_full) for s_, f_ in ((s0, f0), (s1, f1)))
                for name in arms:
                    runs = cell[name]
                    if not runs:
                        continue
                    i_med = int(np.argsort([r[0].tokens_per_s for r in runs])[len(runs) // 2])
                    st, slots, pool_bytes, rss, start, cache_config, _ = runs[i_med]
                    paired = [100 * r[0].tokens_per_s * ceiling[r[6]][0] for r in runs]  # over the ceiling, same round
                    sub = sub_by.get((name, float(budget), fmt, kind), {})
                    bound_b = pool_bytes + non_expert + RSS_MARGIN_BYTES
                    floor_s = full_s_of.get(fmt, cell_s)  # this format's all-in-RAM s/token
                    rows.append(defer_sim(_row(name, budget, float(cap) if kind == "experts" else slots / (L * E), st, slots,
                                     fx, disk_gbps, floor_s, expert_s.get(fmt, ms1 * 1e-3), {
                        "format": fmt, "budget_kind": kind,
                        "pct_full": sub.get("pct_full", float("nan")),
                        "pct_full_min": sub.get("pct_full_min", float("nan")),
                        "pct_full_max": sub.get("pct_full_max", float("nan")),
                        "pct_full_scaled": 100 * st.tokens_per_s * cell_s, "full_tokens_per_s": 1.0 / cell_s,
                        "full_tokens_per_s_before": 1.0 / before_s, "full_tokens_per_s_after": 1.0 / after_s,
                        "armed_layer_ms": 1e3 * full_s / L,
                        "resident_tokens_per_s": 1.0 / res_s, "pct_resident": float(np.median(paired)),
                        "pct_resident_min": min(paired), "pct_resident_max": max(paired),
                        "resident_passes": len(ceiling), "resident_reads": res_reads,
                        "pct_full_format": 100 * st.tokens_per_s * floor_s, "full_format_tokens_per_s": 1.0 / floor_s,
                        "sub_tokens_per_s": sub.get("tokens_per_s", float("nan")),
                        "peak_rss_gb": rss / 1e9, "rss_bound_gb": bound_b / 1e9, "start": start,
                        "passes": len(runs), **vs.get(name, {})}),
                        name, cfg, meta, seqs, cache_config, stream, 1e3 * full_s / L, disk_gbps, fx, calib))  # armed as the pass was
                    rss_bound[f"{name}@{budget}@{fmt}@{kind}"] = bound_b
                _partial(out, rows, sub_rows, head(), disk_gbps)
            disk.close()
            store_path(fmt).unlink()  # the disk has room for one real-shape store at a time: build, measure, delete
            del disk
            release_memory()
        baseline_note = (f"{subset_note}; % of full speed (pct_full) is paired on the subset: its policy passes "
                         f"through its own disk store, each between two all-in-RAM passes of it; the full-depth "
                         f"all-in-RAM speed is scaled: t_full = t_subset x ((1 - f) + f x {n_dec_full}/{n_dec_sub} decoder "
                         f"layers), f = {share:.3f} the measured share of a decode step inside the decoder layers "
                         f"(hooks on each layer; the rest: embedding, final norm, LM head, per-token work), "
                         f"t_subset = {1e3 * base_s:.2f} ms -> {1e3 * full_s:.1f} ms/token before the first full-depth "
                         f"cell (the figure its policies were armed with); each full-depth row's all-in-RAM speed "
                         f"(full_tokens_per_s) is the mean of the subset's measurements just before and just after its "
                         f"cell (full_tokens_per_s_before/_after), scaled alike: "
                         + ", ".join(f"{1e3 * scaled_full_seconds(s_, f_, n_dec_sub, n_dec_full):.1f}"
                                     for s_, f_ in brackets) + " ms/token in turn; resident_tokens_per_s (pct_resident): the "
                         "full-depth model's own speed through the same runtime, store and slots with the routing folded onto "
                         "the experts its slots hold (every expert a step computes resident, no read: resident_reads), "
                         "one pass in each round of the cell after its policies (resident_tokens_per_s: their median); "
                         "pct_resident is paired: the median over rounds of the row's speed over the ceiling's of the "
                         "same round (pct_resident_min/_max)")
    else:
        for fmt in formats:
            m_f, disk = model_store(fmt)
            r, sk = _paired_grid(cfg, m_f, disk, base, meta, seqs, arms, K, E, disk.expert_bytes, disk_gbps, L,
                                 expert_s.get(fmt, ms1 * 1e-3), stream, calib, fmt, xbytes)
            if fmt != "bfloat16":  # this format's own all-in-RAM speed (the bf16 one is the paired baseline)
                fmt_full[fmt] = format_all_in_ram(m_f, disk, seqs, cfg.readers)
                set_format_floor(r, fmt_full[fmt][0])
            rows += r
            skipped.update(sk)
            disk.close()
            store_path(fmt).unlink()
            del disk, m_f
            release_memory()
        base.close()
        baseline_note = "the runtime with every expert resident in RAM slots (bf16, same kernels), paired passes"
    for fmt in formats:
        store_path(fmt).unlink(missing_ok=True)
    # one disk figure for every bound of the process: never below what any of its runs achieved
    bound_gbps, bound_source = finish_bounds(rows + sub_rows, disk_gbps, dep_bound_of)
    finish_sims(rows + sub_rows, bound_gbps)
    sub_by = {(r["policy"], r["budget"], r["format"], r["budget_kind"]): r for r in sub_rows}
    for r in rows:
        sub = sub_by.get((r["policy"], r["budget"], r["format"], r["budget_kind"]))
        if sub is not None:
            r["sub_achieved_vs_bound"] = sub["achieved_vs_bound"]
            r["sub_achieved_vs_dep_bound"] = sub["achieved_vs_dep_bound"]
    mach.kernel_table = quant.TABLE.to_list()
    record = {
        "machine": asdict(mach),
        "model": _model_record(cfg, L, E, K, xbytes, fmt_bytes, n_dec_full),
        "rows": _public(rows),
        "subset_rows": _public(sub_rows),
        "skipped": skipped,
        "plain_model_tokens_per_s": plain_tps,
        "format_all_in_ram_tokens_per_s": {f: 1.0 / s_f for f, (s_f, _) in fmt_full.items()},
        "baseline": baseline_note,
        "peak_rss_bytes": peak_rss_bytes(),
        "load": load_report.to_dict() if load_report is not None else None,
        "disk_gbps_bound": bound_gbps,
        "disk_gbps_source": bound_source,
        "forecaster_recall": forecaster_recall(cfg, seqs, guard) if cfg.forecaster else None,
        "bound_definition": "1 / max(reads/token x expert bytes (the row's format) / B, min(all-in-RAM s/token "
                            "of the row's format, the run's own)), B = max(the one-pass disk measurement at the reader pool's "
                            "queue depth, every run's achieved read rate over its read-busy and its wall time): the "
                            "policy's own loads with full I/O-compute overlap (a demand miss cannot have it); "
                            "achieved_vs_bound <= 1 by construction",
        "dep_bound_definition": DEP_BOUND_FORMULA,
        "provenance": provenance,
    }
    write_report(out, record)
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    return record


def _public(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their private run objects."""
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


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


def quick_config(out: str) -> BenchConfig:
    """A tiny shape that runs in seconds (CI)."""
    return BenchConfig(out=out, hidden=64, moe_intermediate=32, experts=16, top_k=4, layers=2, sequences=1,
                       tokens=12, repeats=2, budgets=(0.25, 0.45), disk_mb=8, readers=2)

