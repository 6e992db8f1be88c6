"""Synthetic routing traces with known structure, for tests, checks and benchmarks (no model needed).

Trace generators return a :class:`SyntheticTraces` (``.meta``, ``.sequences`` and the structure that
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
* :func:`drifting_stage_traces`: planted stages with *coherent* adjacent stages, SAEM's premise.
  :func:`staged_traces` draws each new stage's profile from a pool different from the finished one, so the
  finished stage never predicts the next: the worst case for SAEM's update rule (only its oracle can win
  there). SAEM relies on the opposite (adjacent stages share most of their experts, TCseq ~0.89): a stage
  boundary changes *part* of the expert profile. Each layer has ``hot`` experts carrying ``hot_mass`` of
  the routing mass; at every stage boundary ``hot - keep`` of them are replaced by experts not hot before,
  the rest stay; the first token of a stage is the cue token. Stage lengths are geometric with mean
  ``mean_stage_len``.

* :func:`baseline_optimal_traces`: traces on which repeat-last, recent-freq or transition in turn is the best
  online predictor (for the forecaster's "never below the online statistics" check).

Routing processes with a known structure, for checks of the forecaster (each samples sequences):

* :class:`ModeMarkovProcess`: a hidden mode z_t follows a first-order Markov chain with transition matrix
  P [M, M]; mode m fixes a top-K expert set S_l(m) and its weights for every layer l. The trace reveals z_t
  (the sets of distinct modes differ), so the Bayes-optimal probability that expert e of layer l is active h
  steps ahead is ``(P^h[z_t] @ I_l)[e]`` with I_l [M, E] the mode-membership indicators, and the
  Bayes-optimal top-K (maximizing expected recall) is the top-K of these marginals.
* :class:`StickyRoutingProcess`: near-uniform in aggregate yet locally sticky, like real MoE routing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from expertcast.data.trace_format import QWEN3_30B_A3B_EXPERT_BYTES, TraceMeta, TraceSequence


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


def drifting_stage_traces(num_sequences: int = 4, num_tokens: int = 256, num_layers: int = 4, num_experts: int = 32,
                          top_k: int = 2, hot: int = 8, keep: int = 6, hot_mass: float = 0.9,
                          mean_stage_len: float = 64.0, prompt_len: int = 8, seed: int = 0, cue_token: int = 7,
                          expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES, vocab: int = 1000) -> SyntheticTraces:
    """Planted stages whose hot sets drift: ``keep`` of the ``hot`` experts of each layer survive a boundary.

    Returns a :class:`SyntheticTraces` with ``stage_ids`` (int [T] per
    sequence) and ``cue_token``; ``popularity`` is None (each stage has its own profile).
    """
    L, E, Kk = num_layers, num_experts, top_k
    if not Kk <= hot <= E:
        raise ValueError(f"hot experts per stage must lie in [K={Kk}, E={E}], got {hot}")
    if not 0 <= keep <= hot or 2 * hot - keep > E:
        raise ValueError(f"keep must lie in [0, hot={hot}] with 2*hot-keep <= E={E} (new experts must exist), got {keep}")
    if not 0.0 < hot_mass < 1.0:
        raise ValueError(f"hot_mass must lie in (0, 1), got {hot_mass}")
    rng = np.random.default_rng(seed)
    meta = _meta("drifting-stages", L, E, Kk, expert_bytes, {"seed": seed, "hot": hot, "keep": keep})
    cold_p, hot_p = (1.0 - hot_mass) / (E - hot), hot_mass / hot
    seqs, stages = [], []
    for i in range(num_sequences):
        hot_sets = [rng.choice(E, hot, replace=False) for _ in range(L)]
        logits = np.empty((num_tokens, L, E))
        st = np.empty(num_tokens, np.int64)
        tokens = rng.integers(cue_token + 1, vocab, num_tokens)
        t, k = 0, 0
        while t < num_tokens:
            if t > 0:
                tokens[t] = cue_token
                for layer in range(L):
                    out = rng.choice(hot_sets[layer], hot - keep, replace=False)
                    fresh = rng.choice(np.setdiff1d(np.arange(E), hot_sets[layer]), hot - keep, replace=False)
                    hot_sets[layer] = np.concatenate([np.setdiff1d(hot_sets[layer], out), fresh])
            n = int(rng.geometric(1.0 / mean_stage_len))
            prof = np.full((L, E), cold_p)
            for layer in range(L):
                prof[layer, hot_sets[layer]] = hot_p
            logits[t:t + n] = np.log(prof)
            st[t:t + n] = k
            t, k = t + n, k + 1
        ids, w = _topk_from_logits(logits, Kk, rng)
        seqs.append(_seq(i, ids, w, prompt_len, rng, vocab, tokens=tokens))
        stages.append(st)
    return SyntheticTraces(meta, seqs, stage_ids=stages, cue_token=cue_token)


BASELINE_OPTIMAL = ("repeat-last", "recent-freq", "transition")
"""The online baselines :func:`baseline_optimal_traces` can make optimal."""


def baseline_optimal_traces(kind: str, num_sequences: int = 40, num_tokens: int = 96, num_layers: int = 3,
                            num_experts: int = 16, top_k: int = 2, prompt_len: int = 8, seed: int = 0
                            ) -> SyntheticTraces:
    """Traces on which the online baseline ``kind`` (one of :data:`BASELINE_OPTIMAL`) is the best predictor:

    * ``repeat-last``: per layer, element t copies element t-1 (experts and weights) with probability 0.8, else a
      fresh uniform selection: the last element is the best guess at every horizon;
    * ``recent-freq``: per sequence and layer a hot set of 3K experts carrying 0.95 of the mass (shares 1/rank),
      each element an independent draw: the sequence's own frequency estimates its favourites, the last element
      is one noisy draw and the fit set's tables know nothing of this sequence's set;
    * ``transition``: :func:`markov_traces` without self-transitions and with peaked rows shared by every
      sequence: the fit set's transition table is the chain, repeating or averaging the past is not.
    """
    if kind not in BASELINE_OPTIMAL:
        raise ValueError(f"kind must be one of {BASELINE_OPTIMAL}, got {kind!r}")
    L, E, Kk = num_layers, num_experts, top_k
    if kind == "transition":
        tr = markov_traces(num_sequences, num_tokens, L, E, Kk, stay=0.0, concentration=0.05, prompt_len=prompt_len,
                           seed=seed)
        tr.meta.generation["kind"] = "baseline-optimal-transition"
        return tr
    rng = np.random.default_rng(seed)
    meta = _meta(f"baseline-optimal-{kind}", L, E, Kk, QWEN3_30B_A3B_EXPERT_BYTES, {"seed": seed})
    seqs = []
    for i in range(num_sequences):
        if kind == "recent-freq":
            hot = 3 * Kk
            if hot > E:
                raise ValueError(f"recent-freq traces need E >= 3K, got E={E}, K={Kk}")
            share = 0.95 / np.arange(1, hot + 1)
            share *= 0.95 / share.sum()
            logits = np.full((L, E), np.log(0.05 / (E - hot)))
            for layer in range(L):
                logits[layer, rng.choice(E, hot, replace=False)] = np.log(share)
            ids, w = _topk_from_logits(np.broadcast_to(logits, (num_tokens, L, E)), Kk, rng)
        else:
            ids, w = _topk_from_logits(np.zeros((num_tokens, L, E)), Kk, rng)
            copy = rng.random((num_tokens, L)) < 0.8
            for t in range(1, num_tokens):
                ids[t, copy[t]] = ids[t - 1, copy[t]]
                w[t, copy[t]] = w[t - 1, copy[t]]
        seqs.append(_seq(i, ids, w, prompt_len, rng, 1000))
    return SyntheticTraces(meta, seqs)


# ---------------------------------------------------------------------------------------------- routing processes
@dataclass
class ModeMarkovProcess:
    """Shapes: ``transition`` [M, M] (rows sum to 1); ``sets`` int [M, L, K]; ``weights`` float [M, L, K]."""

    transition: np.ndarray
    sets: np.ndarray
    weights: np.ndarray
    num_experts: int

    @classmethod
    def random(cls, num_modes: int, num_layers: int, num_experts: int, top_k: int, stickiness: float = 0.3,
               concentration: float = 0.3, seed: int = 0) -> ModeMarkovProcess:
        """A random process: Dirichlet(``concentration``) rows mixed with ``stickiness`` on the diagonal."""
        rng = np.random.default_rng(seed)
        P = rng.dirichlet(np.full(num_modes, concentration), size=num_modes)
        P = (1 - stickiness) * P + stickiness * np.eye(num_modes)
        seen: set[bytes] = set()
        sets = np.zeros((num_modes, num_layers, top_k), dtype=np.int64)
        for m in range(num_modes):
            while True:
                s = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_layers)])
                key = np.sort(s, axis=-1).tobytes()
                if key not in seen:
                    seen.add(key)
                    sets[m] = s
                    break
        w = -np.sort(-rng.dirichlet(np.ones(top_k), size=(num_modes, num_layers)), axis=-1)
        return cls(P, sets, w.astype(np.float32), num_experts)

    @property
    def num_layers(self) -> int:
        return self.sets.shape[1]

    @property
    def top_k(self) -> int:
        return self.sets.shape[2]

    def meta(self) -> TraceMeta:
        return TraceMeta(model_id="synthetic/mode-markov", num_layers=self.num_layers, num_experts=self.num_experts,
                         top_k=self.top_k, expert_bytes=1 << 20, dataset="synthetic")

    def sample(self, num_sequences: int, length: int, prompt_len: int = 0, seed: int = 1
               ) -> tuple[list[TraceSequence], list[np.ndarray]]:
        """Sequences and their mode paths (int [T] each)."""
        rng = np.random.default_rng(seed)
        M = self.transition.shape[0]
        cum = np.cumsum(self.transition, axis=1)
        seqs, modes = [], []
        for i in range(num_sequences):
            z = np.empty(length, dtype=np.int64)
            z[0] = rng.integers(M)
            u = rng.random(length)
            for t in range(1, length):
                z[t] = min(int(np.searchsorted(cum[z[t - 1]], u[t])), M - 1)
            seqs.append(TraceSequence(
                seq_id=f"mm-{seed}-{i}", token_ids=np.zeros(length, dtype=np.int32), prompt_len=prompt_len,
                expert_ids=self.sets[z].astype(np.int16), expert_weights=self.weights[z].astype(np.float16)))
            modes.append(z)
        return seqs, modes

    def membership(self) -> np.ndarray:
        """I [M, L, E]: 1 where expert e is in mode m's set at layer l."""
        M, L, K = self.sets.shape
        ind = np.zeros((M, L, self.num_experts))
        for m in range(M):
            for layer in range(L):
                ind[m, layer, self.sets[m, layer]] = 1.0
        return ind

    def bayes_marginals(self, mode: int, horizon: int) -> np.ndarray:
        """[L, E]: P(e active at layer l, h steps after a step in ``mode``)."""
        ph = np.linalg.matrix_power(self.transition, horizon)[mode]
        return np.einsum("m,mle->le", ph, self.membership())

    def bayes_recall(self, modes: list[np.ndarray], horizon: int, k: int | None = None, start: int = 0) -> float:
        """Expected recall@k of the Bayes-optimal top-k over the targets t+h, t >= ``start`` of ``modes``."""
        k = k or self.top_k
        ind = self.membership()
        Ph = np.linalg.matrix_power(self.transition, horizon)
        marg = np.einsum("zm,mle->zle", Ph, ind)  # [M, L, E]
        top = np.argsort(-marg, axis=-1, kind="stable")[..., :k]  # [M, L, k]
        hits, n = 0.0, 0
        for z in modes:
            for t in range(start, len(z) - horizon):
                nxt = z[t + horizon]
                got = np.take_along_axis(ind[nxt], top[z[t]], axis=-1).sum(-1)  # [L]
                hits += float(got.sum()) / self.top_k
                n += self.num_layers
        return hits / max(n, 1)


@dataclass
class StickyRoutingProcess:
    """Routing that is near-uniform in aggregate yet locally sticky, like real MoE routing (docs/design.md,
    "Generalisation protocol"): normalised entropy of expert use ~0.99, step overlap |S_t ∩ S_t+1| / K ~0.27
    for top-6 of 64, random K/E = 0.09.

    Per layer l: a global popularity ``popularity`` [L, E] (mildly skewed); per sequence a preference
    rho_l ~ Dirichlet(``concentration`` · E · popularity_l) (each sequence favours some experts, the favourites
    differ between sequences, so the aggregate stays near-uniform); per step a persistence shared by all
    layers (``stay`` · 2 · u, u ~ Beta(2, 2), so some tokens change their experts more than others): each
    expert of S_t stays in S_t+1 with that probability and the rest of S_t+1 is drawn from rho_l without
    replacement. Router weights are sorted Dirichlet(1) draws. There is no hidden Bayes-optimal forecast in
    closed form; the online baselines (repeat-last, recent frequency) are strong here by construction.

    Within-token cross-layer dependence (``cross_layer`` > 0; docs/design.md, "Generalisation protocol"): layer l >= 1
    has a fixed successor map ``successor[l]`` [E] (expert of layer l-1 -> expert of layer l, a random function);
    each expert e of the token's layer l-1 selection puts ``successor[l][e]`` into its layer l selection with
    probability ``cross_layer``, before the experts kept from the token's history (the previous step, as above) and
    the draws from rho_l fill the rest. So layer l's experts depend on layer l-1's of the same token and on the
    history; a forecast made at trigger layer p can read layers > p of the same token off layer p's selection.
    0 (the default) is the process above, draw for draw.
    """

    popularity: np.ndarray
    top_k: int
    stay: float = 0.13
    concentration: float = 1.0
    cross_layer: float = 0.0
    successor: np.ndarray | None = None
    """int [L, E]: the successor map of each layer (row 0 unused); needed when ``cross_layer`` > 0."""

    @classmethod
    def realistic(cls, num_layers: int = 4, num_experts: int = 64, top_k: int = 6, skew: float = 0.25,
                  stay: float = 0.13, concentration: float = 1.0, seed: int = 0,
                  cross_layer: float = 0.0) -> StickyRoutingProcess:
        """Defaults give entropy ~0.99 and overlap ~0.27 at top-6 of 64 (tested). ``cross_layer``: see the class
        (the successor maps come from their own generator, so the popularity of a seed does not change)."""
        if not 0.0 <= cross_layer <= 1.0:
            raise ValueError(f"cross_layer must be in [0, 1], got {cross_layer}")
        rng = np.random.default_rng(seed)
        logits = skew * rng.standard_normal((num_layers, num_experts))
        pop = np.exp(logits)
        successor = None
        if cross_layer > 0:
            successor = np.random.default_rng([seed, 1]).integers(0, num_experts, (num_layers, num_experts))
        return cls(pop / pop.sum(-1, keepdims=True), top_k, stay, concentration, cross_layer, successor)

    @property
    def num_layers(self) -> int:
        return self.popularity.shape[0]

    @property
    def num_experts(self) -> int:
        return self.popularity.shape[1]

    def meta(self) -> TraceMeta:
        return TraceMeta(model_id="synthetic/sticky-routing", num_layers=self.num_layers,
                         num_experts=self.num_experts, top_k=self.top_k, expert_bytes=1 << 20, dataset="synthetic")

    def sample(self, num_sequences: int, length: int, prompt_len: int = 0, seed: int = 1,
               prefix: str = "sticky") -> list[TraceSequence]:
        """``num_sequences`` sequences of ``length`` steps (ids ``{prefix}-{seed}-{i}``).

        Draws without replacement use the Gumbel-top-k trick, all sequences and layers at once: S_t+1 is the
        top-K of (+inf for the experts that stay, log rho + Gumbel noise for the others)."""
        rng = np.random.default_rng(seed)
        N, L, E, K = num_sequences, self.num_layers, self.num_experts, self.top_k
        log_rho = self._log_preferences(rng, N)

        def draw(stays: np.ndarray) -> np.ndarray:
            score = log_rho + rng.gumbel(size=log_rho.shape)
            score[stays] = np.inf
            return np.argpartition(-score, K - 1, axis=-1)[..., :K]

        if self.cross_layer > 0:
            ids = self._sample_cross_layer(rng, log_rho, length)
        else:
            ids = np.zeros((N, length, L, K), dtype=np.int64)
            ids[:, 0] = draw(np.zeros((N, L, E), dtype=bool))
            stay = np.clip(self.stay * 2 * rng.beta(2, 2, size=(N, length)), 0, 1)
            for t in range(1, length):
                kept = rng.random((N, L, K)) < stay[:, t, None, None]
                stays = np.zeros((N, L, E), dtype=bool)
                n_i, l_i, k_i = np.nonzero(kept)
                stays[n_i, l_i, ids[n_i, t - 1, l_i, k_i]] = True
                ids[:, t] = draw(stays)
        w = -np.sort(-rng.dirichlet(np.ones(K), size=(N, length, L)), axis=-1)
        return [TraceSequence(seq_id=f"{prefix}-{seed}-{i}", token_ids=np.zeros(length, dtype=np.int32),
                              prompt_len=prompt_len, expert_ids=ids[i].astype(np.int16),
                              expert_weights=w[i].astype(np.float16)) for i in range(N)]

    def _log_preferences(self, rng: np.random.Generator, num_sequences: int) -> np.ndarray:
        """float [N, L, E]: log rho of each sequence, the first draws :meth:`sample` makes from its generator."""
        alpha = self.concentration * self.num_experts * self.popularity  # [L, E]
        rho = np.stack([[rng.dirichlet(alpha[li]) for li in range(self.num_layers)] for _ in range(num_sequences)])
        return np.log(rho + 1e-9)

    def preferences(self, num_sequences: int, seed: int) -> np.ndarray:
        """float [N, L, E]: the true log preferences (log rho) of the sequences ``sample(num_sequences, ..., seed)``
        draws (the same generator, the same first draws)."""
        return self._log_preferences(np.random.default_rng(seed), num_sequences)

    def next_step_probabilities(self, log_rho: np.ndarray, current: np.ndarray, samples: int,
                                rng: np.random.Generator) -> np.ndarray:
        """float [N, L, E]: P(e in S_t+1 | S_t = ``current`` [N, L, K], rho), by ``samples`` Monte Carlo draws of the
        process's own step (the stay probability, the kept experts, the fill from rho): the Bayes-optimal forecast
        of the next step for a forecaster that knew each sequence's true preferences, which no forecaster fitted on
        other sequences knows. Only for ``cross_layer`` 0 (the step is then independent across layers)."""
        if self.cross_layer > 0:
            raise ValueError("next_step_probabilities: only for cross_layer 0 (layers then step independently)")
        N, L, K = current.shape
        E = self.num_experts
        p = np.zeros((N, L, E))
        rows = np.broadcast_to(np.arange(N)[:, None, None], (N, L, K))
        lays = np.broadcast_to(np.arange(L)[None, :, None], (N, L, K))
        for _ in range(samples):
            stay = np.clip(self.stay * 2 * rng.beta(2, 2, size=(N, 1, 1)), 0, 1)
            kept = rng.random((N, L, K)) < stay
            score = log_rho + rng.gumbel(size=(N, L, E))
            score[rows[kept], lays[kept], current[kept]] = np.inf
            sel = np.argpartition(-score, K - 1, axis=-1)[..., :K]
            np.add.at(p, (rows, lays, sel), 1.0)
        return p / samples

    def _sample_cross_layer(self, rng: np.random.Generator, log_rho: np.ndarray, length: int) -> np.ndarray:
        """int64 [N, length, L, K]: :meth:`sample`'s selections with the within-token successor maps, layer by
        layer (each layer's top-K of: successors of the layer below +2e6, experts kept from the previous step +1e6,
        log rho + Gumbel noise; so successors come first, then the history, then the favourites)."""
        if self.successor is None:
            raise ValueError("cross_layer > 0 needs the successor maps (StickyRoutingProcess.realistic makes them)")
        N, L, E = log_rho.shape
        K = self.top_k
        rows = np.arange(N)[:, None]
        ids = np.zeros((N, length, L, K), dtype=np.int64)
        stay = np.clip(self.stay * 2 * rng.beta(2, 2, size=(N, length)), 0, 1)
        for t in range(length):
            kept = rng.random((N, L, K)) < stay[:, t, None, None] if t else np.zeros((N, L, K), bool)
            follow = rng.random((N, L, K)) < self.cross_layer
            for li in range(L):
                score = log_rho[:, li] + rng.gumbel(size=(N, E))
                if t:
                    bonus = np.zeros((N, E))
                    np.maximum.at(bonus, (rows, ids[:, t - 1, li]), np.where(kept[:, li], 1e6, 0.0))
                    score += bonus
                if li:
                    bonus = np.zeros((N, E))
                    np.maximum.at(bonus, (rows, self.successor[li][ids[:, t, li - 1]]), np.where(follow[:, li], 2e6, 0.0))
                    score += bonus
                ids[:, t, li] = np.argpartition(-score, K - 1, axis=-1)[..., :K]
        return ids
