"""Latency model of in-situ CPU execution vs transfer of a cold expert (SAEM IV-2, docs/design.md "SAEM").

For a selected expert that is not resident, SAEM either transfers it over the host-device link or runs
it on the CPU where its host copy lives, whichever is predicted faster for the ``n`` tokens routed to
it: ``cpu_ms(n) = cpu_expert_ms + n * cpu_token_ms`` (reading the expert's weights from host memory,
then per-token GEMM work) against ``transfer_ms = expert_bytes / bandwidth`` (device compute of the
transferred expert is the same either way and not counted). Few tokens favour the CPU.

When the CPU path runs in parallel with the layer's transfers (``parallel``, the cost model's
``cpu_parallel``), the experts executed on the CPU within one layer queue behind each other, as do the
transfers: :meth:`LatencyModel.prefer_cpu_queued` then compares when the layer would end either way,
given the work already assigned to each path (greedy two-machine list scheduling). At batch 8 a layer
misses many experts; sending all of them to the CPU because each alone is cheaper there would leave the
link idle.

The parameters are those of the simulator's cost model (:class:`expertcast.inference.cache.cost_model.CostConfig`)
by default, so decisions and modelled costs agree; :meth:`LatencyModel.measure_cpu` times a real SwiGLU
expert on this machine's CPU with torch and fits the two CPU parameters by least squares, and
:meth:`LatencyModel.measure` builds the whole model from timed callables (the offloading runtime
measures its own expert on the host, its own transfer and its device compute at start-up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class LatencyModel:
    """Predicted cost (ms) of serving one non-resident expert routed ``n`` tokens."""

    transfer_ms: float
    """Time to move one expert over the host-device link."""
    cpu_expert_ms: float
    """Fixed CPU cost of one expert execution (weights streamed from host memory)."""
    cpu_token_ms: float
    """CPU cost per token routed to the expert."""
    parallel: bool = False
    """CPU work runs in parallel with the layer's transfers and device compute (the cost model's
    ``cpu_parallel``): decide by :meth:`prefer_cpu_queued`, balancing the two paths within a layer."""
    device_ms: float = 0.0
    """Device compute time of one layer (parallel mode: CPU work shorter than it is hidden)."""

    def __post_init__(self) -> None:
        if self.transfer_ms <= 0:
            raise ValueError(f"transfer_ms must be positive, got {self.transfer_ms}")
        if self.cpu_expert_ms < 0 or self.cpu_token_ms < 0 or self.device_ms < 0:
            raise ValueError(f"CPU and device costs must be non-negative, got {self.cpu_expert_ms}, "
                             f"{self.cpu_token_ms}, {self.device_ms}")

    def cpu_ms(self, n_tokens: int | np.ndarray) -> float | np.ndarray:
        """CPU time of one expert for ``n_tokens`` routed tokens."""
        return self.cpu_expert_ms + np.asarray(n_tokens) * self.cpu_token_ms if isinstance(n_tokens, np.ndarray) \
            else self.cpu_expert_ms + n_tokens * self.cpu_token_ms

    def prefer_cpu(self, n_tokens: int) -> bool:
        """True when running the expert on the CPU is predicted strictly faster than transferring it."""
        if n_tokens < 1:
            raise ValueError(f"an accessed expert has at least one routed token, got {n_tokens}")
        return self.cpu_expert_ms + n_tokens * self.cpu_token_ms < self.transfer_ms

    def prefer_cpu_queued(self, n_tokens: int, cpu_busy_ms: float, link_busy_ms: float) -> bool:
        """Parallel mode, one decision of a layer's greedy split: ``cpu_busy_ms`` of CPU work and
        ``link_busy_ms`` of transfers are already assigned in this layer. The layer ends at
        ``max(link + device_ms, cpu)``; True when running this expert on the CPU ends it no later than
        transferring it (ties go to the CPU: the link stays free for prefetches)."""
        if n_tokens < 1:
            raise ValueError(f"an accessed expert has at least one routed token, got {n_tokens}")
        gpu = link_busy_ms + self.device_ms
        on_cpu = max(gpu, cpu_busy_ms + self.cpu_expert_ms + n_tokens * self.cpu_token_ms)
        on_link = max(gpu + self.transfer_ms, cpu_busy_ms)
        return on_cpu <= on_link

    def crossover_tokens(self) -> int:
        """Largest token count for which the CPU is faster (0: never; a large number: always)."""
        if self.cpu_expert_ms >= self.transfer_ms:
            return 0
        if self.cpu_token_ms == 0:
            return np.iinfo(np.int32).max
        n = int(np.ceil((self.transfer_ms - self.cpu_expert_ms) / self.cpu_token_ms)) - 1
        return max(n, 0)

    @classmethod
    def from_cost(cls, cost: Any, expert_bytes: int) -> LatencyModel:
        """The latency model implied by a :class:`~expertcast.inference.cache.cost_model.CostConfig`."""
        eb = int(cost.expert_bytes or expert_bytes)
        if eb <= 0:
            raise ValueError(f"expert_bytes must be positive, got {eb}")
        return cls(transfer_ms=float(cost.transfer_ms(eb)), cpu_expert_ms=float(cost.cpu_expert_ms),
                   cpu_token_ms=float(cost.cpu_token_ms), parallel=bool(getattr(cost, "cpu_parallel", False)),
                   device_ms=float(np.mean(np.atleast_1d(np.asarray(cost.layer_compute_ms, np.float64)))))

    @classmethod
    def measure_cpu(cls, hidden: int, intermediate: int, transfer_ms: float, token_counts: Sequence[int] = (1, 2, 4, 8, 16),
                    dtype: Any = None, repeats: int = 20, threads: int | None = None) -> tuple[LatencyModel, list[dict]]:
        """Fit ``cpu_expert_ms`` and ``cpu_token_ms`` by timing a SwiGLU expert (gate/up [2I, H], down
        [H, I]) on this CPU for each token count; returns the model and the measured points."""
        import torch

        dtype = dtype or torch.float32
        prev = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            g = torch.Generator().manual_seed(0)
            gate_up = torch.randn(2 * intermediate, hidden, generator=g, dtype=dtype) * hidden ** -0.5
            down = torch.randn(hidden, intermediate, generator=g, dtype=dtype) * intermediate ** -0.5

            def expert(x: torch.Tensor) -> torch.Tensor:
                gu = torch.nn.functional.linear(x, gate_up)
                a, b = gu.chunk(2, dim=-1)
                return torch.nn.functional.linear(torch.nn.functional.silu(a) * b, down)

            points = []
            with torch.inference_mode():
                for n in token_counts:
                    x = torch.randn(int(n), hidden, generator=g, dtype=dtype)
                    points.append({"tokens": int(n), "cpu_ms": median_ms(lambda x=x: expert(x), repeats)})
        finally:
            torch.set_num_threads(prev)
        a, b = fit_cpu_line(points)
        return cls(transfer_ms=float(transfer_ms), cpu_expert_ms=a, cpu_token_ms=b), points

    @classmethod
    def measure(cls, cpu_run: Callable[[int], None], copy_one: Callable[[], None], device_run: Callable[[], None], *,
                token_counts: Sequence[int] = (1, 2, 4, 8), repeats: int = 15, parallel: bool = True,
                cpu_floor_ms: Callable[[int], float] | None = None, sync: Callable[[], None] | None = None
                ) -> tuple[LatencyModel, dict[str, Any]]:
        """The latency model of this machine, from timed callables (the runtime gives real ones:
        :meth:`~expertcast.inference.runtime.engine.OffloadedModel.measure_latency`).

        ``cpu_run(n)``: one expert on its host copy for ``n`` tokens; ``copy_one()``: one expert copied
        host -> device (waited for); ``device_run()``: one layer's device compute of resident experts.
        Each is timed ``repeats`` times after a warm-up (median); ``cpu_floor_ms(n)``: an emulated CPU
        time that a measured point is raised to (CPU-device emulation). Returns the model and the
        figures: ``{"transfer_ms", "device_ms", "cpu_points": [{"tokens", "cpu_ms", "measured_ms"}],
        "cpu_expert_ms", "cpu_token_ms", "crossover_tokens", "parallel", "repeats"}``."""
        points = []
        for n in token_counts:
            measured = median_ms(lambda n=n: cpu_run(int(n)), repeats)
            floor = float(cpu_floor_ms(int(n))) if cpu_floor_ms is not None else 0.0
            points.append({"tokens": int(n), "cpu_ms": max(measured, floor), "measured_ms": measured})
        a, b = fit_cpu_line(points)
        transfer = median_ms(copy_one, repeats, sync)
        device = median_ms(device_run, repeats, sync)
        lat = cls(transfer_ms=max(transfer, 1e-6), cpu_expert_ms=a, cpu_token_ms=b, parallel=bool(parallel),
                  device_ms=device)
        figures = {"transfer_ms": lat.transfer_ms, "device_ms": device, "cpu_points": points, "cpu_expert_ms": a,
                   "cpu_token_ms": b, "crossover_tokens": lat.crossover_tokens(), "parallel": lat.parallel,
                   "repeats": int(repeats), "source": "measured at start-up"}
        return lat, figures


def median_ms(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` runs after one warm-up run (``sync`` after
    each run: e.g. a CUDA synchronize)."""
    fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(max(int(repeats), 1)):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def fit_cpu_line(points: Sequence[dict]) -> tuple[float, float]:
    """(cpu_expert_ms, cpu_token_ms): least-squares line ``cpu_ms = a + b * tokens`` through the points,
    both clipped at 0 (one point: all of it fixed cost)."""
    n = np.array([p["tokens"] for p in points], dtype=np.float64)
    y = np.array([p["cpu_ms"] for p in points], dtype=np.float64)
    if len(set(n.tolist())) < 2:
        return float(max(y.mean(), 0.0)), 0.0
    A = np.stack([np.ones_like(n), n], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(max(a, 0.0)), float(max(b, 0.0))
