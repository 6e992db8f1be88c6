"""The graded offloaded decode's figures (inference/runtime/eval_run.py): Hit is resident hits / accesses (an
expert executed on the CPU is neither a hit nor a miss), so `expertcast eval` and `expertcast stages eval` give the
same figure for the same policy on the same routing; every decode step is timed and its tokens counted (TPOT, tokens
without a miss); the all-resident baseline never misses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from expertcast.data.trace_format import TraceMeta
from expertcast.inference.cache.cost_model import CostConfig
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.eval_run import (
    AllResidentPolicy,
    StepClock,
    batch_stats,
    counters_now,
    decode_metrics,
)
from expertcast.models.presets import build_tiny

EOS = [7, 9, 11, 13]


def _prompts(batch: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(40, 500, (batch, 8), generator=g)
    am = torch.ones_like(ids)
    for i in range(1, batch):  # left padding
        am[i, :i] = 0
        ids[i, :i] = 0
    return ids, am


def _run(om: OffloadedModel, batch: int, new: int = 12, record: bool = False):
    ids, am = _prompts(batch)
    before = counters_now(om)
    with StepClock(om) as clock:
        res = om.generate(ids, am, max_new_tokens=new, eos_token_id=EOS, pad_token_id=0, record=record)
    return batch_stats(om, before, res, res.seconds, clock), res


def test_eval_and_stages_eval_agree_on_hits_when_experts_run_on_the_cpu():
    """SAEM's placement with CPU execution and no stage update (no prefetch, whose landing would depend on the link:
    the machine's here, the cost model's in the simulator): same routing, same decisions, the same Hit."""
    from expertcast.recipes.saem_eval import make_policies, run_grid

    torch.set_num_threads(1)
    model = build_tiny("qwen3_moe-tiny", seed=0)
    L, E = 4, 16  # the preset's shape (checked below)
    calib = np.ones((L, E), np.int64)
    freq = calib / calib.sum(axis=1, keepdims=True)
    decoder = lambda i: b" x"  # noqa: E731  (no cue ever fires)
    args = (["Wait"], decoder, freq, calib)
    cost = CostConfig(expert_bytes=9_440_000)  # stages eval's default expert: the CPU beats a transfer at 1 token
    [policy] = make_policies(*args, cost=cost, names=["stage-noupdate"])
    om = OffloadedModel(model, policy, 0.5)
    assert (om.L, om.E) == (L, E)
    stats, res = _run(om, 1, new=16, record=True)
    A, D, cpu = stats["accesses"], stats["demand_misses"], stats["cpu_exec"]
    assert cpu > 0 and stats["late_prefetches"] == 0  # the stage policy executed cold experts on the CPU
    eval_hit = decode_metrics([stats])["hit"]
    assert eval_hit == pytest.approx(stats["resident_hits"] / A) and eval_hit < 1 - D / A  # a CPU run is no hit
    meta = TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)
    [row] = run_grid("same-routing", (meta, res.traces), *args, batch_sizes=[1], capacities=[0.5], cost=cost,
                     policies=["stage-noupdate"], progress=False)
    assert row["hit"] == pytest.approx(eval_hit)  # the same figure `expertcast stages eval` reports
    assert row["cpu_share"] == pytest.approx(cpu / A)


def test_every_decode_step_is_timed_and_its_miss_free_tokens_counted():
    torch.set_num_threads(1)
    model = build_tiny("qwen3_moe-tiny", seed=0)
    om = OffloadedModel(model, make_policy("lru"), 0.25)
    stats, _ = _run(om, 2)
    st = om.stats
    assert sum(stats["step_tokens"]) == stats["decoded_tokens"] == st.decoded_tokens > 0
    assert len(stats["step_seconds"]) == len(st.step_demand) == st.decode_steps
    assert all(s > 0 for s in stats["step_seconds"])
    free = sum(n for n, d, lt in zip(stats["step_tokens"], st.step_demand, st.step_late, strict=True) if d == lt == 0)
    assert stats["miss_free_tokens"] == free < stats["decoded_tokens"]  # a quarter of the experts: some steps miss
    m = decode_metrics([stats, stats])
    assert m["miss_free_token_frac"] == pytest.approx(free / stats["decoded_tokens"])
    assert m["exposed_misses_per_token"] == pytest.approx(stats["read_exposed"] / stats["decoded_tokens"])
    assert m["read_mb_per_token"] == pytest.approx(stats["read_bytes"] / 1e6 / stats["decoded_tokens"])
    assert stats["read_bytes"] > 0
    assert m["tpot_p50_ms"] <= m["tpot_p90_ms"] <= m["tpot_p99_ms"] <= 1e3 * max(stats["step_seconds"]) + 1e-9
    assert m["ttft_p50_s"] == pytest.approx(stats["ttft_s"])
    om.restore()


def test_the_all_resident_baseline_never_misses_and_decodes_the_same_tokens():
    torch.set_num_threads(1)
    model = build_tiny("qwen3_moe-tiny", seed=0)
    om = OffloadedModel(model, make_policy("lru"), 0.25)
    _, lru = _run(om, 2)
    model = om.restore()
    om = OffloadedModel(model, AllResidentPolicy(), 1.0)
    stats, res = _run(om, 2)
    assert torch.equal(res.sequences, lru.sequences)
    assert stats["demand_misses"] == stats["read_exposed"] == stats["read_bytes"] == 0
    assert stats["resident_hits"] == stats["accesses"] > 0 and stats["miss_free_tokens"] == stats["decoded_tokens"]
    model = om.restore()
    with pytest.raises(ValueError, match="a slot for every expert"):
        OffloadedModel(model, AllResidentPolicy(), 0.5)
