"""The forecaster network: shapes, windowed vs recurrent equivalence, rollout isolation, trigger layer.

Online statistics inside the forecaster: the moving-average scan, recurrent == windowed, state rows, the
zero-learned-part forecaster ranking experts exactly like the online baselines, and the per-sequence weighting of
the sources (hedge): its scores, and that it follows each sequence's better source.

Forecaster placement: a CPU-resident forecaster is never handed the Mamba CUDA kernels, even when
mamba-ssm and causal-conv1d are importable.

No real mamba-ssm runs on a CPU machine, so "importable" is simulated: a subprocess puts fake
``mamba_ssm``/``causal_conv1d`` packages first on its path whose every kernel raises when called.
:mod:`expertcast.models.mamba_kernels` resolves them as the kernels (the test checks it did), so this tests its
dispatch, not the kernels themselves (tests/models/test_mamba2.py holds those equal to the reference on a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    ForecasterState,
    OnlinePrior,
    activation_probs,
    activation_vector,
    ema_scan,
    predictions_to_input,
    trigger_sequence,
)

torch.set_num_threads(1)


def test_activation_vector_normalizes_and_scatters():
    ids = torch.tensor([[[1, 3], [0, 2]]])  # [T=1, L=2, K=2]
    w = torch.tensor([[[3.0, 1.0], [1.0, 1.0]]])
    x = activation_vector(ids, w, 4)
    assert x.shape == (1, 2, 4)
    assert torch.allclose(x[0, 0], torch.tensor([0.0, 0.75, 0.0, 0.25]))
    assert torch.allclose(x.sum(-1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="outside"):
        activation_vector(torch.tensor([[[4, 0]]]), torch.ones(1, 1, 2), 4)


def test_window_forward_equals_recurrent_steps(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(2, 11)
    with torch.no_grad():
        full = m(x)
        assert full.shape == (2, 11, 3, 8)
        st = m.init_state(2)
        stepped = torch.stack([m.step(x[:, i], st)[0] for i in range(11)], dim=1)
        assert torch.allclose(stepped, full, atol=1e-4)
        # a window continuing from a state equals the one-shot window
        st2 = m.init_state(2)
        a, b = m(x[:, :4], st2), m(x[:, 4:], st2)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-4)
        assert st2.steps == 11


def test_rollout_does_not_disturb_next_step(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(2, 6)
    st_a, st_b = m.init_state(2), m.init_state(2)
    for i in range(5):
        la, _ = m.step(x[:, i], st_a)
        m.step(x[:, i], st_b)
        roll = m.rollout(la, st_a, horizon=5)
        assert roll.shape == (2, 5, 3, 8)
        assert torch.equal(roll[:, 0], la)
    na, _ = m.step(x[:, 5], st_a)
    nb, _ = m.step(x[:, 5], st_b)
    assert torch.equal(na, nb)
    for a, b in zip(st_a.conv + st_a.ssm, st_b.conv + st_b.ssm, strict=True):
        assert torch.equal(a, b)


def test_rollout_feeds_predictions_back(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(1, 3)
    st = m.init_state(1)
    for i in range(3):
        lg, _ = m.step(x[:, i], st)
    roll = m.rollout(lg, st, horizon=3)
    manual = st.clone()
    l2, _ = m.step(predictions_to_input(lg, 2), manual)
    l3, _ = m.step(predictions_to_input(l2, 2), manual)
    assert torch.allclose(roll[:, 1], l2, atol=1e-6) and torch.allclose(roll[:, 2], l3, atol=1e-6)


def test_state_rows_select_and_put(tiny_forecaster_cfg, activation_inputs):
    m = ExpertForecaster(tiny_forecaster_cfg()).eval()
    x = activation_inputs(3, 4)
    st = m.init_state(3)
    for i in range(4):
        m.step(x[:, i], st)
    sub = st.select([2, 0])
    full_next, _ = m.step(x[:, 0], st.clone())
    sub_next, _ = m.step(x[[2, 0], 0], sub)
    assert torch.allclose(sub_next, full_next[[2, 0]], atol=1e-6)
    st.put_rows([2, 0], sub)
    cat = ForecasterState.cat([st.select([0]), st.select([1])])
    assert cat.batch_size == 2


def test_trigger_sequence_layout():
    T, L, E = 4, 3, 5
    acts = torch.arange(T * L * E, dtype=torch.float32).view(T, L, E)
    assert torch.equal(trigger_sequence(acts, L - 1), acts)
    el = trigger_sequence(acts, 0)  # element i: layer 0 of step i+1, layers 1..2 of step i
    assert el.shape == (T - 1, L, E)
    assert torch.equal(el[1, 0], acts[2, 0]) and torch.equal(el[1, 1:], acts[1, 1:])
    # the target of element i is element i+1: layers > p of step i+1 ... (next L layer executions)
    assert torch.equal(el[2, 1:], acts[2, 1:]) and torch.equal(el[2, 0], acts[3, 0])


def test_activation_probs_sum_to_k_and_prediction_format():
    lg = torch.randn(2, 3, 8)
    p = activation_probs(lg, 2)
    assert ((p >= 0) & (p <= 1)).all() and (p.sum(-1) <= 2.0 + 1e-5).all()
    flat = activation_probs(torch.zeros(3, 8), 2)  # uniform routing: each expert 2/8, inclusion sums to K
    assert torch.allclose(flat, torch.full((3, 8), 0.25)) and torch.allclose(flat.sum(-1), torch.full((3,), 2.0))
    x = predictions_to_input(lg, 2)
    assert ((x > 0).sum(-1) == 2).all() and torch.allclose(x.sum(-1), torch.ones(2, 3))


def test_bad_inputs_are_named(tiny_forecaster_cfg):
    with pytest.raises(ValueError, match="top_k"):
        tiny_forecaster_cfg(top_k=8)
    with pytest.raises(ValueError, match="trigger_layer"):
        tiny_forecaster_cfg(trigger_layer=3)
    with pytest.raises(ValueError, match="backbone"):
        tiny_forecaster_cfg(backbone="lstm")
    with pytest.raises(ValueError, match=r"backbone 'mamba' \(Mamba-1\) is not supported"):
        tiny_forecaster_cfg(backbone="mamba")
    with pytest.raises(ValueError, match="head_dim"):
        tiny_forecaster_cfg(head_dim=24)
    m = ExpertForecaster(tiny_forecaster_cfg())
    with pytest.raises(ValueError, match=r"L=3, E=8"):
        m(torch.zeros(1, 2, 3, 7))
    with pytest.raises(ValueError, match="batch"):
        m(torch.zeros(2, 1, 3, 8), m.init_state(1))


def test_step_flops_counts_linear_layers(tiny_forecaster_cfg):
    m = ExpertForecaster(tiny_forecaster_cfg())
    n_lin = sum(mod.in_features * mod.out_features for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    assert m.step_flops() >= 2 * n_lin


def test_direct_heads_forward_step_and_rollout(tiny_forecaster_cfg, activation_inputs):
    """H_d direct heads: head 0 is the next-element forecast of the plain forward; rollout up to H_d reads the
    heads without touching the state; beyond H_d it feeds next-element predictions back and reads head H_d."""
    m = ExpertForecaster(tiny_forecaster_cfg(direct_horizons=3)).eval()
    x = activation_inputs(2, 7)
    with torch.no_grad():
        allh = m(x, all_horizons=True)
        assert allh.shape == (2, 7, 3, 3, 8)
        assert torch.allclose(m(x), allh[:, :, 0], atol=1e-6)
    st = m.init_state(2)
    for i in range(7):
        lg, _ = m.step(x[:, i], st, all_horizons=True)
    assert lg.shape == (2, 3, 3, 8) and torch.allclose(lg, allh[:, -1], atol=1e-4)
    before = st.clone()
    short = m.rollout(lg, st, horizon=2)
    assert torch.equal(short, lg[:, :2])
    long = m.rollout(lg, st, horizon=5)
    assert long.shape == (2, 5, 3, 8) and torch.equal(long[:, :3], lg)
    manual = st.clone()
    a, _ = m.step(predictions_to_input(lg[:, 0], 2), manual, all_horizons=True)
    b, _ = m.step(predictions_to_input(a[:, 0], 2), manual, all_horizons=True)
    assert torch.allclose(long[:, 3], a[:, 2], atol=1e-6) and torch.allclose(long[:, 4], b[:, 2], atol=1e-6)
    for s, t in zip(st.conv + st.ssm, before.conv + before.ssm, strict=True):
        assert torch.equal(s, t)  # rollout restored the state
    with pytest.raises(ValueError, match="heads"):
        m.rollout(lg[:, :2], st, horizon=4)
    with pytest.raises(ValueError, match="direct_horizons"):
        tiny_forecaster_cfg(direct_horizons=0)


def test_config_from_older_export_gets_single_head(tiny_forecaster_cfg):
    d = tiny_forecaster_cfg().to_dict()
    d.pop("direct_horizons")
    assert ForecasterConfig.from_dict(d).direct_horizons == 1


torch.set_num_threads(1)


@pytest.fixture
def online_cfg(tiny_forecaster_cfg):
    """The tiny config with one block and online statistics of half-lives 0, 2 and 8 (overridable)."""

    def make(**kw):
        return tiny_forecaster_cfg(**{"num_blocks": 1, "online_half_lives": [0.0, 2.0, 8.0], **kw})

    return make


def test_ema_scan_matches_the_recurrence_across_chunks_and_from_a_state():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 13, 5, generator=g)
    decays = torch.tensor([0.0, 0.5, 0.9])
    prev = torch.rand(2, 3, 5, generator=g)
    out = ema_scan(x, decays, prev, chunk=4)
    e = prev.clone()
    for t in range(13):
        e = decays.view(1, 3, 1) * e + (1 - decays).view(1, 3, 1) * x[:, t].unsqueeze(1)
        assert torch.allclose(out[:, t], e, atol=1e-5)
    assert torch.equal(out[:, :, 0], x)  # decay 0: the last element itself


@pytest.mark.parametrize("hedge,gate", [(0.0, 0.0), (1.5, 0.0), (0.0, 2.0), (1.5, 2.0)])
def test_online_window_forward_equals_recurrent_steps(hedge, gate, online_cfg, activation_inputs):
    m = ExpertForecaster(online_cfg(direct_horizons=2, online_hedge_rate=hedge, online_hedge_half_life=4.0,
                                    learned_gate_rate=gate))
    torch.nn.init.normal_(m.head.weight, std=0.1)  # a non-zero learned part too
    with torch.no_grad():
        m.online.mix.normal_()
    m.eval()
    x = activation_inputs(2, 11)
    with torch.no_grad():
        full = m(x, all_horizons=True)
        st = m.init_state(2)
        stepped = torch.stack([m.step(x[:, i], st, all_horizons=True)[0] for i in range(11)], dim=1)
        assert torch.allclose(stepped, full, atol=1e-4)
        st2 = m.init_state(2)
        a, b = m(x[:, :5], st2, all_horizons=True), m(x[:, 5:], st2, all_horizons=True)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-4)
        assert torch.allclose(st2.online, st.online, atol=1e-6)
        for a, b in zip(st2.hedge or [], st.hedge or [], strict=True):
            assert torch.allclose(a, b, atol=1e-5)


def test_online_statistics_travel_with_state_rows(online_cfg, activation_inputs):
    m = ExpertForecaster(online_cfg(online_hedge_rate=1.0, learned_gate_rate=1.0)).eval()
    x = activation_inputs(3, 5)
    st = m.init_state(3)
    for i in range(5):
        m.step(x[:, i], st)
    sub = st.select([2, 0])
    assert torch.equal(sub.online, st.online[[2, 0]])
    nxt, _ = m.step(x[[2, 0], 0], sub)
    ref, _ = m.step(x[:, 0], st.clone())
    assert torch.allclose(nxt, ref[[2, 0]], atol=1e-6)
    st.put_rows([1], sub.select([0]))
    assert torch.equal(st.online[1], sub.online[0])
    st.reset_rows([0])
    assert not st.online[0].any() and not any(t[0].any() for t in st.hedge)
    assert ForecasterState.cat([st, sub]).online.shape[0] == 5
    assert [t.shape[0] for t in ForecasterState.cat([st, sub]).hedge] == [5] * 6
    # rollout restores the online statistics too
    lg, _ = m.step(x[:, 1], st)
    saved = [t.clone() for t in [st.online] + st.hedge]
    m.rollout(lg, st, horizon=4)
    assert all(torch.equal(a, b) for a, b in zip([st.online] + st.hedge, saved, strict=True))


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, dim=-1).indices.sort(-1).values


def test_zero_learned_part_ranks_like_the_online_baselines(online_cfg, activation_inputs):
    """At initialisation (learned head zero) the forecast is the online prior: with its mixture on the last
    selection it is repeat-last; on one moving average it ranks like that sequence's recent frequency."""
    m = ExpertForecaster(online_cfg(top_k=3)).eval()
    x = activation_inputs(2, 9, K=3, seed=3)
    with torch.no_grad():
        m.online.mix.zero_()
        m.online.mix[..., 0] = 30.0  # the last selection
        lg = m(x)
        assert torch.equal(_top(lg, 3), _top(x, 3))
        m.online.mix.zero_()
        m.online.mix[..., 2] = 30.0  # the half-life-8 moving average
        lg = m(x)
    d = 0.5 ** (1 / 8)
    ema = torch.zeros(2, 3, 8)
    for t in range(9):
        ema = d * ema + (1 - d) * x[:, t]
        assert torch.equal(_top(lg[:, t], 3), _top(ema, 3))


def test_online_config_is_validated_and_old_configs_load_without_it(online_cfg):
    with pytest.raises(ValueError, match="online_half_lives"):
        online_cfg(online_half_lives=[2.0, 2.0])
    with pytest.raises(ValueError, match="online_half_lives"):
        online_cfg(online_half_lives=[-1.0])
    old = online_cfg().to_dict()
    old.pop("online_half_lives")
    assert ForecasterConfig.from_dict(old).online_half_lives == []
    assert ExpertForecaster(ForecasterConfig.from_dict(old)).online is None


def _support_recall(scores: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """Share of target's experts (> 0) in the top-k of scores: [..., L, E] x2 -> [...] (mean over layers)."""
    top = scores.topk(k, dim=-1).indices
    return (target > 0).gather(-1, top).float().sum(-1).div(k).mean(-1)


def test_hedge_scores_are_each_sources_discounted_recall_so_far(activation_inputs):
    L, E, K, H = 2, 8, 2, 3
    prior = OnlinePrior([0.0, 4.0], L, E, heads=H, top_k=K, hedge_rate=1.0, hedge_half_life=8.0)
    x = activation_inputs(2, 12, L=L, E=E, K=K, seed=5).flatten(-2)  # [B, T, L·E]
    with torch.no_grad():
        xs = torch.cat([x, torch.ones(2, 12, 1)], -1)
        ema = ema_scan(xs, prior.decays)
        freq = ema[..., :-1] / ema[..., -1:]
        got = prior._scores(x, freq, None)  # [B, T, H, M+1]
    d = 0.5 ** (1 / 8)
    want = torch.zeros_like(got)
    for t in range(12):
        for j in range(H):
            for s in range(j + 1, t + 1):  # element s resolves the forecast issued at s-j-1
                for m in range(2):
                    r = _support_recall(freq[:, s - j - 1, m].view(2, L, E), x[:, s].view(2, L, E), K)
                    want[:, t, j, m] += d ** (t - s) * r
                want[:, t, j, 2] += d ** (t - s) * K / E
    assert torch.allclose(got, want, atol=1e-5)


def _two_kinds(T: int, seed: int = 0) -> torch.Tensor:
    """[2, T, 1, 8] (K=2): row 0 a fixed pair {0, 1} with a random other pair 30% of the time (its long average
    forecasts it best), row 1 blocks of 6 steps on one random pair (the last selection forecasts it best)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(2, T, 1, 2, dtype=torch.long)
    for t in range(T):
        noisy = bool(torch.rand(1, generator=g) < 0.3)
        ids[0, t, 0] = 2 + torch.randperm(6, generator=g)[:2] if noisy else torch.tensor([0, 1])
        if t % 6 == 0:
            block = torch.randperm(8, generator=g)[:2]
        ids[1, t, 0] = block
    return activation_vector(ids, torch.ones(2, T, 1, 2), 8)


def test_hedge_moves_each_sequence_to_the_source_that_forecasts_it():
    """Equal mixture of the last selection and a half-life-32 average: without per-sequence weighting one fixed
    blend serves both kinds of sequence; with it each sequence's prior follows its own better source, so its
    recall after a warm-up reaches the better single source's and beats the fixed blend."""
    T, warm = 160, 40
    x = _two_kinds(T).flatten(-2)
    rec = {}
    for name, rate in {"fixed": 0.0, "hedge": 4.0}.items():
        prior = OnlinePrior([0.0, 32.0], 1, 8, heads=1, top_k=2, hedge_rate=rate)
        with torch.no_grad():
            lp = prior(x, None, 1)[:, :, 0]  # [2, T, 1, 8]
        rec[name] = _support_recall(lp[:, warm:-1], x[:, warm + 1:].view(2, -1, 1, 8), 2).mean(1)  # [2]
    with torch.no_grad():
        xs = torch.cat([x, torch.ones(2, T, 1)], -1)
        ema = ema_scan(xs, torch.tensor([0.0, 0.5 ** (1 / 32)]))
        freq = (ema[..., :-1] / ema[..., -1:]).view(2, T, 2, 1, 8)
    single = torch.stack([_support_recall(freq[:, warm:-1, m], x[:, warm + 1:].view(2, -1, 1, 8), 2).mean(1)
                          for m in range(2)], -1)  # [2 rows, 2 sources]
    best = single.max(-1).values
    assert single[0, 1] > single[0, 0] + 0.1 and single[1, 0] > single[1, 1] + 0.1  # the two kinds differ
    assert (rec["hedge"] >= best - 0.03).all(), (rec, single)
    assert rec["hedge"].mean() > rec["fixed"].mean() + 0.03, (rec, single)


KERNELS = {
    "mamba_ssm/ops/triton/ssd_combined.py": ["mamba_chunk_scan_combined"],
    "mamba_ssm/ops/triton/selective_state_update.py": ["selective_state_update"],
    "causal_conv1d/__init__.py": ["causal_conv1d_fn", "causal_conv1d_update"],
}

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_forecaster import forecaster_outputs
    from expertcast.models import mamba_kernels
    mamba_kernels.reset_calls()
    torch.save(forecaster_outputs(), {out!r})
    print(json.dumps({{"status": mamba_kernels.kernel_status(), "calls": mamba_kernels.calls()}}))
""")


def forecaster_outputs() -> dict[str, torch.Tensor]:
    """Training forward, eval forward, a window continuing from a state, one recurrent step and a rollout of a
    seeded tiny forecaster on CPU."""
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8,
                           chunk_size=8, num_blocks=2)
    m = ExpertForecaster(cfg)
    x = torch.rand(2, 6, 3, 8)
    m.train()
    out = {"train": m(x).detach()}
    m.eval()
    with torch.no_grad():
        out["eval"] = m(x)
        state = m.init_state(2)
        out["window"] = m(x[:, :4], state)
        logits, _ = m.step(x[:, 4], state, all_horizons=True)
        out["step"], out["rollout"] = logits, m.rollout(logits, state, 3)
    return out


def _fake_kernels(root) -> None:
    for rel, names in KERNELS.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        for d in [f.parent, *f.parent.parents]:
            if d == root:
                break
            (d / "__init__.py").touch()
        body = "".join(f"def {n}(*args, **kwargs):\n    raise RuntimeError('CUDA kernel {n} called')\n" for n in names)
        f.write_text(f.read_text() + body if f.exists() else body)


def test_cpu_forecaster_with_kernels_importable_equals_without(tmp_path):
    import json

    fake = tmp_path / "site"
    _fake_kernels(fake)
    tests = os.path.dirname(os.path.abspath(__file__))  # this file's folder: the child imports its helper
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(tests=tests, out=str(tmp_path / "out.pt"))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    # the fakes were taken for kernels (else this test would prove nothing) ...
    assert report["status"] == {"chunk_scan": True, "state_update": True, "conv": True, "conv_update": True}
    # ... and never called: every call of the CPU forecaster took the PyTorch path
    assert {k.split(":")[0] for k in report["calls"]} == set(report["status"])
    assert not [k for k in report["calls"] if k.endswith(":kernel")]
    with_kernels = torch.load(tmp_path / "out.pt")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = forecaster_outputs()
        for name, t in with_kernels.items():
            assert torch.equal(t, ref[name]), name
    finally:
        torch.set_num_threads(n)


def test_dispatch_counts_the_torch_path_here():
    from expertcast.models import mamba_kernels

    status = mamba_kernels.kernel_status()
    assert set(status) == {"chunk_scan", "state_update", "conv", "conv_update"}
    mamba_kernels.reset_calls()
    forecaster_outputs()
    calls = mamba_kernels.calls()
    assert calls.get("chunk_scan:torch", 0) > 0 and calls.get("state_update:torch", 0) > 0
    assert calls.get("conv:torch", 0) > 0 and calls.get("conv_update:torch", 0) > 0
    assert not [k for k in calls if k.endswith(":kernel")]


@pytest.mark.gpu
def test_cuda_forecaster_uses_the_kernels_when_installed():
    """On CUDA with mamba-ssm installed the scans and the step are kernel calls; outputs match the CPU's."""
    from expertcast.models import mamba_kernels
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    if not all(mamba_kernels.kernel_status().values()):
        pytest.skip("mamba-ssm / causal-conv1d are not installed (pip install -e '.[gpu]')")
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=3, num_experts=8, top_k=2, hidden_size=64, head_dim=32, state_size=16,
                           chunk_size=8, num_blocks=2)
    m = ExpertForecaster(cfg).eval()
    x = torch.rand(2, 16, 3, 8)
    with torch.no_grad():
        ref = m(x)
        st = m.init_state(2)
        ref_step = torch.stack([m.step(x[:, i], st)[0] for i in range(3)], 1)
        mamba_kernels.reset_calls()
        m.cuda()
        got = m(x.cuda()).cpu()
        st = m.init_state(2)
        got_step = torch.stack([m.step(x[:, i].cuda(), st)[0] for i in range(3)], 1).cpu()
    calls = mamba_kernels.calls()
    for op in ("chunk_scan", "conv", "state_update", "conv_update"):
        assert calls.get(f"{op}:kernel", 0) > 0 and not calls.get(f"{op}:torch"), calls
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_step, ref_step, atol=2e-3, rtol=2e-3)


def test_worker_stream_only_on_cuda():
    from expertcast.inference.policies.async_forecast import forecaster_stream

    with forecaster_stream("cpu") as s:
        assert s is None


@pytest.mark.gpu
def test_worker_stream_is_its_own_on_cuda():
    from expertcast.inference.policies.async_forecast import forecaster_stream

    with forecaster_stream("cuda") as s:
        assert s is not None and torch.cuda.current_stream() == s and s != torch.cuda.default_stream()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_element_branch_is_an_mlp_over_the_element_and_its_recent_frequency(tiny_forecaster_cfg, activation_inputs):
    """The per-element branch (``skip_hidden``): with the backbone's head at zero the learned logits are exactly
    relu(W1 [x_t ; m_t] + b1) W2 + b2, m_t the half-life-16 moving average of x from zero; a window equals its
    elements one at a time, and the branch's average travels with the state (clone, select, restore)."""
    from expertcast.models.forecaster import SKIP_HALF_LIFE

    m = ExpertForecaster(tiny_forecaster_cfg(direct_horizons=2, skip_hidden=12)).eval()
    with torch.no_grad():
        m.head.weight.zero_()
        m.head.bias.zero_()
        torch.nn.init.normal_(m.skip.out.weight, std=0.5)
    x = activation_inputs(2, 9)
    with torch.no_grad():
        learned, _ = m.forward_parts(x, all_horizons=True)
        d = 0.5 ** (1 / SKIP_HALF_LIFE)
        ema = torch.zeros(2, 24)
        for t in range(9):
            xt = x[:, t].reshape(2, 24)
            ema = d * ema + (1 - d) * xt
            want = m.skip.out(torch.relu(m.skip.hidden(torch.cat([xt, ema], -1)))).view(2, 2, 3, 8)
            assert torch.allclose(learned[:, t], want, atol=1e-5), t
        full = m(x, all_horizons=True)
        st = m.init_state(2)
        assert st.skip is not None and st.skip.shape == (2, 1, 24)
        stepped = [m.step(x[:, t], st, all_horizons=True)[0] for t in range(5)]
        saved = st.clone()
        row1 = st.select([1])
        stepped += [m.step(x[:, t], st, all_horizons=True)[0] for t in range(5, 9)]
        assert torch.allclose(torch.stack(stepped, 1), full, atol=1e-4)
        assert torch.allclose(st.skip[:, 0], ema, atol=1e-5)
        st.copy_(saved)  # restored: the next element's forecast is the windowed one again
        assert torch.allclose(m.step(x[:, 5], st, all_horizons=True)[0], full[:, 5], atol=1e-4)
        assert torch.allclose(m.step(x[1:, 5], row1, all_horizons=True)[0], full[1:, 5], atol=1e-4)
    plain = ExpertForecaster(tiny_forecaster_cfg(direct_horizons=2))
    assert m.step_flops() - plain.step_flops() == 2 * (24 + 2 * 24 * 12 + 12 * 24 * 2)
    assert plain.init_state(1).skip is None and len(m.init_state(1).tensors()) == len(plain.init_state(1).tensors()) + 1
    with pytest.raises(ValueError, match="skip_hidden"):
        tiny_forecaster_cfg(skip_hidden=-1)


def test_element_branch_starts_at_zero_beside_the_online_prior(tiny_forecaster_cfg, activation_inputs):
    """With online statistics the learned part starts at zero, the branch included (an untrained forecaster ranks
    like the online baselines); without them the branch starts random like the head."""
    m = ExpertForecaster(tiny_forecaster_cfg(skip_hidden=8, online_half_lives=[0.0, 16.0]))
    with torch.no_grad():
        learned, _ = m.forward_parts(activation_inputs(1, 4))
    assert float(learned.abs().max()) == 0.0
    assert float(ExpertForecaster(tiny_forecaster_cfg(skip_hidden=8)).skip.out.weight.abs().max()) > 0
