"""The graph decode path's pieces (inference/runtime/graph/): which path runs and why, and one layer
function on hand-set device state: victims (empty slots first, then least recent, the selection protected),
temporary scratch rows when the pool is full, the table kept consistent, the output equal to the full-load
experts module's."""

from __future__ import annotations

import pytest
import torch
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.graph.path import choose_decode_path
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
