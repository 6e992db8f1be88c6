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

import numpy as np
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


LAMBDA_CAP = 4.0 ** 60
"""Largest per-layer time lambda of :func:`activation_probs`: a layer with at most K experts of nonzero weight (the
sum never reaches K) gets it, every expert of nonzero weight then at probability 1."""


def activation_probs(logits: torch.Tensor, top_k: int, temperature: float | torch.Tensor = 1.0,
                     tol: float = 1e-10, max_iters: int = 100) -> torch.Tensor:
    """Per-expert probability of being among a layer's K selected experts, from logits [..., L, E].

    The selection is modelled as K draws without replacement in proportion to w = softmax(logits / T)
    (Plackett-Luce). Its inclusion probabilities follow from the exponential-clocks view of that
    sampling, approximated with a per-layer time lambda: P(e) = 1 - exp(-lambda * w_e), with lambda
    solved so that the probabilities sum to K, as a K-subset's inclusion probabilities do (at most
    :data:`LAMBDA_CAP`). ``temperature`` T is the calibration fitted on held-out data
    (:attr:`ForecasterConfig.temperature`).

    The root is found in float64 by Newton's method from below (docs/results.md "Forecaster cost per decode
    step (default model, CPU, contended)"): the sum is concave and increasing in lambda, so from a lambda below the root every step stays below
    it and the steps converge monotonically. The start is below the root because 1 - exp(-x) <= min(1, x):
    lambda >= (K - j) / (the weight outside the j largest), every j < K. It stops when every layer's step is at
    most ``tol`` times its lambda (a few steps; ``max_iters`` bounds them).
    """
    w = torch.softmax(logits.float() / temperature, dim=-1)
    E = w.shape[-1]
    if top_k >= E:
        return torch.ones_like(w)
    few = (w > 0).sum(-1, keepdim=True) <= top_k  # the sum cannot reach K: lambda at the cap
    wn = torch.where(few, 1.0 / E, w.double())  # those layers solved on a stand-in (result discarded)
    top = torch.where(few, 1.0 / E, w.topk(top_k + 1, dim=-1).values.double())  # the K + 1 largest, descending
    v = top[..., -1:]
    # the weight outside them: every weight <= v, less the copies of v among them (ties of v may lie outside)
    rest = (torch.where(wn <= v, wn, 0.0).sum(-1, keepdim=True) - (top == v).sum(-1, keepdim=True) * v).clamp_min(0)
    idx = torch.arange(top_k + 1, device=w.device)
    outside = top @ (idx.view(-1, 1) >= idx).double()[:, :top_k] + rest  # [..., j]: outside the j largest
    lam = ((top_k - idx[:top_k]) / outside).amax(-1, keepdim=True)
    neg = -wn
    for _ in range(max_iters):
        e = torch.exp(lam * neg)
        # sum(1 - e) - K over its slope: <= 0 below the root
        step = ((E - top_k) - e.sum(-1, keepdim=True)) / (wn * e).sum(-1, keepdim=True)
        lam = lam - step
        if not bool((step < -tol * lam).any()):  # every |step| <= tol * lambda (steps are <= 0 up to rounding)
            break
    lam = torch.where(few, LAMBDA_CAP, lam.clamp_max(LAMBDA_CAP)).float()
    return 1 - torch.exp(-lam * w)  # in float32, as the probabilities always were


def inclusion_probs(weights: np.ndarray, top_k: int, tol: float = 1e-10, max_iters: int = 100) -> np.ndarray:
    """:func:`activation_probs` from selection weights ``weights`` [..., E] (each row a distribution, the softmax
    :func:`activation_probs` takes of its logits) in numpy: the same start, Newton steps and stop, for the small
    batches a policy solves on the host within a decode step (the re-plan's, a row per later layer of the token),
    where torch's per-op dispatch costs more than the arithmetic (docs/results.md, "A cheaper re-plan, rounds in rotated order"). float32
    [..., E], equal to :func:`activation_probs` of the same weights up to float rounding (tests)."""
    w = np.asarray(weights, dtype=np.float32)
    E = w.shape[-1]
    if top_k >= E:
        return np.ones_like(w)
    few = (w > 0).sum(-1, keepdims=True) <= top_k  # the sum cannot reach K: lambda at the cap
    wd = w.astype(np.float64)
    wn = np.where(few, 1.0 / E, wd)  # those rows solved on a stand-in (result discarded)
    top = np.where(few, 1.0 / E, -np.sort(-wd, axis=-1)[..., :top_k + 1])  # the K + 1 largest, descending
    v = top[..., -1:]
    rest = np.maximum(np.where(wn <= v, wn, 0.0).sum(-1, keepdims=True) - (top == v).sum(-1, keepdims=True) * v, 0.0)
    outside = np.cumsum(top[..., ::-1], axis=-1)[..., ::-1][..., :top_k] + rest  # [..., j]: outside the j largest
    lam = ((top_k - np.arange(top_k)) / outside).max(-1, keepdims=True)
    for _ in range(max_iters):
        e = np.exp(-lam * wn)
        step = ((E - top_k) - e.sum(-1, keepdims=True)) / (wn * e).sum(-1, keepdims=True)
        lam = lam - step
        if not (step < -tol * lam).any():
            break
    lam = np.where(few, LAMBDA_CAP, np.minimum(lam, LAMBDA_CAP)).astype(np.float32)
    return 1 - np.exp(-lam * w)
