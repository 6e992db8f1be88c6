"""The exact components of the forecaster against forecast-eval's online baselines (docs/design.md "Exact components")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig, activation_vector
from expertcast.models.forecaster_components import COMPONENT_SCALE, component_names
from expertcast.models.forecaster_recall import element_arrays, evaluate, fit_baselines

torch.set_num_threads(1)
HALF_LIVES = [4.0, 16.0, 64.0]
NAMES = component_names(HALF_LIVES, cross_layer=True, cross_recent=True)


@pytest.fixture(scope="module")
def traces():
    proc = StickyRoutingProcess.realistic(num_layers=3, num_experts=16, top_k=2, seed=0)
    seqs = proc.sample(14, 40, prompt_len=6, seed=1)
    return proc.meta(), seqs[:8], seqs[8:]


def _forecaster(meta, fit, selection) -> ExpertForecaster:
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=meta.num_layers, num_experts=meta.num_experts, top_k=meta.top_k, trigger_layer=1,
                           hidden_size=32, head_dim=16, state_size=8, num_blocks=1, chunk_size=16, direct_horizons=4,
                           online_half_lives=[0.0, 16.0], online_hedge_rate=1.0, learned_gate_rate=20.0,
                           component_half_lives=HALF_LIVES, component_cross_layer=True, component_cross_recent=True,
                           selection=selection)
    m = ExpertForecaster(cfg).eval()
    with torch.no_grad():
        m.head.weight.normal_()  # a learned part that is not zero: the components must replace it exactly
    m.components.fit(fit, cfg.p)
    return m


@pytest.mark.parametrize("name", NAMES)
def test_each_component_reproduces_its_online_baseline_exactly(traces, name):
    """A forecaster whose selection is component c issues the baseline's scores bit for bit (times a power of
    two) at every direct horizon, step after step from a prompt warm-up: its top-K is the baseline's, ties
    broken identically, and forecast-eval's recall table is the baseline's."""
    meta, fit, ev = traces
    c = NAMES.index(name)
    m = _forecaster(meta, fit, [[c] * meta.num_layers for _ in range(4)])
    base = next(b for b in fit_baselines(fit, meta, 1, HALF_LIVES) if b.name == name)
    ids, w, lens, prompts = element_arrays(ev, meta.num_layers, 1)
    B, T = ids.shape[:2]
    x_all = activation_vector(ids, w, meta.num_experts)
    state = m.init_state(B)
    warm = int(prompts.min()) - 1
    m(x_all[:, :warm], state)
    base.reset(B)
    for i in range(warm):
        base.observe(x_all[:, i])
    for i in range(warm, T - 1):
        logits, _ = m.step(x_all[:, i], state, all_horizons=True)
        pred = base.predict(x_all[:, i], 4)
        assert torch.equal(logits, COMPONENT_SCALE * pred), (name, i)
        assert torch.equal(logits.topk(meta.top_k, dim=-1).indices, pred.topk(meta.top_k, dim=-1).indices)
    tables = evaluate(m, ev, meta, [base], horizons=4, progress=False)
    assert np.array_equal(tables["forecaster"].hits_k, tables[name].hits_k)
    assert np.array_equal(tables["forecaster"].hits_k3, tables[name].hits_k3)


def test_selection_is_per_head_and_layer(traces):
    """Layer 0 on repeat-last, layer 1 on transition, layer 2 on the learned part (head 1) / recent-freq
    (heads 2..4): each layer's recall is that predictor's; the learned layer is the forecaster's own."""
    meta, fit, ev = traces
    rl, tr, rf = NAMES.index("repeat-last"), NAMES.index("transition"), NAMES.index("recent-freq")
    sel = [[rl, tr, -1]] + [[rl, tr, rf] for _ in range(3)]
    m = _forecaster(meta, fit, sel)
    bases = fit_baselines(fit, meta, 1, HALF_LIVES)
    t = evaluate(m, ev, meta, bases, horizons=4, progress=False)
    f = t["forecaster"].recall_per_layer()
    assert np.array_equal(f[:, 0], t["repeat-last"].recall_per_layer()[:, 0])
    assert np.array_equal(f[:, 1], t["transition"].recall_per_layer()[:, 1])
    assert np.array_equal(f[1:, 2], t["recent-freq"].recall_per_layer()[1:, 2])
    m.config.selection = None  # the learned part everywhere: layer 2 at head 1 is the same as with the selection
    assert np.array_equal(evaluate(m, ev, meta, (), horizons=1, progress=False)["forecaster"].hits_k[0, 2],
                          t["forecaster"].hits_k[0, 2])


def test_selection_and_component_half_lives_are_validated():
    kw = dict(num_layers=2, num_experts=8, top_k=2, direct_horizons=2)
    with pytest.raises(ValueError, match="selection"):
        ForecasterConfig(**kw, component_half_lives=[16.0], selection=[[0, 5], [0, 0]])  # 5 components: 0..4
    with pytest.raises(ValueError, match="selection"):
        ForecasterConfig(**kw, selection=[[0, 0], [0, 0]])  # no components
    with pytest.raises(ValueError, match="component_half_lives"):
        ForecasterConfig(**kw, component_half_lives=[0.0])
    ForecasterConfig(**kw, component_half_lives=[16.0], selection=[[-1, 4], [2, 1]])  # 4: recent-count


def _with_switch(meta, fit, half_life: float) -> ExpertForecaster:
    """The learned part selected everywhere (random, so poor), with the per-sequence leader over the components."""
    m = _forecaster(meta, fit, [[-1] * meta.num_layers for _ in range(4)])
    with torch.no_grad():
        m.head.weight.mul_(50.0)  # random logits that drown the online prior
    m.config.learned_gate_rate = 0.0  # (the learned gate would damp them towards the prior, not a component)
    m.config.switch_half_life = half_life
    return m


def test_leader_takes_over_where_the_selected_forecast_loses(traces):
    """Per sequence, a (head, layer) whose selected forecast does worse than a component on the targets seen so far
    issues the leading component: a random learned part then costs only the few elements the leader takes to
    notice, while without it it costs its whole gap (docs/design.md "Exact components")."""
    meta, fit, ev = traces
    base = [b for b in fit_baselines(fit, meta, 1, HALF_LIVES) if b.name == "recent-count"]
    off = evaluate(_with_switch(meta, fit, 0.0), ev, meta, base, horizons=4, progress=False)
    on = evaluate(_with_switch(meta, fit, 8.0), ev, meta, base, horizons=4, progress=False)
    r_off, r_on, r_c = (t.recall() for t in (off["forecaster"], on["forecaster"], off["recent-count"]))
    gap_off, gap_on = r_c - r_off, r_c - r_on
    assert (gap_off > 0.05).all(), gap_off  # the random learned part is clearly worse
    assert (gap_on < 0.25 * gap_off).all(), (gap_on, gap_off)


def test_leader_windowed_and_recurrent_passes_agree(traces):
    """The leader's state (history of issued top-K, discounted recalls) carries across calls: one pass over the
    window, and the same elements fed in three chunks, issue the same forecasts."""
    meta, fit, ev = traces
    m = _with_switch(meta, fit, 8.0)
    ids, w, lens, prompts = element_arrays(ev, meta.num_layers, 1)
    x = activation_vector(ids, w, meta.num_experts)
    with torch.no_grad():
        full = m(x, all_horizons=True)
        st = m.init_state(x.shape[0])
        parts = [m(x[:, a:b], st, all_horizons=True) for a, b in ((0, 7), (7, 8), (8, x.shape[1]))]
        one = m.init_state(x.shape[0])
        first = torch.cat([m(x[:, i:i + 1], one) for i in range(x.shape[1])], dim=1)  # step by step, head 1 only
    step = torch.cat(parts, dim=1)
    K = meta.top_k
    assert torch.equal(full.topk(K, dim=-1).indices.sort(-1).values, step.topk(K, dim=-1).indices.sort(-1).values)
    assert torch.allclose(full, step, atol=1e-4)
    assert torch.equal(full[:, :, 0].topk(K, dim=-1).indices.sort(-1).values,
                       first.topk(K, dim=-1).indices.sort(-1).values)


def test_switch_half_life_is_validated_and_round_trips():
    kw = dict(num_layers=2, num_experts=8, top_k=2, direct_horizons=2, component_half_lives=[16.0])
    with pytest.raises(ValueError, match="switch_half_life"):
        ForecasterConfig(**kw, switch_half_life=-1.0)
    c = ForecasterConfig(**kw, selection=[[4, -1], [0, 1]], switch_half_life=64.0)
    assert ForecasterConfig.from_dict(c.to_dict()) == c


def test_cross_layer_is_appended_after_every_other_component():
    """The cross-layer component takes the last index: every other component keeps the index it has without it (an
    export written before it selects the same components)."""
    assert NAMES[:-2] == component_names(HALF_LIVES) and NAMES[-2:] == ["cross-layer", "cross-x-recent"]
    assert component_names(HALF_LIVES, cross_layer=True) == NAMES[:-1]
    kw = dict(num_layers=2, num_experts=8, top_k=2, direct_horizons=2, component_half_lives=[16.0])
    ForecasterConfig(**kw, component_cross_layer=True, selection=[[5, -1], [0, 5]])  # 5: cross-layer
    ForecasterConfig(**kw, component_cross_layer=True, component_cross_recent=True, selection=[[6, 5], [0, 6]])
    with pytest.raises(ValueError, match="selection"):
        ForecasterConfig(**kw, selection=[[5, -1], [0, 0]])  # without it: 0..4
    with pytest.raises(ValueError, match="selection"):
        ForecasterConfig(**kw, component_cross_layer=True, selection=[[6, -1], [0, 0]])  # cross-x-recent absent
    with pytest.raises(ValueError, match="component_cross_layer"):
        ForecasterConfig(num_layers=2, num_experts=8, top_k=2, component_cross_layer=True)  # no components
    with pytest.raises(ValueError, match="component_cross_recent"):  # needs cross-layer
        ForecasterConfig(**kw, component_cross_recent=True)
    with pytest.raises(ValueError, match="component_cross_recent"):  # needs the half-life-16 average
        ForecasterConfig(**dict(kw, component_half_lives=[4.0, 64.0]), component_cross_layer=True,
                         component_cross_recent=True)


def test_cross_x_recent_picks_the_side_a_sequence_favours():
    """Layer 2 of every token is layer 1's experts shifted to one of two sides, the side fixed per sequence: the
    fit set's cross-layer map splits each expert's mass between both sides (recall about .5 there), while
    cross-x-recent, reweighting it by the sequence's recent usage over the fit set's frequency, finds the side
    (measured: recall .90 at layer 2, horizon 1, against .50; its misses are the first decode steps, before the
    sequence's average has left the fit set's prior). A forecaster selecting the component issues the same hits."""
    L, E, K, p = 3, 8, 2, 1
    rng = np.random.default_rng(0)
    seqs = []
    for s in range(16):
        ids = np.zeros((30, L, K), np.int16)
        for t in range(30):
            ids[t, 0] = rng.choice(E, K, replace=False)
            ids[t, 1] = rng.choice(4, K, replace=False)
            ids[t, 2] = ids[t, 1] + 4 * (s % 2)
        seqs.append(TraceSequence(f"s{s}", np.zeros(30, np.int32), 4, ids, np.full((30, L, K), 1 / K, np.float16)))
    meta = TraceMeta(model_id="two-sides", num_layers=L, num_experts=E, top_k=K, expert_bytes=1)
    fit, ev = seqs[:10], seqs[10:]
    bases = [b for b in fit_baselines(fit, meta, p) if b.name in ("cross-layer", "cross-x-recent")]
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=L, num_experts=E, top_k=K, trigger_layer=p, hidden_size=32, head_dim=16,
                           state_size=8, num_blocks=1, chunk_size=16, direct_horizons=2, component_half_lives=[16.0],
                           component_cross_layer=True, component_cross_recent=True, selection=[[6] * L, [6] * L])
    m = ExpertForecaster(cfg).eval()
    m.components.fit(fit, p)
    t = evaluate(m, ev, meta, bases, horizons=2, progress=False)
    cross, prod = t["cross-layer"].recall_per_layer(), t["cross-x-recent"].recall_per_layer()
    assert prod[0, 2] >= 0.85 and cross[0, 2] <= 0.55, (prod, cross)
    assert np.array_equal(t["forecaster"].hits_k, t["cross-x-recent"].hits_k)


def _within_token_traces(num_sequences: int, tokens: int = 40, seed: int = 0):
    """L = 4, E = 8, K = 2, trigger layer 1: layers 0 and 1 of every token drawn uniformly at random (no
    dependence across tokens), layer l = 2, 3 a fixed permutation of the token's layer-1 experts."""
    L, E, K, p = 4, 8, 2, 1
    rng = np.random.default_rng(seed)
    perm = {2: rng.permutation(E), 3: rng.permutation(E)}
    seqs = []
    for s in range(num_sequences):
        ids = np.zeros((tokens, L, K), np.int16)
        for t in range(tokens):
            for layer in (0, 1):
                ids[t, layer] = rng.choice(E, K, replace=False)
            for layer in (2, 3):
                ids[t, layer] = perm[layer][ids[t, 1]]
        seqs.append(TraceSequence(f"s{s}", np.zeros(tokens, np.int32), 4, ids, np.full((tokens, L, K), 1 / K,
                                                                                        np.float16)))
    meta = TraceMeta(model_id="within-token", num_layers=L, num_experts=E, top_k=K, expert_bytes=1)
    return meta, seqs, p


def test_cross_layer_recovers_a_within_token_map_that_transition_cannot():
    """Layer l > p a fixed function of layer p's experts of the same token: the cross-layer baseline finds every
    expert of those layers at horizon 1 (recall 1.0); transition, which maps a layer to itself across tokens, stays
    near chance there. A forecaster selecting the component issues the same recall."""
    meta, seqs, p = _within_token_traces(12)
    fit, ev = seqs[:8], seqs[8:]
    bases = [b for b in fit_baselines(fit, meta, p) if b.name in ("transition", "cross-layer")]
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=4, num_experts=8, top_k=2, trigger_layer=p, hidden_size=32, head_dim=16,
                           state_size=8, num_blocks=1, chunk_size=16, direct_horizons=2, component_half_lives=[16.0],
                           component_cross_layer=True, selection=[[5] * 4, [5] * 4])
    m = ExpertForecaster(cfg).eval()
    m.components.fit(fit, p)
    t = evaluate(m, ev, meta, bases, horizons=2, progress=False)
    cross, trans = t["cross-layer"].recall_per_layer(), t["transition"].recall_per_layer()
    assert (cross[0, p + 1:] == 1.0).all(), cross
    assert (trans[0, p + 1:] < 0.5).all(), trans
    assert np.array_equal(t["forecaster"].hits_k, t["cross-layer"].hits_k)


def test_selection_picks_cross_layer_where_it_wins():
    """On the within-token traces the held-out selection gives head 1's layers after the trigger layer to the
    cross-layer component (the learned part, random, and every other component are far below it there)."""
    from expertcast.train.forecaster_calibration import select_components

    meta, seqs, p = _within_token_traces(12, seed=1)
    torch.manual_seed(0)
    net = ExpertForecaster(ForecasterConfig(num_layers=4, num_experts=8, top_k=2, trigger_layer=p, hidden_size=32,
                                            head_dim=16, state_size=8, num_blocks=1, chunk_size=16, direct_horizons=2,
                                            component_half_lives=[16.0], component_cross_layer=True))
    report = select_components(net, seqs[:6], seqs[6:], meta, refit=seqs)
    cross = net.components.names.index("cross-layer")
    assert net.config.selection[0][p + 1:] == [cross, cross], net.config.selection
    assert report["recall"]["cross-layer"][0] > report["recall"]["transition"][0] + 0.3
    assert net.components.cross_index == cross


def test_step_flops_count_the_cross_layer_table_only_where_it_is_used():
    """A head that selects the cross-layer component adds L·E·E multiply-adds per step (the trigger layer through the
    table, or the previous head through the transition table); a forecaster that carries it unselected pays nothing."""
    kw = dict(num_layers=3, num_experts=8, top_k=2, trigger_layer=0, hidden_size=32, head_dim=16, state_size=8,
              num_blocks=1, direct_horizons=2, component_half_lives=[16.0])
    base = ExpertForecaster(ForecasterConfig(**kw, selection=[[0] * 3, [0] * 3])).step_flops()
    unused = ExpertForecaster(ForecasterConfig(**kw, component_cross_layer=True, selection=[[0] * 3, [0] * 3]))
    one = ExpertForecaster(ForecasterConfig(**kw, component_cross_layer=True, selection=[[5, 0, 0], [0] * 3]))
    two = ExpertForecaster(ForecasterConfig(**kw, component_cross_layer=True, selection=[[0] * 3, [0, 5, 0]]))
    assert unused.step_flops() == base
    assert one.step_flops() == base + 2 * 3 * 8 * 8
    assert two.step_flops() == base + 2 * 2 * 3 * 8 * 8


def test_one_backbone_pass_serves_every_residual_scale(traces):
    """``forward_from_parts`` on one pass's ``forward_parts`` gives, at each residual scale, the logits ``forward``
    gives with that scale (learned gate, selection and leader included), and leaves the parts unchanged: the post-fit
    selection scores its residual-scale grid on one backbone pass per batch."""
    meta, fit, ev = traces
    L = meta.num_layers
    m = _forecaster(meta, fit, [[-1, 3, -1], [0, -1, 5], [-1] * L, [2] * L])
    m.config.switch_half_life = 8.0
    ids, w, _, _ = element_arrays(ev[:3], L, 1)
    x = activation_vector(ids, w, meta.num_experts)
    with torch.no_grad():
        learned, prior = m.forward_parts(x, all_horizons=True)
        kept = (learned.clone(), prior.clone())
        for alpha in (0.0, 0.5, 1.0, 2.0):
            m.config.residual_scale = [alpha] * 4
            ref = m(x, all_horizons=True)
            assert torch.equal(m.forward_from_parts(x, learned, prior, all_horizons=True), ref), alpha
        assert torch.equal(learned, kept[0]) and torch.equal(prior, kept[1])
        assert not torch.equal(m.forward_from_parts(x, learned, prior, all_horizons=True),
                               m.forward_from_parts(x, learned * 0, prior, all_horizons=True))  # the learned part counts
