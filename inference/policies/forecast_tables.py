"""Forecast tables: every forecast of a recorded sequence computed up front (docs/design.md, "Forecaster").

When the batch's sequences are known in advance (simulator replay), the ``seqmoe`` policy computes each
sequence's forecasts at every position once (sequential steps, rollouts batched over positions) and reuses them
across capacities; the results equal the online path's. :func:`combine_members` merges the per-member forecasts
of a batch: P = 1 - prod_b (1 - P_b).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterState,
    activation_vector,
    trigger_sequence,
)


@torch.no_grad()
def precompute_forecasts(model: ExpertForecaster, expert_ids: np.ndarray, expert_weights: np.ndarray, horizon: int,
                         chunk: int = 256) -> np.ndarray:
    """Activation probabilities of every forecast of one sequence.

    Args:
        expert_ids / expert_weights: [T, L, K] routing of the sequence.
    Returns:
        float32 [T', H, L, E]: entry [i, j] is P(active) of element i+1+j forecast after element i
        (T' = number of elements, see :func:`~expertcast.models.forecaster.trigger_sequence`).
    """
    c = model.config
    dev = model.head.weight.device
    ids = torch.from_numpy(np.asarray(expert_ids, dtype=np.int64))
    w = torch.from_numpy(np.asarray(expert_weights, dtype=np.float32))
    el = trigger_sequence(activation_vector(ids, w, c.num_experts), c.p).to(dev)  # [T', L, E]
    n = el.shape[0]
    out = np.zeros((n, horizon, c.num_layers, c.num_experts), np.float32)
    state = model.init_state(1)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        states, logits = [], []
        for i in range(a, b):
            lg, _ = model.step(el[i:i + 1], state, all_horizons=True)
            states.append(state.clone())
            logits.append(lg)
        batch_state = ForecasterState.cat(states)
        roll = model.rollout(torch.cat(logits), batch_state, horizon)  # [b-a, H, L, E]
        out[a:b] = model.probs(roll).cpu().numpy()
    return out


@torch.no_grad()
def precompute_forecasts_many(model: ExpertForecaster, routing: Sequence[tuple[np.ndarray, np.ndarray]], horizon: int,
                              chunk_rows: int = 1024) -> list[np.ndarray]:
    """:func:`precompute_forecasts` for many sequences at once: one batched recurrent step per element index
    (all sequences together, shorter ones padded and their padded outputs discarded) and rollouts batched over
    (sequence, element) rows, ``chunk_rows`` at a time. The Python/launch overhead of a step is then paid once
    per element index instead of once per element of every sequence (the replay's profile was dominated by it).

    Args:
        routing: per sequence (expert_ids [T, L, K], expert_weights [T, L, K]).
    Returns:
        per sequence float32 [T', H, L, E], as :func:`precompute_forecasts` (equal up to float rounding of
        batched matrix products).
    """
    c = model.config
    dev = model.head.weight.device
    if not routing:
        return []
    els = []
    for ids, w in routing:
        ids_t = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        w_t = torch.from_numpy(np.asarray(w, dtype=np.float32))
        els.append(trigger_sequence(activation_vector(ids_t, w_t, c.num_experts), c.p))
    if c.direct_horizons >= horizon:
        return _precompute_direct(model, els, horizon)
    lengths = np.array([len(e) for e in els])
    B, n_max = len(els), int(lengths.max())
    x = torch.zeros(B, n_max, c.num_layers, c.num_experts)
    for b, e in enumerate(els):
        x[b, : len(e)] = e
    x = x.to(dev)
    outs = [np.zeros((int(n), horizon, c.num_layers, c.num_experts), np.float32) for n in lengths]
    state = model.init_state(B, dev)
    per_chunk = max(1, chunk_rows // B)
    for a in range(0, n_max, per_chunk):
        b_end = min(n_max, a + per_chunk)
        states, logits, rows = [], [], []
        for i in range(a, b_end):
            lg, _ = model.step(x[:, i], state, all_horizons=True)
            live = np.flatnonzero(lengths > i)
            states.append(state.select(live.tolist()))
            logits.append(lg[torch.from_numpy(live).to(dev)])
            rows.extend((int(s), i) for s in live)
        roll = model.rollout(torch.cat(logits), ForecasterState.cat(states), horizon)  # [rows, H, L, E]
        probs = model.probs(roll).cpu().numpy()
        for r, (s, i) in enumerate(rows):
            outs[s][i] = probs[r]
    return outs


@torch.no_grad()
def _precompute_direct(model: ExpertForecaster, els: list[torch.Tensor], horizon: int,
                       max_rows: int = 16384) -> list[np.ndarray]:
    """:func:`precompute_forecasts_many` when the direct heads cover ``horizon``: no rollout, so every forecast of
    a sequence comes from one parallel (chunked-scan) forward pass over its elements ``els`` ([T', L, E] each),
    equal to the recurrent steps up to float rounding. Sequences are batched up to ``max_rows`` padded elements
    (causal: padding at the end never changes earlier outputs)."""
    c = model.config
    dev = model.head.weight.device
    outs: list[np.ndarray] = [np.zeros((0,))] * len(els)
    order = sorted(range(len(els)), key=lambda i: len(els[i]))
    a = 0
    while a < len(order):
        b = a + 1
        while b < len(order) and len(els[order[b]]) * (b - a + 1) <= max_rows:
            b += 1
        group = order[a:b]
        n_max = max(len(els[i]) for i in group)
        x = torch.zeros(len(group), n_max, c.num_layers, c.num_experts)
        for r, i in enumerate(group):
            x[r, : len(els[i])] = els[i]
        logits = model(x.to(dev), all_horizons=True)[:, :, :horizon]  # [G, n, H, L, E]
        probs = model.probs(logits).cpu().numpy()
        for r, i in enumerate(group):
            outs[i] = np.ascontiguousarray(probs[r, : len(els[i])])
        a = b
    return outs


def combine_members(per_member: Sequence[np.ndarray]) -> np.ndarray:
    """P(active for any member) = 1 - prod_b (1 - P_b) of per-member [H, L, E] probabilities."""
    miss = np.ones_like(per_member[0])
    for pm in per_member:
        miss *= 1.0 - np.clip(pm, 0.0, 1.0)
    return 1.0 - miss
