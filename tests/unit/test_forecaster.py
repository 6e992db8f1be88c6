"""The forecaster network: shapes, windowed vs recurrent equivalence, rollout isolation, trigger layer."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    ForecasterState,
    activation_probs,
    activation_vector,
    predictions_to_input,
    trigger_sequence,
)

torch.set_num_threads(1)


def test_activation_vector_normalizes_and_scatters():
    ids = torch.tensor([[[1, 3], [0, 2]]])  # [T=1, L=2, K=2]
    w = torch.tensor([[[3.0, 1.0], [1.0, 1.0]]])
    x = activation_vector(ids, w, 4)
    assert x.shape == (1, 2, 4)
    assert torch.allclose(x[0, 0], torch.tensor([0.0, 0.75, 0.0, 0.25]))
    assert torch.allclose(x.sum(-1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="outside"):
        activation_vector(torch.tensor([[[4, 0]]]), torch.ones(1, 1, 2), 4)


@pytest.mark.parametrize("backbone", ["mamba2", "mamba"])
def test_window_forward_equals_recurrent_steps(backbone, tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg(backbone=backbone)).eval()
    x = activation_inputs(2, 11)
    with torch.no_grad():
        full = m(x)
        assert full.shape == (2, 11, 3, 8)
        st = m.init_state(2)
        stepped = torch.stack([m.step(x[:, i], st)[0] for i in range(11)], dim=1)
        assert torch.allclose(stepped, full, atol=1e-4)
        # a window continuing from a state equals the one-shot window
        st2 = m.init_state(2)
        a, b = m(x[:, :4], st2), m(x[:, 4:], st2)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-4)
        assert st2.steps == 11


def test_rollout_does_not_disturb_next_step(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(2, 6)
    st_a, st_b = m.init_state(2), m.init_state(2)
    for i in range(5):
        la, _ = m.step(x[:, i], st_a)
        m.step(x[:, i], st_b)
        roll = m.rollout(la, st_a, horizon=5)
        assert roll.shape == (2, 5, 3, 8)
        assert torch.equal(roll[:, 0], la)
    na, _ = m.step(x[:, 5], st_a)
    nb, _ = m.step(x[:, 5], st_b)
    assert torch.equal(na, nb)
    for a, b in zip(st_a.conv + st_a.ssm, st_b.conv + st_b.ssm, strict=True):
        assert torch.equal(a, b)


def test_rollout_feeds_predictions_back(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(1, 3)
    st = m.init_state(1)
    for i in range(3):
        lg, _ = m.step(x[:, i], st)
    roll = m.rollout(lg, st, horizon=3)
    manual = st.clone()
    l2, _ = m.step(predictions_to_input(lg, 2), manual)
    l3, _ = m.step(predictions_to_input(l2, 2), manual)
    assert torch.allclose(roll[:, 1], l2, atol=1e-6) and torch.allclose(roll[:, 2], l3, atol=1e-6)


def test_state_rows_select_and_put(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(3, 4)
    st = m.init_state(3)
    for i in range(4):
        m.step(x[:, i], st)
    sub = st.select([2, 0])
    full_next, _ = m.step(x[:, 0], st.clone())
    sub_next, _ = m.step(x[[2, 0], 0], sub)
    assert torch.allclose(sub_next, full_next[[2, 0]], atol=1e-6)
    st.put_rows([2, 0], sub)
    cat = ForecasterState.cat([st.select([0]), st.select([1])])
    assert cat.batch_size == 2


def test_trigger_sequence_layout():
    T, L, E = 4, 3, 5
    acts = torch.arange(T * L * E, dtype=torch.float32).view(T, L, E)
    assert torch.equal(trigger_sequence(acts, L - 1), acts)
    el = trigger_sequence(acts, 0)  # element i: layer 0 of step i+1, layers 1..2 of step i
    assert el.shape == (T - 1, L, E)
    assert torch.equal(el[1, 0], acts[2, 0]) and torch.equal(el[1, 1:], acts[1, 1:])
    # the target of element i is element i+1: layers > p of step i+1 ... (next L layer executions)
    assert torch.equal(el[2, 1:], acts[2, 1:]) and torch.equal(el[2, 0], acts[3, 0])


def test_activation_probs_sum_to_k_and_prediction_format():
    lg = torch.randn(2, 3, 8)
    p = activation_probs(lg, 2)
    assert ((p >= 0) & (p <= 1)).all() and (p.sum(-1) <= 2.0 + 1e-5).all()
    flat = activation_probs(torch.zeros(3, 8), 2)  # uniform routing: each expert 2/8, inclusion sums to K
    assert torch.allclose(flat, torch.full((3, 8), 0.25)) and torch.allclose(flat.sum(-1), torch.full((3,), 2.0))
    x = predictions_to_input(lg, 2)
    assert ((x > 0).sum(-1) == 2).all() and torch.allclose(x.sum(-1), torch.ones(2, 3))


def test_bad_inputs_are_named(tiny_forecaster_cfg):
    with pytest.raises(ValueError, match="top_k"):
        tiny_forecaster_cfg(top_k=8)
    with pytest.raises(ValueError, match="trigger_layer"):
        tiny_forecaster_cfg(trigger_layer=3)
    with pytest.raises(ValueError, match="backbone"):
        tiny_forecaster_cfg(backbone="lstm")
    with pytest.raises(ValueError, match="head_dim"):
        tiny_forecaster_cfg(head_dim=24)
    m = ExpertForecaster(tiny_forecaster_cfg())
    with pytest.raises(ValueError, match=r"L=3, E=8"):
        m(torch.zeros(1, 2, 3, 7))
    with pytest.raises(ValueError, match="batch"):
        m(torch.zeros(2, 1, 3, 8), m.init_state(1))


def test_step_flops_counts_linear_layers(tiny_forecaster_cfg):
    m = ExpertForecaster(tiny_forecaster_cfg())
    n_lin = sum(mod.in_features * mod.out_features for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    assert m.step_flops() >= 2 * n_lin


def test_direct_heads_forward_step_and_rollout(tiny_forecaster_cfg, activation_inputs):
    """H_d direct heads: head 0 is the next-element forecast of the plain forward; rollout up to H_d reads the
    heads without touching the state; beyond H_d it feeds next-element predictions back and reads head H_d."""
    m = ExpertForecaster(tiny_forecaster_cfg(direct_horizons=3)).eval()
    x = activation_inputs(2, 7)
    with torch.no_grad():
        allh = m(x, all_horizons=True)
        assert allh.shape == (2, 7, 3, 3, 8)
        assert torch.allclose(m(x), allh[:, :, 0], atol=1e-6)
    st = m.init_state(2)
    for i in range(7):
        lg, _ = m.step(x[:, i], st, all_horizons=True)
    assert lg.shape == (2, 3, 3, 8) and torch.allclose(lg, allh[:, -1], atol=1e-4)
    before = st.clone()
    short = m.rollout(lg, st, horizon=2)
    assert torch.equal(short, lg[:, :2])
    long = m.rollout(lg, st, horizon=5)
    assert long.shape == (2, 5, 3, 8) and torch.equal(long[:, :3], lg)
    manual = st.clone()
    a, _ = m.step(predictions_to_input(lg[:, 0], 2), manual, all_horizons=True)
    b, _ = m.step(predictions_to_input(a[:, 0], 2), manual, all_horizons=True)
    assert torch.allclose(long[:, 3], a[:, 2], atol=1e-6) and torch.allclose(long[:, 4], b[:, 2], atol=1e-6)
    for s, t in zip(st.conv + st.ssm, before.conv + before.ssm, strict=True):
        assert torch.equal(s, t)  # rollout restored the state
    with pytest.raises(ValueError, match="heads"):
        m.rollout(lg[:, :2], st, horizon=4)
    with pytest.raises(ValueError, match="direct_horizons"):
        tiny_forecaster_cfg(direct_horizons=0)


def test_config_from_older_export_gets_single_head(tiny_forecaster_cfg):
    d = tiny_forecaster_cfg().to_dict()
    d.pop("direct_horizons")
    assert ForecasterConfig.from_dict(d).direct_horizons == 1
