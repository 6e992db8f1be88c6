"""The graph decode path's pieces (inference/runtime/graph/): which path runs and why, and one layer
function on hand-set device state: victims (empty slots first, then least recent, the selection protected),
temporary scratch rows when the pool is full, the table kept consistent, the output equal to the full-load
experts module's.

Graph-compatible decode path (docs/design.md) on CPU, against the eager path, the full-load model and the simulator.

* token identity: greedy generations of the graph path equal the full-load model's (lru and seqmoe, per-layer
  and shared pools, batch 1 and a left-padded batch whose members end at different steps on EOS);
* counters: the graph path reports the driver's Counters; wherever the two paths take the same decisions its
  decode counters and final resident set equal the eager path's and the simulator's replay of the routing the
  graph run recorded:
  - lru: always (the same decisions, taken on the device);
  - seqmoe: when both evict by the same forecasts at the same times: the planner blocking (every step's forecast
    is installed before the next step: no race with the background thread), no prefetch, and the trigger at
    the last layer (p = L-1: the step boundary where the graph path installs a forecast is then the eager
    trigger point). With prefetch the graph path admits its plan one layer ahead inside the compute stream
    (no EDF scheduler, no late prefetches) and with p < L-1 its forecast applies at the step boundary, so
    only the accesses are compared there, and the forecasts reach the device as proactive loads;
* ``torch.compile(fullgraph=True)`` of the per-layer decode function: no graph break, same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.async_forecast import ForecastWorker
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.graph.aot import AOTLayer
from expertcast.inference.runtime.graph.path import choose_decode_path
from expertcast.inference.sim.simulator import build_stream, replay
from expertcast.models.forecaster import untrained_forecaster
from expertcast.models.presets import build_tiny
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.mark.parametrize("name,path", [("lru", "graph"), ("lfu", "eager"), ("fifo", "eager")])
def test_auto_path_and_reason(name, path):
    pol = make_policy(name)
    got, why = choose_decode_path("auto", pol, CPU, None, pinned_store=False)
    assert got == path
    assert (name in why) if path == "eager" else ("device" in why)


def test_graph_refused_with_reason():
    with pytest.raises(UsageError, match="'lfu' decides on the host"):
        choose_decode_path("graph", make_policy("lfu"), CPU, None, pinned_store=False)
    with pytest.raises(UsageError, match="link"):
        choose_decode_path("graph", make_policy("lru"), CPU, 1.0, pinned_store=False)
    with pytest.raises(UsageError, match="decode path must be one of"):
        choose_decode_path("fast", make_policy("lru"), CPU, None, pinned_store=False)
    assert choose_decode_path("eager", make_policy("lru"), CPU, None, pinned_store=False)[0] == "eager"


def test_support_is_the_public_device_step():
    """device_program_of (the one support decision): lru and seqmoe provide a device step, host-only policies and
    subclasses that redefine a decision hook do not; the program says the eviction rule and the plan width."""
    from expertcast.inference.policies.classic import LRUPolicy
    from expertcast.inference.policies.device import EVICT_FORECAST, EVICT_RECENCY
    from expertcast.inference.runtime.graph.path import device_program_of
    from expertcast.models.forecaster import untrained_forecaster

    fc = untrained_forecaster(2, 16, 4)
    lru = device_program_of(make_policy("lru"))
    assert lru.eviction == EVICT_RECENCY and lru.plan_width == 0 and lru.forecaster is None
    seq = make_policy("seqmoe", forecaster=fc, max_tasks_per_layer=3)
    prog = device_program_of(seq)
    assert prog.eviction == EVICT_FORECAST and prog.plan_width == 3 and prog.forecaster is seq
    assert device_program_of(make_policy("seqmoe", forecaster=fc, prefetch=False)).plan_width == 0
    for name in ("lfu", "fifo", "belady"):
        assert device_program_of(make_policy(name)) is None, name
    assert device_program_of(make_policy("seqmoe-async", forecaster=fc)) is None
    assert device_program_of(make_policy("hybrid", forecaster=fc, parts="forecast")) is None  # its own hooks

    class Touchy(LRUPolicy):
        def choose_victim(self, t, layer, candidates, cache):
            return 0

    assert device_program_of(Touchy()) is None
    with pytest.raises(UsageError, match="decides on the host"):
        choose_decode_path("graph", Touchy(), CPU, None, pinned_store=False)


def test_path_is_printed(capsys):
    model = build_tiny("qwen3_moe-tiny", seed=0)
    om = OffloadedModel(model, make_policy("lfu"), 6, decode_path="auto")
    om.restore()
    assert "decode path: eager (policy 'lfu' decides on the host" in capsys.readouterr().err


@pytest.fixture(scope="module")
def layer_setup():
    """A graph-path runtime with 4 slots per layer (E=16, K=4) and a full-load copy of the model."""
    ref = build_tiny("qwen3_moe-tiny", seed=0)
    om = OffloadedModel(build_tiny("qwen3_moe-tiny", seed=0), make_policy("lru"), 4, decode_path="graph")
    yield om, ref
    om.restore()


def _run(om, ref, layer, idx):
    gd, E = om.graph, om.E
    g = torch.Generator().manual_seed(layer)
    h = torch.randn(idx.shape[0], om.model.config.hidden_size, generator=g)
    w = torch.rand(idx.shape, generator=g)
    y = gd.run_layer(gd.layer_ids[layer], h, idx, w)
    mod = [m for m in ref.modules() if hasattr(m, "gate_up_proj") and getattr(m, "num_experts", 0) == E][layer]
    with torch.no_grad():
        want = mod(h, idx, w)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    return gd.state


def _named(st, layer=1):
    """accesses, hits, demand, temp of ``layer`` (rows of the driver's COUNTER_NAMES)."""
    return [int(st.counters[COUNTER_NAMES.index(n), layer]) for n in ("accesses", "hits", "demand", "temp")]


def _slots_of(st, layer, E, experts):
    return [int(st.table[layer * E + e]) for e in experts]


def test_layer_loads_evicts_and_serves_temporaries(layer_setup):
    om, ref = layer_setup
    st, E = om.graph.state, om.E
    st.table.fill_(-1)
    st.slot_key.fill_(-1)
    st.recency.zero_()
    st.clock.zero_()
    st.counters.zero_()
    # layer 1 owns slots 4..7: the first selection fills them lowest first
    st = _run(om, ref, 1, torch.tensor([[3, 5, 7, 9]]))
    assert _slots_of(st, 1, E, [3, 5, 7, 9]) == [4, 5, 6, 7]
    assert _named(st) == [4, 0, 4, 0]  # accesses, hits, demand, temp
    # 3 and 9 hit (protected); 2 misses evict the least recent of the others: 5 (tick 2), then 7 (tick 3)
    st = _run(om, ref, 1, torch.tensor([[9, 11, 3, 12]]))
    assert _slots_of(st, 1, E, [9, 3, 11, 12]) == [7, 4, 5, 6]
    assert _slots_of(st, 1, E, [5, 7]) == [-1, -1]
    assert _named(st) == [8, 2, 6, 0]
    # two tokens with 8 distinct experts, 4 slots: 4 demand loads into the slots, 4 from scratch rows
    st = _run(om, ref, 1, torch.tensor([[0, 1, 2, 13], [14, 15, 6, 8]]))
    assert _named(st) == [16, 2, 14, 4]
    keys = st.slot_key[4:8].tolist()
    assert sorted(k - E for k in keys) == [0, 1, 2, 13]  # the first four misses in selection order took the slots
    # a duplicate key is one access; other layers' slots never move
    before_other = st.slot_key[:4].clone()
    st = _run(om, ref, 1, torch.tensor([[0, 1, 2, 13], [0, 2, 1, 13]]))
    assert _named(st) == [20, 6, 14, 4]
    assert torch.equal(st.slot_key[:4], before_other)
    # the table and the slot keys describe each other
    for s, k in enumerate(st.slot_key[:-1].tolist()):
        if k >= 0:
            assert int(st.table[k]) == s
    assert int((st.table[:-1] >= 0).sum()) == int((st.slot_key[:-1] >= 0).sum())


@pytest.mark.parametrize("with_k2", [False, True])
def test_first_in_order_equals_stable_sort(with_k2):
    """The victims found by successive argmins are the first m of the stable sort by (k1, k2, slot), ties and
    infinities included (empty slots -inf first, excluded slots +inf never valid)."""
    from expertcast.inference.runtime.graph.state import first_in_order

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        S = int(torch.randint(1, 24, (1,), generator=g))
        k1 = torch.randint(0, 4, (S,), generator=g).double()
        k1[torch.rand(S, generator=g) < 0.2] = -torch.inf
        k1[torch.rand(S, generator=g) < 0.2] = torch.inf
        k2 = torch.randint(0, 3, (S,), generator=g).double() if with_k2 else None
        m = int(torch.randint(1, S + 1, (1,), generator=g))
        slots, valid = first_in_order(k1, k2, m)
        order = sorted(range(S), key=lambda s: (float(k1[s]), float(k2[s]) if with_k2 else 0.0, s))[:m]
        finite = [bool(k1[s] < torch.inf) for s in order]
        assert valid.tolist() == finite, trial
        n = sum(finite)  # +inf sorts last: the valid victims are a prefix
        assert slots.tolist()[:n] == order[:n], trial


def test_pool_slots_and_compile_choices():
    from expertcast.inference.runtime.graph.state import pool_slots

    got = pool_slots([0, 0, 1, 2, 1, 1], 6)
    assert got.tolist() == [[0, 1, 6], [2, 4, 5], [3, 6, 6]]
    om = OffloadedModel(build_tiny("qwen3_moe-tiny", seed=0), make_policy("lru"), 4, decode_path="graph")
    try:
        with pytest.raises(UsageError, match="compile backend must be one of"):
            om.graph.compile("fast")
        om.graph.compile("none")
        assert om.graph.layer_fn == om.graph.run_layer
    finally:
        om.restore()


torch.set_num_threads(1)

EOS = [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
NEW = 12
SLOTS = 6  # per layer, of E=16 (top-K=4)


class Batch:
    """The tiny model, a (left-padded) batch of prompts and the full-load reference generation."""

    def __init__(self, batch: int):
        self.model = build_tiny("qwen3_moe-tiny", seed=0)
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(40, 500, (batch, 8), generator=g)
        self.am = torch.ones_like(self.ids)
        for i in range(1, batch):
            self.am[i, :i] = 0
            self.ids[i, :i] = 0
        self.batch = batch
        self.ref = self.model.generate(self.ids, attention_mask=self.am, max_new_tokens=NEW, do_sample=False,
                                       eos_token_id=EOS, pad_token_id=0)
        c = self.model.config
        self.forecaster = untrained_forecaster(c.num_hidden_layers, c.num_experts, c.num_experts_per_tok)

    def policy(self, name: str):
        if name == "seqmoe":
            return make_policy("seqmoe", forecaster=self.forecaster, precompute=False, min_confidence=0.05,
                               prefetch_rule="floor")
        return make_policy(name)

    def run(self, name: str, path: str, pool: str = "per-layer", slots: int = SLOTS, record: bool = False,
            compile_backend: str = "none"):
        om = OffloadedModel(self.model, self.policy(name), slots, pool=pool, decode_path=path)
        try:
            if om.graph is not None and om.graph.planner is not None:
                om.graph.planner.blocking = True
            if compile_backend != "none":
                om.graph.compile(compile_backend)
            res = om.generate(self.ids, self.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, record=record,
                              seq_ids=[f"s{i}" for i in range(self.batch)])
            out = (res, om.stats, om.cache.resident_set(), om.cache_config, om)
        finally:
            self.model = om.restore()
        return out


@pytest.fixture(scope="module", params=[1, 3], ids=["batch1", "batch3"])
def batch(request):
    return Batch(request.param)


@pytest.mark.parametrize("pool,slots", [("per-layer", SLOTS), ("shared", 20)])
def test_graph_lru_equals_full_load_eager_and_simulator(batch, pool, slots):
    res, st, resident, config, om = batch.run("lru", "graph", pool=pool, slots=slots, record=True)
    assert om.decode_path == "graph"
    assert torch.equal(res.sequences, batch.ref)
    _, eager, eager_resident, _, _ = batch.run("lru", "eager", pool=pool, slots=slots)
    meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
    sim = replay(build_stream(meta, res.traces, batch_size=batch.batch), make_policy("lru"), config)
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(eager, k)), (k, getattr(st, k), getattr(eager, k))
        assert np.array_equal(getattr(st, k), getattr(sim, k)), (k, getattr(st, k), getattr(sim, k))
    assert st.A > 0 and st.D > 0 and st.hits.sum() > 0
    assert resident == eager_resident == sim.resident


def test_graph_seqmoe_tokens_and_device_plan(batch):
    res, st, resident, _, om = batch.run("seqmoe", "graph")
    assert torch.equal(res.sequences, batch.ref)
    _, eager, _, _, _ = batch.run("seqmoe", "eager")
    assert np.array_equal(st.accesses, eager.accesses)  # same routing, same accesses
    assert st.P > 0, "the planner's forecasts should reach the device as proactive loads"
    assert np.array_equal(st.hits + st.demand + st.late, st.accesses)
    assert om.graph.planner.stats["forecasts"] > 0
    w = om.graph.planner.worker  # the package's one background forecaster (AsyncSeqMoEPolicy's too)
    assert isinstance(w, ForecastWorker) and w.rollouts == w.steps > 0
    # the host cache written back from the device table holds at most its slots, each expert once
    assert 0 < len(resident) <= om.cache.num_slots


def test_graph_seqmoe_eviction_equals_eager_where_decisions_match(batch):
    """SeqMoE where the decisions match (module docstring): no prefetch, forecast at the last layer (p = L-1, so
    the step boundary is the trigger), the planner blocking (the forecast of every step installed before the next
    one: no race). The graph path evicts by the same forecast scores (ties to the least recent) as the host
    policy, so its counters, its number of forecasts and its resident set equal the eager path's and the
    simulator's replay of the routing it recorded."""
    def run(path):
        pol = make_policy("seqmoe", forecaster=batch.forecaster, precompute=False, prefetch=False)
        om = OffloadedModel(batch.model, pol, SLOTS, decode_path=path)
        try:
            if om.graph is not None:
                om.graph.planner.blocking = True
            out = om.generate(batch.ids, batch.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0,
                              record=True, seq_ids=[f"s{i}" for i in range(batch.batch)])
            return out, om.stats, om.cache.resident_set(), pol.stats["forecasts"], om
        finally:
            batch.model = om.restore()

    assert batch.forecaster.config.p == batch.model.config.num_hidden_layers - 1
    g_out, g_st, g_res, g_fc, om = run("graph")
    e_out, e_st, e_res, e_fc, _ = run("eager")
    assert om.decode_path == "graph"
    assert torch.equal(g_out.sequences, batch.ref) and torch.equal(e_out.sequences, batch.ref)
    meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
    sim = replay(build_stream(meta, g_out.traces, batch_size=batch.batch),
                 make_policy("seqmoe", forecaster=batch.forecaster, precompute=False, prefetch=False), om.cache_config)
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(g_st, k), getattr(e_st, k)), (k, getattr(g_st, k), getattr(e_st, k))
        assert np.array_equal(getattr(g_st, k), getattr(sim, k)), (k, getattr(g_st, k), getattr(sim, k))
    assert g_res == e_res == sim.resident and g_st.D > 0
    assert g_fc == e_fc > 0, "one forecast per decode step on both paths"


def test_graph_state_carries_over_calls_and_paths(batch):
    """A second generate() on the same runtime continues from the device state written back to the host (its
    prefill reads the slots the graph path filled): tokens stay equal and counters still equal the eager
    path's over two calls."""
    def two_calls(path):
        om = OffloadedModel(batch.model, make_policy("lru"), SLOTS, decode_path=path)
        try:
            outs = [om.generate(batch.ids, batch.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0).sequences
                    for _ in range(2)]
            return outs, om.stats
        finally:
            batch.model = om.restore()

    g_out, g_st = two_calls("graph")
    e_out, e_st = two_calls("eager")
    assert all(torch.equal(o, batch.ref) for o in g_out + e_out)
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(g_st, k), getattr(e_st, k)), k


@pytest.mark.parametrize("name", ["lru", "seqmoe"])
def test_fullgraph_compile_of_layer_function_same_tokens(name):
    """torch.compile(fullgraph=True) raises on any graph break (host sync, data-dependent Python); the compiled
    layer function takes the same decisions (counters) and gives the same tokens."""
    b = Batch(1)
    res, st, _, _, _ = b.run(name, "graph", compile_backend="aot_eager")
    assert torch.equal(res.sequences, b.ref)
    _, ref_st, _, _, _ = b.run(name, "graph")
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(ref_st, k)), k


def test_gpu_check_graph_dry_run(tmp_path, capsys):
    """The graph step of scripts/gpu_check.sh on the CPU: every check resolves and runs (token identity, the step
    rerun that CUDA captures, bench_runtime.py --overhead and --decode-path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[4] / "scripts" / "gpu_check_graph.py"
    spec = importlib.util.spec_from_file_location("gpu_check_graph", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("graph-tokens", "cuda-graph-replay", "overhead", "pct-full"):
        assert f" {name} " in out, name
    assert "FAIL" not in out
    over = __import__("json").loads((tmp_path / "overhead.json").read_text())
    assert over["eager_us_per_layer"] > 0 and over["graph_us_per_layer"] > 0


@pytest.mark.parametrize("name", ["lru", "seqmoe"])
def test_aoti_compiled_layer_same_tokens_and_counters(name):
    """The layer function compiled ahead of time by AOTInductor (GraphDecoder.compile("aoti"): exported with the
    device state as mutated inputs, called through the artefact's C++ runner) is the one that runs, gives the
    full-load tokens and takes the uncompiled function's decisions (counters, resident set)."""
    b = Batch(1)
    res, st, resident, _, om = b.run(name, "graph", compile_backend="aoti")
    fn = om.graph.layer_fn
    assert isinstance(fn, AOTLayer) and list(fn.compile_seconds) == [1], "one artefact, for batch size 1"
    assert torch.equal(res.sequences, b.ref)
    _, ref_st, ref_resident, _, _ = b.run(name, "graph")
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(ref_st, k)), k
    assert resident == ref_resident and st.D > 0


def test_overhead_bench_aoti_json(tmp_path):
    """``bench_runtime.py --overhead`` with the default compile backend on the CPU (AOTInductor): both paths timed
    in the same run, the JSON holds the issue's two figures with their spread and the graph path's split, and the
    compiled graph path takes less time per layer than the eager one."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[4] / "scripts" / "bench_runtime.py"
    spec = importlib.util.spec_from_file_location("bench_runtime_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    js = tmp_path / "overhead.json"
    assert mod.main(["--overhead", "--device", "cpu", "--overhead-layers", "4", "--tokens", "6", "--repeats", "3",
                     "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["compile_backend"] == "aoti" and "host time per MoE layer" in r["definition"]
    for p in ("eager", "graph"):
        lo, hi = r[f"{p}_us_per_layer_range"]
        assert 0 < lo <= r[f"{p}_us_per_layer"] <= hi
    assert len(r["paired_us"]) == 3 and all(m["graph_calls"] == m["eager_calls"] > 0 for m in r["paired_us"])
    assert 0 < r["graph_call_us_per_layer"] < r["graph_us_per_layer"]
    assert r["graph_us_per_layer"] < r["eager_us_per_layer"]


@pytest.mark.slow
def test_aoti_compiled_layer_one_artefact_per_batch_size():
    """A left-padded batch of 3 whose members end on EOS at different steps: the AOTInductor layer compiles one
    artefact per active batch size met and still gives the full-load tokens and the uncompiled path's counters."""
    b = Batch(3)
    res, st, resident, _, om = b.run("lru", "graph", compile_backend="aoti")
    assert torch.equal(res.sequences, b.ref)
    sizes = sorted(om.graph.layer_fn.compile_seconds)
    assert sizes[-1] == 3 and len(sizes) == len(set(sizes))
    _, ref_st, ref_resident, _, _ = b.run("lru", "graph")
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(ref_st, k)), k
    assert resident == ref_resident


def test_graph_path_refuses_a_prefetch_rule_it_does_not_plan_by():
    """The device plan is the floor rule's: seqmoe with another prefetch_rule is refused by name on the graph path
    (auto: the eager path, saying why), never run with a plan its options did not ask for."""
    from expertcast.models.forecaster import untrained_forecaster

    fc = untrained_forecaster(2, 16, 4)
    for rule in ("headroom", "benefit"):
        pol = make_policy("seqmoe", forecaster=fc, prefetch_rule=rule)
        with pytest.raises(UsageError, match=f"prefetch_rule={rule}.*give prefetch_rule=floor or prefetch=false"):
            choose_decode_path("graph", pol, CPU, None, pinned_store=False)
        path, why = choose_decode_path("auto", pol, CPU, None, pinned_store=False)
        assert path == "eager" and f"prefetch_rule={rule}" in why
        quiet = make_policy("seqmoe", forecaster=fc, prefetch_rule=rule, prefetch=False)  # no plan: nothing to refuse
        assert choose_decode_path("graph", quiet, CPU, None, pinned_store=False)[0] == "graph"
    floor = make_policy("seqmoe", forecaster=fc, prefetch_rule="floor")
    assert choose_decode_path("graph", floor, CPU, None, pinned_store=False)[0] == "graph"
