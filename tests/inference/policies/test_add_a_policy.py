"""Adding a policy is one module and one line (docs/design.md, "Cache policies"): ``mru``
(inference/policies/mru.py, named in POLICY_MODULES) shows up in the registry with its spec, in
`expertcast simulate` (listed, replayed), in the offloading runtime on a tiny model, and the runtime's counters
equal the simulator's replay of the run it recorded (the parity check of tests/inference/runtime/test_engine_parity.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from expertcast.commands.simulate import main
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.cache.driver import RecordedTransport
from expertcast.inference.cache.expert_cache import Budget, CacheConfig
from expertcast.inference.policies import POLICY_MODULES, make_policy, policy_spec, registry, spec_of
from expertcast.inference.policies.mru import MRUPolicy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.sim.simulator import build_stream, replay, run_policy
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)


def test_mru_is_one_module_and_one_registry_line():
    assert "expertcast.inference.policies.mru" in POLICY_MODULES
    spec = policy_spec("mru")
    assert spec.load() is MRUPolicy and spec.engines == {"driver"} and spec.needs == frozenset() and spec.live
    assert list(registry())[-1] == "mru"
    pol = make_policy("mru")
    assert isinstance(pol, MRUPolicy) and spec_of(pol) is spec and pol.label == "mru" and pol.demand_only


def test_mru_evicts_the_most_recently_used():
    """One layer, 2 slots, top-1: 0 1 2 0 1 2. MRU keeps the older resident each time (LRU never hits)."""
    ids = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int64).reshape(-1, 1, 1)
    seq = TraceSequence("s", np.zeros(len(ids), np.int32), 1, ids.astype(np.int16), np.ones(ids.shape, np.float16))
    meta = TraceMeta("cyclic", 1, 4, 1, 1)
    cfg = CacheConfig(num_layers=1, num_experts=4, top_k=1, pool="per-layer", budget=Budget.slots(2))
    stream = build_stream(meta, [seq])
    mru = run_policy(stream, make_policy("mru"), cfg)
    lru = run_policy(stream, make_policy("lru"), cfg)
    assert mru.engine == "python"  # the driver engine: mru has no compiled kernel
    assert int(lru.hits.sum()) == 0 and int(mru.hits.sum()) > 0


def test_mru_in_expertcast_simulate(tmp_path, capsys):
    assert main(["--list-policies"]) == 0
    listed = capsys.readouterr().out
    assert "\nmru: Most recently used: evicts the candidate accessed last.\n    (no options)" in "\n" + listed
    out = tmp_path / "out"
    assert main(["--synthetic", "zipf", "--synthetic-shape", "2,8,2,3,24", "--policies", "mru,lru",
                 "--capacity", "0.5", "--out", str(out), "--no-belady-fraction"]) == 0
    recs = json.loads((out / "simulate.json").read_text())
    assert {r["policy"] for r in recs} == {"mru", "lru"}
    mru = next(r for r in recs if r["policy"] == "mru")
    assert mru["engine"] == "python" and 0 < mru["hit"] < 1


@pytest.mark.parametrize("batch", [1, 3])
def test_mru_in_the_runtime_equals_the_simulator(batch):
    model = build_tiny("qwen3_moe-tiny", seed=0)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(40, 500, (batch, 8), generator=g)
    am = torch.ones_like(ids)
    for i in range(1, batch):  # left padding
        am[i, :i] = 0
        ids[i, :i] = 0
    seq_ids = [f"s{i}" for i in range(batch)]
    om = OffloadedModel(model, make_policy("mru"), 6, link_gbps=0.02)
    try:
        res = om.generate(ids, am, max_new_tokens=10, pad_token_id=0, record=True, seq_ids=seq_ids)
        resident = om.cache.resident_set()
    finally:
        om.restore()
    meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
    sim = replay(build_stream(meta, res.traces, batch_size=batch), make_policy("mru"), om.cache_config,
                 transport=RecordedTransport(res.landings))
    st = om.stats
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(sim, k)), (k, getattr(st, k), getattr(sim, k))
    assert st.decoded_tokens == sim.decoded_tokens and st.A > 0 and st.D > 0
    assert resident == sim.resident
