"""load_moe_model: presets, local Hugging Face directories, and clear errors.

Router-adaptation exports load without Lightning: the merged ``model/`` (the default) and a kept peft
``adapter/`` give the same logits as the trained module's own LoRA backbone, through ``load_moe_model``,
``resolve_model`` and ``load_moe_config``; an adapter is refused over a base whose weights changed.
"""

from __future__ import annotations

import json

import pytest
import torch
from expertcast.models.backbone import load_moe_model, save_tiny, supported_families
from expertcast.models.spec import MoESpec, UnsupportedModelError

torch.set_num_threads(1)


def test_supported_families():
    assert supported_families() == ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "gpt_oss"]


def test_preset_loads_with_a_working_tokenizer():
    model, tok = load_moe_model("olmoe-tiny")
    assert not model.training
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert int(ids.max()) < model.config.vocab_size
    out = model.generate(ids, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert out.shape[1] == ids.shape[1] + 3
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_local_directory_roundtrip(tmp_path):
    ref, _ = load_moe_model("qwen2_moe-tiny", seed=3)
    path = save_tiny("qwen2_moe-tiny", tmp_path / "m", seed=3)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    model, tok = load_moe_model(path)
    # safetensors views at the file's offsets would take other CPU kernel paths (last-bit logit differences)
    assert all(t.data_ptr() % 64 == 0 for t in [*model.parameters(), *model.buffers()])
    x = torch.tensor([tok("Alternatively, 12 + 30 = 42")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    loaded, built = MoESpec.from_model(model).to_dict(), MoESpec.from_model(ref).to_dict()
    assert loaded.pop("model_id") == str(path)
    built.pop("model_id")
    assert loaded == built and loaded["moe_layers"] == [1, 2, 3]
    bf, _ = load_moe_model(str(path), dtype="bfloat16")
    assert bf.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_moe_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_moe_model(tmp_path / "empty")


def test_non_moe_architecture_is_rejected(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match=r"LlamaConfig.*supported families.*qwen3_moe"):
        load_moe_model(tmp_path / "llama")


def _trained_module(model: str, merge: bool):
    """A tiny LoRA module whose adapter is far from its zero init (so merged != base)."""
    from expertcast.train.router_module import LoraSettings, RouterAdaptationModule

    m = RouterAdaptationModule(model=model, mode="temporal", budget=6,
                               lora=LoraSettings(r=4, alpha=8, merge_on_export=merge))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("adaptation_exports")
    out = {}
    for kind, merge in (("merged", True), ("adapter", False)):
        m = _trained_module("qwen3_moe-tiny", merge)
        out[kind] = (m.export(root / kind), m)
    return out


IDS = torch.tensor([[5, 17, 99, 3, 250, 41, 8, 77]])


@pytest.mark.parametrize("kind", ["merged", "adapter"])
def test_export_loads_as_the_trained_backbone(exports, kind):
    from expertcast.models.backbone import load_moe_config, load_moe_model
    from expertcast.models.names import resolve_model
    from expertcast.models.presets import build_tiny

    d, module = exports[kind]
    info = json.loads((d / "export.json").read_text())
    assert info["base"] == {"name": "qwen3_moe-tiny", "path": "qwen3_moe-tiny", "preset": "qwen3_moe-tiny",
                            "init_seed": 0}
    assert ("model_dir" in info) == (kind == "merged") and ("adapter_dir" in info) == (kind == "adapter")
    assert resolve_model(str(d)) == str(d)
    assert load_moe_config(d).num_experts == 16
    model, tok = load_moe_model(resolve_model(str(d)))
    assert not hasattr(model, "peft_config")  # a plain model: the runtime offloads its expert weights
    want = _logits(module.backbone, IDS)
    torch.testing.assert_close(_logits(model, IDS), want, rtol=1e-4, atol=1e-4)
    assert (want - _logits(build_tiny("qwen3_moe-tiny"), IDS)).abs().max() > 1e-2  # the adaptation is in there
    out = model.generate(IDS, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, IDS.shape[1] + 4)


def test_resolve_model_path_points_loaders_at_the_merged_folder(exports):
    from expertcast.models.backbone import resolve_model_path
    from expertcast.utils.errors import UsageError

    assert resolve_model_path(exports["merged"][0]) == (str(exports["merged"][0] / "model"), True)
    with pytest.raises(UsageError, match="keeps a peft adapter"):
        resolve_model_path(exports["adapter"][0])


def test_adapter_over_other_base_weights_is_refused(tmp_path):
    from expertcast.models.backbone import load_moe_model, save_tiny
    from expertcast.utils.errors import UsageError

    torch.set_num_threads(1)
    base = save_tiny("qwen3_moe-tiny", tmp_path / "base")
    m = _trained_module(str(base), merge=False)
    d = m.export(tmp_path / "export")
    rec = json.loads((d / "export.json").read_text())["base"]
    assert rec["path"] == str(base.resolve()) and len(rec["files_sha256"]) == 64
    torch.testing.assert_close(_logits(load_moe_model(d)[0], IDS), _logits(m.backbone, IDS), rtol=1e-4, atol=1e-4)
    save_tiny("qwen3_moe-tiny", base, seed=1)  # the base folder now holds other weights
    with pytest.raises(UsageError, match="files_sha256"):
        load_moe_model(d)


def test_lm_head_gets_row_major_inputs_and_the_same_logits():
    """transformers slices the prefill's last position ([1, 1, H] with the prompt's batch stride) before the LM
    head; on the CPU in bf16 that view sends F.linear down a path that copies the transposed head weight
    (docs/design.md, "Disk tier"). The loader's pre-hook hands the head a row-major copy: the head sees standard
    strides, and the logits are bit-identical to the unhooked head's."""
    from expertcast.models.backbone import standard_lm_head_input

    model, _ = load_moe_model("qwen3_moe-tiny", dtype=torch.bfloat16)
    head = model.get_output_embeddings()
    assert getattr(head, "_expertcast_standard_input", False)  # every load_moe_model gets the hook
    seen = []
    handle = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].stride()))
    ids = torch.arange(12).view(1, 12) % model.config.vocab_size
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=1).logits
        hidden = model.model(input_ids=ids).last_hidden_state
    handle.remove()
    H = hidden.shape[-1]
    assert seen == [(H, H, 1)]  # row major, not the slice's (12 * H, H, 1)
    assert torch.equal(out, torch.nn.functional.linear(hidden[:, -1:], head.weight))
    assert standard_lm_head_input(model) is model and len(head._forward_pre_hooks) == 1  # idempotent
