"""LM data of router adaptation: the training order depends on the data seed only, so modes that build
different auxiliary routers (which draws from the global RNG) still train on the same batches."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from expertcast.train.router_data import LMExample, RouterLMDataModule, collate, split_heldout


def _order(seed: int) -> list[int]:
    dm = RouterLMDataModule(batch_size=3, seed=seed)
    dm.tokenizer = SimpleNamespace(pad_token_id=0)
    dm.train_set = [LMExample([1], [10 + i]) for i in range(12)]
    return [int(x) for b in dm.train_dataloader() for x in b["input_ids"][:, 1]]


def test_train_order_ignores_global_rng_state():
    torch.manual_seed(0)
    a = _order(0)
    torch.manual_seed(0)
    torch.nn.Linear(128, 32)  # what building a Temporal router bank does to the global RNG
    torch.randn(1000)
    b = _order(0)
    assert a == b
    assert sorted(a) == list(range(10, 22))
    assert a != list(range(10, 22))  # shuffled
    assert _order(1) != a  # the data seed does change it


def test_collate_masks_prompt_and_padding():
    b = collate([LMExample([5, 6], [7, 8, 9]), LMExample([], [4])], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 0, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, -100, 7, 8, 9], [4, -100, -100, -100, -100]]
    assert b["attention_mask"].sum(1).tolist() == [5, 1] and b["prompt_len"].tolist() == [2, 0]
    tr, ho = split_heldout(10, 3, seed=0)
    assert len(ho) == 3 and sorted(tr + ho) == list(range(10)) and split_heldout(10, 3, seed=0) == (tr, ho)
