"""The disk benchmark at a model that "does not fit": a build-shape checkpoint streamed to the disk store, its
``--layers`` subset carrying the paired % of full speed (reduced width, seconds)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from expertcast.inference.runtime.real_shapes import build_shape
from expertcast.inference.sim.simulator import build_stream
from expertcast.recipes.bench_disk import (
    BenchConfig,
    check_held_out,
    check_subset,
    dependency_bound_seconds,
    run_bench,
    scaled_full_seconds,
    trim_sequence,
)

DS_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, vocab_size=512, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4,
                bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    full = build_shape("deepseek-v2-lite", d / "full", layers=4, seed=0, overrides=DS_SMALL)
    sub = build_shape("deepseek-v2-lite", d / "sub", layers=2, seed=0, overrides=DS_SMALL)
    return d, full, sub


def _tensors(folder):
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_subset_layers_are_the_full_builds_first_layers(builds):
    d, _, _ = builds
    full, sub = _tensors(d / "full"), _tensors(d / "sub")
    assert set(sub) <= set(full) and any(".mlp.experts.5.down_proj" in k for k in sub)
    for k, v in sub.items():
        assert torch.equal(v, full[k]), k
    assert "subset" in check_subset(str(d / "full"), str(d / "sub"))
    other = build_shape("deepseek-v2-lite", d / "other", layers=2, seed=3, overrides=DS_SMALL)
    with pytest.raises(ValueError, match="seed"):
        check_subset(str(d / "full"), other.out)
    with pytest.raises(ValueError, match="not a subset"):
        check_subset(str(d / "sub"), str(d / "full"))


def test_streamed_model_with_subset_baseline(builds, tmp_path, monkeypatch):
    import expertcast.recipes.bench_disk as bd

    d, full, _ = builds
    brackets = []
    real = bd.subset_all_in_ram

    def measured(*a, **k):
        brackets.append(real(*a, **k))
        return brackets[-1]

    monkeypatch.setattr(bd, "subset_all_in_ram", measured)
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(tmp_path / "o"), model=str(d / "full"), baseline_model=str(d / "sub"),
                      policies=("lru", "belady"), budgets=(0.25, 0.45), repeats=2, sequences=1, tokens=6, prompt=3,
                      disk_mb=4, readers=2, dtype="bfloat16")
    try:
        rec = run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    assert rec["model"]["L"] == 3 and rec["model"]["decoder_layers"] == 4
    assert [(r["policy"], r["budget"]) for r in rec["rows"]] == [(p, b) for b in (0.25, 0.45) for p in ("lru", "belady")]
    assert len(rec["subset_rows"]) == 4 and not rec["skipped"]
    xb = rec["model"]["expert_bytes"]
    for r, s in zip(rec["rows"], rec["subset_rows"], strict=True):
        assert r["pct_full"] == s["pct_full"] and r["sub_tokens_per_s"] == s["tokens_per_s"]
        assert s["pct_full_min"] <= s["pct_full"] <= s["pct_full_max"]
        assert r["reads"] == r["loads"] > 0 and r["decoded_tokens"] == 6
        assert math.isclose(r["read_mb_per_token"], r["reads"] * xb / 1e6 / 6, rel_tol=1e-9)
        # the compute floor: the all-in-RAM speed, or the run's own where it beat that (scaled) estimate
        assert r["bound_tokens_per_s"] <= max(r["full_tokens_per_s"], r["tokens_per_s"]) * (1 + 1e-9)
        assert r["achieved_vs_bound"] <= 1 + 1e-9 and r["disk_idle_ms_per_token"] >= 0
        assert math.isclose(r["pct_full_scaled"], 100 * r["tokens_per_s"] / r["full_tokens_per_s"], rel_tol=1e-9)
        assert 0 < r["peak_rss_gb"] and r["rss_bound_gb"] > 0
    for r in rec["rows"] + rec["subset_rows"]:  # the simulator, same cell: demand-only decisions do not hang on timing
        assert r["sim_hit"] == r["hit"] and r["sim_reads_per_token"] == pytest.approx(r["reads_per_token"]), r
        assert 0 < r["sim_tokens_per_s"] <= r["full_tokens_per_s"] * (1 + 1e-9) and r["sim_stall_ms_per_token"] >= 0
    belady = {r["budget"]: r["hit"] for r in rec["rows"] if r["policy"] == "belady"}
    lru = {r["budget"]: r["hit"] for r in rec["rows"] if r["policy"] == "lru"}
    assert all(belady[b] >= lru[b] for b in belady)  # the protect-rule plan is the demand-only ceiling
    assert "t_full = t_subset x ((1 - f) + f x 4/2" in rec["baseline"] and "3/2" not in rec["baseline"]
    # the full depth's all-in-RAM figure is bracketed in time: the subset measured again after each cell, each row's
    # figure between the two measurements around its cell (the mean of their seconds), the policies still armed
    # with the figure taken before the first cell
    assert len(brackets) == 2 and all(s > 0 and 0 < f < 1 for s, f in brackets)
    c25, c45 = ([r for r in rec["rows"] if r["budget"] == b] for b in (0.25, 0.45))
    assert c25[0]["full_tokens_per_s_after"] == c45[0]["full_tokens_per_s_before"]
    for r in rec["rows"]:
        lo, hi = sorted((r["full_tokens_per_s_before"], r["full_tokens_per_s_after"]))
        assert lo * (1 - 1e-9) <= r["full_tokens_per_s"] <= hi * (1 + 1e-9)
        assert r["armed_layer_ms"] == rec["rows"][0]["armed_layer_ms"]
    assert 1.0 / c45[0]["full_tokens_per_s_after"] == pytest.approx(
        bd.scaled_full_seconds(brackets[1][0], brackets[1][1], 2, 4))
    # the full depth's own ceiling: the same model, store and slots, the routing folded onto the slots: no read once warm
    for r in rec["rows"]:
        assert r["resident_reads"] == 0 and r["resident_tokens_per_s"] > 0, r
        assert math.isclose(r["pct_resident"], 100 * r["tokens_per_s"] / r["resident_tokens_per_s"], rel_tol=1e-9)
    left = {p.name for p in (tmp_path / "o").iterdir()}
    assert left == {"bench_disk.json", "bench_disk.csv", "bench_disk.png"}, left  # both stores deleted
    assert json.loads((tmp_path / "o" / "bench_disk.json").read_text())["provenance"]["sequences"]


def test_cells_run_in_rounds_and_pair_each_policy_with_lru_of_its_round(builds, tmp_path, monkeypatch):
    """Every round runs each policy once, round 2j rotated by j and round 2j + 1 the same order reversed (a drift of
    the machine falls on both sides of a comparison: :func:`round_order`), and ``vs_ref`` is the ratio of two passes of the same round, never of two medians."""
    import expertcast.recipes.bench_disk as bd

    d, _, _ = builds
    calls = []
    real = bd.arm_policy

    def logged(name, *a, **k):
        calls.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(bd, "arm_policy", logged)

    def ceiling(*a, **k):  # the full depth's ceiling, one pass per round: a different figure in each round
        calls.append("ceiling")
        assert k.get("repeats") == 1
        return 0.1 * calls.count("ceiling"), 0

    monkeypatch.setattr(bd, "resident_ceiling", ceiling)
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(tmp_path / "o"), model=str(d / "full"), baseline_model=str(d / "sub"),
                      policies=("belady", "lru"), budgets=(0.25,), repeats=3, full_repeats=2, sequences=1, tokens=4,
                      prompt=3, disk_mb=4, readers=2, dtype="bfloat16")
    try:
        rec = run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    # the subset's 3 rounds (the third rotated by one), then the full depth's 2; at the end, once the run's disk figure is known, the
    # simulator's replay of each row (the full depth's, then the subset's)
    # the full depth's ceiling after each of its rounds, paired with that round's passes
    assert calls == ["belady", "lru", "lru", "belady", "lru", "belady"] + \
        ["belady", "lru", "ceiling", "lru", "belady", "ceiling"] + ["belady", "lru"] + ["belady", "lru"], calls
    for r in rec["rows"]:
        assert r["resident_passes"] == 2 and r["resident_tokens_per_s"] == pytest.approx(1 / 0.15)
        assert r["pct_resident_min"] <= r["pct_resident"] <= r["pct_resident_max"]
        # the row's own pass (the median-speed one) over the ceiling of its round: one end of the paired range
        assert any(math.isclose(100 * r["tokens_per_s"] * c, v, rel_tol=1e-9)
                   for c in (0.1, 0.2) for v in (r["pct_resident_min"], r["pct_resident_max"])), r
    for r in rec["rows"] + rec["subset_rows"]:  # every card on the link of the run's bound figure
        assert r["sim_disk_gbps"] == rec["disk_gbps_bound"] >= rec["machine"]["disk_gbps"], r
    for rows, rounds in ((rec["subset_rows"], 3), (rec["rows"], 2)):
        by = {r["policy"]: r for r in rows}
        assert by["lru"]["vs_ref"] == 1.0 and by["lru"]["ref_policy"] == "lru"
        b = by["belady"]
        assert b["vs_ref_rounds"] == rounds == b["passes"]
        assert b["vs_ref_min"] <= b["vs_ref"] <= b["vs_ref_max"] and b["vs_ref"] > 0
    # one full-depth round: the pair is the two rows' own passes
    assert bd.paired_vs_ref({"lru": [2.0, 4.0, 3.0], "x": [3.0, 2.0, 3.0]}, "lru")["x"] == {
        "ref_policy": "lru", "vs_ref": 1.0, "vs_ref_min": 0.5, "vs_ref_max": 1.5, "vs_ref_rounds": 3}
    assert bd.paired_vs_ref({"x": [1.0]}, "lru") == {}
    assert bd.round_order(["a", "b", "c"], 1) == ["c", "b", "a"] and bd.reference_arm(["x", "y"]) == "x"
    assert [bd.round_order(["a", "b", "c"], r) for r in (2, 3)] == [["b", "c", "a"], ["a", "c", "b"]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_round_order_balances_every_pair_of_arms(n):
    """Over 2n rounds every arm runs once per round and in every place twice, and in each pair of rounds any two arms
    stand as far apart once each way: a drift linear over the pair cancels in their paired ratio, and no arm keeps
    the ends of the rounds (reversal alone gave them to the same two arms)."""
    import expertcast.recipes.bench_disk as bd

    arms = [f"arm{i}" for i in range(n)]
    orders = [bd.round_order(arms, r) for r in range(2 * n)]
    assert all(sorted(o) == arms for o in orders)
    for a in arms:
        assert sorted(o.index(a) for o in orders) == sorted(list(range(n)) * 2)
    for r in range(0, 2 * n, 2):
        for a in arms:
            for b in arms:
                d0 = orders[r].index(a) - orders[r].index(b)
                assert orders[r + 1].index(a) - orders[r + 1].index(b) == -d0


def test_subset_baseline_per_format_floor(builds, tmp_path, monkeypatch):
    """A quantized format at full depth: its bound's compute floor is its own all-in-RAM speed, measured on the
    subset in that format and scaled to the full depth like the bf16 one. The timeline lets go of its pass's model
    when it is saved (it held the slots through the next pass's allocation: at 45% of the real shape, 2 x 13 GB)."""
    import expertcast.recipes.bench_disk as bd
    from expertcast.recipes.bench_disk import scaled_full_seconds

    made = []

    class Kept(bd.Timeline):
        def __init__(self, om):
            super().__init__(om)
            made.append(self)

    monkeypatch.setattr(bd, "Timeline", Kept)
    d, _, _ = builds
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(tmp_path / "o"), model=str(d / "full"), baseline_model=str(d / "sub"),
                      policies=("lru",), budgets=(0.45,), repeats=1, sequences=1, tokens=6, prompt=3,
                      disk_mb=4, readers=2, dtype="bfloat16", expert_dtypes=("int4",),
                      trace_timeline=str(tmp_path / "tl.json"))
    try:
        rec = run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    (r,), (s,) = rec["rows"], rec["subset_rows"]
    sub_int4 = rec["format_all_in_ram_tokens_per_s"]["int4"]
    assert s["full_format_tokens_per_s"] == pytest.approx(sub_int4)
    assert r["full_format_tokens_per_s"] < sub_int4  # 4 decoder layers cost more than the subset's 2
    assert r["full_format_tokens_per_s"] != pytest.approx(r["full_tokens_per_s"])
    assert 1.0 / r["full_format_tokens_per_s"] <= scaled_full_seconds(1.0 / sub_int4, 1.0, 2, 4) * (1 + 1e-9)
    assert r["pct_full_format"] == pytest.approx(100 * r["tokens_per_s"] / r["full_format_tokens_per_s"])
    assert r["bound_tokens_per_s"] <= max(r["full_format_tokens_per_s"], r["tokens_per_s"]) * (1 + 1e-9)
    for row in (r, s):  # the simulated speed stands on the format's own all-in-RAM floor too
        assert 1.0 / row["sim_tokens_per_s"] == pytest.approx(
            1.0 / row["full_format_tokens_per_s"] + row["sim_stall_ms_per_token"] / 1e3)
    assert len(made) == 1 and made[0].om is None  # saved, and the model released
    tl = json.loads((tmp_path / "tl.json").read_text())  # the timeline is the full-depth pass's, not the subset's
    assert tl["what"].endswith("full depth") and {ly["layer"] for ly in tl["layers"]} == {0, 1, 2, 3}


def test_trim_and_scale():
    from expertcast.data.trace_format import TraceSequence

    T, L, K = 20, 2, 2
    s = TraceSequence("a", np.arange(T, dtype=np.int32), 10, np.zeros((T, L, K), np.int16),
                      np.full((T, L, K), 0.5, np.float16), None)
    t = trim_sequence(s, 3, 4)
    assert t.prompt_len == 3 and list(t.token_ids) == list(range(7, 14)) and t.expert_ids.shape == (7, L, K)
    assert scaled_full_seconds(0.010, 0.8, 2, 6) == pytest.approx(0.002 + 0.008 * 3)


def test_dependency_bound_by_hand():
    """A demand miss overlaps only its own layer's compute: two layer-executions of 4 experts (c = 1 ms each), one
    with 3 demand misses of 10 ms reads at the pool's bandwidth (last lands at 30 ms, + 1 ms compute, against the
    4 ms the all-in-RAM run spends there), one without; the full-overlap bound would only see 30 ms of reads."""
    from expertcast.inference.runtime.stats import RuntimeStats

    st = RuntimeStats(2, 1000)
    st.decoded_tokens, st.reads, st.layer_execs = 1, 3, [(0, 4, 3), (1, 4, 0)]
    t = dependency_bound_seconds(st, 1000, 1000 / 0.010, 0.001, 0.020)
    assert t == pytest.approx(0.020 + (0.030 + 0.001 - 0.004))
    assert 1 / t < 1 / max(0.020, 0.030)  # below the full-overlap bound
    st.layer_execs = [(0, 4, 0), (1, 4, 0)]  # no demand miss: reads (prefetches) overlap any compute
    assert dependency_bound_seconds(st, 1000, 1000 / 0.010, 0.001, 0.020) == pytest.approx(0.030)


def test_static_calibration_must_be_held_out():
    from expertcast.data.synthetic import zipf_traces

    seqs = list(zipf_traces(num_sequences=3, num_tokens=12, num_layers=2, num_experts=8, top_k=2).sequences)
    check_held_out(seqs[2:], seqs[:2])
    with pytest.raises(ValueError, match="overlaps the replayed"):
        check_held_out(seqs[1:], seqs[:2])
    with pytest.raises(ValueError, match="no held-out sequence"):
        check_held_out([], seqs)


def test_layer_share_times_the_decoder_layers_of_decode_steps_only(builds):
    """The share of a decode step inside the decoder layers, measured by hooks on the layers that are removed
    afterwards, is a proper fraction (the embedding, final norm, LM head and the driver's work lie outside)."""
    from expertcast.data.synthetic import zipf_traces
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.engine import OffloadedModel
    from expertcast.recipes.bench_disk import decoder_layers, layer_share
    from transformers import AutoModelForCausalLM

    d, _, _ = builds
    model = AutoModelForCausalLM.from_pretrained(str(d / "full"), dtype=torch.float32)
    layers = decoder_layers(model)
    assert len(layers) == 4
    E, K = model.config.n_routed_experts, model.config.num_experts_per_tok
    syn = zipf_traces(num_sequences=1, num_tokens=12, num_layers=3, num_experts=E, top_k=K, prompt_len=4, seed=0)
    om = OffloadedModel(model, make_policy("lru"), 1.0)
    try:
        s_tok, share = layer_share(om, list(syn.sequences), repeats=2)
    finally:
        om.close()
    assert s_tok > 0 and 0.0 < share < 1.0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layers)  # hooks removed


def test_bound_uses_a_disk_figure_that_bounds_and_never_exceeds_one():
    """A run whose reads went faster than the one-pass measurement, and a run faster than its (noisy) all-in-RAM
    baseline: the bound's disk figure is the largest achieved rate (named), and achieved_vs_bound <= 1."""
    from expertcast.recipes.bench_disk_report import bound_disk_gbps, finish_bounds

    rows = [  # 80 reads/token of 10 MB at 2 tok/s = 1.6 GB/s over the wall time, 2.8 GB/s over its read-busy time
        {"policy": "lru", "budget": 0.25, "format": "bfloat16", "tokens_per_s": 2.0, "reads_per_token": 80,
         "expert_bytes": 10_000_000, "read_gbps": 2.8, "compute_floor_s": 0.4},
        {"policy": "belady", "budget": 0.45, "format": "bfloat16", "tokens_per_s": 3.0, "reads_per_token": 1,
         "expert_bytes": 10_000_000, "read_gbps": float("nan"), "compute_floor_s": 0.4},  # faster than baseline
    ]
    assert bound_disk_gbps(1.25, rows) == (2.8, "achieved by lru @ 0.25 bfloat16 (read-busy)")
    gbps, source = finish_bounds(rows, 1.25)
    assert gbps == 2.8 and "lru" in source
    for r in rows:
        assert r["achieved_vs_bound"] <= 1.0 + 1e-12 and r["disk_gbps_bound"] == 2.8
    assert rows[1]["achieved_vs_bound"] == pytest.approx(1.0)  # the run's own time is the floor
    assert rows[0]["bound_tokens_per_s"] == pytest.approx(1 / max(80 * 1e7 / 2.8e9, 0.4))
    assert bound_disk_gbps(5.0, rows) == (5.0, "one-pass measurement")


def test_recall_axis_formats_and_timeline(tmp_path):
    """Oracle rows per recall (break-even on and off), bf16 and int4 stores (int4 reads fewer bytes per token), the
    disk's busy + idle time per token adding up to the token's time, a bound that holds, and the timeline."""
    from expertcast.recipes.bench_disk import quick_config

    cfg = quick_config(str(tmp_path / "o"))
    cfg.policies, cfg.budgets, cfg.repeats = ("lru",), (0.45,), 1
    cfg.recall, cfg.expert_dtypes, cfg.disk_seconds = (1.0, 0.5), ("bfloat16", "int4"), 0.2
    cfg.trace_timeline = str(tmp_path / "tl.json")
    threads = torch.get_num_threads()
    try:
        rec = run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    rows = rec["rows"]
    oracle = [(r["format"], r["recall"], r["breakeven"]) for r in rows if r["recall"] is not None]
    assert oracle == [(f, rc, be) for f in ("bfloat16", "int4") for rc in (1.0, 0.5) for be in (True, False)]
    # one recall curve per setting but the recall: the two break-even arms are two series of two points each
    series = {r["oracle_series"] for r in rows if r["recall"] is not None}
    assert series == {"seqmoe:forecast=oracle,breakeven=true", "seqmoe:forecast=oracle,breakeven=false"}, series
    from expertcast.recipes.bench_disk_arms import oracle_of

    assert oracle_of("seqmoe:recall=0.7,forecast=oracle,plan_executions=2")["oracle_series"] == \
        "seqmoe:forecast=oracle,plan_executions=2" and oracle_of("lru") == {}
    by = {(r["policy"], r["format"]): r for r in rows}
    xb = rec["model"]["expert_bytes_by_format"]
    assert xb["int4"] < xb["bfloat16"] / 3
    assert by[("lru", "int4")]["read_mb_per_token"] == pytest.approx(by[("lru", "int4")]["reads_per_token"]
                                                                      * xb["int4"] / 1e6)
    for r in rows:
        assert r["achieved_vs_bound"] <= 1.0 + 1e-9 and r["achieved_vs_dep_bound"] <= 1.0 + 1e-9
        assert r["disk_busy_ms_per_token"] >= 0 and r["disk_idle_ms_per_token"] >= 0
        assert r["disk_busy_ms_per_token"] + r["disk_idle_ms_per_token"] >= 1e3 / r["tokens_per_s"] * (1 - 1e-9)
    assert rec["disk_gbps_bound"] >= rec["machine"]["disk_gbps"] and rec["disk_gbps_source"]
    assert set(rec["machine"]["format_gemm"]) == {"bfloat16", "int4"} and rec["machine"]["kernel_table"]
    assert rec["machine"]["disk_seconds"] >= 0.2
    for r in rows:  # a forecasting policy's rows carry its cost per decode step (the oracle's: reading its tables)
        assert ("forecaster_ms_per_step" in r) == (r["recall"] is not None), r["policy"]
        if r["recall"] is not None:
            assert r["forecaster_ms_per_step"] >= 0 and 0 <= r["forecaster_share"] < 1
    # int4's bound stands on int4's own all-in-RAM speed, bf16's on the paired bf16 baseline
    assert set(rec["format_all_in_ram_tokens_per_s"]) == {"int4"}
    for r in rows:
        own = rec["format_all_in_ram_tokens_per_s"]["int4"] if r["format"] == "int4" else r["full_tokens_per_s"]
        assert r["full_format_tokens_per_s"] == pytest.approx(own)
        assert r["pct_full_format"] == pytest.approx(100 * r["tokens_per_s"] / own)
        assert r["bound_tokens_per_s"] <= max(own, r["tokens_per_s"]) * (1 + 1e-9)
    tl = json.loads((tmp_path / "tl.json").read_text())
    assert "recall=1" in tl["what"] and tl["layers"] and tl["reads"]
    assert all(r["submit"] <= r["start"] <= r["end"] for r in tl["reads"])
    left = {p.name for p in (tmp_path / "o").iterdir()}
    assert left == {"bench_disk.json", "bench_disk.csv", "bench_disk.png", "bench_disk_recall.png"}, left


def test_learned_forecaster_guard_and_recall(tmp_path):
    """seqmoe with the learned forecaster is built through the policy parser beside the oracle; its measured
    recall@K sits on the recall axis; the guard refuses its own fit sequences unless allowed."""
    from expertcast.data.synthetic import zipf_traces
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.forecaster_export import save_forecaster
    from expertcast.recipes.bench_disk import forecaster_guard, forecaster_recall, policy_arms, quick_config
    from expertcast.utils.errors import OverlapError

    cfg = quick_config(str(tmp_path / "o"))
    syn = zipf_traces(num_sequences=1, num_tokens=cfg.prompt + cfg.tokens, num_layers=cfg.layers,
                      num_experts=cfg.experts, top_k=cfg.top_k, prompt_len=cfg.prompt, seed=cfg.seed)
    seqs = list(syn.sequences)
    torch.manual_seed(0)
    fcfg = ForecasterConfig(num_layers=cfg.layers, num_experts=cfg.experts, top_k=cfg.top_k, hidden_size=16,
                            head_dim=8, state_size=4, num_blocks=1, direct_horizons=2)
    export = save_forecaster(ExpertForecaster(fcfg).eval(), tmp_path / "fc", source={"model_id": syn.meta.model_id},
                             training={"train_ids": [seqs[0].seq_id], "val_ids": []})
    cfg.forecaster, cfg.recall = str(export), (1.0,)
    assert policy_arms(cfg) == ["lru", "lfu", "static", "seqmoe", "seqmoe:forecast=oracle,recall=1,breakeven=true",
                                "seqmoe:forecast=oracle,recall=1,breakeven=false"]
    with pytest.raises(OverlapError):
        forecaster_guard(cfg, syn.meta, seqs)
    cfg.allow_overlap = True
    guard = forecaster_guard(cfg, syn.meta, seqs)
    fr = forecaster_recall(cfg, seqs, guard)
    assert 0.0 <= fr["h1"] <= 1.0 and len(fr["per_sequence"]) == 1
    # the plain "seqmoe" arm (no options in its text) is built with --forecaster; an oracle arm shares its config
    from expertcast.recipes.bench_disk_arms import arm_policy

    pol, _ = arm_policy("seqmoe", cfg, syn.meta, seqs, 1e9, 1.0)
    assert pol.model is not None and pol.oracle is None and pol.fc.trigger_layer == fcfg.trigger_layer
    orc, _ = arm_policy("seqmoe:forecast=oracle,recall=1,breakeven=false", cfg, syn.meta, seqs, 1e9, 1.0)
    assert orc.oracle is not None and orc.model is not None and orc.fc == pol.fc


def test_an_arms_reader_options_reach_its_reader_pool(tmp_path, monkeypatch):
    """``POLICY@chunk=N`` runs the policy with the reader pool's prefetch blocks at N KiB (0: whole reads that do
    not yield), in the same round as the plain arm; the row keeps the arm's name; a bad reader option is refused
    before the run."""
    from expertcast.inference.runtime import disk_store
    from expertcast.recipes.bench_disk import quick_config
    from expertcast.recipes.bench_disk_arms import oracle_of, split_arm
    from expertcast.utils.errors import UsageError

    assert split_arm("seqmoe:replan=1@chunk=0") == ("seqmoe:replan=1", {"prefetch_chunk_kb": 0})
    assert split_arm("lru") == ("lru", {}) and split_arm("lru@chunk=512") == ("lru", {"prefetch_chunk_kb": 512})
    for bad in ("lru@chunks=1", "lru@chunk=-1", "lru@chunk"):
        with pytest.raises(UsageError, match="reader option"):
            split_arm(bad)
    assert oracle_of("seqmoe:forecast=oracle,recall=0.5@chunk=0") == {
        "recall": 0.5, "breakeven": True, "oracle_series": "seqmoe:forecast=oracle@chunk=0"}
    chunks = []
    real = disk_store.ReaderPoolEngine.__init__

    def logged(self, *a, **k):
        real(self, *a, **k)
        chunks.append(self.chunk)

    monkeypatch.setattr(disk_store.ReaderPoolEngine, "__init__", logged)
    cfg = quick_config(str(tmp_path / "o"))
    cfg.policies, cfg.budgets, cfg.repeats, cfg.disk_seconds = ("lru", "lru@chunk=0"), (0.45,), 1, 0.2
    threads = torch.get_num_threads()
    try:
        rec = run_bench(cfg, stream=build_stream)
        cfg.policies = ("lru@chunk=x",)
        with pytest.raises(UsageError, match="reader option"):
            run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    assert {r["policy"] for r in rec["rows"]} == {"lru", "lru@chunk=0"}
    assert 0 in chunks and 2048 * 1024 in chunks


def test_resident_routing_folds_each_layer_onto_its_slots():
    import numpy as np
    from expertcast.data.trace_format import TraceSequence
    from expertcast.recipes.bench_disk import resident_routing

    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(16)[:3] for _ in range(4)]) for _ in range(6)]).astype(np.int16)
    ids[0, 0] = [1, 6, 11]  # 1, 6 and 11 all fold onto 1 mod 5: the later ones take the next free ids
    seq = TraceSequence(seq_id="s", token_ids=np.arange(6, dtype=np.int32), expert_ids=ids,
                        expert_weights=rng.random((6, 4, 3)).astype(np.float32), prompt_len=2)
    (f,) = resident_routing([seq], 5)
    assert f.expert_ids.min() >= 0 and f.expert_ids.max() < 5
    assert all(len(set(row.tolist())) == 3 for row in f.expert_ids.reshape(-1, 3))  # top-K stays distinct
    assert f.expert_ids[0, 0].tolist() == [1, 2, 3]
    unchanged = (ids < 5).all(-1) & np.array([[len({int(e) % 5 for e in r}) == 3 for r in t] for t in ids])
    assert (f.expert_ids[unchanged] == ids[unchanged] % 5).all()
    assert len({tuple(r) for r in f.expert_ids[:, 1].tolist()}) > 1  # the routing still varies over the tokens
    assert (f.token_ids == seq.token_ids).all() and (f.expert_weights == seq.expert_weights).all()
    assert (seq.expert_ids == ids).all()  # the input is left as it was
    with pytest.raises(ValueError, match="top-3"):
        resident_routing([seq], 2)


def test_a_cell_whose_arms_are_all_skipped_is_measured_no_further(builds, tmp_path, monkeypatch):
    """Where every arm of a full-depth cell is skipped (here: each refuses to be built), the cell writes no row and
    takes neither the bracketing measurement nor the full depth's ceiling (minutes per cell at real shape, for no
    row); the run names what it skipped."""
    import expertcast.recipes.bench_disk as bd

    d, _, _ = builds
    measured = []

    def refused(name, *a, **k):
        raise ValueError(f"{name}: refused here")

    monkeypatch.setattr(bd, "arm_policy", refused)
    monkeypatch.setattr(bd, "subset_all_in_ram", lambda *a, **k: measured.append("bracket"))
    monkeypatch.setattr(bd, "resident_ceiling", lambda *a, **k: measured.append("ceiling"))
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(tmp_path / "o"), model=str(d / "full"), baseline_model=str(d / "sub"),
                      policies=("lru",), budgets=(0.25,), repeats=1, sequences=1, tokens=4, prompt=3,
                      disk_mb=4, readers=2, dtype="bfloat16")
    try:
        rec = run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    assert rec["rows"] == [] and measured == []
    assert any("(full depth)" in k and "refused here" in v for k, v in rec["skipped"].items()), rec["skipped"]


def _stores(out):
    import expertcast.recipes.bench_disk as bd

    return [p.name for p in bd.disk_stores(out)]


@pytest.mark.parametrize("where", ["disk_read_rate", "_paired_grid"])
def test_a_failed_run_deletes_its_disk_stores(builds, tmp_path, monkeypatch, where):
    """A run that fails after writing its disk stores (the disk measurement finds no space, as a real-shape run did
    beside a 28.8 GB store, with the model's store written; or the subset's grid fails with the subset's store written
    too) deletes them, so that the next run has the room; the error reaches the caller and the folder's other files
    stay."""
    import expertcast.recipes.bench_disk as bd

    d, _, _ = builds

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bd, where, full)
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(out), model=str(d / "full"), baseline_model=str(d / "sub"), policies=("lru",),
                      budgets=(0.25,), repeats=1, sequences=1, tokens=4, prompt=3, disk_mb=4, readers=2,
                      dtype="bfloat16")
    seen = set()
    real = bd._load_streamed

    def load(*a, **k):
        r = real(*a, **k)
        seen.update(_stores(out))
        return r

    monkeypatch.setattr(bd, "_load_streamed", load)
    try:
        with pytest.raises(OSError, match="No space left"):
            run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    # the stores that stood when it failed: the test would not test the clean-up without them
    assert seen == ({"experts.bfloat16.disk.safetensors"} if where == "disk_read_rate" else
                    {"experts.bfloat16.disk.safetensors", "subset.bfloat16.disk.safetensors"}), seen
    assert not _stores(out) and (out / "notes.txt").read_text() == "kept"


def test_a_stopped_run_keeps_its_cells_with_the_machine_and_what_produced_them(builds, tmp_path, monkeypatch):
    """A real-shape run that stops after a cell (here: it fails while closing its second) leaves
    ``bench_disk.partial.json`` with the finished cell's rows beside the machine figures, the model and the
    provenance of the run, and the rows' bounds at a disk figure that bounds them (achieved_vs_bound <= 1), not the
    one-pass figure a faster run could exceed."""
    import expertcast.recipes.bench_disk as bd

    d, _, _ = builds
    calls = []
    real = bd.subset_all_in_ram

    def stops(*a, **k):  # called once after each full-depth cell, before its rows
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return real(*a, **k)

    monkeypatch.setattr(bd, "subset_all_in_ram", stops)
    monkeypatch.setattr(bd, "disk_read_rate", lambda *a, **k: (0.001, "O_DIRECT", 1.0))  # far below any run's rate
    out = tmp_path / "o"
    threads = torch.get_num_threads()
    cfg = BenchConfig(out=str(out), model=str(d / "full"), baseline_model=str(d / "sub"), policies=("lru",),
                      budgets=(0.25, 0.45), repeats=1, sequences=1, tokens=4, prompt=3, disk_mb=4, readers=2,
                      dtype="bfloat16")
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            run_bench(cfg, stream=build_stream)
    finally:
        torch.set_num_threads(threads)
    rec = json.loads((out / bd.PARTIAL_FILE).read_text())
    assert rec["status"].startswith("partial")
    assert [(r["policy"], r["budget"]) for r in rec["rows"]] == [("lru", 0.25)]
    assert [(r["policy"], r["budget"]) for r in rec["subset_rows"]] == [("lru", 0.25), ("lru", 0.45)]
    assert rec["machine"]["disk_gbps"] == 0.001 and rec["machine"]["gemm_gflops_1"] > 0
    assert rec["model"]["L"] == 3 and rec["model"]["decoder_layers"] == 4 and rec["model"]["expert_bytes"] > 0
    prov = rec["provenance"]
    assert prov["sequences"] and prov["routing_fingerprint"] and prov["code_version"]
    assert prov["settings"]["budgets"] == [0.25, 0.45]
    assert rec["disk_gbps_bound"] > 0.001 and "achieved" in rec["disk_gbps_source"]
    for r in rec["rows"] + rec["subset_rows"]:
        assert r["achieved_vs_bound"] <= 1 + 1e-9 and r["disk_gbps_bound"] == rec["disk_gbps_bound"], r
        assert not any(k.startswith("_") for k in r)
    assert not _stores(out) and not (out / "bench_disk.json").exists()
    # what the record names is enough for the simulator's card of its finished cells (scripts/bench_disk_resim.py)
    [card] = bd.resimulate(rec, rec["disk_gbps_bound"], build_stream)
    assert (card["policy"], card["budget"]) == ("lru", 0.25) and card["recorded_sim_tokens_per_s"] is None
    assert card["sim_hit"] == rec["rows"][0]["hit"] and card["sim_tokens_per_s"] > 0  # demand-only: same decisions
