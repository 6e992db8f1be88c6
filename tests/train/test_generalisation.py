"""The generalisation protocol: nested stable fit subsets, disjoint fit/eval sets, baselines fitted on the fit set
only while the online ones read the evaluated sequences, and train_sequences in the data module."""

from __future__ import annotations

import pytest
import torch
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.models.forecaster_recall import _frequency
from expertcast.train.forecaster_data import ForecasterDataModule, training_subset
from expertcast.train.generalisation import (
    in_domain_split,
    margin_over_online,
    protocol_rows,
    recall_row,
    train_row_forecaster,
)
from expertcast.utils.errors import OverlapError

torch.set_num_threads(1)


def _sets():
    a = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=0)
    b = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=7, concentration=0.3)
    return a.meta(), a.sample(60, 30, prompt_len=4, seed=1, prefix="a"), b.sample(8, 30, prompt_len=4, seed=2, prefix="b")


def test_fit_subsets_are_nested_stable_and_sized_by_what_the_data_allows():
    meta, fit, ev = _sets()
    rows = protocol_rows("a->b", fit, ev)
    assert [r.n_fit for r in rows] == [10, 50, None] and [len(r.fit) for r in rows] == [10, 50, 60]
    ids = [{s.seq_id for s in r.fit} for r in rows]
    assert ids[0] < ids[1] < ids[2]
    assert [s.seq_id for s in training_subset(list(reversed(fit)), 10)] == [s.seq_id for s in rows[0].fit]
    assert [r.n_fit for r in protocol_rows("small", fit[:30], ev)] == [10, None]
    with pytest.raises(OverlapError):
        protocol_rows("leak", fit, ev + fit[:1])
    f, e = in_domain_split(fit)
    assert f and e and not {s.seq_id for s in f} & {s.seq_id for s in e}


def test_baselines_fit_on_the_fit_set_and_online_ones_read_the_evaluated_sequences():
    meta, fit, ev = _sets()
    row = protocol_rows("a->b", fit, ev, sizes=[10])[0]
    tables = recall_row(None, meta, row, horizons=2)
    assert set(tables) == {"repeat-last", "frequency", "transition", "recent-freq", "recent-count", "cross-layer",
                           "cross-x-recent"}
    # recent-freq and repeat-last read the evaluated sequences: they beat the fit set's frequency on the
    # other process, whose sequences favour their own experts
    assert tables["recent-freq"].recall("k")[0] > tables["frequency"].recall("k")[0] + 0.05
    assert tables["repeat-last"].recall("k")[0] > tables["frequency"].recall("k")[0] + 0.05
    tables["forecaster"] = tables["frequency"]
    assert (margin_over_online(tables) < 0).all()
    # the frequency baseline is the 10 fit sequences' frequency, not the evaluated ones'
    from expertcast.models.forecaster_recall import fit_baselines

    freq = next(b for b in fit_baselines(row.fit, meta, 1) if b.name == "frequency").freq
    assert torch.allclose(freq, _frequency(row.fit, 2, 16, 1))
    assert not torch.allclose(freq, _frequency(ev, 2, 16, 1))


def test_data_module_trains_on_exactly_n_sequences_of_its_training_split():
    meta, fit, _ = _sets()
    full = ForecasterDataModule.from_sequences(meta, fit, window=16, val_fraction=0.2)
    dm = ForecasterDataModule.from_sequences(meta, fit, window=16, val_fraction=0.2, train_sequences=10)
    info = dm.training_info()
    assert len(info["train_ids"]) == 10 and info["val_ids"] == full.training_info()["val_ids"]
    assert set(info["train_ids"]) == {s.seq_id for s in training_subset(full.splits["train"], 10)}


WEIGHTED = ("repeat-last", "recent-freq")


def test_forecaster_reduces_to_the_best_online_baseline_where_its_learned_part_has_nothing_to_add():
    """Cross-domain on real-like sticky routing: fit on one process, evaluate on another whose sequences favour
    their own experts (nothing the fit set teaches carries over; the sequence's own statistics are what
    forecasts it). With the online prior (starting on the recent-freq statistic, per-sequence weighting) and
    the held-out residual scale (and the per-sequence learned gate, as shipped) the forecaster stays within 1 point
    of the best of the weight-averaging online baselines its prior is built from (repeat-last, recent-freq) at
    every horizon 1..8; its learned part at full weight does not (-15..-20 points), and the per-sequence gate
    alone recovers most of that (-2..-5). The membership average (recent-count, 2-3 points above on these traces)
    is reached only through the exact components (this net has none; see test_forecaster_module's
    never-below test)."""
    a = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=0)
    b = StickyRoutingProcess.realistic(num_layers=2, num_experts=16, top_k=2, seed=7, concentration=0.3)
    fit = a.sample(30, 48, prompt_len=4, seed=1, prefix="a")
    ev = b.sample(12, 48, prompt_len=4, seed=2, prefix="b")
    row = protocol_rows("a->b", fit, ev, sizes=[None])[0]
    net = train_row_forecaster(a.meta(), row, max_steps=120, window=48, batch_size=8, hidden_size=32, head_dim=16,
                               state_size=16, num_blocks=1, chunk_size=32, lr=5e-3, kl_weight=0.1, direct_horizons=8,
                               max_sampling_rate=0.0, online_half_lives=[0, 2, 8, 16, 32, 128], prior_start=16,
                               online_hedge_rate=1.0, learned_gate_rate=2.0)
    margin = margin_over_online(recall_row(net, a.meta(), row), baselines=WEIGHTED)
    assert (margin >= -0.01).all(), margin
    net.config.residual_scale = [1.0] * 8  # the learned part at full weight everywhere, no per-sequence gate
    net.config.learned_gate_rate = 0.0
    full = margin_over_online(recall_row(net, a.meta(), row), baselines=WEIGHTED)
    # the per-sequence gate on the learned part recovers most of that loss without any held-out data
    net.config.learned_gate_rate = 2.0
    gated = margin_over_online(recall_row(net, a.meta(), row), baselines=WEIGHTED)
    print("margin (held-out residual scale)", margin.round(4), "| at full weight", full.round(4), "| gated",
          gated.round(4))
    assert full.min() < margin.min() - 0.005, (margin, full)
    assert (gated > full + 0.05).all(), (full, gated)
