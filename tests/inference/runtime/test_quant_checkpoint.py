"""Block-scaled FP8 checkpoints (docs/design.md, "Expert formats"): written from an unquantized checkpoint and
loaded, dequantized per tensor, into any expert format, token-identical to a full load of their dequantized
weights."""

from __future__ import annotations

import pytest
import torch
from expertcast.inference.policies import make_policy

torch.set_num_threads(1)


def _greedy(model, ids, am):
    return model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("expert_dtype", ["bfloat16", "int4"])
def test_fp8_checkpoint_loads_token_identical_to_its_dequantized_weights(expert_dtype, tmp_path):
    """A block-scaled FP8 checkpoint (shared experts and attention in fp8 too) streams into any expert format:
    the offloaded run equals the full load of the same weights dequantized (quantized again into int4 for int4)."""
    import shutil

    from expertcast.inference.runtime.experts import quantize_model_experts
    from expertcast.inference.runtime.loading import checkpoint_tensors, load_offloaded
    from expertcast.inference.runtime.quant_checkpoint import dequantized_state, write_fp8_checkpoint
    from expertcast.models.backbone import load_moe_model, save_tiny
    from safetensors.torch import save_file

    d = save_tiny("deepseek_v3-tiny", tmp_path / "bf", seed=0)
    f8 = write_fp8_checkpoint(d, tmp_path / "fp8")
    ents = checkpoint_tensors(f8)
    assert any(e.dtype == torch.float8_e4m3fn and ".experts." in k for k, e in ents.items())
    assert any(e.dtype == torch.float8_e4m3fn and "self_attn" in k for k, e in ents.items())
    assert ents["model.embed_tokens.weight"].dtype != torch.float8_e4m3fn
    ref_dir = tmp_path / "deq"
    shutil.copytree(d, ref_dir)
    save_file({k: v.contiguous() for k, v in dequantized_state(f8).items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    dt = "bfloat16" if expert_dtype != "bfloat16" else "float32"
    full, _ = load_moe_model(ref_dir, dtype=dt)
    if expert_dtype != "bfloat16":
        quantize_model_experts(full, expert_dtype)
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    ref = _greedy(full, ids, am)
    om, _, report = load_offloaded(f8, make_policy("lru"), full.config.num_experts_per_tok, dtype=dt,
                                   expert_dtype=expert_dtype)
    assert report.unused_checkpoint_keys == [] and report.plan.expert_format == expert_dtype
    out = om.generate(ids, am, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, ref) and om.stats.D > 0
    om.close()
