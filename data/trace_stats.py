"""Summary statistics of a trace set: per-layer expert frequency, normalized entropy, step-to-step overlap.

For each phase (``decode``: positions >= prompt_len, ``prefill``: positions < prompt_len) and MoE
layer l, over all sequences:

- ``top1_share`` / ``min_share``: largest / smallest fraction of the layer's K-selections taken by one
  expert (a uniform router gives 1/E for both); ``experts_used``: experts selected at least once.
- ``entropy``: H(f_l) / log E of the layer's selection frequencies f_l (1 = perfectly balanced).
- ``overlap``: mean over consecutive positions t, t+1 of the same phase and sequence of
  |S_t ∩ S_{t+1}| / K, S_t the selected set (temporal locality of routing; what an LRU cache lives on).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.utils.errors import UsageError

PHASES = ("decode", "prefill")


@dataclass
class PhaseAccumulator:
    """Running counts of one phase: selections ``counts`` [L, E], overlap sums [L] and pair counts."""

    counts: np.ndarray
    overlap_sum: np.ndarray
    pairs: int = 0
    tokens: int = 0

    @classmethod
    def empty(cls, L: int, E: int) -> PhaseAccumulator:
        return cls(np.zeros((L, E), dtype=np.int64), np.zeros(L, dtype=np.float64))

    def add(self, ids: np.ndarray, E: int) -> None:
        """``ids`` int [T, L, K] of consecutive positions of one sequence."""
        T, L, K = ids.shape
        if T == 0:
            return
        flat = (np.arange(L)[None, :, None] * E + ids.astype(np.int64)).ravel()
        self.counts += np.bincount(flat, minlength=L * E).reshape(L, E)
        self.tokens += T
        if T > 1:
            inter = (ids[:-1, :, :, None] == ids[1:, :, None, :]).any(-1).sum(-1)  # [T-1, L]
            self.overlap_sum += inter.sum(0) / K
            self.pairs += T - 1


def accumulate(meta: TraceMeta, seqs: Iterable[TraceSequence]) -> dict[str, PhaseAccumulator]:
    L, E = meta.num_layers, meta.num_experts
    acc = {p: PhaseAccumulator.empty(L, E) for p in PHASES}
    for s in seqs:
        acc["prefill"].add(s.expert_ids[:s.prompt_len], E)
        acc["decode"].add(s.expert_ids[s.prompt_len:], E)
    return acc


def _entropy_norm(counts: np.ndarray) -> float:
    tot = counts.sum()
    if tot == 0 or len(counts) < 2:
        return float("nan")
    p = counts[counts > 0] / tot
    return float(-(p * np.log(p)).sum() / np.log(len(counts)))


def trace_stats(meta: TraceMeta, seqs: Iterable[TraceSequence]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Rows (one per phase and layer, plus an ``all`` row per phase = mean over layers) and, per
    phase, the per-layer selection frequencies [L, E] (rows sum to 1; zeros where no tokens)."""
    acc = accumulate(meta, seqs)
    rows: list[dict] = []
    freqs: dict[str, np.ndarray] = {}
    for phase in PHASES:
        a = acc[phase]
        if a.tokens == 0:
            continue
        tot = a.counts.sum(1, keepdims=True)
        f = np.divide(a.counts, tot, out=np.zeros(a.counts.shape, dtype=np.float64), where=tot > 0)
        freqs[phase] = f
        layer_rows = []
        for li in range(meta.num_layers):
            layer_rows.append({
                "phase": phase,
                "layer": li if meta.moe_layers is None else int(meta.moe_layers[li]),
                "tokens": a.tokens,
                "experts_used": int((a.counts[li] > 0).sum()),
                "top1_share": float(f[li].max()),
                "min_share": float(f[li].min()),
                "entropy": _entropy_norm(a.counts[li]),
                "overlap": float(a.overlap_sum[li] / a.pairs) if a.pairs else float("nan"),
            })
        rows += layer_rows
        rows.append({
            "phase": phase, "layer": "all", "tokens": a.tokens,
            "experts_used": float(np.mean([r["experts_used"] for r in layer_rows])),
            "top1_share": float(np.mean([r["top1_share"] for r in layer_rows])),
            "min_share": float(np.mean([r["min_share"] for r in layer_rows])),
            "entropy": float(np.mean([r["entropy"] for r in layer_rows])),
            "overlap": float(a.overlap_sum.sum() / (a.pairs * meta.num_layers)) if a.pairs else float("nan"),
        })
    if not rows:
        raise UsageError("no routed positions in these traces")
    return rows, freqs


def plot_frequencies(freqs: dict[str, np.ndarray], meta: TraceMeta, path: str) -> None:
    """PNG heatmap(s) of per-layer expert selection frequency (one panel per phase)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if p in freqs]
    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 0.3 * meta.num_layers + 2.5), squeeze=False)
    for ax, phase in zip(axes[0], phases, strict=True):
        im = ax.imshow(freqs[phase] * meta.num_experts, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"{phase}: selection frequency x E (1 = uniform)")
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer (decoder index)" if meta.moe_layers else "MoE layer")
        step = max(1, meta.num_layers // 16)
        ticks = list(range(0, meta.num_layers, step))
        ax.set_yticks(ticks)
        ax.set_yticklabels([str(meta.moe_layers[t]) if meta.moe_layers else str(t) for t in ticks])
        fig.colorbar(im, ax=ax)
    from expertcast.utils.paths import display_path

    fig.suptitle(f"{display_path(meta.model_id)}  L={meta.num_layers} E={meta.num_experts} K={meta.top_k}")
    fig.tight_layout()
    import io

    from expertcast.utils.io import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
