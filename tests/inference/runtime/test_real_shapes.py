"""Real-shape checkpoints (docs/design.md, "Real shapes"): the real configurations' values, the builder's
shards (deterministic, regenerable tensor by tensor, the released checkpoints' key layout), loading them
through the runtime without materialising the model, and forced routing on them equal to the full-load run.

CI builds reduced-width variants only (hidden 64-128, a few layers; a few MB, 50 MB for the memory test).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from expertcast.inference.runtime import real_shapes
from expertcast.inference.runtime.real_shapes import build_shape, checkpoint_plan, shape_config, tensor_values
from expertcast.utils.errors import UsageError

torch.set_num_threads(1)

# DeepSeek-V2-Lite's structure (MLA without q LoRA, 64 routed + 2 shared experts, top-6, first layer dense) at
# a width CI can build in a second.
DS_SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, vocab_size=512, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4,
                bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def ds_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("shape") / "ds"
    report = build_shape("deepseek-v2-lite", out, layers=3, seed=0, overrides=DS_SMALL, shard_bytes=600_000)
    return out, report


def _read_st(path, key):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_tensor(key)


def test_real_configurations_hold_the_released_values():
    """The presets the builder writes are the released models' config values (no download)."""
    from expertcast.models.spec import MoESpec

    ds = shape_config("deepseek-v2-lite")
    assert ds.model_type == "deepseek_v2"
    assert (ds.hidden_size, ds.n_routed_experts, ds.n_shared_experts, ds.moe_intermediate_size,
            ds.num_experts_per_tok, ds.first_k_dense_replace, ds.num_hidden_layers) == (2048, 64, 2, 1408, 6, 1, 27)
    assert (ds.kv_lora_rank, ds.q_lora_rank, ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim,
            ds.num_attention_heads, ds.vocab_size, ds.intermediate_size) == (512, None, 128, 64, 128, 16, 102400, 10944)
    spec = MoESpec.from_config(ds)
    assert spec.moe_layers == list(range(1, 27)) and spec.expert_bytes == 3 * 2048 * 1408 * 2
    q = MoESpec.from_config(shape_config("qwen3-30b-a3b"))
    assert (q.num_layers, q.num_experts, q.top_k, q.hidden_size, q.expert_intermediate_size) == (48, 128, 8, 2048, 768)


def test_full_size_plan_is_the_released_checkpoint_layout():
    """The plan of the full DeepSeek-V2-Lite (meta device: nothing allocated) has its 15.7 B parameters under the
    released checkpoint's per-expert keys, every key mapped back by the loader's own KeyMapper."""
    plan = checkpoint_plan(shape_config("deepseek-v2-lite"), torch.bfloat16)
    by_key = {t.key: t for t in plan.tensors}
    assert plan.num_params == 15_706_484_224
    assert plan.expert_params == 26 * 64 * 3 * 2048 * 1408
    assert by_key["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (1408, 2048)
    assert by_key["model.layers.26.mlp.experts.63.down_proj.weight"].shape == (2048, 1408)
    assert by_key["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (2816, 2048)
    assert by_key["model.layers.0.mlp.gate_proj.weight"].shape == (10944, 2048)  # the dense first layer
    assert by_key["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 2048)
    assert sum(t.expert for t in plan.tensors) == 26 * 64 * 3
    assert not any("gate_up_proj" in k for k in by_key)


def test_build_is_deterministic_and_each_tensor_regenerates_alone(ds_small, tmp_path):
    out, report = ds_small
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert report.num_shards > 1 and len(set(index["weight_map"].values())) == report.num_shards
    assert index["metadata"]["total_size"] == report.checkpoint_bytes
    prov = json.loads((out / real_shapes.PROVENANCE_FILE).read_text())
    assert prov["shape"] == "deepseek-v2-lite" and prov["seed"] == 0 and prov["layers"] == 3
    assert prov["overrides"] == DS_SMALL and prov["config"]["n_routed_experts"] == 64
    assert prov["code"]["expertcast"] and prov["report"]["shards"] == report.shards

    again = build_shape("deepseek-v2-lite", tmp_path / "again", layers=3, seed=0, overrides=DS_SMALL,
                        shard_bytes=600_000)
    other = build_shape("deepseek-v2-lite", tmp_path / "other", layers=3, seed=1, overrides=DS_SMALL,
                        shard_bytes=600_000)
    assert {k: v["sha256"] for k, v in again.shards.items()} == {k: v["sha256"] for k, v in report.shards.items()}
    assert all(other.shards[k]["sha256"] != v["sha256"] for k, v in report.shards.items())

    plan = checkpoint_plan(shape_config("deepseek-v2-lite", 3, DS_SMALL), torch.bfloat16)
    for key in ("model.layers.2.mlp.experts.17.up_proj.weight", "model.embed_tokens.weight",
                "model.layers.1.input_layernorm.weight", "model.layers.2.mlp.gate.weight"):
        t = next(p for p in plan.tensors if p.key == key)
        stored = _read_st(out / index["weight_map"][key], key)
        assert stored.dtype == t.dtype and torch.equal(stored, tensor_values(t, seed=0)), key
    assert _read_st(out / index["weight_map"]["model.layers.1.input_layernorm.weight"],
                    "model.layers.1.input_layernorm.weight").eq(1).all()


def test_transformers_loads_the_build_with_the_planned_values(ds_small):
    """transformers' own from_pretrained (per-expert keys fused by its conversion mapping) reads the same values."""
    from expertcast.models.backbone import load_moe_model

    out, _ = ds_small
    model, _ = load_moe_model(str(out), dtype="auto", device="cpu")
    assert type(model).__name__ == "DeepseekV2ForCausalLM" and model.dtype == torch.bfloat16
    plan = {t.key: t for t in checkpoint_plan(shape_config("deepseek-v2-lite", 3, DS_SMALL), torch.bfloat16).tensors}
    exp = model.model.layers[2].mlp.experts
    gate = tensor_values(plan["model.layers.2.mlp.experts.5.gate_proj.weight"], 0)
    up = tensor_values(plan["model.layers.2.mlp.experts.5.up_proj.weight"], 0)
    assert torch.equal(exp.gate_up_proj[5], torch.cat([gate, up]))
    assert torch.equal(exp.down_proj[63], tensor_values(plan["model.layers.2.mlp.experts.63.down_proj.weight"], 0))


def _capture(model):
    outs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).clone()))
             for layer in model.model.layers]
    return outs, hooks


@pytest.mark.parametrize("policy", ["lru", "lfu", "static", "belady"])
def test_forced_routing_at_real_shape_equals_the_full_load_run(ds_small, policy):
    """Every decoder layer's output of the offloaded forced-routing replay (25% of the experts resident, the
    rest loaded on demand) equals, bit for bit, the full-load model's under the same routing (transformers'
    grouped_mm kernel, every expert in RAM)."""
    from expertcast.data.synthetic import markov_traces
    from expertcast.inference.policies import make_policy
    from expertcast.inference.policies.static import selection_counts
    from expertcast.inference.runtime.forced import FullLoadReplayer
    from expertcast.inference.runtime.loading import load_offloaded
    from expertcast.inference.sim.simulator import build_stream
    from expertcast.models.backbone import load_moe_model

    out, _ = ds_small
    syn = markov_traces(num_sequences=2, num_tokens=14, num_layers=2, num_experts=64, top_k=6, seed=3, vocab=512)
    seqs = list(syn.sequences)
    full, _ = load_moe_model(str(out), dtype="auto", device="cpu")
    ref, hooks = _capture(full)
    FullLoadReplayer(full).replay(seqs)
    for h in hooks:
        h.remove()
    kw = {"calibration": selection_counts(seqs, 2, 64)} if policy == "static" else {}
    future = build_stream(syn.meta, seqs, 1) if policy == "belady" else None
    om, _, rep = load_offloaded(str(out), make_policy(policy, **kw), 0.25, future=future)
    assert rep.source == "checkpoint" and rep.plan.checkpoint_layout == "per-expert"
    got, hooks = _capture(om.model)
    st = om.replay(seqs)
    om.close()
    assert st.D > 0, "some experts must be loaded on demand for the comparison to mean anything"
    assert len(got) == len(ref) == 3 * 2 * (1 + 14 - 8)  # 3 layers x 2 sequences x (prefill + 6 decode steps)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_load_holds_one_copy_of_the_experts(tmp_path):
    """load_offloaded streams the shards into the host store on the meta skeleton: the load's peak RSS grows by
    about one copy of the experts (at least 0.9x: the store is really there) and well below two (a loader that
    materialised the model before packing its experts would hold both)."""
    small = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=256, vocab_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, bos_token_id=1, eos_token_id=2)
    rep = build_shape("qwen3-30b-a3b", tmp_path / "q", layers=2, overrides=small)  # 2 x 128 experts: 50 MB
    warm = build_shape("qwen3-30b-a3b", tmp_path / "w", layers=1, overrides={**small, "num_experts": 8})
    expert_total = rep.routed_expert_params * 2
    code = textwrap.dedent(f"""
        import json, torch
        from pathlib import Path
        from expertcast.inference.policies import make_policy
        from expertcast.inference.runtime.loading import load_offloaded
        torch.set_num_threads(1)
        def field(name):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
        load_offloaded({str(warm.out)!r}, make_policy("lru"), 1.0)[0].close()  # imports, lazy initialisation
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
        except OSError:
            pass
        before = field("VmHWM")
        om, _, r = load_offloaded({str(rep.out)!r}, make_policy("lru"), 0.1)
        after = field("VmHWM")
        om.close()
        print(json.dumps({{"before": before, "after": after, "store": om.store.nbytes}}))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    grew = m["after"] - m["before"]
    assert m["store"] == expert_total
    assert 0.9 * expert_total <= grew <= 1.5 * expert_total, (grew / 1e6, expert_total / 1e6)


def test_refuses_without_room_and_writes_nothing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(UsageError, match=r"not enough disk space.*needs 1\.9\d MB.*has 1\.00 MB free"):
        build_shape("deepseek-v2-lite", tmp_path / "x", layers=3, overrides=DS_SMALL)
    assert not any(tmp_path.iterdir())


def test_bad_requests_are_one_line_errors(ds_small, tmp_path):
    out, _ = ds_small
    with pytest.raises(UsageError, match="already holds a build"):
        build_shape("deepseek-v2-lite", out, layers=3, overrides=DS_SMALL)
    (tmp_path / "foreign").mkdir()
    with pytest.raises(UsageError, match="not a build-shape output"):
        build_shape("deepseek-v2-lite", tmp_path / "foreign", layers=3, overrides=DS_SMALL)
    with pytest.raises(UsageError, match="has no MoE layer"):
        build_shape("deepseek-v2-lite", tmp_path / "y", layers=1, overrides=DS_SMALL)  # layer 0 is dense
    with pytest.raises(UsageError, match="unknown shape 'llama'"):
        build_shape("llama", tmp_path / "z")
    with pytest.raises(UsageError, match="--layers 99"):
        build_shape("qwen3-30b-a3b", tmp_path / "z", layers=99)


def test_overwrite_replaces_an_earlier_build(tmp_path):
    a = build_shape("deepseek-v2-lite", tmp_path / "m", layers=2, seed=0, overrides=DS_SMALL)
    b = build_shape("deepseek-v2-lite", tmp_path / "m", layers=2, seed=5, overrides=DS_SMALL, overwrite=True)
    assert a.shards["model.safetensors"]["sha256"] != b.shards["model.safetensors"]["sha256"]
    assert json.loads((tmp_path / "m" / real_shapes.PROVENANCE_FILE).read_text())["seed"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left behind
    assert np.isclose(b.checkpoint_bytes, a.checkpoint_bytes)


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "qwen2_moe-tiny", "mixtral-tiny", "olmoe-tiny", "deepseek_v2-tiny",
                                  "deepseek_v3-tiny", "gpt_oss-tiny"])
def test_every_family_builds_a_checkpoint_both_loaders_read_alike(name, tmp_path):
    """A build of every family's tiny preset: per-expert keys where transformers fuses them on load (fused for
    GPT-OSS), no key the model lacks, and transformers' from_pretrained and the offloading loader decode the
    same greedy tokens from it."""
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.loading import load_offloaded
    from expertcast.models.backbone import load_moe_model

    build_shape(name, tmp_path / name, dtype="float32", seed=4)
    full, _ = load_moe_model(str(tmp_path / name), dtype="auto", device="cpu")
    ids = torch.randint(5, 400, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = full.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    K = full.config.num_experts_per_tok
    del full
    om, _, rep = load_offloaded(str(tmp_path / name), make_policy("lru"), K)  # K slots per layer: demand loads
    out = om.generate(ids, max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    om.close()
    assert rep.plan.checkpoint_layout == ("fused" if name == "gpt_oss-tiny" else "per-expert")
    assert rep.unused_checkpoint_keys == [] and om.stats.D > 0
    assert torch.equal(out.sequences, ref)
