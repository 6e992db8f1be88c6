"""The disk tier's benchmark (docs/design.md, "Disk tier"): the machine's figures and every policy's speed, in one run.

:func:`run_bench` measures, in this order and in the same process:

(i) the disk's direct-read bandwidth: a temporary file of ``disk_mb`` in the output folder (written, flushed,
    dropped from the page cache), read with ``O_DIRECT`` (else buffered + DONTNEED, named) in blocks of one
    padded expert row at random offsets by ``readers`` threads (the reader pool's queue depth), then deleted;
(ii) RAM copy bandwidth (``torch`` copy of a 256 MB buffer, best of 5);
(iii) the expert GEMM rate at the model's expert shape and dtype (one expert's gate/up + down projections
    for 1 and 64 tokens), with the kernel oneDNN reports for a bf16 matmul of that shape
    (``ONEDNN_VERBOSE=1`` in a subprocess) and the CPU's relevant ``/proc/cpuinfo`` flags;
then per policy and RAM budget a forced-routing replay of the traces through the disk store
(:class:`~.disk_store.ReaderPoolEngine`), in paired passes: all-in-RAM baseline, policy, baseline, ... (``repeats``
policy passes, each against the mean of its neighbouring baselines; median and min-max). The all-in-RAM baseline
is the runtime with every expert resident in RAM slots (capacity 1.0, warmed): the same expert kernels as the disk
runs, so the ratio is what the disk costs; the plain model's forced replay (transformers' experts kernel,
:class:`~.forced.FullLoadReplayer`) is reported beside it. The *bound* of a
policy is the speed its own measured loads allow with full I/O-compute overlap:
``1 / max(reads per token x expert bytes / disk bandwidth, 1 / baseline tokens/s)``; ``achieved_vs_bound`` is
the policy's tokens/s over it.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from expertcast.inference.runtime.disk_store import ALIGN, BUFFERED, DIRECT, aligned_empty, round_up
from expertcast.utils.provenance import code_version

CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


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
    """A model (e.g. a ``--layers`` subset) whose all-in-RAM forced replay is the baseline, when the benchmark
    model's experts do not fit RAM (default: the benchmark model itself, in RAM)."""
    disk_mb: int = 256
    """Size of the temporary file of the disk bandwidth measurement."""
    threads: int = 1
    """torch compute threads."""
    seed: int = 0


@dataclass
class MachineFigures:
    disk_gbps: float
    disk_io_mode: str
    disk_block_bytes: int
    disk_queue_depth: int
    ram_copy_gbps: float
    gemm_gflops_1: float
    gemm_gflops_64: float
    expert_ms_1: float
    gemm_kernel: str
    cpu_flags: list[str] = field(default_factory=list)
    cpu_model: str = ""


# --------------------------------------------------------------------------------------------- machine figures
def disk_bandwidth(folder: str | os.PathLike, size_mb: int, block: int, readers: int, seed: int = 0) -> tuple[float, str]:
    """(GB/s, I/O mode) of direct reads of ``block`` bytes at random aligned offsets of a fresh ``size_mb`` file
    in ``folder`` by ``readers`` threads (deleted afterwards)."""
    block = round_up(block)
    n = max(size_mb * 1_000_000 // block, readers)
    fd, name = tempfile.mkstemp(prefix=".bench-disk-", dir=folder)
    try:
        chunk = np.random.default_rng(seed).integers(0, 256, block, dtype=np.uint8).tobytes()
        with os.fdopen(fd, "wb") as f:
            for _ in range(n):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        mode = DIRECT
        try:
            rfd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            probe = aligned_empty(block)
            os.preadv(rfd, [probe.numpy()], 0)
        except OSError:
            mode = BUFFERED
            rfd = os.open(name, os.O_RDONLY)
        os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
        order = np.random.default_rng(seed).permutation(n)
        parts = np.array_split(order, readers)

        def read(idx: np.ndarray) -> None:
            buf = aligned_empty(block).numpy()
            for i in idx:
                os.preadv(rfd, [buf], int(i) * block)
                if mode == BUFFERED:
                    os.posix_fadvise(rfd, int(i) * block, block, os.POSIX_FADV_DONTNEED)

        ts = [threading.Thread(target=read, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        os.close(rfd)
        return n * block / 1e9 / dt, mode
    finally:
        os.unlink(name)


def ram_bandwidth(mb: int = 256) -> float:
    """GB/s of a torch copy between two ``mb`` buffers (best of 5; bytes copied, not read + written)."""
    a = torch.ones(mb * 1_000_000, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return a.numel() / 1e9 / best


def cpu_info() -> tuple[str, list[str]]:
    """(model name, the flags of :data:`CPU_FLAGS` present) from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor(), []
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    return model, [f for f in CPU_FLAGS if f in flags]


_ONEDNN_PROBE = """
import torch
torch.set_num_threads({threads})
x = torch.randn({n}, {h}).to(torch.{dtype}); w = torch.randn({i2}, {h}).to(torch.{dtype})
for _ in range(3):
    torch.nn.functional.linear(x, w)
"""


def gemm_kernel(hidden: int, inter: int, dtype: str, threads: int, n: int = 64) -> str:
    """The oneDNN implementation that ran a ``dtype`` linear of the expert's gate/up shape (``ONEDNN_VERBOSE=1``
    in a subprocess), e.g. ``brg_matmul:avx512_core_amx``; ``not oneDNN (...)`` when oneDNN printed nothing."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
    code = _ONEDNN_PROBE.format(threads=threads, n=n, h=hidden, i2=2 * inter, dtype=dtype)
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    except (subprocess.TimeoutExpired, OSError) as e:
        return f"unknown ({e})"
    kernels = []
    for ln in out.splitlines():
        if ln.startswith(("onednn_verbose", "dnnl_verbose")) and ",exec," in ln:
            cols = ln.split(",")
            try:
                i = cols.index("exec")
                prim, impl = cols[i + 2], cols[i + 3]
            except (ValueError, IndexError):
                continue
            kernels.append(f"{prim}:{impl}")
    if kernels:
        return max(set(kernels), key=kernels.count)
    return "not oneDNN (torch's own/ATen BLAS kernel; ONEDNN_VERBOSE printed no exec line)"


def gemm_rate(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int, tokens: int, reps: int = 20
              ) -> tuple[float, float]:
    """(GFLOP/s, ms) of one expert forward of ``module`` on ``tokens`` rows (median of ``reps``)."""
    from expertcast.inference.runtime.experts import expert_forward

    dt = next(iter(weights.values())).dtype
    x = torch.randn(tokens, hidden).to(dt)
    flops = 2 * tokens * sum(v.numel() for k, v in weights.items() if not k.endswith("_bias"))
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        expert_forward(module, x, weights)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times[3:]))
    return flops / med / 1e9, med * 1e3


# --------------------------------------------------------------------------------------------- the replay grid
def _traces(cfg: BenchConfig, L: int, E: int, K: int, expert_bytes: int):
    if cfg.traces:
        from expertcast.data.traces import load_traces

        meta, seqs = load_traces(cfg.traces)
        meta.check_compatible(L, E, K, what="benchmark model")
        seqs = [s for s in seqs if s.num_tokens - s.prompt_len >= 4][: cfg.sequences]
        if not seqs:
            raise ValueError(f"{cfg.traces}: no sequence with at least 4 decoded positions")
        return seqs, f"recorded traces {cfg.traces}"
    from expertcast.data.synthetic import zipf_traces

    syn = zipf_traces(num_sequences=cfg.sequences, num_tokens=cfg.prompt + cfg.tokens, num_layers=L, num_experts=E,
                      top_k=K, seed=cfg.seed)
    return syn.sequences, "synthetic zipf routing"


def _policy(name: str, cfg: BenchConfig, seqs):
    from expertcast.inference.policies import make_policy

    if name == "static":
        return make_policy("static", calibration=seqs)
    if name == "seqmoe":
        return make_policy("seqmoe", forecaster=cfg.forecaster)
    return make_policy(name)


def _fingerprint(seqs) -> str:
    from expertcast.utils.provenance import trace_fingerprint

    return trace_fingerprint([s.seq_id for s in seqs], [np.asarray(s.expert_ids).tobytes() for s in seqs])


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure everything (see the module docstring); write ``bench_disk.json``, ``bench_disk.csv``,
    ``bench_disk.png`` under ``cfg.out``; return the JSON record."""
    from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store_from
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.forced import FullLoadReplayer
    from expertcast.inference.runtime.loading import peak_rss_bytes
    from expertcast.inference.runtime.store import HostExpertStore, find_experts_modules
    from expertcast.models.presets import build_from_config, get_config

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.dtype)
    if cfg.model:
        from expertcast.models.backbone import load_moe_model

        model, _ = load_moe_model(cfg.model, dtype=dtype)
        c = model.config.get_text_config()
        cfg.hidden, cfg.moe_intermediate = int(c.hidden_size), int(c.moe_intermediate_size)
        cfg.experts, cfg.top_k = int(c.num_experts), int(c.num_experts_per_tok)
    mcfg = get_config("qwen3_moe-tiny", hidden_size=cfg.hidden, moe_intermediate_size=cfg.moe_intermediate,
                      intermediate_size=2 * cfg.moe_intermediate, num_experts=cfg.experts,
                      num_experts_per_tok=cfg.top_k, num_hidden_layers=cfg.layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=max(cfg.hidden // 4, 8))
    if not cfg.model:
        model = build_from_config(mcfg, seed=cfg.seed, dtype=dtype)
    refs = find_experts_modules(model)
    L, E, K = len(refs), cfg.experts, cfg.top_k
    cfg.layers = L
    ram_store = HostExpertStore.from_model(model, refs=refs)
    xbytes = ram_store.expert_bytes
    disk_path = out / "experts.disk.safetensors"
    write_disk_store_from(ram_store, disk_path, [r.name for r in refs])
    seqs, source = _traces(cfg, L, E, K, xbytes)

    # (i)-(iii): the machine
    stride = round_up(xbytes, ALIGN)
    disk_gbps, disk_mode = disk_bandwidth(out, cfg.disk_mb, stride, cfg.readers, cfg.seed)
    ram_gbps = ram_bandwidth()
    w0 = ram_store.views(0, 0)
    g1, ms1 = gemm_rate(refs[0].module, w0, cfg.hidden, 1)
    g64, _ = gemm_rate(refs[0].module, w0, cfg.hidden, 64)
    cpu_model, flags = cpu_info()
    kernel = gemm_kernel(cfg.hidden, cfg.moe_intermediate, cfg.dtype, cfg.threads)
    mach = MachineFigures(disk_gbps, disk_mode, stride, cfg.readers, ram_gbps, g1, g64, ms1, kernel, flags, cpu_model)
    del ram_store

    # the baseline: the all-in-RAM model under the same forced routing
    if cfg.baseline_model or cfg.model:
        from expertcast.models.backbone import load_moe_model

        base_model, _ = load_moe_model(cfg.baseline_model or cfg.model, dtype=dtype)
    else:
        base_model = build_from_config(copy.deepcopy(mcfg), seed=cfg.seed, dtype=dtype)  # own config: the runtime
        # sets the experts implementation on its model's config
    plain = FullLoadReplayer(base_model)  # the plain model (transformers' experts kernel), reported once
    plain.replay(seqs, max_decode=cfg.tokens)
    plain_tps = plain.replay(seqs, max_decode=cfg.tokens).tokens_per_s
    base_model = plain.close()
    # the baseline: the runtime with every expert resident in RAM slots (the same kernels as the disk runs, so the
    # ratio is the cost of the disk), warmed so that every routed expert is in its slot
    from expertcast.inference.policies import make_policy

    base = OffloadedModel(base_model, make_policy("lru"), 1.0)
    base.replay(seqs, max_decode=cfg.tokens)

    def baseline() -> float:
        return base.replay(seqs, max_decode=cfg.tokens).tokens_per_s

    policies = list(cfg.policies) + (["seqmoe"] if cfg.forecaster and "seqmoe" not in cfg.policies else [])
    rows = []
    disk = DiskExpertStore(disk_path)
    for budget in cfg.budgets:
        cap = max(float(budget), K / E + 1e-9)
        for name in policies:
            b_prev = baseline()
            ratios, speeds, stats = [], [], []
            for _ in range(cfg.repeats):
                om = OffloadedModel(model, _policy(name, cfg, seqs), cap, store=disk, readers=cfg.readers)
                st = om.replay(seqs, max_decode=cfg.tokens)
                om.close()
                b_next = baseline()
                speeds.append(st.tokens_per_s)
                ratios.append(st.tokens_per_s / (0.5 * (b_prev + b_next)))
                stats.append((st, 0.5 * (b_prev + b_next)))
                b_prev = b_next
            i_med = int(np.argsort(speeds)[len(speeds) // 2])
            st, b = stats[i_med]
            tok = max(st.decoded_tokens, 1)
            io_s = st.reads / tok * xbytes / (disk_gbps * 1e9)
            bound = 1.0 / max(io_s, 1.0 / b)
            m = st.metrics()
            rows.append({
                "policy": name, "budget": float(budget), "capacity": cap, "tokens_per_s": st.tokens_per_s,
                "pct_full": 100 * float(np.median(ratios)), "pct_full_min": 100 * min(ratios),
                "pct_full_max": 100 * max(ratios), "full_tokens_per_s": b, "hit": st.hit,
                "exposed_misses_per_token": m["exposed_misses_per_token"],
                "miss_free_token_frac": m["miss_free_token_frac"], "read_mb_per_token": m["read_mb_per_token"],
                "read_gbps": m["read_gbps"], "read_vs_disk": m["read_gbps"] / disk_gbps, "io_overlap": m["io_overlap"],
                "bound_tokens_per_s": bound, "achieved_vs_bound": st.tokens_per_s / bound,
                "reads": st.reads, "loads": st.D + st.P, "late_prefetches": int(st.late.sum()),
                "decoded_tokens": st.decoded_tokens,
            })
    disk.close()
    base.close()
    disk_path.unlink()  # the disk has room for one real-shape store at a time: build, measure, delete
    record = {
        "machine": asdict(mach),
        "model": {"name": cfg.model or "random-weight qwen3_moe", "L": L, "E": E, "K": K, "hidden": cfg.hidden, "moe_intermediate": cfg.moe_intermediate,
                  "dtype": cfg.dtype, "expert_bytes": xbytes, "disk_store_bytes": L * E * stride},
        "rows": rows,
        "plain_model_tokens_per_s": plain_tps,
        "baseline": "the runtime with every expert resident in RAM slots (same kernels), paired passes",
        "peak_rss_bytes": peak_rss_bytes(),
        "bound_definition": "1 / max(reads/token x expert bytes / disk GB/s, 1 / all-in-RAM tokens/s): the policy's "
                            "own loads at the measured disk bandwidth with full I/O-compute overlap",
        "provenance": {"settings": asdict(cfg), "routing": source, "routing_fingerprint": _fingerprint(seqs),
                       "code_version": code_version(), "torch": torch.__version__, "python": sys.version.split()[0],
                       "forecaster_hash": _export_hash(cfg.forecaster), "host": platform.node()},
    }
    _write(out, record)
    return record


def _export_hash(path: str | None) -> str | None:
    if not path:
        return None
    from expertcast.utils.provenance import sha256_files

    return sha256_files(path)


COLUMNS = ["policy", "budget", "capacity", "tokens_per_s", "pct_full", "pct_full_min", "pct_full_max", "hit",
           "exposed_misses_per_token", "miss_free_token_frac", "read_mb_per_token", "read_gbps", "read_vs_disk",
           "io_overlap", "bound_tokens_per_s", "achieved_vs_bound", "reads", "loads"]


def _write(out: Path, record: dict[str, Any]) -> None:
    from expertcast.utils.io import atomic_write_json, print_table, save_figure, write_csv

    m = record["machine"]
    print(f"disk: {m['disk_gbps']:.2f} GB/s ({m['disk_io_mode']}, {m['disk_block_bytes']} B blocks, queue depth "
          f"{m['disk_queue_depth']}); RAM copy: {m['ram_copy_gbps']:.2f} GB/s; expert GEMM: {m['gemm_gflops_1']:.1f} "
          f"GFLOP/s at 1 token ({m['expert_ms_1']:.3f} ms), {m['gemm_gflops_64']:.1f} at 64; kernel {m['gemm_kernel']}; "
          f"CPU {m['cpu_model']} flags {','.join(m['cpu_flags']) or 'none of ' + ','.join(CPU_FLAGS)}")
    print(f"all-in-RAM baseline: {record['baseline']}; the plain model's forced replay: "
          f"{record['plain_model_tokens_per_s']:.1f} tokens/s")
    print_table(record["rows"], title="disk tier: forced-routing replay through the disk store", columns=COLUMNS)
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

