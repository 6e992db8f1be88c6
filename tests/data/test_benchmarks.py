"""Benchmark loading (local jsonl, clear errors) and prompt building."""

from __future__ import annotations

import pytest
from expertcast.data.benchmarks import DatasetNotFoundError, gsm8k_gold_answer, load_benchmark
from expertcast.data.prompts import build_prompt, instruction_for


def test_gsm8k_local(data_dir):
    test = load_benchmark("gsm8k", "test", data_dir=data_dir)
    assert len(test) == 1319
    p = test[0]
    assert p.id == "gsm8k-test-00000" and p.benchmark == "gsm8k" and p.split == "test"
    assert p.question.startswith("Janet")
    assert p.answer == "18" and p.solution.rstrip().endswith("#### 18")
    assert len({q.id for q in test}) == 1319
    assert len(load_benchmark("gsm8k", "train", data_dir=data_dir, limit=5)) == 5


def test_math500_local(data_dir):
    probs = load_benchmark("math500", "test", data_dir=data_dir)
    assert len(probs) == 500
    p = probs[0]
    assert p.id == "test/precalculus/807.json"
    assert p.answer == "\\left( 3, \\frac{\\pi}{2} \\right)" and "\\boxed" in p.solution
    assert p.extra == {"subject": "Precalculus", "level": 2}


def test_env_var_is_used(data_dir, monkeypatch):
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    assert len(load_benchmark("math500", limit=3)) == 3


def test_missing_dataset_is_one_clear_line(tmp_path):
    with pytest.raises(DatasetNotFoundError) as ei:
        load_benchmark("gsm8k", "test", data_dir=tmp_path)
    msg = str(ei.value)
    assert "\n" not in msg
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg and "EXPERTCAST_DATA_DIR" in msg


def test_hub_failure_is_one_clear_line(monkeypatch):
    # HF_HUB_OFFLINE=1 in the test suite: the Hub path fails and must say what it tried
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DatasetNotFoundError) as ei:
        load_benchmark("math500", "test", use_hub=True)
    msg = str(ei.value)
    assert "\n" not in msg and "HuggingFaceH4/MATH-500" in msg


def test_bad_names():
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k")
    with pytest.raises(ValueError, match="no split 'train'"):
        load_benchmark("math500", "train")


def test_corrupt_jsonl_names_line(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "a #### 1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"test.jsonl:2: not valid JSON"):
        load_benchmark("gsm8k", "test", data_dir=tmp_path)
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "solution": "x"}\n')
    with pytest.raises(ValueError, match="no field 'answer'"):
        load_benchmark("gsm8k", "test", data_dir=tmp_path)


def test_gsm8k_gold_answer():
    assert gsm8k_gold_answer("so 1,000 apples\n#### 1,000") == "1000"
    with pytest.raises(ValueError, match="no '#### answer'"):
        gsm8k_gold_answer("no marker")


class _NoTemplate:
    chat_template = None


def test_plain_prompt():
    s = build_prompt(_NoTemplate(), "  What is 2+2? ", "gsm8k")
    assert s.endswith("Question: What is 2+2?\nAnswer:")
    assert "####" in s and "\\boxed{}" in s
    assert "\\boxed{}" in build_prompt(None, "x", "math500")


def test_chat_template_prompt():
    from expertcast.models.tokenizer import byte_level_tokenizer

    tok = byte_level_tokenizer()
    s = build_prompt(tok, "What is 2+2?", "math500")
    assert s.startswith("<|im_start|>user\nWhat is 2+2?")
    assert instruction_for("math500") in s
    assert s.endswith("<|im_start|>assistant\n")  # add_generation_prompt=True
    assert build_prompt(tok, "q", "gsm8k", use_chat_template=False).endswith("Question: q\nAnswer:")
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt(_NoTemplate(), "q", use_chat_template=True)
