"""Runtime == simulator, policy by policy: for every registered policy, the offloading
runtime's counters (accesses, hits, late prefetches, demand misses, temporary loads, CPU executions,
proactive and dropped loads) and its final resident set equal the simulator's replay of the run the
runtime recorded (its routing, and the layer-executions at which its prefetches landed), at batch 1
and at batch 4 (left padding, members ending early on EOS).

Both sides run the same driver (inference/cache/driver.py); what this checks is everything around it: the
runtime's lockstep schedule, prefill replay, step numbering, fed tokens, per-member routing, and each
policy's reading of them. The link is slowed down so that prefetches really arrive late."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.cache.driver import RecordedTransport
from expertcast.inference.policies import make_policy, registry, spec_of
from expertcast.inference.policies.router import RouterRecord, RouterReplay
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.saem.cpu_exec import LatencyModel
from expertcast.inference.sim.simulator import build_stream, replay
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)

EOS = [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
NEW = 12
SLOTS = 6  # per layer, of E=16 (top-K=4)
LINK_GBPS = 0.02  # ~1.2 ms per 24 kB expert: prefetches land late
PREFETCHING = {"seqmoe", "seqmoe-replan", "seqmoe-async", "hybrid", "stage", "stage-oracle", "router-full", "router-spatio"}


class Run:
    """The tiny model, one recorded batch and what the policies need from it."""

    def __init__(self, batch: int):
        self.model = build_tiny("qwen3_moe-tiny", seed=0)
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(40, 500, (batch, 8), generator=g)
        self.am = torch.ones_like(self.ids)
        for i in range(1, batch):  # left padding: prompts of 8, 7, 6, ... tokens
            self.am[i, :i] = 0
            self.ids[i, :i] = 0
        self.seq_ids = [f"s{i}" for i in range(batch)]
        self.batch = batch
        om = OffloadedModel(self.model, make_policy("lru"), SLOTS)
        self.rec = om.generate(self.ids, self.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, record=True,
                               seq_ids=self.seq_ids)
        self.meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
        self.model = om.restore()
        self.traces = self.rec.traces
        rng = np.random.default_rng(0)
        shape = lambda s: (s.num_tokens, om.L, om.E)  # noqa: E731
        self.router_replay = RouterReplay({s.seq_id: RouterRecord(*(rng.random(shape(s)).astype(np.float16)
                                                                    for _ in range(3))) for s in self.traces})
        torch.manual_seed(0)
        self.forecaster = ExpertForecaster(ForecasterConfig(num_layers=om.L, num_experts=om.E, top_k=om.K,
                                                            hidden_size=32, num_blocks=1, state_size=8, head_dim=16,
                                                            chunk_size=16)).eval()

    def stream(self):
        return build_stream(self.meta, self.traces, batch_size=self.batch)

    def policy(self, name: str):
        """A fresh policy ``name`` configured from this run (same options for the runtime and the simulator);
        ``seqmoe-replan``: seqmoe re-planning after every layer (driver step 4b) with a within-token table."""
        if name == "seqmoe-replan":
            torch.manual_seed(0)
            f = ExpertForecaster(ForecasterConfig(num_layers=self.meta.num_layers, num_experts=self.meta.num_experts,
                                                  top_k=self.meta.top_k, trigger_layer=0, hidden_size=32, num_blocks=1, state_size=8,
                                                  head_dim=16, chunk_size=16, online_half_lives=[16.0],
                                                  component_half_lives=[16.0], within_token_table=True)).eval()
            f.components.fit(self.traces, 0)  # in-sample: parity, not a figure
            return make_policy("seqmoe", forecaster=f, precompute=False, breakeven=False, replan=1)
        lat = LatencyModel(transfer_ms=1.0, cpu_expert_ms=0.5, cpu_token_ms=0.15)
        stage = dict(cues="a|e", decoder=lambda i: bytes([int(i) % 256]), latency=lat)
        kw = {"static": dict(calibration=self.traces), "stage": stage, "stage-oracle": stage,
              # the headroom rule without the break-even (the untrained forecast issues loads), and the floor rule
              # in the hybrid: both prefetch paths under parity
              "seqmoe": dict(forecaster=self.forecaster, precompute=False, breakeven=False),
              "seqmoe-async": dict(forecaster=self.forecaster, blocking=True, min_confidence=0.05),
              "router-temporal": dict(replay=self.router_replay), "router-full": dict(replay=self.router_replay),
              "router-spatio": dict(replay=self.router_replay, R=3),
              "hybrid": dict(forecaster=self.forecaster, precompute=False, prefetch_rule="floor", min_confidence=0.05,
                             replay=self.router_replay, cues=stage["cues"], decoder=stage["decoder"])}.get(name, {})
        return make_policy(name, **kw)


@pytest.fixture(scope="module", params=[1, 4], ids=["batch1", "batch4"])
def run(request):
    r = Run(request.param)
    if request.param > 1:
        assert len({s.num_tokens - s.prompt_len for s in r.traces}) > 1, "members should end at different steps"
    return r


@pytest.mark.parametrize("name", sorted(registry()) + ["seqmoe-replan"])
def test_runtime_counters_equal_simulator_replay(run, name):
    pol = run.policy(name)
    future = run.stream() if "future" in spec_of(pol).needs else None
    if not spec_of(pol).runs_on("driver"):  # belady-seq may evict an expert the running layer computes with
        with pytest.raises(ValueError, match="compiled engine"):
            OffloadedModel(run.model, pol, SLOTS, future=future)
        return
    om = OffloadedModel(run.model, pol, SLOTS, link_gbps=LINK_GBPS, future=future)
    try:
        res = om.generate(run.ids, run.am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, record=True,
                          seq_ids=run.seq_ids)
        resident = om.cache.resident_set()
    finally:
        run.model = om.restore()
        getattr(pol, "close", lambda: None)()
    assert torch.equal(res.sequences, run.rec.sequences)  # offloading never changes the tokens
    sim_pol = run.policy(name)
    try:
        sim = replay(build_stream(run.meta, res.traces, batch_size=run.batch), sim_pol, om.cache_config,
                     transport=RecordedTransport(res.landings))
    finally:
        getattr(sim_pol, "close", lambda: None)()
    st = om.stats
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(sim, k)), (name, k, getattr(st, k), getattr(sim, k))
    assert st.decoded_tokens == sim.decoded_tokens and st.A > 0
    assert resident == sim.resident
    if name in PREFETCHING:
        assert st.P > 0, "a prefetching policy should have issued proactive loads here"
    if name == "seqmoe-replan":
        assert pol.stats["replans"] > 0 if run.batch == 1 else pol.stats["replans_skipped"] > 0  # batch 1 only
