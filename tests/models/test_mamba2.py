"""The forecaster's own Mamba-2: the chunked SSD scan against its recurrence, the backbone's window against its
one-step update, transformers' Mamba-2 as an outside oracle (same weights, same outputs; same seeded
initialisation), and on a GPU every kernel against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from expertcast.models import mamba_kernels
from expertcast.models.mamba2 import Mamba2Backbone
from expertcast.models.mamba_ssd import causal_conv, conv_step, segment_sums, ssd_scan, ssd_step

torch.set_num_threads(1)


def _ssd_inputs(Bsz=2, T=13, H=4, P=3, G=2, N=5, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, dt, B, C = r(Bsz, T, H, P), r(Bsz, T, H), r(Bsz, T, G, N), r(Bsz, T, G, N)
    A, D, dt_bias = -torch.rand(H, generator=g) - 0.1, r(H), r(H) - 1
    init = r(Bsz, H, P, N)
    return [t.to(device) for t in (x, dt, A, B, C, D, dt_bias, init)]


def test_segment_sums_are_the_sums_between_positions():
    a = torch.tensor([0.5, -1.0, 2.0, 0.25])
    s = segment_sums(a)
    for i in range(4):
        for j in range(4):
            want = a[j + 1:i + 1].sum() if i >= j else -torch.inf
            assert s[i, j] == want


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 32])
def test_chunked_scan_equals_the_recurrence(chunk):
    """Any chunk size (one element, not dividing T, all of T, longer than T), from a non-zero state, G > 1: the
    window's outputs and final state are the one-step recurrence's."""
    x, dt, A, B, C, D, dt_bias, init = _ssd_inputs()
    y, final = ssd_scan(x, dt, A, B, C, D, dt_bias, chunk, init)
    state = init.clone()
    ys = torch.stack([ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, dt_bias) for t in range(13)], 1)
    torch.testing.assert_close(y, ys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=1e-5, rtol=1e-5)
    y0, _ = ssd_scan(x, dt, A, B, C, D, dt_bias, chunk)  # no state: zeros
    y1, _ = ssd_scan(x, dt, A, B, C, D, dt_bias, chunk, torch.zeros_like(init))
    assert torch.equal(y0, y1)


def test_conv_window_continues_and_steps():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 6, 9, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    full = causal_conv(x, w, b)
    win = torch.zeros(2, 6, 4)
    split = torch.cat([causal_conv(x[..., :5], w, b, win), causal_conv(x[..., 5:], w, b, win)], -1)
    assert torch.allclose(split, full, atol=1e-6) and torch.equal(win, x[..., -4:])
    win = torch.zeros(2, 6, 4)
    steps = torch.stack([conv_step(x[..., t], win, w, b) for t in range(9)], -1)
    assert torch.allclose(steps, full, atol=1e-6)


def _backbone(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(hidden_size=32, num_blocks=2, state_size=8, head_dim=16, expand=2, conv_kernel=4, n_groups=2,
                chunk_size=4) | kw
    m = Mamba2Backbone(**args).eval()
    with torch.no_grad():  # away from the initial values (D = 1, norm weights 1, ...)
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _zero_state(m, Bsz, device="cpu"):
    shapes = m.state_shapes()
    return ([torch.zeros(Bsz, *c, device=device) for c, _ in shapes],
            [torch.zeros(Bsz, *s, device=device) for _, s in shapes])


def test_backbone_steps_equal_the_window():
    m = _backbone()
    x = torch.randn(3, 11, 32)
    with torch.no_grad():
        full = m(x)
        conv, ssm = _zero_state(m, 3)
        steps = torch.cat([m(x[:, t:t + 1], conv, ssm) for t in range(11)], 1)
        conv2, ssm2 = _zero_state(m, 3)
        split = torch.cat([m(x[:, :6], conv2, ssm2), m(x[:, 6:], conv2, ssm2)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(conv + ssm, conv2 + ssm2, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(s.abs().sum() > 0 for s in ssm)


def test_gradients_flow_through_the_window():
    m = _backbone().train()
    x = torch.randn(2, 7, 32, requires_grad=True)
    m(x).square().sum().backward()
    assert x.grad is not None and all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_same_outputs_and_initialisation_as_transformers_mamba2():
    """transformers' Mamba2Model (what exports of formats 1-4 ran) as an oracle: seeded alike, the weights are
    equal; given the same weights, the same hidden states, whole window and step by step."""
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, "Mamba2Model"):
        pytest.skip("this transformers has no Mamba2Model")
    cfg = tf.Mamba2Config(vocab_size=1, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, head_dim=16,
                          num_heads=4, n_groups=2, conv_kernel=4, chunk_size=4, pad_token_id=0, bos_token_id=0,
                          eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    ref = tf.Mamba2Model(cfg).eval()
    torch.manual_seed(0)
    mine = Mamba2Backbone(32, 2, 8, 16, 2, 4, 2, 4).eval()
    weights = {k: v for k, v in ref.state_dict().items() if k != "embeddings.weight"}
    assert set(weights) == set(mine.state_dict())
    assert all(torch.equal(v, mine.state_dict()[k]) for k, v in weights.items())
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mine.load_state_dict({k: v for k, v in ref.state_dict().items() if k != "embeddings.weight"})
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        want = ref(inputs_embeds=x).last_hidden_state
        got = mine(x)
        conv, ssm = _zero_state(mine, 2)
        steps = torch.cat([mine(x[:, t:t + 1], conv, ssm) for t in range(11)], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(steps, want, atol=1e-5, rtol=1e-5)


def _kernels_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not all(mamba_kernels.kernel_status().values()):
        pytest.skip("mamba-ssm / causal-conv1d are not installed (pip install -e '.[gpu]')")


@pytest.mark.gpu
def test_kernels_equal_the_reference():
    """Each kernel against its reference on the same CUDA tensors: the scan (from a state, G > 1, T not a multiple
    of the chunk), the state update, the convolution and its one-step update."""
    _kernels_or_skip()
    x, dt, A, B, C, D, dt_bias, init = _ssd_inputs(Bsz=2, T=37, H=4, P=16, G=2, N=16, device="cuda")
    mamba_kernels.reset_calls()
    y, final = mamba_kernels.chunk_scan(x, dt, A, B, C, D, dt_bias, 16, init)
    with mamba_kernels.reference_only():
        y_ref, final_ref = mamba_kernels.chunk_scan(x, dt, A, B, C, D, dt_bias, 16, init)
    torch.testing.assert_close(y, y_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(final, final_ref, atol=2e-3, rtol=2e-3)
    s_k, s_r = init.clone(), init.clone()
    y_k = mamba_kernels.state_update(s_k, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias)
    y_r = ssd_step(s_r, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, dt_bias)
    torch.testing.assert_close(y_k, y_r, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(s_k, s_r, atol=2e-3, rtol=2e-3)
    g = torch.Generator(device="cuda").manual_seed(2)
    xc = torch.randn(2, 64, 9, device="cuda", generator=g)
    w, b = torch.randn(64, 4, device="cuda", generator=g), torch.randn(64, device="cuda", generator=g)
    torch.testing.assert_close(mamba_kernels.conv(xc, w, b), causal_conv(xc, w, b), atol=2e-3, rtol=2e-3)
    win_k = torch.randn(2, 64, 4, device="cuda", generator=g)
    win_r = win_k.clone()
    out_k = mamba_kernels.conv_update(xc[..., 0], win_k, w, b)
    out_r = conv_step(xc[..., 0], win_r, w, b)
    torch.testing.assert_close(out_k, out_r, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(win_k, win_r)
    calls = mamba_kernels.calls()
    for op in ("chunk_scan", "state_update", "conv", "conv_update"):
        assert calls.get(f"{op}:kernel", 0) > 0, calls


@pytest.mark.gpu
def test_backbone_on_cuda_with_kernels_equals_the_reference():
    _kernels_or_skip()
    m = _backbone(chunk_size=8).cuda()
    x = torch.randn(2, 21, 32, device="cuda")
    with torch.no_grad():
        got = m(x)
        conv, ssm = _zero_state(m, 2, "cuda")
        steps = torch.cat([m(x[:, t:t + 1], conv, ssm) for t in range(5)], 1)
        with mamba_kernels.reference_only():
            want = m(x)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(steps, want[:, :5], atol=2e-3, rtol=2e-3)
