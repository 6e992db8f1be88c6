"""Within-token reach (models/forecaster_recall.py, docs/design.md "Generalisation protocol"): the same token's earlier
layers as predictors of a layer's routing, their tables fitted on other sequences."""

from __future__ import annotations

import numpy as np
import torch
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.data.trace_format import TraceSequence
from expertcast.models.forecaster_components import fit_within_token
from expertcast.models.forecaster_recall import within_token_reach


def _seq(ids: list, prompt: int = 0) -> TraceSequence:
    a = np.asarray(ids, dtype=np.int16)
    return TraceSequence("s", np.zeros(a.shape[0], dtype=np.int32), prompt, a, np.ones(a.shape, dtype=np.float16))


def test_within_token_table_counts_pairs_of_the_same_position_from_each_layers_source():
    # 3 positions, L = 3, K = 1, E = 4; sources: layer 1 <- layer 0, layer 2 <- layer 0 (layer 0 has none)
    s = _seq([[[0], [1], [2]], [[0], [1], [3]], [[2], [3], [3]]])
    W = fit_within_token([s], 3, 4, [-1, 0, 0], alpha=0.0 + 1e-9)
    assert torch.allclose(W[1, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]), atol=1e-6)  # 0 -> 1 twice
    assert torch.allclose(W[1, 2], torch.tensor([0.0, 0.0, 0.0, 1.0]), atol=1e-6)  # 2 -> 3 once
    assert torch.allclose(W[2, 0], torch.tensor([0.0, 0.0, 0.5, 0.5]), atol=1e-6)  # 0 -> 2, 0 -> 3
    assert torch.allclose(W[0], torch.full((4, 4), 0.25))  # no source: uniform rows
    assert torch.allclose(W[1, 1], torch.full((4,), 0.25))  # never a source at layer 0: uniform
    # the layer before: layer 2 <- layer 1 (1 -> 2, 1 -> 3, 3 -> 3)
    W1 = fit_within_token([s], 3, 4, [-1, 0, 1], alpha=1e-9)
    assert torch.allclose(W1[2, 1], torch.tensor([0.0, 0.0, 0.5, 0.5]), atol=1e-6)
    assert torch.allclose(W1[2, 3], torch.tensor([0.0, 0.0, 0.0, 1.0]), atol=1e-6)


def _reach(cross: float) -> dict:
    proc = StickyRoutingProcess.realistic(num_layers=8, num_experts=16, top_k=2, seed=3, cross_layer=cross)
    fit = proc.sample(30, 40, prompt_len=8, seed=1)
    held = proc.sample(10, 40, prompt_len=8, seed=2)
    meta = proc.meta()
    return within_token_reach(fit, held, meta, p=0)


def test_reach_finds_the_layer_before_where_the_routing_chains_across_layers_and_nothing_where_it_does_not():
    chained = _reach(0.9)
    assert chained["layers"] == [4, 7]  # the largest distance kept (4 < L = 8; 8 is not), every source exists
    assert chained["targets"] == 10 * 32 * 4  # 10 sequences x 32 decode positions x 4 layers
    r = {row["predictor"]: row["R@K"] for row in chained["rows"]}
    assert set(r) == {"repeat-last", "recent-freq", "layer 0 (trigger)", "layer 0 (trigger) x recent", "1 back",
                      "1 back x recent", "2 back", "2 back x recent", "4 back", "4 back x recent"}
    # each of layer l-1's experts puts its successor into layer l with probability .9: the layer before tells most,
    # and what a layer tells fades with its distance (layer 0 is 4-7 layers before the targets)
    assert r["1 back"] > 0.6 and r["1 back"] > r["2 back"] > r["4 back"] > r["layer 0 (trigger)"]
    assert r["1 back"] > r["layer 0 (trigger)"] + 0.1 and r["1 back"] > r["recent-freq"] + 0.2
    independent = {row["predictor"]: row["R@K"] for row in _reach(0.0)["rows"]}
    # layers step independently: the same token's earlier layers tell nothing the sequence's own usage does not
    assert independent["1 back"] < independent["recent-freq"] - 0.05
    assert abs(independent["1 back x recent"] - independent["recent-freq"]) < 0.05
