"""Tiny presets of every family build, run forward and generate in transformers 5; real presets give
configs only; the byte-level / BPE tokenizers and their chat template."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.presets import build_tiny, get_config, get_preset, list_presets
from expertcast.models.tokenizer import byte_level_tokenizer, train_bpe_tokenizer

torch.set_num_threads(1)

FAMILY_OF_TINY = {
    "qwen3_moe-tiny": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe-tiny": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral-tiny": ("mixtral", "MixtralForCausalLM"),
    "olmoe-tiny": ("olmoe", "OlmoeForCausalLM"),
    "deepseek_v2-tiny": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3-tiny": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "gpt_oss-tiny": ("gpt_oss", "GptOssForCausalLM"),
}


def test_every_family_has_a_tiny_preset():
    assert sorted(list_presets("tiny")) == sorted(FAMILY_OF_TINY)
    assert {"qwen3-30b-a3b", "mixtral-8x7b", "olmoe-1b-7b", "deepseek-v2-lite"} <= set(list_presets("real"))


@pytest.mark.parametrize("name", sorted(FAMILY_OF_TINY))
def test_tiny_preset_builds_forwards_and_generates(name):
    family, cls = FAMILY_OF_TINY[name]
    model = build_tiny(name, seed=0)
    cfg = model.config
    assert cfg.model_type == family and type(model).__name__ == cls
    assert 32 <= cfg.hidden_size <= 128 and 2 <= cfg.num_hidden_layers <= 4
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    assert 8 <= n_experts <= 16
    x = torch.randint(4, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=x)
    assert out.logits.shape == (2, 24, cfg.vocab_size)
    assert torch.isfinite(out.logits).all()
    gen = model.generate(x, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert gen.shape == (2, 28)
    assert torch.equal(gen[:, :24], x)
    # Greedy generation continues with the argmax of the last position's logits.
    assert torch.equal(gen[:, 24], out.logits[:, -1].argmax(-1))


@pytest.mark.parametrize("name", ["qwen3_moe-tiny", "gpt_oss-tiny"])
def test_build_is_deterministic_by_seed(name):
    a, b, c = build_tiny(name, seed=0), build_tiny(name, seed=0), build_tiny(name, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    experts = [k for k in sa if "experts" in k and sa[k].ndim == 3]
    assert experts and not all(torch.equal(sa[k], sc[k]) for k in experts)


def test_build_tiny_dtype_and_overrides():
    m = build_tiny("mixtral-tiny", dtype="bfloat16", num_hidden_layers=3)
    assert m.config.num_hidden_layers == 3
    assert m.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_real_presets_are_configs_only():
    cfg = get_config("qwen3-30b-a3b")
    assert type(cfg).__name__ == "Qwen3MoeConfig"
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (48, 128, 8)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.vocab_size) == (2048, 768, 151936)
    assert cfg.dtype == torch.bfloat16 and get_preset("qwen3-30b-a3b").hub_id == "Qwen/Qwen3-30B-A3B"
    with pytest.raises(ValueError, match="real-size"):
        build_tiny("qwen3-30b-a3b")


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="qwen3_moe-tiny"):
        get_config("no-such-model")


def test_byte_level_tokenizer_chat_template_and_think_tokens():
    tok = byte_level_tokenizer()
    assert len(tok) == 262 and len(tok) <= get_config("qwen3_moe-tiny").vocab_size
    assert tok.pad_token_id == 0 and tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    text = "<think>\nWait, é</think>\n\n4"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<think>")
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_bpe_tokenizer_has_exact_vocab_and_roundtrips():
    texts = ["Natalia sold 48 clips in April, and then she sold half as many clips in May."] * 50 + [
        "Alternatively, let me check the answer again. Wait, 2 + 3 = 5."] * 50
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    assert len(tok) == 300
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [298, 299]
    s = "<think>\nAlternatively, Natalia sold 48 clips.</think>\n\n#### 72"
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(s.encode())  # merges were learned
    assert tok.decode(ids) == s
    with pytest.raises(ValueError, match="below"):
        train_bpe_tokenizer(texts, vocab_size=100)
