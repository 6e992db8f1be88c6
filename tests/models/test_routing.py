"""Routing capture: teacher-forced routing equals the routing seen step by step while decoding with a KV
cache, for a tiny model of every supported family; weights and router_probs mean what the model uses."""

from __future__ import annotations

import pytest
import torch
from expertcast.models.presets import build_tiny
from expertcast.models.routing import RoutingRecorder, capture_routing, find_routers, record_routing

FAMILIES = ["qwen3_moe-tiny", "qwen2_moe-tiny", "mixtral-tiny", "olmoe-tiny", "deepseek_v2-tiny", "deepseek_v3-tiny",
            "gpt_oss-tiny"]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name: str):
    model = build_tiny(name, seed=0)
    if name.startswith("deepseek_v3"):
        # a non-zero correction bias, as in trained DeepSeek-V3 checkpoints, so that selection (score + bias,
        # group-limited) differs from plain top-K of the scores the weights come from
        g = torch.Generator().manual_seed(1)
        for site in find_routers(model):
            site.module.e_score_correction_bias.copy_(torch.randn(site.num_experts, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_teacher_forced_equals_step_by_step(name):
    model = _model(name)
    sites = find_routers(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 260, (1, 20), generator=g)  # longer than GPT-OSS's sliding window (16) in total
    with record_routing(model) as rec:
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
                             use_cache=True)
        steps_ids, steps_w, _ = rec.pop()  # prefill forward, then one forward per fed token
    assert out.shape[1] == 32
    # every token but the last generated one was fed to the model while decoding
    assert steps_ids.shape == (31, len(sites), sites[0].top_k)
    cap = capture_routing(model, out[:, :-1], router_probs=True)
    assert torch.equal(cap.expert_ids[0], steps_ids)
    torch.testing.assert_close(cap.expert_weights[0], steps_w, rtol=1e-4, atol=1e-5)
    assert cap.moe_layers == [s.layer_idx for s in sites]


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_and_probs_are_the_native_ones(name):
    model = _model(name)
    site = find_routers(model)[0]
    ids = torch.randint(4, 260, (2, 24), generator=torch.Generator().manual_seed(3))
    cap = capture_routing(model, ids, router_probs=True)
    p, e, w = cap.router_probs, cap.expert_ids, cap.expert_weights
    E, K = site.num_experts, site.top_k
    assert p.shape == (2, 24, e.shape[2], E)
    torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), rtol=0, atol=1e-5)
    assert int(e.min()) >= 0 and int(e.max()) < E
    # K distinct experts per token and layer
    assert bool((e.sort(-1).values.diff(dim=-1) != 0).all())
    picked = p.gather(-1, e)
    cfg = model.config
    if name.startswith("deepseek_v3"):
        # weights: the chosen experts' (bias-free) scores renormalised, scaling factor divided out
        torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True), rtol=1e-4, atol=1e-5)
        # selection used the bias: it is not the top-K of the scores everywhere
        plain = p.topk(K, dim=-1).indices.sort(-1).values
        assert not torch.equal(plain, e.sort(-1).values)
    else:
        # selection = top-K of the native distribution
        torch.testing.assert_close(picked.sort(-1).values, p.topk(K, dim=-1).values.sort(-1).values)
        if getattr(cfg, "norm_topk_prob", True) or name.startswith("gpt_oss"):
            torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True), rtol=1e-4, atol=1e-5)
        else:  # Qwen2-MoE / OLMoE with norm_topk_prob=False use the raw probabilities
            torch.testing.assert_close(w, picked, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,side", [("olmoe-tiny", "right"), ("gpt_oss-tiny", "left"), ("deepseek_v3-tiny", "left")])
def test_padding_does_not_change_real_tokens(name, side):
    model = _model(name)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(4, 260, (1, 20), generator=g)  # longer than GPT-OSS's sliding window
    b = torch.randint(4, 260, (1, 9), generator=g)
    batch = torch.zeros((2, 20), dtype=torch.long)
    mask = torch.zeros((2, 20), dtype=torch.long)
    batch[0], mask[0] = a[0], 1
    real = slice(0, 9) if side == "right" else slice(11, 20)
    batch[1, real], mask[1, real] = b[0], 1
    cap = capture_routing(model, batch, mask)
    alone_a = capture_routing(model, a)
    alone_b = capture_routing(model, b)
    assert torch.equal(cap.expert_ids[0], alone_a.expert_ids[0])
    assert torch.equal(cap.expert_ids[1, real], alone_b.expert_ids[0])
    torch.testing.assert_close(cap.expert_weights[1, real], alone_b.expert_weights[0], rtol=1e-4, atol=1e-5)


def test_errors():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="no MoE router"):
        find_routers(dense)
    model = _model("mixtral-tiny")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        capture_routing(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        capture_routing(model, torch.zeros((2, 5), dtype=torch.long), torch.ones((2, 4), dtype=torch.long))
    rec = RoutingRecorder(model)
    with pytest.raises(RuntimeError, match="no routing recorded"):
        rec.pop()
    # hooks are removed on exit
    with rec:
        pass
    assert all(not s.module._forward_hooks for s in rec.sites)
