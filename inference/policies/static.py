"""Static-frequency placement (the ktransformers / llama.cpp style): the most frequently selected
experts of calibration traces are placed once and never change.

Per-layer pool: layer ``l`` keeps its ``B_l`` most frequent experts; shared pool: the ``N`` most
frequent ``(layer, expert)`` pairs over all layers. Ties go to the lower expert id (lower layer first in
a shared pool). A selected expert outside the placement is served without being retained: from a
temporary slot (``miss="temp"``, a demand transfer, default) or on the CPU (``miss="cpu"``, the
llama.cpp/ktransformers split). Because misses are never inserted it is not a demand-paging policy and
Belady does not bound it (with one slot, keeping the hotter of two alternating experts beats any
policy that must insert every miss).

Calibration: ``calibration`` is an int array [L, E] of selection counts, or a list of
:class:`~expertcast.data.trace_format.TraceSequence` (all positions counted). Without it the simulator
calibrates on the replayed traces themselves and marks the record ``calibration="in-sample"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from expertcast.inference.cache.options import PolicyOptions, option
from expertcast.inference.cache.policy import MissAction, Policy
from expertcast.inference.cache.spec import PolicySpec

MISS_MODES = {"temp": MissAction.TEMP, "cpu": MissAction.CPU}


def selection_counts(sequences: Sequence, num_layers: int, num_experts: int) -> np.ndarray:
    """int64 [L, E]: how many positions selected each expert, over all positions of ``sequences``."""
    freq = np.zeros((num_layers, num_experts), np.int64)
    for s in sequences:
        ids = np.asarray(s.expert_ids)
        if ids.shape[1] != num_layers:
            raise ValueError(f"calibration sequence {s.seq_id} has {ids.shape[1]} layers, expected {num_layers}")
        if ids.size and int(ids.max()) >= num_experts:
            raise ValueError(f"calibration sequence {s.seq_id} selects expert {int(ids.max())} >= E={num_experts}")
        layer_idx = np.broadcast_to(np.arange(num_layers)[None, :, None], ids.shape)
        np.add.at(freq, (layer_idx.reshape(-1), ids.reshape(-1).astype(np.int64)), 1)
    return freq


class StaticFrequencyPolicy(Policy):
    """Fixed placement of the most frequent experts; misses are not retained."""

    @dataclass
    class Options(PolicyOptions):
        """Fixed placement of the most frequently selected experts."""

        calibration: str | None = option(None, "traces whose selection counts fix the placement (default: the "
                                         "replayed traces, in-sample, or --calibration)", file="traces")
        miss: str = option("temp", "how a non-resident expert is served: temporary slot or CPU",
                           choices=tuple(MISS_MODES))

    name = "static"
    demand_only = True
    bypasses = True
    """Misses are never inserted: not bounded by Belady."""

    def __init__(self, options: Options | None = None, *, calibration: Any = None):
        """``calibration``: selection counts int [L, E] or calibration sequences (the ``calibration`` option's
        trace set, loaded)."""
        super().__init__(options)
        self.miss = self.options.miss
        self.calibration_source = "given" if calibration is not None else None
        self.freq = None if calibration is None else self._as_counts(calibration)

    @staticmethod
    def _as_counts(calibration) -> np.ndarray:
        if isinstance(calibration, np.ndarray):
            if calibration.ndim != 2:
                raise ValueError(f"static calibration counts must be [L, E], got shape {calibration.shape}")
            return calibration.astype(np.int64)
        seqs = list(calibration)
        if not seqs:
            raise ValueError("static placement needs at least one calibration sequence")
        L, E = seqs[0].expert_ids.shape[1], int(max(int(np.asarray(s.expert_ids).max()) for s in seqs)) + 1
        return selection_counts(seqs, L, E)

    def calibrate(self, freq: np.ndarray, source: str) -> None:
        """Set the selection counts [L, E] (the simulator calls this for in-sample calibration)."""
        self.freq = np.asarray(freq, dtype=np.int64)
        self.calibration_source = source

    def placement(self, config) -> list[tuple[int, int]]:
        """The fixed resident set for ``config``'s pools."""
        if self.freq is None:
            raise RuntimeError("static placement has no calibration counts (give calibration= or let the "
                               "simulator calibrate in-sample)")
        L, E = config.num_layers, config.num_experts
        freq = np.zeros((L, E), np.int64)
        fl, fe = min(L, self.freq.shape[0]), min(E, self.freq.shape[1])
        if self.freq.shape[0] != L or self.freq.shape[1] > E:
            raise ValueError(f"static calibration counts have shape {self.freq.shape}, the cache has L={L}, E={E}")
        freq[:fl, :fe] = self.freq[:fl, :fe]
        caps = config.pool_capacities
        out: list[tuple[int, int]] = []
        if config.pool == "per-layer":
            for layer in range(L):
                order = np.argsort(-freq[layer], kind="stable")[: int(caps[layer])]
                out += [(layer, int(e)) for e in sorted(order)]
        else:
            flat = np.argsort(-freq.reshape(-1), kind="stable")[: int(caps[0])]
            out = [(int(i) // E, int(i) % E) for i in sorted(flat)]
        return out

    def warm_start(self, cache):
        return self.placement(cache.config)

    def on_miss(self, t, layer, expert, n_tokens, cache):
        return MISS_MODES[self.miss]

    def choose_victim(self, t, layer, candidates, cache) -> int:
        raise RuntimeError("static placement never evicts")


SPECS = (
    PolicySpec("static", StaticFrequencyPolicy, StaticFrequencyPolicy.Options, engines={"driver", "placement"},
               needs={"calibration"}, help="fixed placement of the most frequent experts"),
)
