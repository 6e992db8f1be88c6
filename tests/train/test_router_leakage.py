"""Prompt leakage of a router-adaptation export (train/router_leakage.py): a prompt whose id is a recorded
training id, or whose question occurs in a recorded training text (under any id), is refused unless
--allow-overlap, which every row then reports; texts of the source that the export did not train on do
not count."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from expertcast.train.router_data import text_id
from expertcast.train.router_leakage import check_prompt_leakage, leaked_prompts, normalise, training_texts
from expertcast.utils.errors import OverlapError

ARITH_Q1 = "Mia has 9 bags with 54 apples in each bag. How many apples does Mia have?"  # arith-test-00001


def _p(pid: str, q: str):
    return SimpleNamespace(id=pid, question=q)


def test_id_and_content_matches():
    training = {"train_ids": ["gsm8k-train-00001", "text-a"], "val_ids": ["text-v"]}
    texts = ["Q: Tom had   THREE apples and ate one.\nHow many are left?  A: 2", "a validation text"]
    problems = [_p("gsm8k-train-00001", "anything"),  # its id is a training id
                _p("x-1", "tom had three apples and ate one. how many are left?"),  # content, case/space differ
                _p("x-2", "Tom had three pears and ate one. How many are left?"),  # not in any text
                _p("x-3", "Tom had"),  # too short to name a problem: id only
                _p("text-v", "unrelated")]  # a validation id counts too
    assert leaked_prompts(problems, training, texts) == ["gsm8k-train-00001", "x-1", "text-v"]
    assert normalise("  A\n\tB  c ") == "a b c"


@pytest.fixture(scope="module")
def leaky_source(tmp_path_factory) -> tuple[Path, list[str]]:
    """A local .jsonl text source holding one arith test question (under a content-hash id) and other texts."""
    d = tmp_path_factory.mktemp("leak_src")
    texts = [f"Question: {ARITH_Q1}\nAnswer: 9 x 54 = 486. #### 486",
             "Question: A farmer has 12 cows and buys 3 more. How many cows?\nAnswer: 15 #### 15",
             "Some plain text about caching experts in a mixture of experts model."]
    src = d / "texts.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return src, texts


@pytest.fixture(scope="module")
def exports(tmp_path_factory, leaky_source):
    """LM-only exports of an untrained tiny preset whose training blocks point at the .jsonl source: one trained
    on every text (leaky), one on the texts without the arith question (clean), one recording nothing."""
    from expertcast.train.router_module import RouterAdaptationModule

    torch.set_num_threads(1)
    src, texts = leaky_source
    root = tmp_path_factory.mktemp("leak_exports")
    module = RouterAdaptationModule(model="qwen3_moe-tiny", mode="lm_only", budget=6)
    all_ids = sorted(text_id(t) for t in texts)
    for name, ids in (("leaky", all_ids), ("clean", sorted(text_id(t) for t in texts[1:])), ("unrecorded", None)):
        block = None if ids is None else {"source": str(src), "dataset_split": "train", "train_ids": ids, "val_ids": []}
        module.export(root / name, training=block)
    return root


def test_check_refuses_then_flags(exports, leaky_source, data_dir):
    from expertcast.data.benchmarks import load_benchmark

    problems = load_benchmark("arith", "test", data_dir=str(data_dir), limit=4)
    assert problems[1].question == ARITH_Q1
    # the recorded texts are reloaded from the source: only the ids the export lists
    src, texts = leaky_source
    got = training_texts({"source": str(src), "train_ids": [text_id(texts[2])]})
    assert len(got) == 1 and "caching experts" in got[0]
    with pytest.raises(OverlapError, match=r"1 of the 4 evaluated prompts are in the training data of export .*leaky "
                                           r"\(arith-test-00001\).*--allow-overlap"):
        check_prompt_leakage(problems, exports / "leaky")
    flagged = check_prompt_leakage(problems, exports / "leaky", allow_overlap=True)
    assert flagged == {"prompt_overlap": 1, "leaked_prompts": ["arith-test-00001"], "allowed": True}
    # the same source, but the export did not train on the text holding the question: no leakage
    assert check_prompt_leakage(problems, exports / "clean")["prompt_overlap"] == 0
    with pytest.raises(OverlapError, match="records no training data"):
        check_prompt_leakage(problems, exports / "unrecorded")
    assert check_prompt_leakage(problems, exports / "unrecorded", allow_overlap=True)["prompt_overlap"] is None


def test_unloadable_training_source_is_refused(exports, tmp_path, data_dir):
    import shutil

    from expertcast.data.benchmarks import load_benchmark

    problems = load_benchmark("arith", "test", data_dir=str(data_dir), limit=2)
    moved = tmp_path / "moved"
    shutil.copytree(exports / "leaky", moved)
    src = Path(json.loads((moved / "export.json").read_text())["training"]["source"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("expertcast.train.router_leakage.recorded_training",
                   lambda d: {"source": str(src.parent / "gone.jsonl"), "train_ids": ["x"]})
        with pytest.raises(OverlapError, match="cannot be reloaded.*not found"):
            check_prompt_leakage(problems, moved)


def test_router_eval_refuses_leaked_prompts(exports, tmp_path, run_router_eval, data_dir):
    # the study's held-out texts are GSM8K's (no id of the .jsonl source): only the prompt check can fire
    argv = ["--limit", "40", "--heldout", "0.25", "--max-length", "64", "--eval-limit", "2", "--batch-size", "2",
            "--benchmark", "arith", "--prompts", "2", "--max-new-tokens", "4"]
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(tmp_path / "c"), *argv])
    assert rc == 0, err
    rows = json.loads((tmp_path / "c" / "all_rows.json").read_text())
    assert {r["prompt_overlap"] for r in rows} == {0} and {r["train_overlap"] for r in rows} == {0}
    rc, err = run_router_eval(["--exports", str(exports / "leaky"), "--out", str(tmp_path / "l"), *argv])
    assert rc == 2 and len(err) == 1 and "1 of the 2 evaluated prompts are in the training data" in err[0], err
    assert not (tmp_path / "l" / "all_rows.json").exists()
    rc, err = run_router_eval(["--exports", str(exports / "leaky"), "--out", str(tmp_path / "l"), *argv, "--allow-overlap"])
    assert rc == 0, err
    rows = json.loads((tmp_path / "l" / "all_rows.json").read_text())
    assert {r["prompt_overlap"] for r in rows} == {1} and all(r["overlap_allowed"] for r in rows)
