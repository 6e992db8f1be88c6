"""ExpertCache slot table and CacheConfig capacity rules."""

from __future__ import annotations

import json

import numpy as np
import pytest
from expertcast.inference.cache.expert_cache import Budget, CacheConfig, ExpertCache, SlotState
from expertcast.utils.errors import UsageError


def test_capacity_resolution_per_layer_and_shared():
    c = CacheConfig(48, 128, 8, budget=Budget.fraction(0.15))
    assert c.uniform_slots_per_layer == 19 and c.total_slots == 48 * 19
    s = CacheConfig(48, 128, 8, pool="shared", budget=Budget.fraction(0.15))
    assert s.total_slots == round(0.15 * 48 * 128) and s.pool_of_layer.tolist() == [0] * 48
    b = CacheConfig(3, 16, 2, budget=Budget.per_layer([2, 4, 3]))
    assert b.pool_capacities.tolist() == [2, 4, 3] and b.uniform_slots_per_layer is None
    assert b.fraction == pytest.approx(9 / 48)


def test_capacity_errors_name_the_problem():
    with pytest.raises(ValueError, match="gives 1 slots per layer, below top-K=2"):
        CacheConfig(2, 16, 2, budget=Budget.fraction(0.05))
    with pytest.raises(ValueError, match="gives 3 shared slots, below top-K=4"):
        CacheConfig(2, 16, 4, pool="shared", budget=Budget.slots(3))
    with pytest.raises(ValueError, match="below top-K=2"):
        CacheConfig(3, 16, 2, budget=Budget.per_layer([2, 1, 2]))
    with pytest.raises(ValueError, match="must list 3 budgets"):
        CacheConfig(3, 16, 2, budget=Budget.per_layer([2, 2]))
    with pytest.raises(ValueError, match="give the cache budget"):
        CacheConfig(3, 16, 2)
    with pytest.raises(ValueError, match="give the cache budget"):
        CacheConfig(3, 16, 2, budget=0.5)  # a bare number has no unit: Budget.fraction / Budget.slots
    with pytest.raises(ValueError, match="more than E=16"):
        CacheConfig(3, 16, 2, budget=Budget.slots(17))
    with pytest.raises(ValueError, match="pool must be"):
        CacheConfig(3, 16, 2, pool="global", budget=Budget.slots(4))


def test_slot_table_states_and_protection():
    cache = ExpertCache(CacheConfig(2, 8, 1, budget=Budget.slots(2)))
    assert cache.num_slots == 4 and cache.pool_of(1) == 1
    s0 = cache.take_free_slot(0)
    cache.assign(s0, 0, 3, SlotState.USED)
    s1 = cache.take_free_slot(0)
    cache.assign(s1, 0, 5, SlotState.FETCH, proactive=True)
    assert cache.take_free_slot(0) == -1
    assert cache.is_resident(0, 3) and not cache.is_resident(0, 5) and cache.contains(0, 5)
    assert cache.state_of(0, 5) == SlotState.FETCH and cache.state_of(0, 6) == SlotState.EMPTY
    # Fetch is never a candidate; the running layer's selection is protected
    assert cache.eviction_candidates(0).tolist() == [[0, 3]]
    assert cache.eviction_candidates(0, protect_layer=0, protect=np.array([3])).tolist() == []
    with pytest.raises(ValueError, match="never evicted"):
        cache.evict(0, 5)
    with pytest.raises(ValueError, match="pool"):
        cache.assign(cache.take_free_slot(1), 0, 1, SlotState.USED)


def test_evict_and_reuse_slot():
    cache = ExpertCache(CacheConfig(2, 8, 1, pool="shared", budget=Budget.slots(2)))
    a = cache.take_free_slot(0)
    cache.assign(a, 1, 7, SlotState.USED)
    s = cache.evict(1, 7)
    assert s == a and cache.slot(1, 7) == -1 and cache.occupied() == 0
    cache.assign(s, 0, 2, SlotState.COMPUTE)
    assert cache.resident_set() == {(0, 2)}
    with pytest.raises(ValueError, match="already holds"):
        cache.assign(cache.take_free_slot(0), 0, 2, SlotState.USED)


def test_budget_carries_its_unit():
    assert Budget.parse(0.25) == Budget.fraction(0.25) and Budget.parse(8) == Budget.slots(8)
    assert Budget.parse([2, 4, 3]) == Budget.per_layer([2, 4, 3]) and Budget.parse(Budget.slots(3)) == Budget.slots(3)
    assert Budget.from_row({"capacity": 0.25}) == Budget.fraction(0.25)
    assert Budget.from_row({"slots": 8}) == Budget.slots(8)
    with pytest.raises(ValueError, match="'capacity': fraction"):
        Budget.from_row({"capacity": 0.25, "slots": 8})
    with pytest.raises(ValueError, match="a cache budget is"):
        Budget.parse("0.25")
    assert [b.requested for b in (Budget.fraction(0.25), Budget.slots(8), Budget.per_layer([2, 4]))] == \
        [0.25, 8, [2, 4]]
    assert [b.tag for b in (Budget.fraction(0.25), Budget.slots(8), Budget.per_layer([2, 4]))] == \
        ["c0.25", "s8", "p2-4"]
    assert CacheConfig(48, 128, 8, budget=Budget.fraction(0.15)).total_slots == \
        CacheConfig(48, 128, 8, budget=Budget.slots(19)).total_slots


def test_byte_budget_resolves_with_the_expert_size():
    """A budget in bytes of expert weights: n // expert_bytes slots, shared or split evenly over the layers;
    it needs the experts' size and names itself in decimal GB (``--budget-gb``)."""
    gib = Budget.bytes(2**30)
    assert gib.tag == "b1073741824" and gib.label == "budget 1.074 GB"
    assert Budget.gb(1.5) == Budget.bytes(1_500_000_000) and Budget.gb(1.5).flag == "--budget-gb"
    per = CacheConfig(3, 16, 2, budget=Budget.bytes(20 * 1000 + 999), expert_bytes=1000)  # 20 experts' worth
    assert per.pool_capacities.tolist() == [6, 6, 6]
    shared = CacheConfig(3, 16, 2, pool="shared", budget=Budget.bytes(20 * 1000), expert_bytes=1000)
    assert shared.pool_capacities.tolist() == [20]
    with pytest.raises(UsageError, match="needs the size of one expert"):
        CacheConfig(3, 16, 2, budget=Budget.bytes(10**6))
    with pytest.raises(UsageError, match="below top-K=2"):
        CacheConfig(3, 16, 2, budget=Budget.bytes(3 * 1000), expert_bytes=1000)
    with pytest.raises(UsageError, match="positive number of bytes"):
        Budget.bytes(0)


@pytest.mark.parametrize("budget", [Budget.fraction(0.25), Budget.fraction(1.0), Budget.slots(8), Budget.gb(1.5),
                                    Budget.gb(0.017304)])
def test_budget_row_round_trips(budget):
    """The one-key row form outputs and resume keys record (``{"capacity": f}`` / ``{"slots": n}`` /
    ``{"budget_gb": g}``) reads back to the same Budget; fraction and slot rows are the flags' old dicts."""
    row = budget.row()
    assert len(row) == 1 and Budget.from_row(row) == budget
    assert Budget.from_row(json.loads(json.dumps(row))) == budget
    if budget.kind == "fraction":
        assert row == {"capacity": budget.value} and type(row["capacity"]) is float
    if budget.kind == "slots":
        assert row == {"slots": 8} and type(row["slots"]) is int
    if budget.kind == "bytes":
        assert set(row) == {"budget_gb"} and budget.value_text == str(row["budget_gb"])
    with pytest.raises(UsageError, match="no one-key row form"):
        Budget.per_layer([2, 4]).row()


@pytest.mark.parametrize("cap", [{"capacity": 0.25}, {"slots": 4}, 0.25])
def test_a_dict_never_reaches_the_cache(cap):
    """The cache takes a Budget (or the library's number forms), never a flag dict: a dict is refused."""
    if isinstance(cap, dict):
        with pytest.raises(UsageError, match="as a Budget"):
            CacheConfig(2, 8, 2, budget=cap)
        with pytest.raises(UsageError, match="a cache budget is"):
            Budget.parse(cap)
    else:
        assert CacheConfig(2, 8, 2, budget=Budget.parse(cap)).total_slots == 4
