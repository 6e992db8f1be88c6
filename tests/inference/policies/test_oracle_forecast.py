"""The oracle forecast (docs/design.md, "Oracle forecast"): tables of the true future degraded to a chosen recall,
and seqmoe fed by it: at recall 1.0 Belady's counters (eviction only) and the Belady-with-prefetch reference
counters (prefetch on), a prefetched expert never evicted before its deadline, the same decisions in the runtime
(RAM and disk stores)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.synthetic import zipf_traces
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import make_policy, parse_policy_options
from expertcast.inference.policies.oracle import BeladyPolicy
from expertcast.inference.policies.oracle_forecast import (
    OracleForecast,
    degrade,
    forecast_recall,
    true_elements,
)
from expertcast.inference.policies.seqmoe import SeqMoEPolicy
from expertcast.inference.sim.simulator import build_stream, replay, simulate
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)

L, E, K = 4, 16, 2
FAST = CostConfig(bandwidth_gbps=1e6)  # every prefetch lands long before its deadline


def _trace(seed=3, tokens=24, prompt=0, n=1):
    syn = zipf_traces(num_sequences=n, num_tokens=tokens, num_layers=L, num_experts=E, top_k=K, alpha=0.8,
                      prompt_len=prompt, seed=seed)
    return syn.meta, syn.sequences


def _config(pool="per-layer", slots=4):
    return CacheConfig(num_layers=L, num_experts=E, top_k=K, pool=pool, budget=Budget.slots(slots), expert_bytes=1000)


def _oracle(**kw):
    return make_policy("seqmoe", forecast="oracle", link_bytes_per_s=1e15, **kw)


def test_table_is_the_true_future_and_recall_degrades_it_at_equal_precision():
    _, seqs = _trace(tokens=40)
    s = seqs[0]
    for p in (L - 1, 1):
        src = OracleForecast(1.0, trigger_layer=p)
        cfg = src.bind(L, E, K)
        tab = src.table(s, cfg, 5)
        el = true_elements(s.expert_ids, E, p, tail=True)
        assert tab.shape == (40 - (p < L - 1), 5, L, E) and tab.dtype == np.float16
        assert len(el) == 40
        if p < L - 1:  # the tail: the last step's layers after p
            assert not el[-1, : p + 1].any() and el[-1, p + 1:].sum() == K * (L - 1 - p)
        for i in (0, 7, len(el) - 3):
            for j in range(5):
                want = el[i + 1 + j] if i + 1 + j < len(el) else np.zeros((L, E), bool)
                assert np.array_equal(tab[i, j] > 0, want), (p, i, j)
        assert np.allclose(forecast_recall(tab, s.expert_ids, p, L)[:4], 1.0)
    _, many = _trace(tokens=200, n=4)
    for r in (0.9, 0.5):
        src = OracleForecast(r, seed=1)
        cfg = src.bind(L, E, K)
        tabs = src.tables(many, cfg, 3)
        got = np.nanmean([forecast_recall(t, q.expert_ids, cfg.p, L) for t, q in zip(tabs, many, strict=True)], 0)
        assert np.all(np.abs(got - r) < 0.03), (r, got)
        named = np.concatenate([t[:-3].reshape(-1, E) for t in tabs]).astype(bool)
        assert np.all(named.sum(-1) == K)  # K named per forecast: a dropped true expert is replaced by a false one
        again = OracleForecast(r, seed=1).tables(many[::-1], cfg, 3)[::-1]  # per-sequence seeding: order-free
        assert all(np.array_equal(a, b) for a, b in zip(tabs, again, strict=True))
        other = OracleForecast(r, seed=2).tables(many, cfg, 3)
        assert not all(np.array_equal(a, b) for a, b in zip(tabs, other, strict=True))
    rows = np.zeros((3, E), bool)
    rows[0, :K] = True
    out = degrade(rows, 0.0, np.random.default_rng(0))
    assert out[0].sum() == K and not out[0, :K].any() and not out[1:].any()


def test_options_and_bad_input():
    pol = make_policy("seqmoe", forecast="oracle", recall=0.7, forecast_seed=3)
    assert isinstance(pol, SeqMoEPolicy) and pol.oracle is not None and pol.oracle.recall == 0.7
    assert "oracle" in pol.source
    assert parse_policy_options("seqmoe:forecast=oracle,recall=0.9").recall == 0.9  # no forecaster needed
    with pytest.raises(UsageError, match="needs a forecaster"):
        parse_policy_options("seqmoe:forecast=model")
    with pytest.raises(ValueError, match="needs a forecaster"):
        make_policy("seqmoe", forecast="model")
    with pytest.raises(UsageError, match="recall"):
        make_policy("seqmoe", forecast="oracle", recall=1.5)
    with pytest.raises(UsageError, match="trigger_layer"):
        make_policy("seqmoe", forecast="oracle", trigger_layer=9).reset(_config())
    pol = make_policy("seqmoe", forecast="oracle")
    pol.reset(_config())
    with pytest.raises(UsageError, match="recorded expert_ids"):
        pol.begin_batch([object()])


class _MissLog(BeladyPolicy):
    """Belady recording the layer-execution of every demand miss."""

    def reset(self, config):
        super().reset(config)
        self.missed = []

    def on_miss(self, t, layer, expert, n_tokens, cache):
        self.missed.append((t, layer))
        return super().on_miss(t, layer, expert, n_tokens, cache)


@pytest.mark.parametrize("p", [L - 1, 1])
def test_recall_one_eviction_only_gives_beladys_counters(p):
    """Exact futures with gamma 0.5 and a horizon covering the sequence: the eviction score orders every pool's
    residents by next use, as Belady does (ties only among experts never used again, which cannot change a hit)."""
    meta, seqs = _trace()
    stream = build_stream(meta, seqs, 1)
    for slots in (3, 5):
        cfg = _config(slots=slots)
        ref = replay(stream, make_policy("belady"), cfg)
        got = replay(stream, _oracle(horizon=32, prefetch=False, trigger_layer=p), cfg)
        for k in ("accesses", "hits", "demand", "evictions"):
            assert np.array_equal(getattr(got, k), getattr(ref, k)), (slots, k)
        assert got.P == 0 and ref.D > 0


@pytest.mark.parametrize("p", [L - 1, 1])
def test_recall_one_with_prefetch_gives_the_belady_with_prefetch_counters(p):
    """The Belady-with-prefetch reference (conservative prefetching: Belady's replacements, each load moved to the
    forecast before it). The simulator has no such policy, so the reference is built from Belady's own misses:
    a miss at layer-execution x is a proactive load when a forecast covers x with a compute window before it
    (x >= s*L + p + 2, the first forecast being made at trigger p of step s, and x not the first layer after a
    trigger, whose loads have no window: ``plan_within_headroom`` needs a load to land before its execution
    starts), else a demand miss. Every load of the oracle at recall 1 is needed at its deadline and displaces
    Belady's victim, so: the same accesses and evictions, demand = the reference's, proactive = the rest of
    Belady's misses, every prefetch used, none late on a fast link."""
    meta, seqs = _trace()
    stream = build_stream(meta, seqs, 1)
    s = 0 if p == L - 1 else 1
    for slots in (3, 5):
        cfg = _config(slots=slots)
        bel = _MissLog()
        bel.name = "belady"
        ref = replay(stream, bel, cfg)
        d_ref, p_ref = np.zeros(L, np.int64), np.zeros(L, np.int64)
        for t, layer in bel.missed:
            x = t * L + layer
            window = x >= s * L + p + 2 and layer != (p + 1) % L
            (p_ref if window else d_ref)[layer] += 1
        assert np.array_equal(d_ref + p_ref, ref.demand) and p_ref.sum() > 0
        pol = _oracle(horizon=32, trigger_layer=p, plan_executions=1)  # the reference plans the next execution
        got = replay(stream, pol, cfg, FAST)
        assert np.array_equal(got.accesses, ref.accesses)
        assert np.array_equal(got.demand, d_ref), (slots, got.demand, d_ref)
        assert np.array_equal(got.proactive, p_ref), (slots, got.proactive, p_ref)
        assert np.array_equal(got.evictions, ref.evictions)
        assert np.array_equal(got.prefetch_used, got.proactive) and got.late.sum() == 0
        assert got.hit == pytest.approx(1 - d_ref.sum() / ref.accesses.sum())


def _watch_deadlines(pol, deadline_of):
    """Wrap ``pol``'s hooks so that evicting a proactively loaded expert before its deadline fails the test:
    ``deadline_of(layer, expert, t0)`` is the step whose execution of ``layer`` the load was made for, ``t0`` the
    step of that layer's next execution at the load. Returns the counts {"loads", "evictions", "later"} (later: loads
    for an execution after the next)."""
    now = {"x": (0, 0, 0)}  # (step, layer, phase): 0 = before the layer runs, 1 = after it ran
    pending: dict[tuple[int, int], int] = {}  # (layer, expert) -> the step of its deadline
    seen = {"loads": 0, "evictions": 0, "later": 0}
    before, after, insert, evict = pol.before_layer, pol.after_layer, pol.on_insert, pol.on_evict

    def before_layer(t, layer, cache):
        now["x"] = (t, layer, 0)
        for k in [k for k, d in pending.items() if k[0] == layer and d <= t]:
            del pending[k]  # its deadline execution starts now
        return before(t, layer, cache)

    def after_layer(t, layer, cache):
        now["x"] = (t, layer, 1)
        return after(t, layer, cache)

    def on_insert(layer, expert, proactive):
        if proactive:
            t, cur, phase = now["x"]
            ahead = layer > cur or (layer == cur and phase == 0)
            t0 = t if ahead else t + 1
            pending[(layer, expert)] = deadline_of(layer, expert, t0)
            seen["loads"] += 1
            seen["later"] += pending[(layer, expert)] > t0
        return insert(layer, expert, proactive)

    def on_evict(layer, expert):
        assert (layer, expert) not in pending, f"prefetched {(layer, expert)} evicted at {now['x']} before its deadline"
        seen["evictions"] += 1
        return evict(layer, expert)

    pol.before_layer, pol.after_layer, pol.on_insert, pol.on_evict = before_layer, after_layer, on_insert, on_evict
    return seen


def _planned_deadlines(pol):
    """Wrap ``pol``'s headroom planner: returns {(layer, expert): the layer-execution its newest planned load is for}
    (the planner's own deadline, whichever execution of the layer it is)."""
    planned: dict[tuple[int, int], int] = {}
    plan = pol._plan_headroom

    def _plan_headroom(*a, **kw):
        tasks = plan(*a, **kw)
        planned.update({t.key: int(t.deadline) for t in tasks})
        return tasks

    pol._plan_headroom = _plan_headroom
    return planned


@pytest.mark.parametrize("executions", [1, 2])
@pytest.mark.parametrize("bandwidth_gbps", [0.05, 1e6])
def test_prefetched_expert_is_never_evicted_before_its_deadline(executions, bandwidth_gbps):
    """A degraded oracle (recall 0.5: half its prefetches are false) in a tight shared pool, where demand loads of
    other layers compete for the slots the prefetches took: no proactively loaded expert is evicted before the
    execution it was loaded for has started, on a slow link (loads land late) and a fast one (loads land long before
    their deadline); with ``plan_executions=2`` also the loads for a layer's execution after next, which a landed load
    sits through its next execution for."""
    meta, seqs = _trace(tokens=48, n=3, prompt=4)
    pol = _oracle(recall=0.5, forecast_seed=1, breakeven=False, trigger_layer=1, plan_executions=executions)
    planned = _planned_deadlines(pol)
    seen = _watch_deadlines(pol, lambda layer, expert, t0: planned[(layer, expert)] // L)
    res = replay(build_stream(meta, seqs, 1), pol, _config("shared", slots=12),
                 CostConfig(bandwidth_gbps=bandwidth_gbps, layer_compute_ms=0.15))
    assert seen["loads"] > 20 and seen["evictions"] > 20 and res.P > 0
    assert res.prefetch_used.sum() < res.P  # false prefetches were made (and left unused)
    if executions == 2:  # loads for the execution after next were made
        assert seen["later"] > 0


def test_planning_the_execution_after_next_reaches_the_layer_after_the_trigger():
    """``plan_executions=2``: the layer right after the trigger (whose next execution starts as the forecast is made)
    is loaded a step ahead, for its execution after next: at recall 1 its demand misses fall to those before the
    second forecast, the other layers' demand misses do not rise, and no load is evicted before the execution it was
    loaded for (at recall 1 that is the expert's first use after the load)."""
    meta, seqs = _trace(tokens=40)
    stream = build_stream(meta, seqs, 1)
    p = 1
    one = replay(stream, _oracle(horizon=32, trigger_layer=p, plan_executions=1), _config(slots=5), FAST)
    pol = _oracle(horizon=32, trigger_layer=p, plan_executions=2)
    ids = np.asarray(seqs[0].expert_ids)

    def first_use(layer, expert, t0):
        uses = [u for u in range(t0, len(ids)) if expert in ids[u, layer]]
        assert uses, f"recall 1 loaded {(layer, expert)}, which is never used again"
        return uses[0]

    seen = _watch_deadlines(pol, first_use)
    two = replay(stream, pol, _config(slots=5), FAST)
    nxt = (p + 1) % L
    assert seen["loads"] == two.P > one.P
    assert two.demand[nxt] < one.demand[nxt]
    assert two.demand[nxt] <= int(sum(len(set(ids[t, nxt])) for t in range(2)))  # only before the second forecast
    assert all(two.demand[layer] <= one.demand[layer] for layer in range(L) if layer != nxt)
    assert np.array_equal(two.prefetch_used, two.proactive) and two.late.sum() == 0


def test_recall_axis_in_simulate():
    meta, seqs = _trace(tokens=64, n=3, prompt=8)
    recs = simulate((meta, seqs), ["lru", *[f"seqmoe:forecast=oracle,recall={r},link_bytes_per_s=1e15"
                                            for r in (1.0, 0.7, 0.4)]],
                    [0.25], cost=FAST, progress=False)
    assert [r["policy"].split("(")[0] for r in recs] == ["lru", "seqmoe", "seqmoe", "seqmoe"]
    assert "recall=0.7" in recs[2]["policy"]
    hits = [r["hit"] for r in recs[1:]]
    assert hits[0] > hits[1] > hits[2] and hits[0] > recs[0]["hit"]


def _tiny():
    from expertcast.models.presets import build_tiny

    return build_tiny("qwen3_moe-tiny", seed=0, dtype=torch.bfloat16)


def test_runtime_forced_replay_equals_the_simulator_and_reads_from_disk(tmp_path):
    """The runtime's forced routing gives the oracle its future: on the RAM store its counters equal the
    simulator's; on the disk store (real reads) every prefetch is used, every load is one read, the logits are
    the all-in-RAM run's, and it misses less than the demand-only Belady on the same store."""
    from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store_from
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.store import HostExpertStore

    syn = zipf_traces(num_sequences=2, num_tokens=20, num_layers=4, num_experts=16, top_k=4, seed=3)
    seqs = syn.sequences
    model = _tiny()
    om = OffloadedModel(model, _oracle(horizon=24), 0.25)
    st = om.replay(seqs)
    cfg = om.cache_config
    model = om.restore()
    sim = replay(build_stream(syn.meta, seqs, 1), _oracle(horizon=24), cfg, FAST)
    for k in ("accesses", "demand", "proactive", "evictions", "prefetch_used"):
        assert np.array_equal(getattr(st, k), getattr(sim, k)), k
    assert st.P > 0

    path = write_disk_store_from(HostExpertStore.from_model(model), tmp_path / "experts.safetensors")
    runs = {}
    for name in ("full", "belady", "oracle"):
        model = _tiny()
        logits = []
        hook = model.register_forward_hook(lambda m, a, k, o, out=logits: out.append(o.logits.detach().clone()),
                                           with_kwargs=True)
        disk = None if name == "full" else DiskExpertStore(path)
        pol = {"full": lambda: make_policy("lru"), "belady": lambda: make_policy("belady"),
               "oracle": lambda: _oracle(horizon=24)}[name]()
        future = build_stream(syn.meta, seqs, 1) if name == "belady" else None
        kw = {} if disk is None else {"store": disk, "readers": 2}
        om = OffloadedModel(model, pol, 1.0 if name == "full" else 0.25, future=future, **kw)
        try:
            runs[name] = (om.replay(seqs), logits)
        finally:
            om.close()
            hook.remove()
            if disk is not None:
                disk.close()
    st, got = runs["oracle"]
    assert len(got) == len(runs["full"][1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, runs["full"][1], strict=True))
    assert st.P > 0 and np.array_equal(st.prefetch_used, st.proactive)
    assert st.reads == st.D + st.P and st.read_prefetch == st.P
    assert st.D < runs["belady"][0].D


def test_runtime_forced_replay_equals_the_simulator_planning_two_executions(tmp_path):
    """``plan_executions=2``: the layer after the trigger (layer 0 here) gets loads a step ahead, which in the runtime
    land long before their deadline (RAM store) or whenever the disk reads finish (disk store) and sit through the
    layer's next execution; its demand misses must not evict them there (they are still needed), so the runtime's
    counters equal the simulator's, where the same loads are still in flight at that execution. Every load is used.
    (Hits against late prefetches depend on when the real copies land: their sum is compared.)"""
    from expertcast.inference.runtime.disk_store import DiskExpertStore, write_disk_store_from
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.inference.runtime.store import HostExpertStore

    syn = zipf_traces(num_sequences=2, num_tokens=20, num_layers=4, num_experts=16, top_k=4, seed=3)
    seqs = syn.sequences
    path = write_disk_store_from(HostExpertStore.from_model(_tiny()), tmp_path / "experts.safetensors")
    for on_disk in (False, True):
        disk = DiskExpertStore(path) if on_disk else None
        om = OffloadedModel(_tiny(), _oracle(horizon=24, plan_executions=2), 0.25,
                            **({"store": disk, "readers": 2} if on_disk else {}))
        try:
            st = om.replay(seqs)
            cfg = om.cache_config
        finally:
            om.close()
            if disk is not None:
                disk.close()
        sim = replay(build_stream(syn.meta, seqs, 1), _oracle(horizon=24, plan_executions=2), cfg, FAST)
        for k in ("accesses", "demand", "temp", "proactive", "evictions", "prefetch_used"):
            assert np.array_equal(getattr(st, k), getattr(sim, k)), (on_disk, k, getattr(st, k), getattr(sim, k))
        assert np.array_equal(st.hits + st.late, sim.hits + sim.late)
        assert st.proactive[0] > 0 and np.array_equal(st.prefetch_used, st.proactive)
        if on_disk:
            assert st.reads == st.D + st.P and st.read_prefetch == st.P
