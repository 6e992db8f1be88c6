"""LM data of router adaptation: the training order depends on the data seed only, so modes that build
different auxiliary routers (which draws from the global RNG) still train on the same batches; the
held-out split depends on each text's id only, so it is the same under any --limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from expertcast.train.router_data import (
    LMExample,
    RouterLMDataModule,
    collate,
    load_texts,
    split_heldout,
    text_id,
)
from expertcast.utils.errors import UsageError


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


def test_split_by_text_id_is_stable_under_limit():
    ids = [f"gsm8k-train-{i:05d}" for i in range(400)]
    tr, ho = split_heldout(ids, 0.1, seed=0)
    assert sorted(tr + ho) == list(range(400)) and 20 < len(ho) < 65  # ~10% held out
    held = {ids[i] for i in ho}
    for n in (37, 150, 399):  # a smaller --limit: every text keeps its side
        tr_n, ho_n = split_heldout(ids[:n], 0.1, seed=0)
        assert {ids[i] for i in ho_n} == held & set(ids[:n])
        assert not {ids[i] for i in tr_n} & held
    # order does not matter either, the seed does
    rev = ids[::-1]
    assert {rev[i] for i in split_heldout(rev, 0.1, seed=0)[1]} == held
    assert {ids[i] for i in split_heldout(ids, 0.1, seed=1)[1]} != held


@pytest.mark.parametrize("heldout", [0, 1, 96, -0.1])
def test_heldout_must_be_a_fraction(heldout):
    with pytest.raises(UsageError, match="fraction"):
        RouterLMDataModule(heldout=heldout)


def test_too_few_texts_for_a_split():
    with pytest.raises(UsageError, match="leaves no held-out text"):
        split_heldout(["a"], 0.01, seed=0)


def test_texts_carry_stable_ids(tmp_path, data_dir):
    tok = SimpleNamespace(eos_token="<|im_end|>", chat_template=None)
    small = load_texts("gsm8k", data_dir=str(data_dir), limit=5, tokenizer=tok, chat_format=False)
    large = load_texts("gsm8k", data_dir=str(data_dir), limit=50, tokenizer=tok, chat_format=False)
    assert [t.text_id for t in small] == [t.text_id for t in large[:5]] == [f"gsm8k-train-{i:05d}" for i in range(5)]
    f = tmp_path / "texts.jsonl"
    f.write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n{"text": "alpha beta"}\n', encoding="utf-8")
    texts = load_texts(str(f))
    assert [t.text_id for t in texts] == [text_id("alpha beta"), text_id("gamma"), text_id("alpha beta")]
    assert texts[0].text_id.startswith("text-") and texts[0].text_id != texts[1].text_id


def test_datamodule_exposes_sorted_ids(tmp_path):
    from expertcast.models.tokenizer import byte_level_tokenizer

    f = tmp_path / "texts.jsonl"
    f.write_text("".join(f'{{"text": "text number {i}"}}\n' for i in range(60)), encoding="utf-8")
    dm = RouterLMDataModule(source=str(f), heldout=0.2, max_length=32, tokenizer=None)
    dm.tokenizer = byte_level_tokenizer()
    dm.setup("fit")
    tr, ho = dm.train_ids(), dm.heldout_ids()
    assert tr == sorted(tr) and ho == sorted(ho) and not set(tr) & set(ho)
    assert set(tr) | set(ho) == {text_id(f"text number {i}") for i in range(60)}
    assert {e.seq_id for e in dm.heldout_set} == set(ho)


def test_arith_source_is_its_train_split_prompted_as_eval_prompts_it():
    """``source="arith"``: the benchmark's train problems as chats (the user turn exactly the prompt
    ``eval --benchmark arith`` builds), never a test problem."""
    from expertcast.data import arith
    from expertcast.data.prompts import build_prompt

    tok = SimpleNamespace(eos_token="<|im_end|>", chat_template=None)
    texts = load_texts("arith", limit=40, tokenizer=tok, chat_format=False)
    problems = arith.arith_problems("train", 40)
    assert [t.text_id for t in texts] == [p.id for p in problems]
    assert all(t.prompt == build_prompt(tok, p.question, "arith", use_chat_template=False)
               for t, p in zip(texts, problems, strict=True))
    assert all(t.completion == " " + p.solution + "<|im_end|>" for t, p in zip(texts, problems, strict=True))
    assert not {p.key for p in problems} & {p.key for p in arith.arith_problems("test", 1000)}
