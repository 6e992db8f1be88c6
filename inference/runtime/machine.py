"""The machine's figures the offloaded runtime runs against (docs/design.md, "Disk tier"): direct-read disk bandwidth at
an expert row's block size and the reader pool's queue depth, RAM copy bandwidth, one expert's GEMM rate and the
oneDNN kernel behind it, the CPU's relevant flags, and the RSS high-water mark reset that brackets a measured pass.
The disk benchmark (:mod:`expertcast.recipes.bench_disk`) records them beside every policy's speed."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from expertcast.inference.runtime.disk_store import BUFFERED, DIRECT, aligned_empty, round_up

CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
"""The /proc/cpuinfo flags :func:`cpu_info` reports (bf16 and AMX matmul support)."""


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
    disk_seconds: float = float("nan")
    """How long the disk measurement read."""
    format_gemm: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per expert format: one expert's GEMM rate at 1 and 64 tokens (bf16-equivalent FLOPs), its ms at 1 token and
    bytes per expert."""
    kernel_table: list[dict] = field(default_factory=list)
    """The kernels that ran per quantized shape (``quant.TABLE.to_list()``)."""


# --------------------------------------------------------------------------------------------- machine figures
def disk_bandwidth(folder: str | os.PathLike, size_mb: int, block: int, readers: int, seed: int = 0) -> tuple[float, str]:
    """(GB/s, I/O mode) of direct reads of ``block`` bytes at random aligned offsets of a fresh ``size_mb`` file
    in ``folder`` by ``readers`` threads (deleted afterwards): one pass of :func:`disk_read_rate`."""
    gbps, mode, _ = disk_read_rate(folder, size_mb, block, readers, seed)
    return gbps, mode


def disk_read_rate(folder: str | os.PathLike, size_mb: int, block: int, readers: int, seed: int = 0,
                   min_seconds: float = 0.0) -> tuple[float, str, float]:
    """(GB/s, I/O mode, seconds read) of :func:`disk_bandwidth`'s reads, the file read again in a new random order
    (direct reads: from the disk each time) until at least ``min_seconds`` have passed (a short pass can miss the
    disk's steady rate)."""
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
        rng = np.random.default_rng(seed)

        def read(idx: np.ndarray) -> None:
            buf = aligned_empty(block).numpy()
            for i in idx:
                os.preadv(rfd, [buf], int(i) * block)
                if mode == BUFFERED:
                    os.posix_fadvise(rfd, int(i) * block, block, os.POSIX_FADV_DONTNEED)

        t0 = time.perf_counter()
        passes = 0
        while passes == 0 or time.perf_counter() - t0 < min_seconds:
            ts = [threading.Thread(target=read, args=(p,)) for p in np.array_split(rng.permutation(n), readers)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            passes += 1
        dt = time.perf_counter() - t0
        os.close(rfd)
        return passes * n * block / 1e9 / dt, mode, dt
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


def gemm_rate(module: torch.nn.Module, weights: dict[str, torch.Tensor], hidden: int, tokens: int, reps: int = 20,
              dtype: torch.dtype | None = None) -> tuple[float, float]:
    """(GFLOP/s, ms) of one expert forward of ``module`` on ``tokens`` rows (median of ``reps``); ``weights`` may
    hold quantized weights (:class:`~expertcast.inference.runtime.quant.QWeight`, bf16-equivalent FLOPs), the
    activations then in ``dtype``."""
    from expertcast.inference.runtime.experts import expert_forward

    dt = dtype or next(v.dtype for v in weights.values() if isinstance(v, torch.Tensor))
    x = torch.randn(tokens, hidden).to(dt)
    flops = 2 * tokens * sum(v.numel() if isinstance(v, torch.Tensor) else v.N * v.K  # a QWeight: N x K weights
                             for k, v in weights.items() if not k.endswith("_bias"))
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        expert_forward(module, x, weights)
        times.append(time.perf_counter() - t0)
    med = float(np.median(times[3:]))
    return flops / med / 1e9, med * 1e3
