"""Synthetic routing traces with *coherent* adjacent stages: SAEM's premise planted.

:func:`expertcast.inference.sim.synthetic.staged_traces` draws each new stage's profile from a pool different
from the finished one, so the finished stage never predicts the next: the worst case for SAEM's update
rule (only its oracle can win there). SAEM relies on the opposite (paper III: adjacent stages share most
of their experts, TCseq ~0.89): a stage boundary changes *part* of the expert profile. :func:`drifting_stage_traces`
plants that: each layer has ``hot`` experts carrying ``hot_mass`` of the routing mass; at every stage
boundary ``hot - keep`` of them are replaced by experts not hot before, the rest stay; the first token of
a stage is the cue token. Stage lengths are geometric with mean ``mean_stage_len``.
"""

from __future__ import annotations

import numpy as np
from expertcast.inference.cache.cost_model import QWEN3_30B_A3B_EXPERT_BYTES
from expertcast.inference.sim.synthetic import SyntheticTraces, _meta, _seq, _topk_from_logits


def drifting_stage_traces(num_sequences: int = 4, num_tokens: int = 256, num_layers: int = 4, num_experts: int = 32,
                          top_k: int = 2, hot: int = 8, keep: int = 6, hot_mass: float = 0.9,
                          mean_stage_len: float = 64.0, prompt_len: int = 8, seed: int = 0, cue_token: int = 7,
                          expert_bytes: int = QWEN3_30B_A3B_EXPERT_BYTES, vocab: int = 1000) -> SyntheticTraces:
    """Planted stages whose hot sets drift: ``keep`` of the ``hot`` experts of each layer survive a boundary.

    Returns a :class:`~expertcast.inference.sim.synthetic.SyntheticTraces` with ``stage_ids`` (int [T] per
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
