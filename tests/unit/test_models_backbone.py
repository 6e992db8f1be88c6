"""load_moe_model: presets, local Hugging Face directories, and clear errors."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.backbone import load_moe_model, save_tiny, supported_families
from expertcast.models.spec import MoESpec, UnsupportedModelError

torch.set_num_threads(1)


def test_supported_families():
    assert supported_families() == ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]


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
