"""Forecaster data: whole-sequence batches padded to their own longest sequence (the post-fit selection's input)."""

from __future__ import annotations

import torch
from expertcast.data.synthetic import StickyRoutingProcess
from expertcast.train.forecaster_data import ForecastWindows, whole_sequence_batches


def test_whole_sequence_batches_hold_every_sequence_once_padded_to_their_own_longest():
    proc = StickyRoutingProcess.realistic(num_layers=3, num_experts=16, top_k=2, seed=0)
    seqs = []
    for n, T, seed in ((12, 10, 1), (4, 40, 2), (1, 200, 3), (1, 2, 4)):  # one without a target
        seqs += proc.sample(n, T, prompt_len=2, seed=seed, prefix=f"s{T}")
    seqs = seqs[::3] + seqs[1::3] + seqs[2::3]
    meta = proc.meta()
    longest = max(s.num_tokens for s in seqs)
    padded = ForecastWindows(seqs, meta, window=longest, trigger_layer=1)  # one window per sequence, all padded
    want = {}
    for i in range(len(padded)):
        it = padded[i]
        n = int(it["mask"].sum())
        want[it["target_ids"][:n].numpy().tobytes()] = (it["inputs"][:n], it["target_ids"][:n], it["decode"][:n])
    row = 3 * 16
    for by_length in (True, False):
        got, cells = {}, 0
        for b in whole_sequence_batches(seqs, meta, 1, row, budget=60 * row, by_length=by_length):
            B, W = b["mask"].shape
            assert B == 1 or B * W * row <= 60 * row  # within the budget (one sequence may exceed it alone)
            lengths = b["mask"].sum(1) + 2
            assert B == 1 or int(lengths.max()) <= 2 * int(lengths.min())  # lengths within 2x: padding at most doubles
            assert W == int(b["mask"].sum(1).max()) + 2  # the batch's longest sequence's tokens (targets + s + 1)
            cells += B * W
            for r in range(B):
                n = int(b["mask"][r].sum())
                got[b["target_ids"][r, :n].numpy().tobytes()] = (b["inputs"][r, :n], b["target_ids"][r, :n],
                                                                 b["decode"][r, :n])
        assert len(want) == len(padded) and got.keys() == want.keys()
        for k, (x, t, d) in want.items():
            assert torch.equal(got[k][0], x) and torch.equal(got[k][1], t) and torch.equal(got[k][2], d)
        if by_length:
            assert cells <= 2 * sum(int(padded[i]["mask"].sum()) + 2 for i in range(len(padded)))
            assert cells < len(padded) * longest / 4  # far fewer padded elements than one window of the longest each
    in_order = [b["target_ids"][r, : int(b["mask"][r].sum())] for b in whole_sequence_batches(
        seqs, meta, 1, row, 10**9, by_length=False) for r in range(len(b["mask"]))]
    assert len(in_order) == len(padded)  # by_length=False: the sequences in the given order
    assert all(torch.equal(t, padded[i]["target_ids"][: len(t)]) for i, t in enumerate(in_order))
