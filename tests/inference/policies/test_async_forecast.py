"""SeqMoE with the forecaster on a worker thread beside decoding (inference/policies/async_forecast.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.async_forecast import AsyncSeqMoEPolicy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)
NEW = 10


def _setup():
    model = build_tiny("qwen3_moe-tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g)
    am = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    c = model.config
    torch.manual_seed(0)
    fc = ExpertForecaster(ForecasterConfig(num_layers=c.num_hidden_layers, num_experts=c.num_experts,
                                           top_k=c.num_experts_per_tok, hidden_size=32, num_blocks=1, state_size=8,
                                           head_dim=16, chunk_size=16)).eval()
    return model, ids, am, ref, fc


def _run(model, pol, ids, am, cap):
    om = OffloadedModel(model, pol, cap, pool="per-layer")
    out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    st = om.stats
    counters = (st.A, st.D, st.P, int(np.sum(st.hits)), st.bytes_moved)
    return out.sequences, counters, om.restore()


def test_blocking_async_equals_synchronous_online_seqmoe():
    """Waiting for each step's forecast reproduces the synchronous online policy exactly (same forecasts,
    same prefetches, same evictions), and the tokens equal the full-load model's."""
    model, ids, am, ref, fc = _setup()
    K = model.config.num_experts_per_tok
    sync = make_policy("seqmoe", forecaster=fc, precompute=False, prefetch_rule="floor")  # the async policy's rule
    seq_s, cnt_s, model = _run(model, sync, ids, am, K + 1)
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(blocking=True), forecaster=fc)
    try:
        seq_a, cnt_a, model = _run(model, pol, ids, am, K + 1)
    finally:
        pol.close()
    assert torch.equal(seq_s, ref) and torch.equal(seq_a, ref)
    assert cnt_s[2] > 0, "the synchronous policy must prefetch for the comparison to mean something"
    assert cnt_a == cnt_s
    assert pol.stats["forecasts"] == sync.stats["forecasts"] > 0
    assert pol.stats["staleness"] == 0


def test_nonblocking_async_keeps_tokens_and_consumes_every_element():
    model, ids, am, ref, fc = _setup()
    K = model.config.num_experts_per_tok
    pol = AsyncSeqMoEPolicy(forecaster=fc)
    try:
        seq, cnt, model = _run(model, pol, ids, am, K)
        pol.worker.drain()
        # 9 prompt positions + NEW - 1 decode forwards, each hands one element to the worker
        assert pol.worker.steps == 9 + NEW - 1
        assert pol.stats["forecasts"] > 0 and pol.worker.rollouts >= 1
        assert pol.worker.rollouts <= pol.worker.steps
    finally:
        pol.close()
    assert torch.equal(seq, ref)
    assert cnt[0] > 0


def test_worker_failure_surfaces_in_the_decoding_thread():
    model, ids, am, ref, fc = _setup()
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(blocking=True), forecaster=fc)

    def broken(*a, **k):
        raise ValueError("forecaster exploded")

    pol.model.step = broken
    try:
        with pytest.raises(RuntimeError, match="forecaster worker failed"):
            _run(model, pol, ids, am, model.config.num_experts_per_tok)
    finally:
        pol.close()
