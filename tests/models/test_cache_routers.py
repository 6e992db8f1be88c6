"""Cache-aware routers: hand-worked loss cases, copy-init, exact transparency on the backbone, export."""

from __future__ import annotations

import json
import math

import pytest
import torch
from expertcast.models.cache_routers import (
    CacheRouters,
    RouterOutputs,
    cache_coverage_loss,
    coverage_loss,
    expert_use_stats,
    pair_mask,
    record_router_outputs,
    resolve_budget,
    soft_topb_membership,
    spatio_at_target,
    spatio_temporal_priority,
)
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------- soft Top-B membership and L_cov


def test_soft_topb_membership_hand_worked():
    s = torch.tensor([0.5, 0.2, 0.1, 0.4])
    # B = 2: theta = 0.4 (second largest); tau = 0.1
    m = soft_topb_membership(s, 2, 0.1)
    want = [_sig((0.5 - 0.4) / 0.1), 0.5 * 0 + _sig((0.2 - 0.4) / 0.1), _sig((0.1 - 0.4) / 0.1), 0.5]
    assert torch.allclose(m, torch.tensor(want), atol=1e-6)
    # the B-th entry always sits at exactly 1/2; a small tau approaches hard Top-B membership
    hard = soft_topb_membership(s, 2, 1e-4)
    assert torch.allclose(hard, torch.tensor([1.0, 0.0, 0.0, 0.5]), atol=1e-6)


def test_coverage_loss_hand_worked_and_masked():
    s = torch.tensor([[0.5, 0.2, 0.1, 0.4], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    m = soft_topb_membership(s, 2, 0.1)
    rows = -(q * m).sum(-1)
    assert torch.allclose(coverage_loss(s, q, 2, 0.1), rows.mean())
    valid = torch.tensor([False, True])
    assert torch.allclose(coverage_loss(s, q, 2, 0.1, valid), rows[1])
    # hard limit: loss = -(target mass inside the top-B) with the boundary entry at weight 1/2
    hard = coverage_loss(s[:1], q[:1], 2, 1e-4)
    assert hard.item() == pytest.approx(-(0.7 + 0.5 * 0.1), abs=1e-5)
    with pytest.raises(ValueError, match="shapes differ"):
        coverage_loss(s, q[:, :3], 2, 0.1)
    with pytest.raises(ValueError, match="tau"):
        soft_topb_membership(s, 2, 0.0)


def test_coverage_gradient_raises_target_experts():
    logits = torch.zeros(6, requires_grad=True)
    q = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    loss = coverage_loss(torch.softmax(logits, -1) + torch.tensor([0.3, 0.2, 0, 0, 0, 0]), q, 2, 0.05)
    loss.backward()
    # descending the loss raises the logits of the experts the target wants
    assert logits.grad[4] < 0 and logits.grad[5] < 0


# ---------------------------------------------------------------- causal predecessor and masks


def test_spatio_predecessor_wraps_to_previous_token_last_layer():
    B, T, L, E = 1, 3, 3, 2
    p_S = torch.arange(B * T * L * E, dtype=torch.float32).view(B, T, L, E)
    tgt = spatio_at_target(p_S)
    for t in range(T):
        for li in range(L):
            if li > 0:
                assert torch.equal(tgt[0, t, li], p_S[0, t, li - 1])
            elif t > 0:
                assert torch.equal(tgt[0, t, 0], p_S[0, t - 1, L - 1])  # wrap-around
            else:
                assert torch.equal(tgt[0, 0, 0], torch.zeros(E))  # no predecessor


def test_spatio_temporal_priority_composition():
    g = torch.Generator().manual_seed(0)
    B, T, L, E = 2, 4, 3, 5
    p_R, p_T, p_S = (torch.rand(B, T, L, E, generator=g) for _ in range(3))
    s = spatio_temporal_priority(p_R, p_T, p_S)
    assert s.shape == (B, T - 1, L, E)
    # target (t=2, l=0): p^R_{1,0} + p^T_{1,0} + p^S_{1,L-1};  target (t=2, l=2): ... + p^S_{2,1}
    assert torch.allclose(s[:, 1, 0], p_R[:, 1, 0] + p_T[:, 1, 0] + p_S[:, 1, L - 1])
    assert torch.allclose(s[:, 1, 2], p_R[:, 1, 2] + p_T[:, 1, 2] + p_S[:, 2, 1])
    s_only = spatio_temporal_priority(p_R, None, p_S)
    assert torch.allclose(s_only[:, 1, 2], p_R[:, 1, 2] + p_S[:, 2, 1])


def test_pair_mask_is_omega():
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    m = pair_mask(am, 2)
    assert m.shape == (2, 3, 2)
    assert m[..., 0].tolist() == [[True, True, False], [True, False, False]]


def test_mode_losses_hand_worked():
    """Two tokens, one layer, E=3, B=1, tiny tau: the arg-max is the B-th entry, so its membership is
    exactly 1/2 and every other one ~0: each loss is minus half the target mass of the arg-max."""
    p_R = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]).view(1, 2, 1, 3)
    p_T = torch.tensor([[0.0, 0.9, 0.1], [0.3, 0.3, 0.4]]).view(1, 2, 1, 3)
    p_S = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.5, 0.0]]).view(1, 2, 1, 3)
    out = RouterOutputs(p_R, p_T, p_S)
    tau = 1e-4
    # temporal: s^T_0 = [0.6, 1.2, 0.2] -> expert 1 kept; target p^R_1 gives it 0.7
    assert cache_coverage_loss(out, "temporal", 1, tau).item() == pytest.approx(-0.35, abs=1e-4)
    # full (L=1: rho(1,0) = (0,0)): s^ST_1 = [0.6, 1.2, 1.2] tie -> both at 1/2: -(0.35 + 0.05)
    assert cache_coverage_loss(out, "full", 1, tau).item() == pytest.approx(-0.4, abs=1e-4)
    # spatio-only: s^S_1 = [0.6, 0.3, 1.1] -> expert 2, target mass 0.1
    assert cache_coverage_loss(out, "spatio_only", 1, tau).item() == pytest.approx(-0.05, abs=1e-4)
    # masking the second token leaves no valid pair
    assert cache_coverage_loss(out, "temporal", 1, tau, torch.tensor([[1, 0]])).item() == 0.0
    with pytest.raises(ValueError, match="unknown router mode"):
        cache_coverage_loss(out, "both", 1, tau)


def test_resolve_budget():
    assert resolve_budget(0.25, 16, 4) == 4
    assert resolve_budget(6, 16, 4) == 6
    with pytest.raises(ValueError, match="below the native top-K"):
        resolve_budget(0.1, 16, 4)
    with pytest.raises(ValueError, match="exceeds"):
        resolve_budget(20, 16, 4)


def test_expert_use_stats():
    ids = torch.tensor([[[0, 1]], [[0, 2]], [[0, 3]], [[0, 1]]])  # N=4, L=1, K=2
    st = expert_use_stats(ids, 4, 2)
    assert st["max_freq"] == pytest.approx(0.5)
    assert st["topb_mass"] == pytest.approx(0.75)
    f = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert st["entropy"] == pytest.approx(float(-(f * f.log()).sum()), abs=1e-6)


# ---------------------------------------------------------------- attachment to real backbones


@pytest.fixture(scope="module")
def qwen():
    return build_tiny("qwen3_moe-tiny", seed=0)


def test_copy_init_matches_native_router(qwen):
    r = CacheRouters.for_model(qwen, mode="full")
    ids = torch.randint(3, 500, (2, 7))
    out = record_router_outputs(qwen, r, ids)
    L = r.num_layers
    assert out.p_R.shape == (2, 7, L, 16)
    # W^T_l = W^R_l: p^T equals p^R at init; W^S_l = W^R_{l+1} on layer l's input
    assert torch.allclose(out.p_T, out.p_R, atol=1e-6)
    w_next = qwen.model.layers[1].mlp.gate.weight
    with torch.no_grad():
        base = qwen.model
        captured = {}
        def grab(module, args, output):
            captured["h"] = args[0]

        hd = qwen.model.layers[0].mlp.gate.register_forward_hook(grab)
        base(input_ids=ids, use_cache=False)
        hd.remove()
    want = torch.softmax(captured["h"].float() @ w_next.float().T, -1).view(2, 7, 16)
    assert torch.allclose(out.p_S[:, :, 0], want, atol=1e-6)


@pytest.mark.parametrize("preset", ["qwen3_moe-tiny", "gpt_oss-tiny"])
def test_attaching_routers_leaves_logits_and_generation_unchanged(preset):
    model = build_tiny(preset, seed=1)
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    routers = CacheRouters.for_model(model, mode="full", init="random")
    with torch.no_grad():  # make the routers disagree with the native ones
        for p in routers.parameters():
            p.add_(torch.randn_like(p))
    with routers.attach(model) as tap, torch.no_grad():
        logits = model(ids).logits
        gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert tap._h[0] is not None  # the hooks did run
    assert torch.equal(logits, ref_logits)
    assert torch.equal(gen, ref_gen)


def test_routers_refuse_other_model(qwen):
    r = CacheRouters.for_model(build_tiny("mixtral-tiny"), mode="temporal")
    with pytest.raises(ValueError, match="another model"):
        r.attach(qwen)


def test_gradients_reach_backbone_and_routers(qwen):
    model = build_tiny("qwen3_moe-tiny", seed=0).train()
    r = CacheRouters.for_model(model, mode="full")
    ids = torch.randint(3, 500, (2, 8))
    with r.attach(model) as tap:
        model(ids)
        loss = cache_coverage_loss(tap.outputs(2, 8), "full", 4, 0.05)
    loss.backward()
    assert r.temporal[0].weight.grad is not None and r.temporal[0].weight.grad.abs().sum() > 0
    assert r.spatio[-1].weight.grad.abs().sum() > 0
    # native distributions stay differentiable: the native router receives gradient
    assert model.model.layers[2].mlp.gate.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- export


def test_export_roundtrip_and_refusals(tmp_path, qwen):
    from expertcast.models.router_export import load_routers, save_routers

    r = CacheRouters.for_model(qwen, mode="full")
    d = tmp_path / "routers"
    save_routers(d, r, qwen, extra={"budget": 4, "tau": 0.05})
    r2, meta = load_routers(d, model=qwen)
    assert meta["mode"] == "full" and meta["budget"] == 4
    for a, b in zip(r.state_dict().values(), r2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # another model
    with pytest.raises(ValueError, match="another model"):
        load_routers(d, model=build_tiny("olmoe-tiny"))
    # corrupt weights
    w = d / "cache_routers.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-3] ^= 0xFF
    w.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt"):
        load_routers(d)
    # foreign JSON
    (d / "cache_routers.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an expertcast cache-router export"):
        load_routers(d)
