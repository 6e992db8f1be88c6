"""Forecaster inputs and outputs as tensors (SeqMoE 3.1, 5.2; docs/design.md "Forecaster").

The activation vector of a decode step (per MoE layer the normalized top-K weights at the active experts, zeros
elsewhere), the trigger-layer elements built from them, and the two ways back from logits: an input-format vector
(rollout, scheduled sampling) and per-expert selection probabilities.

Trigger layer ``p`` (docs/design.md "Forecaster"): the element for step t holds layers <= p of step t and layers > p
of step t-1; its target holds layers > p of step t and layers <= p of step t+1, i.e. the target of
element t is element t+1. :func:`trigger_sequence` builds these elements from a [T, L, E] activation
tensor, so that the model itself only ever does next-element prediction; ``p = L-1`` is plain
next-step forecasting.
"""

from __future__ import annotations

import torch


def activation_vector(expert_ids: torch.Tensor, expert_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Scatter top-K routing into dense per-layer weight vectors.

    Args:
        expert_ids: int [..., L, K] selected experts (any integer dtype).
        expert_weights: float [..., L, K] their router weights (renormalized here to sum to 1 per layer).
        num_experts: E.
    Returns:
        float32 [..., L, E] with the normalized top-K weights at active experts and zeros elsewhere.
    """
    if expert_ids.shape != expert_weights.shape:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} and expert_weights {tuple(expert_weights.shape)} differ")
    ids = expert_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(f"expert ids outside [0, {num_experts}) (range {int(ids.min())}..{int(ids.max())})")
    w = expert_weights.float().clamp_min(0)
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-9)
    out = torch.zeros(*ids.shape[:-1], num_experts, dtype=torch.float32, device=ids.device)
    return out.scatter_add_(-1, ids, w)


def trigger_sequence(acts: torch.Tensor, p: int) -> torch.Tensor:
    """Forecaster elements for trigger layer ``p``.

    Args:
        acts: [..., T, L, E] per-step activation vectors.
        p: trigger layer.
    Returns:
        [..., T', L, E] with element i holding layers <= p of step i+s and layers > p of step i+s-1,
        where s = 0 (T' = T) for p = L-1 and s = 1 (T' = T-1) otherwise. Element i+1 is the target of
        element i.
    """
    L = acts.shape[-2]
    if not 0 <= p < L:
        raise ValueError(f"trigger layer {p} outside [0, {L - 1}]")
    if p == L - 1:
        return acts
    return torch.cat([acts[..., 1:, : p + 1, :], acts[..., :-1, p + 1 :, :]], dim=-2)


def trigger_offset(num_layers: int, p: int) -> int:
    """Step index of the first element of :func:`trigger_sequence` (0 for p = L-1, else 1)."""
    return 0 if p == num_layers - 1 else 1


def predictions_to_input(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Turn per-layer logits into an input-format activation vector (for rollout and scheduled sampling).

    Args:
        logits: [..., L, E].
    Returns:
        [..., L, E] float: softmax probabilities of the predicted top-K, renormalized to sum 1 per layer,
        zeros elsewhere (the format of :func:`activation_vector`).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True).clamp_min(1e-9)
    return torch.zeros_like(probs).scatter_(-1, top_i, top_w)


def activation_probs(logits: torch.Tensor, top_k: int, temperature: float = 1.0, iters: int = 40) -> torch.Tensor:
    """Per-expert probability of being among a layer's K selected experts, from logits [..., L, E].

    The selection is modelled as K draws without replacement in proportion to w = softmax(logits / T)
    (Plackett-Luce). Its inclusion probabilities follow from the exponential-clocks view of that
    sampling, approximated with a per-layer time lambda: P(e) = 1 - exp(-lambda * w_e), with lambda
    solved (bisection) so that the probabilities sum to K, as a K-subset's inclusion probabilities do.
    ``temperature`` T is the calibration fitted on held-out data (:attr:`ForecasterConfig.temperature`).
    """
    w = torch.softmax(logits.float() / temperature, dim=-1)
    E = w.shape[-1]
    if top_k >= E:
        return torch.ones_like(w)
    target = float(top_k)
    lo = torch.zeros(w.shape[:-1] + (1,), device=w.device)
    hi = torch.ones_like(lo)
    for _ in range(60):  # grow hi until the sum reaches K (w_min > 0 so it always does)
        done = (1 - torch.exp(-hi * w)).sum(-1, keepdim=True) >= target
        if bool(done.all()):
            break
        hi = torch.where(done, hi, hi * 4)
    for _ in range(iters):
        mid = (lo + hi) / 2
        big = (1 - torch.exp(-mid * w)).sum(-1, keepdim=True) > target
        hi = torch.where(big, mid, hi)
        lo = torch.where(big, lo, mid)
    return 1 - torch.exp(-hi * w)
