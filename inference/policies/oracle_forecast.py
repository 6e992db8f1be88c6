"""The oracle forecast: the true future routing of a replayed sequence, degraded to a chosen recall@K
(docs/design.md, "Oracle forecast").

It separates the runtime from the predictor: ``seqmoe:forecast=oracle,recall=R`` runs the same prefetch planner and
probabilistic-Belady eviction as the learned forecaster, with forecasts read from the replayed trace (the simulator's
sequences, the runtime's forced routing) instead of a model. Its tables have the layout of the learned forecaster's
precomputed tables (:func:`~expertcast.inference.policies.seqmoe.precompute_forecasts`): float16 [T', H, L, E], entry
[i, j] the forecast of element i+1+j made after element i (elements: :func:`~expertcast.models.forecaster.
trigger_sequence` at the trigger layer p), zeros past the sequence's end. Unlike a learned forecast, it also covers
the layers after p of the last step (the partial element no further step completes).

Recall R: each forecast (element, horizon, layer) names the K experts of the true top-K, each true expert kept with
probability R; every dropped one is replaced by an expert drawn uniformly from the layer's non-selected ones, so the
forecast still names K experts and its precision equals its recall (false experts at the rate true ones are dropped).
Probabilities are 1 for the named experts and 0 elsewhere. The draws are independent per (element, horizon, layer)
and seeded per sequence (``seed`` and the sequence id), so a table does not depend on which sequences are replayed
with it or in what order. R = 1 is the exact future: with a horizon covering the sequence and gamma <= 0.5 the
eviction score orders residents as Belady does (a test checks the counters).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from expertcast.models.forecaster import ForecasterConfig, trigger_offset
from expertcast.utils.errors import UsageError

FORECAST_SOURCES = ("model", "oracle")
"""Where ``seqmoe`` reads its forecasts: the learned forecaster, or the replayed trace's true future."""


def true_elements(expert_ids: np.ndarray, num_experts: int, p: int, tail: bool = False) -> np.ndarray:
    """bool [T', L, E]: the selected experts of each element of trigger layer ``p`` (element i: layers <= p of step
    i+s, layers > p of step i+s-1; :func:`~expertcast.models.forecaster.trigger_sequence`). ``tail`` (p < L-1): one
    more, partial element, the layers > p of the last step (no step follows it), which the oracle forecasts too."""
    ids = np.asarray(expert_ids, np.int64)
    T, L, _ = ids.shape
    act = np.zeros((T, L, num_experts), bool)
    np.put_along_axis(act, ids, True, axis=-1)
    if p == L - 1:
        return act
    nxt = np.concatenate([act[1:, : p + 1], np.zeros((1, p + 1, num_experts), bool)]) if tail else act[1:, : p + 1]
    return np.concatenate([nxt, act[: len(nxt), p + 1:]], axis=1)


def degrade(truth: np.ndarray, recall: float, rng: np.random.Generator) -> np.ndarray:
    """bool [..., E] like ``truth`` (rows of K true experts, or empty rows): each true expert kept with probability
    ``recall``, each dropped one replaced by a false expert drawn uniformly without replacement from the row's
    others. Empty rows stay empty."""
    if recall >= 1.0:
        return truth.copy()
    keep = truth & (rng.random(truth.shape) < recall)
    dropped = (truth & ~keep).sum(-1, keepdims=True)
    score = np.where(truth, -1.0, rng.random(truth.shape))  # false experts in random order, true ones last
    rank = np.argsort(np.argsort(-score, axis=-1, kind="stable"), axis=-1, kind="stable")
    return keep | (~truth & (rank < dropped))


class OracleForecast:
    """The oracle forecast source of ``seqmoe`` (``forecast=oracle``): tables of the replayed sequences' true future
    routing at recall ``recall``.

    Args:
        recall: in [0, 1], the expected recall@K (= precision) of every forecast.
        seed: the draws' seed (with the sequence id).
        trigger_layer: p; None: L-1 (the forecast covers the next step), as :class:`ForecasterConfig`.
        config: a forecaster's config to take the trigger layer and shape from (the oracle replacing that forecaster).
    """

    def __init__(self, recall: float = 1.0, seed: int = 0, trigger_layer: int | None = None,
                 config: ForecasterConfig | None = None) -> None:
        if not 0.0 <= recall <= 1.0:
            raise UsageError(f"oracle forecast recall must be in [0, 1], got {recall}")
        self.recall = float(recall)
        self.seed = int(seed)
        self.trigger_layer = trigger_layer if config is None else config.trigger_layer
        self.config = config
        self.source = f"oracle(recall={self.recall:g},seed={self.seed})"

    def bind(self, num_layers: int, num_experts: int, top_k: int) -> ForecasterConfig:
        """The config (shape, trigger layer) the oracle forecasts for; a forecaster's config is checked against the
        shape, else one is made."""
        if self.config is not None:
            return self.config
        if self.trigger_layer is not None and not 0 <= self.trigger_layer < num_layers:
            raise UsageError(f"oracle forecast trigger_layer {self.trigger_layer} outside [0, {num_layers - 1}]")
        return ForecasterConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                                trigger_layer=self.trigger_layer)

    def rng(self, seq: Any) -> np.random.Generator:
        key = zlib.crc32(str(getattr(seq, "seq_id", "")).encode())
        return np.random.default_rng([self.seed, key])

    def table(self, seq: Any, config: ForecasterConfig, horizon: int, chunk: int = 256) -> np.ndarray:
        """float16 [T', H, L, E]: the forecasts of ``seq`` (a replayed sequence with ``expert_ids`` [T, L, K])."""
        ids = getattr(seq, "expert_ids", None)
        if ids is None:
            raise UsageError("the oracle forecast reads the replayed routing: it needs sequences with expert_ids "
                             "(a trace replay or forced routing), not live generation")
        el = true_elements(ids, config.num_experts, config.p, tail=True)
        n = len(ids) - trigger_offset(config.num_layers, config.p)  # the forecasts made (elements of the sequence)
        out = np.zeros((n, horizon, config.num_layers, config.num_experts), np.float16)
        rng = self.rng(seq)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            for j in range(horizon):
                lo, hi = a + 1 + j, min(b + 1 + j, len(el))  # targets of origins a..b-1 at horizon j
                if hi <= lo:
                    continue
                out[a: a + hi - lo, j] = degrade(el[lo:hi], self.recall, rng)
        return out

    def tables(self, seqs: Sequence[Any], config: ForecasterConfig, horizon: int) -> list[np.ndarray]:
        return [self.table(s, config, horizon) for s in seqs]


def forecast_recall(table: np.ndarray, expert_ids: np.ndarray, p: int, num_layers: int) -> np.ndarray:
    """float [H]: the measured recall@K of ``table`` ([T', H, L, E]) against ``expert_ids`` [T, L, K] per horizon
    (the forecasts whose target lies inside the sequence)."""
    E = table.shape[-1]
    el = true_elements(expert_ids, E, p, tail=True)
    n, H = table.shape[0], table.shape[1]
    out = np.full(H, np.nan)
    for j in range(H):
        m = min(n, len(el) - 1 - j)
        if m <= 0:
            continue
        hit = (table[:m, j] > 0.5) & el[1 + j: 1 + j + m]
        out[j] = hit.sum() / max(el[1 + j: 1 + j + m].sum(), 1)
    return out
