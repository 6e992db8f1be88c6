"""The held-out residual scale: the grid choice per head, its validation, the Lightning fit writing it into the
config only when fitting ends (from the last validation), and the export keeping it."""

from __future__ import annotations

import lightning as pl
import pytest
import torch
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.forecaster_export import load_forecaster, save_forecaster
from expertcast.train.forecaster_data import ForecasterDataModule
from expertcast.train.forecaster_module import RESIDUAL_GRID, ForecasterModule, ResidualScaleFit

torch.set_num_threads(1)


def test_residual_fit_picks_the_best_alpha_per_head_and_the_smallest_on_ties():
    L, E, K, W = 1, 6, 2, 5
    tgt = torch.zeros(1, W, L, K, dtype=torch.long)
    tgt[..., 0], tgt[..., 1] = 0, 1  # every target: experts {0, 1}
    prior = torch.zeros(1, W, 2, L, E)
    prior[..., 2:4] = 1.0  # the prior ranks {2, 3} first: recall 0
    learned = torch.zeros(1, W, 2, L, E)
    learned[:, :, 0, :, :2] = 3.0  # head 0's learned part fixes it once alpha > 1/3
    fit = ResidualScaleFit(2, K)
    fit.add(learned, prior, tgt, torch.ones(1, W, dtype=torch.bool))
    assert fit.result() == [0.5, 0.0]  # head 1: every alpha ties (learned part zero) -> the smallest
    assert fit.count.tolist() == [W, W - 1]  # head j is scored on the targets j positions later
    with pytest.raises(ValueError, match="residual_scale"):
        ForecasterConfig(num_layers=1, num_experts=6, top_k=2, direct_horizons=2, residual_scale=[1.0])
    with pytest.raises(ValueError, match="residual_scale"):
        ForecasterConfig(num_layers=1, num_experts=6, top_k=2, direct_horizons=1, residual_scale=[1.5])


def test_residual_scale_scales_only_the_learned_logits():
    cfg = ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=32, head_dim=16, state_size=8,
                           num_blocks=1, direct_horizons=2, online_half_lives=[0.0, 4.0])
    m = ExpertForecaster(cfg).eval()
    torch.nn.init.normal_(m.head.weight, std=0.3)
    x = torch.rand(2, 6, 2, 8)
    with torch.no_grad():
        learned, prior = m.forward_parts(x)
        m.config.residual_scale = [0.0, 0.5]
        out = m(x, all_horizons=True)
    assert torch.allclose(out[:, :, 0], prior[:, :, 0], atol=1e-6)
    assert torch.allclose(out[:, :, 1], 0.5 * learned[:, :, 1] + prior[:, :, 1], atol=1e-6)


def test_lightning_fit_applies_the_last_validations_choice_at_the_end_and_the_export_keeps_it(tmp_path):
    proc = StickyRoutingProcess.realistic(num_layers=2, num_experts=8, top_k=2, seed=0)
    seqs = proc.sample(24, 20, prompt_len=2, seed=1)
    dm = ForecasterDataModule.from_sequences(proc.meta(), seqs, window=16, batch_size=8, val_fraction=0.3)
    module = ForecasterModule(hidden_size=32, head_dim=16, state_size=8, num_blocks=1, chunk_size=16, direct_horizons=3,
                              online_half_lives=[0.0, 4.0, 16.0], prior_start=16.0, online_hedge_rate=1.0,
                              max_sampling_rate=0.0)
    seen: list = []

    class Spy(pl.Callback):
        def on_validation_end(self, trainer, pl_module):  # never applied while training goes on
            seen.append(pl_module.net.config.residual_scale)

    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Spy()])
    trainer.fit(module, dm)
    rs = module.net.config.residual_scale
    assert seen and all(s is None for s in seen)
    assert rs is not None and len(rs) == 3 and all(a in RESIDUAL_GRID for a in rs)
    assert rs == module._residual_scale
    exp = load_forecaster(save_forecaster(module.net, tmp_path / "exp"))
    assert exp.config.residual_scale == rs and exp.config.online_hedge_rate == 1.0
    x = torch.rand(1, 7, 2, 8)
    with torch.no_grad():
        assert torch.equal(exp.model(x, all_horizons=True), module.net.eval()(x, all_horizons=True))
