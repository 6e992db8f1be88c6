"""Graph-compatible decode path (issue 16) on CPU, against the eager path, the full-load model and the simulator.

* token identity: greedy generations of the graph path equal the full-load model's (lru and seqmoe, per-layer
  and shared pools, batch 1 and a left-padded batch whose members end at different steps on EOS);
* counters: for lru the graph path's decode counters and final resident set equal the eager path's and the
  simulator's replay of the routing the graph run recorded (the same decisions, taken on the device);
* seqmoe: forecasts from the host planner reach the device (proactive loads, eviction by forecast score);
  without prefetch and with the forecast at the last layer its counters equal the eager path's; with prefetch
  they differ by construction (module docstring of graph_decode);
* ``torch.compile(fullgraph=True)`` of the per-layer decode function: no graph break, same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.inference.driver import COUNTER_NAMES
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.simulator import build_stream, replay
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.presets import build_tiny

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
        torch.manual_seed(0)
        c = self.model.config
        self.forecaster = ExpertForecaster(ForecasterConfig(
            num_layers=c.num_hidden_layers, num_experts=c.num_experts, top_k=c.num_experts_per_tok, hidden_size=32,
            num_blocks=1, state_size=8, head_dim=16, chunk_size=16)).eval()

    def policy(self, name: str):
        if name == "seqmoe":
            return make_policy("seqmoe", forecaster=self.forecaster, precompute=False, min_confidence=0.05)
        return make_policy(name)

    def run(self, name: str, path: str, pool: str = "per-layer", slots: int = SLOTS, record: bool = False,
            compile_layer: bool = False):
        om = OffloadedModel(self.model, self.policy(name), slots, pool=pool, decode_path=path)
        try:
            if om.graph is not None and om.graph.planner is not None:
                om.graph.planner.blocking = True
            if compile_layer:
                om.graph.layer_fn = torch.compile(om.graph._layer, fullgraph=True, backend="aot_eager")
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
    # the host cache written back from the device table holds at most its slots, each expert once
    assert 0 < len(resident) <= om.cache.num_slots


def test_graph_seqmoe_eviction_equals_eager_where_decisions_match(batch):
    """SeqMoE without prefetch, forecast at the last layer (trigger p = L-1, so the step boundary is the trigger):
    the graph path evicts by the same forecast scores (ties to the least recent) as the host policy, so its
    counters and resident set equal the eager path's (which equal the simulator's: test_runtime_parity)."""
    def run(path):
        om = OffloadedModel(batch.model, make_policy("seqmoe", forecaster=batch.forecaster, precompute=False,
                                                     prefetch=False), SLOTS, decode_path=path)
        try:
            if om.graph is not None:
                om.graph.planner.blocking = True
            out = om.generate(batch.ids, batch.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0)
            return out.sequences, om.stats, om.cache.resident_set()
        finally:
            batch.model = om.restore()

    assert batch.forecaster.config.p == batch.model.config.num_hidden_layers - 1
    g_out, g_st, g_res = run("graph")
    e_out, e_st, e_res = run("eager")
    assert torch.equal(g_out, batch.ref) and torch.equal(e_out, batch.ref)
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(g_st, k), getattr(e_st, k)), (k, getattr(g_st, k), getattr(e_st, k))
    assert g_res == e_res and g_st.D > 0


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
    res, st, _, _, _ = b.run(name, "graph", compile_layer=True)
    assert torch.equal(res.sequences, b.ref)
    _, ref_st, _, _, _ = b.run(name, "graph")
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(ref_st, k)), k


def test_gpu_check_graph_dry_run(tmp_path, capsys):
    """The graph step of scripts/gpu_check.sh on the CPU: every check resolves and runs (token identity, the step
    rerun that CUDA captures, bench_runtime.py --overhead and --decode-path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_graph.py"
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
