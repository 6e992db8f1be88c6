"""`expertcast router-eval`: evaluates held-out texts only and checks them against the export's training
texts (refused unless --allow-overlap, which every row reports); bad inputs are one line and exit 2; with
--wandb (offline) the study's table (every row, in the order of all_rows.json) and its plot reach the W&B run.

The exports are written by RouterAdaptationModule.export on an untrained tiny preset (an LM-only run
of zero steps), so only the evaluation path runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from expertcast.train.router_data import split_heldout

LIMIT, HELDOUT = 40, 0.25
IDS = [f"gsm8k-train-{i:05d}" for i in range(LIMIT)]
TRAIN = [IDS[i] for i in split_heldout(IDS, HELDOUT, seed=0)[0]]
EVAL = ["--limit", str(LIMIT), "--heldout", str(HELDOUT), "--max-length", "64", "--eval-limit", "4",
        "--batch-size", "4", "--benchmark", "arith", "--prompts", "2", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Exports whose training block lists the train side only, every text, or nothing."""
    from expertcast.train.router_module import RouterAdaptationModule

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("router_exports")
    module = RouterAdaptationModule(model="qwen3_moe-tiny", mode="lm_only", budget=6)
    for name, train_ids in (("clean", TRAIN), ("leaky", IDS), ("unrecorded", None)):
        block = None if train_ids is None else {"source": "gsm8k", "train_ids": sorted(train_ids), "val_ids": []}
        module.export(root / name, training=block)
    return root


def test_heldout_texts_only_and_overlap_reported(exports, tmp_path, run_router_eval, data_dir):
    out = tmp_path / "study"
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(out), *EVAL])
    assert rc == 0, err
    rows = json.loads((out / "all_rows.json").read_text())
    assert [r["policy"] for r in rows] == ["lru", "static"]  # an LM-only run: LRU and static placement
    for row in rows:
        assert row["train_overlap"] == 0 and row["overlap_allowed"] is False and row["heldout_texts"] == 4
        assert 0 < row["hit"] <= 1 and row["heldout_lm"] > 0 and row["prompts"] == 2
        assert row["identical_to_full"] is True and row["agree_lm_only"] == 1.0
        assert row["decode_batch_size"] == 1 and row["prompt_overlap"] == 0  # one sequence owns the B slots
    # a second run reuses the cached evaluation (same settings key)
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(out), *EVAL])
    assert rc == 0 and json.loads((out / "all_rows.json").read_text()) == rows
    # another --limit keeps every held-out text held out: the check still passes
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(tmp_path / "l30"), *EVAL,
                               "--limit", "30"])
    assert rc == 0, err
    # prompts decoded two at a time: offloading still changes no token; the rows say so (a separate cached evaluation)
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(tmp_path / "b2"), *EVAL,
                               "--decode-batch-size", "2"])
    assert rc == 0, err
    rows2 = json.loads((tmp_path / "b2" / "all_rows.json").read_text())
    assert [r["decode_batch_size"] for r in rows2] == [2, 2] and all(r["identical_to_full"] for r in rows2)
    # evaluating on texts the export trained on is refused, naming the export ...
    rc, err = run_router_eval(["--exports", str(exports / "leaky"), "--out", str(tmp_path / "leak"), *EVAL])
    assert rc == 2 and len(err) == 1 and "were used to train export" in err[0] and "--allow-overlap" in err[0], err
    assert not (tmp_path / "leak" / "all_rows.json").exists()
    # ... unless allowed, and then every row says so
    rc, err = run_router_eval(["--exports", str(exports / "leaky"), "--out", str(tmp_path / "leak"), *EVAL,
                               "--allow-overlap"])
    assert rc == 0, err
    row = json.loads((tmp_path / "leak" / "all_rows.json").read_text())[0]
    assert row["train_overlap"] == 4 and row["overlap_allowed"] is True
    # another evaluation setting on the same output folder is refused, not mixed in
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(out), *EVAL, "--max-length", "48"])
    assert rc == 2 and "cannot resume" in err[-1] and "max_length: 64 (saved) vs 48 (now)" in err[-1], err


BAD = [
    (["--exports", "{tmp}/missing"], "is not a folder"),
    (["--exports", "{tmp}"], "export.json is missing"),
    (["--exports", "{x}/unrecorded"], "records no training sequence ids"),
    (["--exports", "{x}/altered"], "was modified after export"),
    (["--exports", "{x}/clean", "{x}/clean"], "two exports are named 'clean'"),
    (["--modes", "bogus"], "unknown run names bogus"),
    (["--heldout", "96"], "expected a fraction in (0, 1)"),
    (["--exports", "{x}/clean", "--benchmark", "nosuch"], "unknown benchmark 'nosuch'"),
    (["--steps", "0"], "expected a positive integer"),
    (["--budget", "-1"], "expected a finite positive number"),
    (["--R", "x"], "expected a positive integer"),
    (["--model", "./nope", "--modes", "lm_only"], "no such local directory"),
    (["--model", "qwen3_moe-tiny", "--modes", "lm_only", "--out", "."], "current working directory"),
    (["--out-dir", "x"], "unrecognized arguments: --out-dir"),
]


@pytest.mark.parametrize("argv,words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_one_line_and_exit_2(exports, tmp_path, monkeypatch, run_router_eval, argv, words):
    import shutil

    if not (exports / "altered").exists():
        shutil.copytree(exports / "clean", exports / "altered")
        info = json.loads((exports / "altered" / "export.json").read_text())
        info["budget"] = 8
        (exports / "altered" / "export.json").write_text(json.dumps(info))
    monkeypatch.chdir(tmp_path)
    rc, err = run_router_eval(EVAL + [a.format(tmp=tmp_path, x=exports) for a in argv])
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("expertcast router-eval: error:") and words in err[0], err[0]


def test_router_eval_logs_its_table_and_plot_offline(exports, tmp_path, wandb_dir, data_dir, offline_contents, run_router_eval):
    out = tmp_path / "study"
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(out), *EVAL, "--wandb",
                               "--wandb-project", "t"])
    assert rc == 0, err
    runs = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one run of the command
    got = offline_contents(runs[0], lambda c: any("table2" in Path(t).name for t in c["tables"]) and c["images"])
    [table] = [t for t in got["tables"] if "table2" in Path(t).name]
    logged = json.loads((runs[0] / table).read_text())
    rows = json.loads((out / "all_rows.json").read_text())
    cols = logged["columns"]
    assert {"run", "policy", "hit", "heldout_lm", "train_overlap"} <= set(cols)
    assert [r[cols.index("policy")] for r in logged["data"]] == [r["policy"] for r in rows] == ["lru", "static"]
    assert [r[cols.index("hit")] for r in logged["data"]] == pytest.approx([r["hit"] for r in rows])
    assert [r[cols.index("run")] for r in logged["data"]] == ["clean", "clean"]  # the run: the export folder's name
    assert any(Path(i).name.startswith("router_eval") or "plot" in Path(i).name for i in got["images"]), got["images"]


def test_without_wandb_no_run_is_made(exports, tmp_path, wandb_dir, data_dir, run_router_eval):
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(tmp_path / "study"), *EVAL])
    assert rc == 0, err
    assert not (wandb_dir / "wandb").exists() or not list((wandb_dir / "wandb").glob("offline-run-*"))
