"""Cache metrics shared by the simulator's :class:`ReplayResult` and the runtime's :class:`RuntimeStats`
(docs/design.md, "Cache semantics"): both hold per-layer int64 [L] counters ``accesses``, ``hits``,
``demand``, ``temp``, ``late``, ``cpu``, ``proactive``, ``dropped`` plus ``expert_bytes`` and ``decoded_tokens``, so they compute Hit/AdjHit/MB-per-token the
same way."""

from __future__ import annotations

import numpy as np


class CacheMetricsMixin:
    """A = accesses, D = demand misses (incl. temporary loads), P = proactive loads."""

    accesses: np.ndarray
    hits: np.ndarray
    demand: np.ndarray
    temp: np.ndarray
    late: np.ndarray
    cpu: np.ndarray
    proactive: np.ndarray
    dropped: np.ndarray
    expert_bytes: int
    decoded_tokens: int

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
    def hit(self) -> float:
        """Hit = 1 − D/A."""
        return 1.0 - self.D / self.A if self.A else float("nan")

    @property
    def adj_hit(self) -> float:
        """AdjHit = (A − D)/(A + P)."""
        return (self.A - self.D) / (self.A + self.P) if self.A else float("nan")

    @property
    def mb_per_token(self) -> float:
        """(D + P) × expert bytes per decoded token, in MB (1e6 bytes)."""
        return (self.D + self.P) * self.expert_bytes / 1e6 / max(self.decoded_tokens, 1)

    def counter_metrics(self) -> dict[str, int | float]:
        """The totals both drivers report, in report order (each adds its own timing fields)."""
        return {
            "accesses": self.A,
            "hits": int(self.hits.sum()),
            "late_prefetches": int(self.late.sum()),
            "demand_misses": self.D,
            "temp_loads": int(self.temp.sum()),
            "proactive_loads": self.P,
            "dropped_prefetches": int(self.dropped.sum()),
            "cpu_exec": int(self.cpu.sum()),
            "hit": self.hit,
        }
