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


def test_streamed_model_with_subset_baseline(builds, tmp_path):
    d, full, _ = builds
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
        assert r["bound_tokens_per_s"] <= r["full_tokens_per_s"] * (1 + 1e-9)
        assert math.isclose(r["pct_full_scaled"], 100 * r["tokens_per_s"] / r["full_tokens_per_s"], rel_tol=1e-9)
        assert 0 < r["peak_rss_gb"] and r["rss_bound_gb"] > 0
    belady = {r["budget"]: r["hit"] for r in rec["rows"] if r["policy"] == "belady"}
    lru = {r["budget"]: r["hit"] for r in rec["rows"] if r["policy"] == "lru"}
    assert all(belady[b] >= lru[b] for b in belady)  # the protect-rule plan is the demand-only ceiling
    assert "t_full = t_subset x ((1 - f) + f x 4/2" in rec["baseline"] and "3/2" not in rec["baseline"]
    left = {p.name for p in (tmp_path / "o").iterdir()}
    assert left == {"bench_disk.json", "bench_disk.csv", "bench_disk.png"}, left  # both stores deleted
    assert json.loads((tmp_path / "o" / "bench_disk.json").read_text())["provenance"]["sequences"]


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
