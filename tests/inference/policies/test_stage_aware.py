"""StageAwarePolicy / StageOraclePolicy in the simulator on traces with planted stages."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.synthetic import staged_traces
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.stage_aware import StageAwarePolicy
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.inference.saem.stages import synthetic_cue_decoder
from expertcast.inference.sim.simulator import simulate


@pytest.fixture(scope="module")
def syn():
    return staged_traces(num_sequences=4, num_tokens=160, num_layers=3, num_experts=16, top_k=2, num_stages=3,
                         hot=4, mean_stage_len=24.0, seed=3)


def _run(syn, pols, bs=1, cap=0.25):
    return {r["policy"]: r for r in simulate(syn, pols, capacities=[cap], batch_size=bs, belady_fraction=False,
                                             engine="python", progress=False)}


def _labelled(p, label):
    p.label = label
    return p


def test_updates_follow_planted_boundaries(syn):
    dec = synthetic_cue_decoder(syn.cue_token)
    pol = _labelled(make_policy("stage", cues="Wait", decoder=dec), "stage")
    r = _run(syn, [pol])["stage"]
    # one update per generated cue token (" Wait" is confirmed by the next token) plus one per sequence
    # for the prompt (prefill) stage; a cue on a sequence's last token is never confirmed in time
    n_cues = sum(int((s.token_ids[s.prompt_len + 1:-1] == syn.cue_token).sum()) for s in syn.sequences)
    assert pol.n_updates == n_cues + len(syn.sequences)
    # proactive loads only at updates, never more than the budgets
    assert 0 < r["proactive_loads"] <= pol.n_updates * 3 * 4
    # misses are never demand-loaded into the cache: each goes to the CPU or the temporary slot
    assert r["cpu_exec"] + r["temp_loads"] == r["accesses"] - r["hits"] - r["late_prefetches"]
    assert r["demand_misses"] == r["temp_loads"]


def test_cpu_execution_follows_latency_model_and_ablation(syn):
    dec = synthetic_cue_decoder(syn.cue_token)
    always_cpu = LatencyModel(transfer_ms=1.0, cpu_expert_ms=0.1, cpu_token_ms=0.0)
    never_cpu = LatencyModel(transfer_ms=1.0, cpu_expert_ms=2.0, cpu_token_ms=0.0)
    pols = [_labelled(make_policy("stage", cues="Wait", decoder=dec, latency=always_cpu), "cpu"),
            _labelled(make_policy("stage", cues="Wait", decoder=dec, latency=never_cpu), "slow-cpu"),
            _labelled(make_policy("stage", cues="Wait", decoder=dec, cpu_exec=False, latency=always_cpu), "nocpu")]
    r = _run(syn, pols, bs=2)
    assert r["cpu"]["cpu_exec"] > 0 and r["cpu"]["temp_loads"] == 0
    assert r["slow-cpu"]["cpu_exec"] == 0 and r["slow-cpu"]["temp_loads"] > 0
    assert r["nocpu"]["cpu_exec"] == 0
    # same placement decisions: the three find the same experts resident or in flight (timing decides
    # whether a refill prefetch is a hit or a late prefetch)
    found = {k: v["hits"] + v["late_prefetches"] for k, v in r.items()}
    assert found["cpu"] == found["slow-cpu"] == found["nocpu"]


def test_oracle_beats_stage_aware_on_planted_stages(syn):
    dec = synthetic_cue_decoder(syn.cue_token)
    pols = [_labelled(make_policy("stage", cues="Wait", decoder=dec), "stage"),
            _labelled(make_policy("stage-oracle", cues="Wait", decoder=dec), "oracle")]
    for bs in (1, 4):
        r = _run(syn, pols, bs=bs)
        # planted stages change profile at every cue: the finished stage mispredicts, the oracle does not
        found = {k: (v["hits"] + v["late_prefetches"]) / v["accesses"] for k, v in r.items()}
        assert found["oracle"] > found["stage"] + 0.1
        assert r["oracle"]["resident_hit"] > r["stage"]["resident_hit"]
        assert pols[1].n_updates == pols[0].n_updates


def test_static_ablation_and_errors(syn):
    dec = synthetic_cue_decoder(syn.cue_token)
    with pytest.raises(ValueError, match="calibration frequencies"):
        make_policy("stage", cues="Wait", decoder=dec, stage_updates=False)
    with pytest.raises(ValueError, match="needs cues"):
        make_policy("stage", decoder=dec)
    freq = np.zeros((3, 16))
    freq[:, :4] = 1.0
    st = _labelled(make_policy("stage", cues="Wait", decoder=dec, stage_updates=False, static_frequency=freq), "s")
    r = _run(syn, [st])["s"]
    assert r["proactive_loads"] == 0 and st.n_updates == 0
    shared = CacheConfig(num_layers=3, num_experts=16, top_k=2, pool="shared", budget=Budget.fraction(0.25))
    with pytest.raises(ValueError, match="per-layer"):
        make_policy("stage", cues="Wait", decoder=dec).reset(shared)
    bad = CacheConfig(num_layers=2, num_experts=16, top_k=2, budget=Budget.fraction(0.25))
    with pytest.raises(ValueError, match="another model"):
        make_policy("stage", cues="Wait", decoder=dec, static_frequency=freq).reset(bad)


def test_budget_below_top_k_is_opt_in_and_served_off_cache(syn):
    # 1 slot per layer < K=2 (SAEM's 3.125% ratio on a model with few experts)
    with pytest.raises(ValueError, match="below top-K"):
        CacheConfig(num_layers=3, num_experts=16, top_k=2, budget=Budget.fraction(0.0625))
    cfg = CacheConfig(num_layers=3, num_experts=16, top_k=2, budget=Budget.fraction(0.0625), allow_below_top_k=True)
    assert cfg.uniform_slots_per_layer == 1
    with pytest.raises(ValueError, match="needs a slot"):
        CacheConfig(num_layers=3, num_experts=16, top_k=2, budget=Budget.fraction(0.01), allow_below_top_k=True)
    dec = synthetic_cue_decoder(syn.cue_token)
    pol = _labelled(make_policy("stage", cues="Wait", decoder=dec), "stage")
    recs = simulate(syn, [pol, "lru"], capacities=[0.0625], batch_size=2, belady_fraction=False, engine="python",
                    progress=False, allow_below_top_k=True)
    r = {x["policy"]: x for x in recs}
    for x in r.values():
        assert x["slots_per_layer"] == 1
        # at most one of a layer's two selected experts can be resident: hits <= accesses / 2
        assert x["hits"] + x["late_prefetches"] <= x["accesses"] / 2
    s, lru = r["stage"], r["lru"]
    assert s["cpu_exec"] + s["temp_loads"] == s["accesses"] - s["hits"] - s["late_prefetches"]
    assert lru["temp_loads"] > 0 and lru["cpu_exec"] == 0  # LRU keeps one, the rest through the temporary slot


class _OneCpu(StageAwarePolicy):
    """Test helper: expert 3 on the CPU, everything else demand-loaded."""

    def __init__(self):
        super().__init__(StageAwarePolicy.Options(cues="Wait"), decoder=lambda i: b"x")

    def on_miss(self, t, layer, expert, n_tokens, cache):
        from expertcast.inference.cache.policy import MissAction

        return MissAction.CPU if expert == 3 else MissAction.LOAD

    def choose_victim(self, t, layer, candidates, cache):
        return 0


@pytest.mark.parametrize("parallel", [False, True])
def test_cpu_parallel_cost_model(parallel):
    from expertcast.data.trace_format import TraceMeta, TraceSequence
    from expertcast.inference.cache.cost_model import CostConfig
    from expertcast.inference.sim.simulator import build_stream, replay

    # one decode step, L=1, K=2: expert 0 transferred (0.5 ms), expert 3 on the CPU (0.3 + 0.1 = 0.4 ms),
    # layer compute 0.2 ms. Serial: 0.5 + max(0.2, 0.4) = 0.9 ms; parallel: max(0.5 + 0.2, 0.4) = 0.7 ms.
    meta = TraceMeta("hand", 1, 4, 2, expert_bytes=1_000_000)
    seq = TraceSequence("s", np.zeros(1, np.int32), 0, np.array([[[0, 3]]], np.int16), np.ones((1, 1, 2), np.float16))
    cost = CostConfig(bandwidth_gbps=2.0, layer_compute_ms=0.2, cpu_expert_ms=0.3, cpu_token_ms=0.1,
                      cpu_parallel=parallel)
    r = replay(build_stream(meta, [seq]), _OneCpu(), CacheConfig(1, 4, 2, budget=Budget.slots(2), expert_bytes=1_000_000), cost,
               record_timeline=True)
    assert r.stall_ms == pytest.approx(0.5 if parallel else 0.7)
    cpu_ev = [e for e in r.timeline if e.kind == "cpu"]
    assert cpu_ev[0].start == pytest.approx(0.0 if parallel else 0.5)


def test_parallel_mode_splits_a_layers_misses(syn):
    from expertcast.inference.cache.cost_model import CostConfig

    dec = synthetic_cue_decoder(syn.cue_token)
    cost = CostConfig(cpu_parallel=True)
    pols = [_labelled(make_policy("stage", cues="Wait", decoder=dec, cost=cost), "par"),
            _labelled(make_policy("stage", cues="Wait", decoder=dec), "ser")]
    r = {x["policy"]: x for x in simulate(syn, pols, capacities=[0.125], batch_size=4, cost=cost,
                                          belady_fraction=False, engine="python", progress=False)}
    # serial decisions send every (few-token) miss to the CPU; the parallel split also uses the link
    assert r["ser"]["temp_loads"] == 0 and r["ser"]["cpu_exec"] > 0
    assert r["par"]["temp_loads"] > 0 and r["par"]["cpu_exec"] > 0
    assert r["par"]["pct_full_speed"] > r["ser"]["pct_full_speed"]


def test_cue_set_found_beside_the_model(tmp_path):
    from expertcast.inference.saem.cues import CUESET_FILENAME, CueSet, resolve_cue_set

    freq = np.full((3, 16), 0.1)
    CueSet(cues=["Wait", "Alternatively"], expert_frequency=freq.tolist()).save(tmp_path / CUESET_FILENAME)
    assert resolve_cue_set(None, tmp_path) == tmp_path / CUESET_FILENAME
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match="has no cues.json"):
        resolve_cue_set(None, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_cue_set(tmp_path / "nope.json", tmp_path)
    pol = make_policy("stage", tokenizer=str(tmp_path), decoder=lambda i: b"x")
    assert pol.cues == ["Wait", "Alternatively"] and pol.static_frequency.shape == (3, 16)


def _tcseq(traces) -> float:
    from expertcast.inference.saem.cues import adjacent_cosine, stage_counts

    vals = []
    for s, st in zip(traces.sequences, traces.stage_ids, strict=True):
        starts = np.flatnonzero(np.diff(st, prepend=-1) != 0)
        vals.append(adjacent_cosine(stage_counts(np.asarray(s.expert_ids), starts, traces.meta.num_experts)).ravel())
    return float(np.concatenate(vals).mean())


def test_drifting_stages_plant_adjacent_coherence():
    from expertcast.data.synthetic import drifting_stage_traces

    kw = dict(num_sequences=3, num_tokens=400, num_layers=2, num_experts=32, top_k=2, hot=8, mean_stage_len=50.0,
              seed=0)
    drift = drifting_stage_traces(keep=6, **kw)
    indep = staged_traces(num_stages=4, **kw)
    for s, st in zip(drift.sequences, drift.stage_ids, strict=True):
        starts = np.flatnonzero(np.diff(st) != 0) + 1
        assert len(starts) > 2 and (s.token_ids[starts] == drift.cue_token).all()
        assert (s.token_ids[1:] == drift.cue_token).sum() == len(starts)
    # adjacent stages share 6 of 8 hot experts: far more alike than independent profiles
    assert _tcseq(drift) > _tcseq(indep) + 0.15
    assert _tcseq(drifting_stage_traces(keep=0, **kw)) < _tcseq(drift) - 0.15
    with pytest.raises(ValueError, match="keep"):
        drifting_stage_traces(keep=9, **kw)


def test_stage_updates_track_drifting_stages():
    from expertcast.data.synthetic import drifting_stage_traces
    from expertcast.inference.policies.static import selection_counts

    d = drifting_stage_traces(num_sequences=4, num_tokens=300, num_layers=2, num_experts=32, top_k=2, hot=8, keep=6,
                              mean_stage_len=50.0, seed=2)
    dec = synthetic_cue_decoder(d.cue_token)
    freq = selection_counts(d.sequences[:1], 2, 32).astype(np.float64)
    kw = dict(cues="Wait", decoder=dec, static_frequency=freq)
    pols = [_labelled(make_policy("stage", **kw), "stage"), _labelled(make_policy("stage-oracle", **kw), "oracle"),
            _labelled(make_policy("stage", stage_updates=False, **kw), "noupdate"), "lru"]
    r = {x["policy"]: x for x in simulate((d.meta, d.sequences[1:]), pols, capacities=[0.25], batch_size=1,
                                          belady_fraction=False, engine="python", progress=False)}
    # the finished stage's hot set predicts most of the next one; a placement that never moves does not
    assert r["stage"]["resident_hit"] > r["noupdate"]["resident_hit"] + 0.2
    assert r["oracle"]["resident_hit"] > r["stage"]["resident_hit"]
    # refills at boundaries only: far fewer transfers than demand paging
    st_tr = r["stage"]["demand_misses"] + r["stage"]["proactive_loads"]
    assert st_tr < 0.5 * r["lru"]["demand_misses"]
