"""Laying a trace's routing onto a model of another shape (forced routing at real shape; docs/design.md,
"Real shapes"): each rule of :func:`map_trace_to_model`, and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.synthetic import random_traces
from expertcast.data.trace_format import TraceSequence
from expertcast.inference.runtime.forced import map_trace_to_model


def _trace(L=3, E=8, K=4, T=12, n=2):
    return random_traces(num_sequences=n, num_tokens=T, num_layers=L, num_experts=E, top_k=K, seed=1)


def test_same_shape_is_the_identity():
    tr = _trace()
    meta, seqs, m = map_trace_to_model(tr.meta, tr.sequences, 3, 8, 4)
    assert m.layers == "identity" and m.top_k == "identity" and m.unused_experts == 0
    for a, b in zip(tr.sequences, seqs, strict=True):
        assert np.array_equal(a.expert_ids, b.expert_ids) and np.array_equal(a.expert_weights, b.expert_weights)
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (3, 8, 4)


def test_fewer_trace_layers_cycle_and_ids_are_kept_on_a_wider_model():
    tr = _trace(L=3, E=8, K=4)
    meta, seqs, m = map_trace_to_model(tr.meta, tr.sequences, 7, 64, 4)
    assert m.layer_of == (0, 1, 2, 0, 1, 2, 0) and m.layers == "cycled" and m.unused_experts == 56
    s, t = tr.sequences[0], seqs[0]
    assert t.expert_ids.shape == (12, 7, 4)
    for layer in range(7):
        assert np.array_equal(t.expert_ids[:, layer], s.expert_ids[:, layer % 3])
    assert (meta.num_layers, meta.num_experts) == (7, 64)
    assert any("l mod 3" in line for line in m.lines())


def test_larger_trace_k_keeps_the_highest_weights():
    ids = np.array([[[5, 1, 7, 2]]], np.int16)
    w = np.array([[[0.1, 0.4, 0.2, 0.3]]], np.float16)
    tr = _trace(L=1, E=8, K=4, T=1, n=1)
    s = TraceSequence("s", np.array([3], np.int32), 1, ids, w)
    _, (t,), m = map_trace_to_model(tr.meta, [s], 1, 8, 2)
    assert t.expert_ids.tolist() == [[[1, 2]]] and t.expert_weights.astype(float).round(2).tolist() == [[[0.4, 0.3]]]
    assert m.top_k == "top-weights"


def test_more_trace_layers_need_truncate_and_keep_the_first():
    tr = _trace(L=5)
    with pytest.raises(ValueError, match="the trace has 5 MoE layers, the model 2"):
        map_trace_to_model(tr.meta, tr.sequences, 2, 8, 4)
    _, seqs, m = map_trace_to_model(tr.meta, tr.sequences, 2, 8, 4, truncate_layers=True)
    assert m.layers == "first" and np.array_equal(seqs[0].expert_ids, tr.sequences[0].expert_ids[:, :2])


@pytest.mark.parametrize("shape,match", [((3, 4, 4), "names 8 experts per layer, the model has 4"),
                                         ((3, 8, 6), "selects 4 experts per token, the model computes 6")])
def test_refusals(shape, match):
    tr = _trace()
    with pytest.raises(ValueError, match=match):
        map_trace_to_model(tr.meta, tr.sequences, *shape)


def test_unknown_phase_gets_a_one_position_prompt():
    tr = _trace(n=1)
    s = tr.sequences[0]
    s0 = TraceSequence(s.seq_id, s.token_ids, 0, s.expert_ids, s.expert_weights)
    _, (t,), m = map_trace_to_model(tr.meta, [s0], 3, 8, 4)
    assert t.prompt_len == 1 and m.prompt_positions_added == 1
