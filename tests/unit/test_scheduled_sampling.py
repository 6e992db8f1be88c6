"""Scheduled sampling with the model's own multi-step rollout: the schedule, which inputs are replaced, that
replaced inputs are exactly the fed-back rollout, and that it beats teacher forcing at long horizons."""

from __future__ import annotations

import pytest
import torch
from expertcast.data.synthetic import ModeMarkovProcess
from expertcast.models.forecaster import (
    ExpertForecaster,
    ForecasterConfig,
    activation_vector,
    predictions_to_input,
)
from expertcast.models.forecaster_recall import evaluate
from expertcast.train.forecaster_module import (
    fit_forecaster,
    rollout_inputs,
    sample_replacements,
    sampling_schedule,
)

torch.set_num_threads(1)


def test_sampling_schedule_teacher_forces_then_ramps_and_caps():
    sched = [sampling_schedule(p, 0.4, 0.4, 0.5) for p in (0.0, 0.39, 0.4, 0.6, 0.8, 1.0)]
    assert sched[:3] == [0.0, 0.0, 0.0]
    assert sched[3] == pytest.approx(0.25) and sched[4] == pytest.approx(0.5) and sched[5] == pytest.approx(0.5)
    assert sampling_schedule(0.9, 0.4, 0.4, 0.0) == 0.0


def test_replacements_spare_segment_starts_and_padding():
    mask = torch.ones(64, 20, dtype=torch.bool)
    mask[:, 15:] = False
    rep = sample_replacements(mask, 1.0, 4)
    pos = torch.arange(20)
    assert torch.equal(rep, ((pos % 4 != 0) & (pos < 15)).expand(64, -1))
    assert not sample_replacements(mask, 0.0, 4).any()
    half = sample_replacements(mask, 0.5, 4, generator=torch.Generator().manual_seed(0))
    seg = half[:, 1::4]  # one decision per (row, segment)
    assert 0.35 < seg[:, :3].float().mean() < 0.65
    assert torch.equal(half[:, 1:4].any(1), half[:, 1:4].all(1))


@pytest.mark.parametrize("direct_horizons", [1, 3])
def test_replaced_inputs_are_the_models_fed_back_rollout(direct_horizons):
    cfg = ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8,
                           num_blocks=1, chunk_size=8, direct_horizons=direct_horizons, online_half_lives=[0.0, 4.0])
    torch.manual_seed(0)
    net = ExpertForecaster(cfg).eval()
    torch.nn.init.normal_(net.head.weight, std=0.3)
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(3 * 13 * 2)]).view(3, 13, 2, 2)
    x = activation_vector(ids, torch.rand(3, 13, 2, 2, generator=g), 8)
    R = 5
    rep = sample_replacements(torch.ones(3, 13, dtype=torch.bool), 0.6, R, generator=g)
    assert rep.any()
    out = rollout_inputs(net, x, rep, R)
    assert torch.equal(out[~rep], x[~rep])
    for b, p in rep.nonzero().tolist():
        s = p - p % R
        st = net.init_state(1)
        for i in range(s + 1):  # the true history up to the segment's first element
            lg, _ = net.step(x[b:b + 1, i], st)
        for _ in range(p - s - 1):  # then the model's own forecasts, fed back
            lg, _ = net.step(predictions_to_input(lg, 2), st)
        assert torch.allclose(out[b, p], predictions_to_input(lg, 2)[0], atol=1e-5), (b, p)
        assert not torch.allclose(out[b, p], x[b, p])


def test_rollout_training_beats_teacher_forcing_at_long_horizons():
    """Known Markov process, next-step head + recursive rollout (direct_horizons 1): trained with the model's own
    rollout as inputs, held-out recall@K at h4 and h8 is above teacher forcing's (measured: h4 0.485 vs 0.452,
    h8 0.475 vs 0.435; Bayes-optimal 0.500 / 0.493)."""
    proc = ModeMarkovProcess.random(num_modes=8, num_layers=2, num_experts=16, top_k=4, stickiness=0.2,
                                    concentration=0.2, seed=0)
    seqs, modes = proc.sample(80, 40, seed=1)
    got = {}
    for name, kw in {"tf": dict(max_sampling_rate=0.0),
                     "ss": dict(max_sampling_rate=0.7, teacher_forcing_fraction=0.2, sampling_ramp_fraction=0.3,
                                sampling_rollout=8)}.items():
        module, dm = fit_forecaster(proc.meta(), seqs, epochs=6, **kw)
        tab = evaluate(module.net, dm.splits["val"], proc.meta(), [], horizons=8, progress=False)
        got[name] = tab["forecaster"].recall("k")
    for h in (4, 8):
        assert got["ss"][h - 1] > got["tf"][h - 1] + 0.015, (h, got)
