"""Prefetch under spread probability (expected-benefit rule) and the hybrid policy's parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data import synthetic
from expertcast.inference.cache.expert_cache import Budget, CacheConfig, ExpertCache, SlotState
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.hybrid import HybridPolicy, parse_parts
from expertcast.inference.policies.prefetch import (
    chance_level,
    displaced_scores,
    expected_benefit,
    generate_tasks,
)
from expertcast.inference.policies.router import RouterRecord, RouterReplay
from expertcast.inference.policies.seqmoe import SeqMoEPolicy
from expertcast.inference.sim.simulator import simulate
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)
L, E, K = 3, 8, 2


def _forecaster() -> ExpertForecaster:
    torch.manual_seed(0)
    return ExpertForecaster(ForecasterConfig(num_layers=L, num_experts=E, top_k=K, hidden_size=32, head_dim=16,
                                             state_size=8, num_blocks=1)).eval()


def _traces():
    return synthetic.markov_traces(num_sequences=2, num_tokens=40, num_layers=L, num_experts=E, top_k=K, seed=1)


# ---------------------------------------------------------------------------------------------- benefit rule
def test_generate_tasks_ranks_by_value_and_drops_non_positive_benefit():
    probs = np.array([[0.15, 0.12, 0.11, 0.0]])
    value = np.array([[-0.1, 0.3, 0.05, 0.9]])
    tasks = generate_tasks(probs, np.array([4.0]), None, max_per_layer=2, min_confidence=0.1, value=value)
    assert [(t.expert, t.confidence) for t in tasks] == [(1, 0.3), (2, 0.05)]  # 0: no benefit; 3: p = 0
    assert expected_benefit(np.ones((2, 3)), np.array([0.25, 1.5])).tolist() == [[0.75] * 3, [-0.5] * 3]
    assert chance_level(64, 6) == pytest.approx(0.09375)


def _spread_policy(rule: str) -> tuple[SeqMoEPolicy, ExpertCache]:
    """A policy holding a spread forecast (two favourites per layer at 0.3, the rest at 0.15; chance K/E = 0.25)
    and an empty cache of 3 slots per layer."""
    pol = SeqMoEPolicy(SeqMoEPolicy.Options(prefetch_rule=rule), forecaster=_forecaster())
    cfg = CacheConfig(num_layers=L, num_experts=E, top_k=K, pool="per-layer", budget=Budget.slots(3))
    pol.reset(cfg)
    cache = ExpertCache(cfg)
    F = np.full((pol.horizon, L, E), 0.15)
    F[:, :, :2] = 0.3
    pol.first_probs = F[0]
    pol.score_before = np.einsum("h,hle->le", pol.disc, F)
    pol.score_after = pol.score_before - F[0]
    pol.first_exec = np.arange(L) + L
    pol.has_forecast = True
    return pol, cache


def test_benefit_rule_prefetches_spread_forecasts_the_floor_rule_ignores():
    floor, cache = _spread_policy("floor")
    assert {(t.layer, t.expert) for t in floor._generate(cache)} == {(lyr, e) for lyr in range(L) for e in (0, 1)}
    benefit, cache = _spread_policy("benefit")
    assert {(t.layer, t.expert) for t in benefit._generate(cache)} == {(lyr, e) for lyr in range(L) for e in (0, 1)}
    assert displaced_scores(cache, benefit._scores).tolist() == [0.0] * L  # free slots: nothing displaced
    benefit.min_confidence, floor.min_confidence = 0.5, 0.5  # a floor above every forecast
    assert floor._generate(cache) == []
    assert len(benefit._generate(cache)) == 2 * L  # capped at chance K/E = 0.25: the favourites still go


def test_benefit_rule_never_displaces_a_resident_worth_more():
    pol, cache = _spread_policy("benefit")
    for lyr in range(L):
        for e in (5, 6, 7):  # a full cache of outsiders
            cache.assign(cache.take_free_slot(cache.pool_of(lyr)), lyr, e, SlotState.USED)
    pol._now = (1, 0, 0)
    assert len(pol._generate(cache)) == 2 * L  # the favourites are worth more than the outsiders
    pol.score_before[:, 5:] = 5.0  # now every resident a load would displace is worth more than any load
    pol.score_after[:, 5:] = 5.0
    assert pol._generate(cache) == []


# ---------------------------------------------------------------------------------------------- hybrid
def test_parts_parsing_and_missing_inputs():
    assert parse_parts("auto", False, False) == ("forecast",)
    assert parse_parts("auto", True, True) == ("forecast", "routers", "stage")
    assert parse_parts("stage+forecast", False, True) == ("stage", "forecast")
    with pytest.raises(ValueError, match="subset of forecast, routers, stage"):
        parse_parts("forecast+oracle", True, True)
    with pytest.raises(ValueError, match="needs the routers' scores"):
        parse_parts("routers", False, True)
    with pytest.raises(ValueError, match="needs stage cues"):
        HybridPolicy(HybridPolicy.Options(parts="stage"), forecaster=_forecaster())
    with pytest.raises(UsageError, match="parts"):
        from expertcast.inference.policies import parse_policy_options

        parse_policy_options("hybrid:parts=forecast+belady")


def test_forecast_part_alone_equals_seqmoe():
    fc = _forecaster()
    recs = simulate(_traces(), [make_policy("seqmoe", forecaster=fc, min_confidence=0.05),
                                make_policy("hybrid", forecaster=fc, parts="forecast", min_confidence=0.05)],
                    [0.5], progress=False, belady_fraction=False)
    keys = ("hit", "adj_hit", "mb_per_token", "proactive_loads", "demand_misses")
    assert [recs[0][k] for k in keys] == [recs[1][k] for k in keys]


def _oracle_replay(tr) -> RouterReplay:
    """p_R = the current selection, p_T = the next token's selection (a perfect temporal router)."""
    recs = {}
    for s in tr.sequences:
        T = s.num_tokens
        cur = np.zeros((T, L, E), np.float32)
        np.put_along_axis(cur, s.expert_ids.astype(np.int64), 1.0 / K, axis=2)
        nxt = np.zeros_like(cur)
        nxt[:-1] = cur[1:]
        recs[s.seq_id] = RouterRecord(cur.astype(np.float16), nxt.astype(np.float16))
    return RouterReplay(recs)


def test_router_part_changes_eviction_and_helps_with_informative_scores():
    tr, fc = _traces(), _forecaster()
    rp = _oracle_replay(tr)
    pols = [make_policy("hybrid", forecaster=fc, parts="forecast", prefetch=False),
            make_policy("hybrid", forecaster=fc, parts="forecast+routers", replay=rp, prefetch=False),
            make_policy("hybrid", forecaster=fc, parts="routers", replay=rp)]
    recs = simulate(tr, pols, [0.5], progress=False, belady_fraction=False)
    hit = {r["policy"]: r["hit"] for r in recs}
    assert pols[2].demand_only and recs[2]["proactive_loads"] == 0
    assert hit[pols[1].label] > hit[pols[0].label] + 0.02
    assert hit[pols[2].label] > hit[pols[0].label] + 0.02


def test_stage_part_refreshes_priorities_at_cue_boundaries():
    tr = _traces()
    for s in tr.sequences:  # a cue token every 10 decode steps
        s.token_ids[s.prompt_len::10] = 7
    dec = lambda i: b" Wait" if int(i) == 7 else b" x"  # noqa: E731
    pol = make_policy("hybrid", forecaster=_forecaster(), parts="forecast+stage", cues="Wait", decoder=dec)
    simulate((tr.meta, tr.sequences[:1]), [pol], [0.5], progress=False, belady_fraction=False)
    assert pol.stats["stage_refreshes"] >= 3 and pol.stats["stage_refreshes"] == pol._stage.n_updates
    # the stage term is the finished stage's per-token selection frequency: K selections per token per layer
    assert pol._stage_term.sum(axis=1) == pytest.approx(np.full(L, float(K)))
    assert pol.extra == pytest.approx(pol._stage_term)


def test_routers_part_without_scores_is_refused_at_the_first_batch_and_auto_gains_live_scores():
    """An explicit routers part may wait for live scores (the runtime attaches them after reset), but a batch never
    runs without them; ``auto`` gains the part when a score source is attached, explicit parts without it refuse."""
    tr, fc = _traces(), _forecaster()
    pol = make_policy("hybrid", forecaster=fc, parts="forecast+routers")
    assert pol.parts == ("forecast", "routers") and pol.routers_explicit and pol.replay is None
    with pytest.raises(ValueError, match="needs the routers' scores"):
        simulate(tr, [pol], [0.5], progress=False, belady_fraction=False)
    rp = _oracle_replay(tr)
    auto = make_policy("hybrid", forecaster=fc, parts="auto", prefetch=False)
    auto.reset(CacheConfig(num_layers=L, num_experts=E, top_k=K, pool="per-layer", budget=Budget.fraction(0.5)))
    assert auto.parts == ("forecast",) and not auto.routers_explicit
    auto.use_routers(rp)  # after reset, as the runtime does: the new part is reset too
    assert auto.parts == ("forecast", "routers") and auto.replay is rp and not auto.routers_explicit
    ref = make_policy("hybrid", forecaster=fc, parts="forecast+routers", replay=rp, prefetch=False)
    recs = simulate(tr, [auto, ref], [0.5], progress=False, belady_fraction=False)
    assert recs[0]["hit"] == recs[1]["hit"] and recs[0]["demand_misses"] == recs[1]["demand_misses"]
    with pytest.raises(ValueError, match="leave the routers part off"):
        make_policy("hybrid", forecaster=fc, parts="forecast").use_routers(rp)


def test_hybrid_composes_seqmoe_and_declares_its_parts():
    """hybrid holds a SeqMoEPolicy and widens its priority through its public add_priority (no subclass, no private
    step overridden); its spec declares the inputs of its optional parts, which callers read instead of its class."""
    from expertcast.inference.policies import policy_spec

    assert not issubclass(HybridPolicy, SeqMoEPolicy)
    assert not [n for n in vars(HybridPolicy) if n.startswith("_") and not n.startswith("__") and hasattr(SeqMoEPolicy, n)]
    spec = policy_spec("hybrid")
    assert spec.parts == {"router_scores", "cues"} and spec.takes("router_scores") and "router_scores" not in spec.needs
    pol = make_policy("hybrid", forecaster=_forecaster(), parts="forecast")
    cfg = CacheConfig(num_layers=L, num_experts=E, top_k=K, pool="per-layer", budget=Budget.fraction(0.5))
    pol.reset(cfg)
    assert isinstance(pol.core, SeqMoEPolicy) and pol.core.priority_extra is pol.extra
    demand = make_policy("hybrid", forecaster=_forecaster(), parts="stage", cues="Wait", decoder=lambda i: b"x")
    assert demand.demand_only and not demand.core.forecasting
