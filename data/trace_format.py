"""In-memory form of routing traces (docs/design.md, "Routing traces").

On disk a trace set is a directory of Arrow shards written through `datasets` (see
:mod:`expertcast.data.traces`); in memory every consumer (simulator, forecaster data, SAEM, runtime
replay) sees :class:`TraceMeta` plus a list of :class:`TraceSequence`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

TRACE_FORMAT_VERSION = 1
QWEN3_30B_A3B_EXPERT_BYTES = 3 * 2048 * 768 * 2
"""9,437,184 bytes: one Qwen3-30B-A3B routed expert in bf16 (the expert size of synthetic traces and the
cost model's default)."""


@dataclass
class TraceMeta:
    """Metadata of a trace set (stored in the dataset info and in ``trace_meta.json``)."""

    model_id: str
    """Hub id or local path of the model whose routers were observed."""
    num_layers: int
    """L: number of MoE layers (the trace's layer axis indexes MoE layers, not decoder layers)."""
    num_experts: int
    """E: routed experts per MoE layer."""
    top_k: int
    """K: experts selected per token per layer."""
    expert_bytes: int
    """Bytes of one routed expert's weights at the model's dtype."""
    revision: str | None = None
    moe_layers: list[int] | None = None
    """Decoder-layer index of each MoE layer, when known."""
    dataset: str | None = None
    split: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    """Generation settings (max_new_tokens, sampling, ...) or the source of imported completions."""
    has_router_probs: bool = False
    source_format: str | None = None
    """Layout an imported trace was read from (``expertcast traces import --format``); None: collected here."""
    source_sha256: str | None = None
    """sha256 of the imported file (of a folder: of its files' names and hashes); None: collected here."""
    phase_known: bool = True
    """False when the source does not say which positions were prefill: every position is then stored as decode
    (``prompt_len`` 0) and consumers must say that prefill and decode could not be told apart."""
    has_sources: bool = False
    """Every sequence records its ``source`` (prompt set / dataset), for a fit/eval split by source."""
    format_version: int = TRACE_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceMeta:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    def check_compatible(self, num_layers: int, num_experts: int, top_k: int, what: str = "model") -> None:
        """Raise ValueError naming the mismatch when this trace's L/E/K differ from ``what``'s."""
        mine = (self.num_layers, self.num_experts, self.top_k)
        theirs = (num_layers, num_experts, top_k)
        if mine != theirs:
            raise ValueError(
                f"trace of {self.model_id!r} has L={mine[0]}, E={mine[1]}, K={mine[2]} but the {what} has "
                f"L={theirs[0]}, E={theirs[1]}, K={theirs[2]}: these traces were recorded on another model"
            )


@dataclass
class TraceSequence:
    """Routing of one sequence.

    Shapes: ``token_ids`` int32 [T]; ``expert_ids`` int16 [T, L, K] (router order);
    ``expert_weights`` float16 [T, L, K] (normalized top-K weights); ``router_probs`` float16
    [T, L, E] or None. Positions ``< prompt_len`` are prefill, the rest decode. ``source``: the prompt set or
    dataset the sequence came from, when the trace records it.
    """

    seq_id: str
    token_ids: np.ndarray
    prompt_len: int
    expert_ids: np.ndarray
    expert_weights: np.ndarray
    router_probs: np.ndarray | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        T = len(self.token_ids)
        if self.expert_ids.ndim != 3 or self.expert_ids.shape[0] != T:
            raise ValueError(f"sequence {self.seq_id}: expert_ids must be [T={T}, L, K], got {self.expert_ids.shape}")
        if self.expert_weights.shape != self.expert_ids.shape:
            raise ValueError(
                f"sequence {self.seq_id}: expert_weights {self.expert_weights.shape} != expert_ids {self.expert_ids.shape}"
            )
        if self.router_probs is not None and self.router_probs.shape[:2] != self.expert_ids.shape[:2]:
            raise ValueError(f"sequence {self.seq_id}: router_probs {self.router_probs.shape} do not match [T, L, E]")
        if not 0 <= self.prompt_len <= T:
            raise ValueError(f"sequence {self.seq_id}: prompt_len {self.prompt_len} outside [0, {T}]")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_expert_ids(self) -> np.ndarray:
        """[T - prompt_len, L, K] routing of the decoded positions."""
        return self.expert_ids[self.prompt_len:]


def sequences_fingerprint(sequences: list[TraceSequence]) -> str:
    """sha256 of a set of traced sequences: their ids with their token ids and routing (order-free).

    Two trace sets with the same fingerprint hold the same sequences with the same routing, whatever
    their shard layout; exports record it so a run can say exactly which data trained it.
    """
    from expertcast.utils.provenance import trace_fingerprint

    return trace_fingerprint([s.seq_id for s in sequences],
                             [s.token_ids.tobytes() + b"|" + s.expert_ids.tobytes() + b"|" + str(s.prompt_len).encode()
                              for s in sequences])
