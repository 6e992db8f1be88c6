"""The one set of cache counters and the metrics computed from them (docs/design.md, "Cache semantics").

:class:`Counters` holds the eight per-layer int64 [L] counters the driver
(:class:`~expertcast.inference.cache.driver.Driver`) increments on counted (decode) steps, plus the
expert size and the decoded tokens the per-token metrics need. The simulator's
:class:`~expertcast.inference.sim.simulator.ReplayResult` and the runtime's
:class:`~expertcast.inference.runtime.stats.RuntimeStats` are Counters with their own timing fields, so
both compute Hit, AdjHit, MB per token and the prefetch ratios here. A = accesses, D = demand misses (incl.
temporary loads), P = proactive loads, U = proactive loads used before eviction (``prefetch_used``, a subset of P).

Beside them, the tallies the protocol card reads (:mod:`expertcast.inference.sim.card`): ``evictions`` per layer
[L] (residents replaced to make room, on the layer of the load that needed the slot) and, per counted step in
order, ``step_demand`` (its demand misses) and ``step_late`` (its late prefetches). The driver and the simulator's
engines fill them; the graph decode path leaves them empty (they are not among :data:`COUNTER_NAMES`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

COUNTER_NAMES = ("accesses", "hits", "late", "demand", "temp", "cpu", "proactive", "dropped", "prefetch_used")
"""The per-layer counters, in the driver's order. ``prefetch_used``: proactive loads of counted steps that an access
used (on time, or late) before they were evicted, on the layer of the load."""


def hit_rate(A: int, D: int) -> float:
    """Hit = 1 − D/A (NaN without accesses)."""
    return 1.0 - D / A if A else float("nan")


def resident_hit_rate(H: int, A: int) -> float:
    """Resident hits / A: the accesses served from their slot (a CPU-executed access is neither a hit nor a miss,
    a late prefetch no hit; NaN without accesses)."""
    return H / A if A else float("nan")


def adj_hit_rate(A: int, D: int, P: int) -> float:
    """AdjHit = (A − D)/(A + P) (NaN without accesses)."""
    return (A - D) / (A + P) if A else float("nan")


def prefetch_precision(U: int, P: int) -> float:
    """Precision = U/P: proactive loads used before eviction per proactive load (NaN without proactive loads)."""
    return U / P if P else float("nan")


def mb_per_token(D: int, P: int, expert_bytes: int, decoded_tokens: int) -> float:
    """(D + P) × expert bytes per decoded token, in MB (1e6 bytes)."""
    return (D + P) * expert_bytes / 1e6 / max(decoded_tokens, 1)


@dataclass
class Counters:
    """Per-layer int64 [L] counters of counted (decode) steps (zeros when not given), the bytes of one
    expert and the decoded tokens and decode steps they were counted over."""

    num_layers: int
    expert_bytes: int = 0
    accesses: np.ndarray = None  # type: ignore[assignment]
    hits: np.ndarray = None  # type: ignore[assignment]
    late: np.ndarray = None  # type: ignore[assignment]
    demand: np.ndarray = None  # type: ignore[assignment]
    temp: np.ndarray = None  # type: ignore[assignment]
    cpu: np.ndarray = None  # type: ignore[assignment]
    proactive: np.ndarray = None  # type: ignore[assignment]
    dropped: np.ndarray = None  # type: ignore[assignment]
    prefetch_used: np.ndarray = None  # type: ignore[assignment]
    decoded_tokens: int = 0
    decode_steps: int = 0
    reads: int = 0
    """Runtime: expert reads (copies into slots) submitted for counted loads; equals ``D + P`` (every demand,
    temporary and proactive load the driver counts is one read)."""
    read_demand: int = 0
    """Of ``reads``: demand and temporary loads."""
    read_prefetch: int = 0
    """Of ``reads``: proactive loads."""
    read_bytes: int = 0
    """Bytes of ``reads``."""
    read_seconds: float = 0.0
    """Sum of the durations of ``reads`` (readers in parallel each count their own)."""
    read_busy_seconds: float = 0.0
    """Decode time during which at least one read was in progress (disk store's reader pool)."""
    read_exposed: int = 0
    """Counted loads the compute had to wait for (not finished when the expert's kernel was due): exposed misses."""
    evictions: np.ndarray = None  # type: ignore[assignment]
    """int64 [L]: residents evicted on counted steps, on the layer of the load that took their slot."""
    step_demand: list[int] = field(default_factory=list)
    """Demand misses of each counted step, in order (batch 1: of each decoded token)."""
    step_late: list[int] = field(default_factory=list)
    """Late prefetches of each counted step, in order."""
    layer_execs: list[tuple[int, int, int]] = field(default_factory=list)
    """Runtime (eager path): ``(layer, experts computed, demand misses)`` of each counted layer-execution, in
    order: what the dependency-aware bound of the disk benchmark needs (a layer's demand reads overlap only
    that layer's compute; docs/design.md, "Compute order"). Empty in the simulator."""

    def __post_init__(self) -> None:
        for name in COUNTER_NAMES:
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(self.num_layers, np.int64))
        if self.evictions is None:
            self.evictions = np.zeros(self.num_layers, np.int64)

    def open_step(self) -> None:
        """A counted step begins: its per-step tallies start at 0."""
        self.step_demand.append(0)
        self.step_late.append(0)

    @property
    def steps_without_miss(self) -> int:
        """Counted steps with neither a demand miss nor a late prefetch (nothing waited for)."""
        d = np.asarray(self.step_demand, np.int64)
        late = np.asarray(self.step_late, np.int64)
        if len(late) != len(d):  # engines without prefetch fill step_demand only
            late = np.zeros_like(d)
        return int(((d == 0) & (late == 0)).sum())

    def counts(self) -> dict[str, Any]:
        """The fields of :class:`Counters` (not those of a subclass), e.g. to build a subclass from them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Counters)}

    @property
    def A(self) -> int:
        return int(self.accesses.sum())

    @property
    def D(self) -> int:
        return int(self.demand.sum())

    @property
    def P(self) -> int:
        return int(self.proactive.sum())

    @property
    def U(self) -> int:
        return int(self.prefetch_used.sum())

    @property
    def hit(self) -> float:
        """Hit = 1 − D/A."""
        return hit_rate(self.A, self.D)

    @property
    def adj_hit(self) -> float:
        """AdjHit = (A − D)/(A + P)."""
        return adj_hit_rate(self.A, self.D, self.P)

    @property
    def resident_hit(self) -> float:
        """Resident hits / A (late prefetches and CPU-executed accesses are not resident hits)."""
        return resident_hit_rate(int(self.hits.sum()), self.A)

    @property
    def proactive_per_token(self) -> float:
        """P per decoded token."""
        return self.P / max(self.decoded_tokens, 1)

    @property
    def prefetch_precision(self) -> float:
        """U/P: the share of proactive loads an access used before they were evicted (NaN without any)."""
        return prefetch_precision(self.U, self.P)

    @property
    def mb_per_token(self) -> float:
        """(D + P) × expert bytes per decoded token, in MB (1e6 bytes)."""
        return mb_per_token(self.D, self.P, self.expert_bytes, self.decoded_tokens)

    @property
    def bytes_moved(self) -> int:
        """Bytes copied host->device on counted steps (demand, temporary and proactive loads)."""
        return (self.D + self.P) * self.expert_bytes

    def read_metrics(self) -> dict[str, int | float]:
        """The I/O figures of a runtime run (zero in the simulator, which moves no bytes)."""
        tok = max(self.decoded_tokens, 1)
        return {
            "reads": self.reads,
            "read_demand": self.read_demand,
            "read_prefetch": self.read_prefetch,
            "read_mb_per_token": self.read_bytes / 1e6 / tok,
            "read_seconds": self.read_seconds,
            "read_busy_seconds": self.read_busy_seconds,
            "read_gbps": self.read_bytes / 1e9 / self.read_busy_seconds if self.read_busy_seconds > 0 else float("nan"),
            "exposed_misses_per_token": self.read_exposed / tok,
        }

    @property
    def per_layer_hit(self) -> list[float]:
        acc = np.maximum(self.accesses, 1)
        return [float(v) for v in 1.0 - self.demand / acc]

    def counter_metrics(self) -> dict[str, int | float]:
        """The totals both drivers report, in report order (each adds its own timing fields)."""
        return {
            "accesses": self.A,
            "hits": int(self.hits.sum()),
            "late_prefetches": int(self.late.sum()),
            "demand_misses": self.D,
            "temp_loads": int(self.temp.sum()),
            "proactive_loads": self.P,
            "proactive_per_token": self.proactive_per_token,
            "prefetches_used": self.U,
            "prefetch_precision": self.prefetch_precision,
            "dropped_prefetches": int(self.dropped.sum()),
            "cpu_exec": int(self.cpu.sum()),
            "hit": self.hit,
        }
