"""Synthetic routing traces with known structure, for tests and benchmarks (no model needed).

Every generator returns a :class:`SyntheticTraces` (``.meta``, ``.sequences`` and the structure that
produced them). Selections are distinct top-K experts per (position, layer) in router order
(descending weight) with normalized float16 weights, the layout of real traces.

* :func:`random_traces`: uniform, independent selections.
* :func:`zipf_traces`: per layer a fixed Zipf(alpha) popularity over a random permutation of the
  experts; each position samples K distinct experts by popularity (Gumbel top-K).
* :func:`markov_traces`: per layer a known row-stochastic transition matrix ``transition[l]`` [E, E]
  over the *first* (highest-weight) expert: position t's selection is the top-K of
  ``log transition[l][first_{t-1}] + Gumbel noise`` (so the first expert follows the Markov chain
  exactly and the others are drawn without replacement from the same row).
* :func:`staged_traces`: planted stages: each stage has its own per-layer popularity (a hot subset of
  experts); stage lengths are geometric; the token at a stage's first position is a cue token id
  (``cue_token``), other tokens are drawn from ``[cue_token + 1, vocab)``. ``stage_ids`` [T] per
  sequence gives the truth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES


@dataclass
class SyntheticTraces:
    meta: TraceMeta
    sequences: list[TraceSequence]
    transition: np.ndarray | None = None
    """[L, E, E] Markov transition matrices (markov_traces)."""
    popularity: np.ndarray | None = None
    """[L, E] (zipf) or [num_stages, L, E] (staged) selection probabilities."""
    stage_ids: list[np.ndarray] = field(default_factory=list)
    """Per sequence int [T] stage index of each position (staged_traces)."""
    cue_token: int | None = None


def _meta(kind: str, L: int, E: int, K: int, expert_bytes: int, extra: dict) -> TraceMeta:
    if K > E:
        raise ValueError(f"top-K {K} exceeds E={E}")
    return TraceMeta(model_id=f"synthetic-{kind}", num_layers=L, num_experts=E, top_k=K,
                     expert_bytes=expert_bytes, dataset="synthetic", generation={"kind": kind, **extra})


def _topk_from_logits(logits: np.ndarray, K: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Gumbel top-K: logits [..., E] -> (ids int16 [..., K] by descending score, weights f16 [..., K])."""
    g = logits + rng.gumbel(size=logits.shape)
    idx = np.argpartition(-g, K - 1, axis=-1)[..., :K]
    sc = np.take_along_axis(g, idx, -1)
    order = np.argsort(-sc, axis=-1, kind="stable")
    idx = np.take_along_axis(idx, order, -1)
    sc = np.take_along_axis(sc, order, -1)
    w = np.exp(sc - sc[..., :1])
    w = w / w.sum(-1, keepdims=True)
    return idx.astype(np.int16), w.astype(np.float16)


def _seq(i: int, ids: np.ndarray, w: np.ndarray, prompt_len: int, rng, vocab: int, tokens=None) -> TraceSequence:
    T = ids.shape[0]
    tok = rng.integers(0, vocab, T).astype(np.int32) if tokens is None else tokens.astype(np.int32)
    return TraceSequence(seq_id=f"syn-{i}", token_ids=tok, prompt_len=min(prompt_len, T), expert_ids=ids,
                         expert_weights=w)


def random_traces(num_sequences: int = 4, num_tokens: int = 64, num_layers: int = 4, num_experts: int = 16,
                  top_k: int = 2, prompt_len: int = 8, seed: int = 0,
                  expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES, vocab: int = 1000) -> SyntheticTraces:
    rng = np.random.default_rng(seed)
    meta = _meta("random", num_layers, num_experts, top_k, expert_bytes, {"seed": seed})
    seqs = []
    for i in range(num_sequences):
        ids, w = _topk_from_logits(np.zeros((num_tokens, num_layers, num_experts)), top_k, rng)
        seqs.append(_seq(i, ids, w, prompt_len, rng, vocab))
    return SyntheticTraces(meta, seqs)


def zipf_popularity(num_layers: int, num_experts: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """[L, E] Zipf(alpha) probabilities over a random permutation of the experts per layer."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64) ** -alpha
    pop = np.stack([ranks[rng.permutation(num_experts)] for _ in range(num_layers)])
    return pop / pop.sum(-1, keepdims=True)


def zipf_traces(num_sequences: int = 4, num_tokens: int = 64, num_layers: int = 4, num_experts: int = 16,
                top_k: int = 2, alpha: float = 1.0, prompt_len: int = 8, seed: int = 0,
                expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES, vocab: int = 1000) -> SyntheticTraces:
    rng = np.random.default_rng(seed)
    meta = _meta("zipf", num_layers, num_experts, top_k, expert_bytes, {"seed": seed, "alpha": alpha})
    pop = zipf_popularity(num_layers, num_experts, alpha, rng)
    logp = np.log(pop)
    seqs = []
    for i in range(num_sequences):
        ids, w = _topk_from_logits(np.broadcast_to(logp, (num_tokens, num_layers, num_experts)), top_k, rng)
        seqs.append(_seq(i, ids, w, prompt_len, rng, vocab))
    return SyntheticTraces(meta, seqs, popularity=pop)


def markov_transition(num_layers: int, num_experts: int, stay: float, concentration: float,
                      rng: np.random.Generator) -> np.ndarray:
    """[L, E, E] row-stochastic matrices: ``stay`` on the diagonal, the rest Dirichlet(concentration)."""
    P = rng.dirichlet(np.full(num_experts, concentration), size=(num_layers, num_experts))
    eye = np.eye(num_experts)[None]
    P = P * (1.0 - eye)
    P = P / P.sum(-1, keepdims=True) * (1.0 - stay) + eye * stay
    return P


def markov_traces(num_sequences: int = 4, num_tokens: int = 64, num_layers: int = 4, num_experts: int = 16,
                  top_k: int = 2, stay: float = 0.5, concentration: float = 0.3, transition: np.ndarray | None = None,
                  prompt_len: int = 8, seed: int = 0, expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES,
                  vocab: int = 1000) -> SyntheticTraces:
    rng = np.random.default_rng(seed)
    L, E, Kk = num_layers, num_experts, top_k
    P = markov_transition(L, E, stay, concentration, rng) if transition is None else np.asarray(transition, float)
    if P.shape != (L, E, E):
        raise ValueError(f"transition must be [L={L}, E={E}, E={E}], got {P.shape}")
    meta = _meta("markov", L, E, Kk, expert_bytes, {"seed": seed, "stay": stay})
    logP = np.log(np.maximum(P, 1e-30))
    N = num_sequences
    ids = np.empty((N, num_tokens, L, Kk), np.int16)
    w = np.empty((N, num_tokens, L, Kk), np.float16)
    layers = np.arange(L)[None, :]
    prev = rng.integers(0, E, (N, L))
    for t in range(num_tokens):  # all sequences in lockstep
        ids[:, t], w[:, t] = _topk_from_logits(logP[layers, prev], Kk, rng)
        prev = ids[:, t, :, 0].astype(np.int64)
    seqs = [_seq(i, ids[i], w[i], prompt_len, rng, vocab) for i in range(N)]
    return SyntheticTraces(meta, seqs, transition=P)


def staged_traces(num_sequences: int = 4, num_tokens: int = 128, num_layers: int = 4, num_experts: int = 16,
                  top_k: int = 2, num_stages: int = 3, hot: int = 4, hot_mass: float = 0.9,
                  mean_stage_len: float = 32.0, prompt_len: int = 8, seed: int = 0, cue_token: int = 7,
                  expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES, vocab: int = 1000) -> SyntheticTraces:
    """Planted stage structure: within a stage, ``hot_mass`` of each layer's routing mass sits on that
    stage's ``hot`` experts; a new stage (a different profile) begins after a geometric length."""
    rng = np.random.default_rng(seed)
    L, E, Kk = num_layers, num_experts, top_k
    if hot < Kk or hot > E:
        raise ValueError(f"hot experts per stage must lie in [K={Kk}, E={E}], got {hot}")
    pop = np.full((num_stages, L, E), (1.0 - hot_mass) / max(E - hot, 1))
    for s in range(num_stages):
        for layer in range(L):
            pop[s, layer, rng.choice(E, hot, replace=False)] = hot_mass / hot
    pop /= pop.sum(-1, keepdims=True)
    meta = _meta("staged", L, E, Kk, expert_bytes, {"seed": seed, "num_stages": num_stages})
    seqs, stages = [], []
    for i in range(num_sequences):
        st = np.empty(num_tokens, np.int64)
        tokens = rng.integers(cue_token + 1, vocab, num_tokens)
        cur = int(rng.integers(num_stages))
        t = 0
        while t < num_tokens:
            n = int(rng.geometric(1.0 / mean_stage_len))
            st[t:t + n] = cur
            if t > 0:
                tokens[t] = cue_token
            t += n
            cur = int((cur + 1 + rng.integers(max(num_stages - 1, 1))) % num_stages) if num_stages > 1 else 0
        ids, w = _topk_from_logits(np.log(pop[st]), Kk, rng)
        seqs.append(_seq(i, ids, w, prompt_len, rng, vocab, tokens=tokens))
        stages.append(st)
    return SyntheticTraces(meta, seqs, popularity=pop, stage_ids=stages, cue_token=cue_token)


# ---------------------------------------------------------------------------------------------- check policies
def untrained_forecaster(num_layers: int, num_experts: int, top_k: int, seed: int = 0):
    """A small randomly initialised :class:`~expertcast.models.forecaster.ExpertForecaster` (eval mode) of the
    given routing shape: a deterministic stand-in for checks that exercise SeqMoE's mechanics, not its quality."""
    import torch
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    torch.manual_seed(seed)
    return ExpertForecaster(ForecasterConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                                             hidden_size=32, num_blocks=1, state_size=8, head_dim=16,
                                             chunk_size=16)).eval()


def check_policy(name: str, model, **seqmoe_kw):
    """The policy of the decode-path checks (tests and ``scripts/gpu_check_graph.py``): ``"lru"``, or ``"seqmoe"``
    with :func:`untrained_forecaster` for ``model``'s routing shape (online forecasts, min_confidence 0.05;
    ``seqmoe_kw`` overrides)."""
    from expertcast.inference.policies import make_policy

    if name == "lru":
        return make_policy("lru")
    if name != "seqmoe":
        raise ValueError(f"check_policy: 'lru' or 'seqmoe', got {name!r}")
    c = model.config
    fc = untrained_forecaster(c.num_hidden_layers, c.num_experts, c.num_experts_per_tok)
    kw = {"precompute": False, "min_confidence": 0.05, **seqmoe_kw}
    return make_policy("seqmoe", forecaster=fc, **kw)
