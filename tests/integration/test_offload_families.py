"""Every family of the README's table loads straight to the host store from a saved checkpoint
(:func:`expertcast.inference.runtime.loading.load_offloaded`) and decodes the same greedy tokens as the
full-load model, batch 1 and batch 2 (left padded), at the smallest capacity (top-K slots per layer,
so experts are loaded and evicted all along). Shared experts (Qwen2-MoE, DeepSeek-V3) and the first
dense layers stay resident. Also: sharded checkpoints (index json), fused-expert checkpoints, the
memory-mapped store, and the errors of a checkpoint that does not match its config."""

from __future__ import annotations

import json

import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.loading import checkpoint_tensors, load_offloaded, plan_offload
from expertcast.models.backbone import load_moe_model, save_tiny
from expertcast.utils.errors import UsageError
from safetensors.torch import save_file

torch.set_num_threads(1)
NEW = 8

FAMILIES = {  # README table -> tiny preset
    "qwen3_moe": "qwen3_moe-tiny",
    "qwen2_moe": "qwen2_moe-tiny",
    "mixtral": "mixtral-tiny",
    "olmoe": "olmoe-tiny",
    "deepseek_v3": "deepseek_v3-tiny",
    "gpt_oss": "gpt_oss-tiny",
}


def _batches():
    """Batch 1 and a left-padded batch 2 (the second prompt 3 tokens shorter)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    ids[1, :3] = 0
    return [(ids[:1], am[:1]), (ids, am)]


def _greedy(model, ids, am):
    return model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)


def _check_identical(model_dir, **load_kw):
    """Full load vs offloaded load of ``model_dir``: same tokens for batch 1 and 2; returns the runtime."""
    full, _ = load_moe_model(model_dir)
    refs = [_greedy(full, ids, am) for ids, am in _batches()]
    K = full.config.num_experts_per_tok
    del full
    om, tok, report = load_offloaded(model_dir, make_policy("lru"), K, **load_kw)  # int: K slots per layer
    assert tok is not None and report.source == "checkpoint"
    for (ids, am), ref in zip(_batches(), refs, strict=True):
        out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, ref), (model_dir, ids.shape[0])
    assert om.stats.D > 0, "top-K slots per layer must cause demand loads"
    mem = om.memory_report()
    assert mem.device_expert_param_bytes == 0
    assert mem.host_expert_bytes == report.plan.expert_bytes_total
    assert mem.device_non_expert_bytes == report.plan.non_expert_bytes
    assert mem.num_slots == report.plan.num_slots == K * om.L
    return om, report


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_offloads_from_checkpoint_token_identical(family, tmp_path):
    d = save_tiny(FAMILIES[family], tmp_path / family, seed=0)
    om, report = _check_identical(d)
    expected_layout = "fused" if family == "gpt_oss" else "per-expert"  # save_pretrained un-fuses the others
    assert report.plan.checkpoint_layout == expected_layout
    assert report.unused_checkpoint_keys == []
    names = {n for n, _ in om.model.named_parameters()}
    if family in ("qwen2_moe", "deepseek_v3"):
        shared = [n for n in names if "shared_expert" in n]
        assert shared, "shared experts are resident parameters"
        for n in shared:
            assert om.model.get_parameter(n).device.type == "cpu" and om.model.get_parameter(n).numel() > 0
        dense = om.model.model.layers[0].mlp  # first-k dense (DeepSeek-V3) / mlp_only_layers=[0] (Qwen2-MoE)
        assert not hasattr(dense, "experts") and all(p.numel() > 0 for p in dense.parameters())
        assert om.L == om.model.config.num_hidden_layers - 1


def test_sharded_checkpoint_with_renamed_keys(tmp_path):
    """Mixtral saved in several shards (``block_sparse_moe.experts.N.w1`` keys, an index json)."""
    model, tok = load_moe_model("mixtral-tiny", seed=2)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="200KB")
    tok.save_pretrained(d)
    assert (d / "model.safetensors.index.json").is_file()
    files = {e.file.name for e in checkpoint_tensors(d).values()}
    assert len(files) > 2
    _, report = _check_identical(d)
    assert report.plan.checkpoint_files == sorted(files)


def test_fused_checkpoint_and_mmap_store(tmp_path):
    """A checkpoint holding transformers-5 fused tensors (``experts.gate_up_proj`` [E, 2I, H]) is read one
    expert slice at a time; the store is streamed into a memory-mapped file."""
    d = save_tiny("qwen3_moe-tiny", tmp_path / "fused", seed=4)
    model, _ = load_moe_model(d)
    (d / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in checkpoint_tensors(d))
    om, report = _check_identical(d, mmap_path=tmp_path / "store" / "experts.safetensors")
    assert report.plan.checkpoint_layout == "fused"
    assert om.store.mmap_path is not None and om.memory_report().host_mmap


def test_bf16_load_of_fp32_checkpoint_matches_bf16_full_load(tmp_path):
    """dtype conversion on load: the store rows are bf16, and decode equals a bf16 full load."""
    d = save_tiny("olmoe-tiny", tmp_path / "olmoe", seed=5)
    full, _ = load_moe_model(d, dtype="bfloat16")
    ids, am = _batches()[1]
    ref = _greedy(full, ids, am)
    om, _, report = load_offloaded(d, make_policy("lru"), 0.5, dtype="bfloat16")
    assert om.store.rows.dtype == torch.bfloat16 and report.plan.dtype == "bfloat16"
    assert torch.equal(om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0).sequences, ref)


def test_checkpoint_that_does_not_match_its_config_is_refused(tmp_path):
    d = save_tiny("qwen3_moe-tiny", tmp_path / "m", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match=r"experts\.\d+\..*has shape .* per expert"):
        load_offloaded(d, make_policy("lru"), 0.5)
    d2 = save_tiny("mixtral-tiny", tmp_path / "m2", seed=0)
    model, _ = load_moe_model(d2)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(sd, str(d2 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match="lacks model.norm.weight"):
        load_offloaded(d2, make_policy("lru"), 0.5)
    from safetensors.torch import load_file  # half of expert 3's gate_up (its w3 = up) is missing

    sd = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if "experts.3.up_proj" not in k}
    cfg["moe_intermediate_size"] = 32
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UsageError, match=r"lacks expert weights of MoE layer 0 .*\('gate_up_proj', 3\)"):
        load_offloaded(d, make_policy("lru"), 0.5)


def test_plan_refuses_slots_that_do_not_fit_and_experts_the_host_cannot_hold(tmp_path):
    d = save_tiny("qwen3_moe-tiny", tmp_path / "m", seed=0)
    plan = plan_offload(d, 0.5)
    assert plan.expert_bytes_total == 4 * 16 * plan.expert_bytes and plan.num_slots == 32
    assert plan.slot_bytes == (32 + 2) * plan.expert_bytes and plan.full_load_fits
    plan.device, plan.device_free = "cuda:0", plan.non_expert_bytes + plan.slot_bytes - 1
    with pytest.raises(UsageError, match=r"slots do not fit cuda:0: 32 slots \+ 2 temporary .*lower --capacity"):
        plan.check_fits(mmap=False)
    assert not plan.full_load_fits
    plan.device_free, plan.host_available = None, plan.expert_bytes_total - 1
    with pytest.raises(UsageError, match="host memory cannot hold the experts.*--mmap-store"):
        plan.check_fits(mmap=False)
    plan.check_fits(mmap=True)  # the memory-mapped store needs no host copy


def test_tiny_preset_name_is_built_in_host_memory_then_offloaded():
    """A preset has no checkpoint to stream: built in host memory, then offloaded (report says so)."""
    full, _ = load_moe_model("deepseek_v3-tiny", seed=3)
    ids, am = _batches()[1]
    ref = _greedy(full, ids, am)
    om, tok, report = load_offloaded("deepseek_v3-tiny", make_policy("lru"), 0.5, seed=3)
    assert report.source == "host" and report.plan.num_slots == om.cache.num_slots == 16
    assert torch.equal(om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0).sequences, ref)


def test_tied_embeddings_checkpoint(tmp_path):
    """save_pretrained omits a tied lm_head: the loader ties it to the loaded embeddings."""
    from expertcast.models.presets import build_tiny
    from expertcast.models.tokenizer import byte_level_tokenizer

    d = tmp_path / "tied"
    build_tiny("olmoe-tiny", seed=6, tie_word_embeddings=True).save_pretrained(d)
    byte_level_tokenizer(model_max_length=512).save_pretrained(d)
    assert "lm_head.weight" not in checkpoint_tensors(d)
    om, _ = _check_identical(d)
    assert om.model.lm_head.weight is om.model.model.embed_tokens.weight
