"""Table assembly of `expertcast router-eval`: which R a table shows, and the same-weights LRU delta.

`expertcast router-eval`: evaluates held-out texts only and checks them against the export's training
texts (refused unless --allow-overlap, which every row reports); bad inputs are one line and exit 2; with
--wandb (offline) the study's table (every row, in the order of all_rows.json) and its plot reach the W&B run.

The exports are written by RouterAdaptationModule.export on an untrained tiny preset (an LM-only run
of zero steps), so only the evaluation path runs here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from expertcast.commands.router_eval import _base_budget, _table_R, add_lru_deltas
from expertcast.train.router_data import split_heldout


def _row(run, policy, hit, B=8, R="-"):
    return {"run": run, "policy": policy, "hit": hit, "B": B, "R": R}


def test_table_R_is_closest_to_three_quarters_of_B():
    rows = [_row("full", "router-full", 0.7, R=R) for R in (2, 4, 6, 8)] + [_row("full", "lru", 0.6)]
    assert _table_R(rows, "full", 8) == 6
    rows4 = [_row("full_B4", "router-full", 0.7, B=4, R=R) for R in (2, 4)]
    assert _table_R(rows4, "full_B4", 4) == 4  # 0.75*4 = 3: 2 and 4 tie, the larger wins
    assert _table_R(rows, "temporal", 8) == "-"


def test_lru_delta_compares_same_run_and_budget():
    rows = [_row("a", "lru", 0.60), _row("a", "router-temporal", 0.65),
            _row("a", "lru", 0.40, B=4), _row("a", "router-temporal", 0.38, B=4),
            _row("b", "router-full", 0.9, R=6)]
    add_lru_deltas(rows)
    assert rows[1]["d_hit_vs_lru_pts"] == pytest.approx(5.0)
    assert rows[3]["d_hit_vs_lru_pts"] == pytest.approx(-2.0)  # B=4 row against B=4 LRU, not B=8
    assert rows[0]["d_hit_vs_lru_pts"] == 0.0
    assert math.isnan(rows[4]["d_hit_vs_lru_pts"])  # no LRU on run b
    assert _base_budget(rows) == 8


def test_gain_against_lm_only_lru_and_greedy_agreement():
    from expertcast.commands.router_eval import add_lm_only_refs, greedy_agreement

    rows = [{**_row("lm", "lru", 0.50), "train_mode": "lm_only", "heldout_lm": 2.0},
            {**_row("t", "lru", 0.55), "train_mode": "temporal", "heldout_lm": 2.02},
            {**_row("t", "router-temporal", 0.61), "train_mode": "temporal", "heldout_lm": 2.02}]
    add_lru_deltas(rows)
    assert rows[2]["d_hit_vs_lru_pts"] == pytest.approx(6.0)  # the router's own gain (same weights)
    assert rows[2]["d_hit_vs_lm_only_lru_pts"] == pytest.approx(11.0)  # router + backbone
    add_lm_only_refs(rows, {"lm": [[1, 2, 3, 4]], "t": [[1, 2, 9]]})
    assert rows[1]["lm_vs_lm_only_pct"] == pytest.approx(1.0)
    assert rows[0]["agree_lm_only"] == 1.0 and rows[2]["agree_lm_only"] == pytest.approx(0.5)  # 2 of 4 positions
    assert greedy_agreement([[5], [1, 2]], [[5], [2, 1]]) == pytest.approx(0.5)


def _study(d, seed, rows, **settings):
    import json
    from dataclasses import replace

    from expertcast.commands.router_study import STUDY, StudyConfig

    d.mkdir()
    (d / "table2.json").write_text(json.dumps([{**r, "seed": seed} for r in rows]))
    cfg = replace(StudyConfig(), seed=seed, **settings)
    (d / STUDY).write_text(json.dumps({"settings": cfg.study_settings()}))
    return d


def _full(run, policy, hit, lm, acc, R="-"):
    return {"run": run, "policy": policy, "B": 8, "R": R, "sw": 1.0, "hit": hit, "d_hit_vs_lru_pts": 0.0,
            "d_hit_vs_lm_only_lru_pts": 0.0, "adj_hit": hit, "mb_per_token": 1.0, "accuracy": acc, "heldout_lm": lm,
            "lm_vs_lm_only_pct": 0.0, "identical_to_full": True, "train_overlap": 0, "prompt_overlap": 0, "prompts": 4}


def test_combine_seeds_mean_and_spread(tmp_path, capsys):
    import json

    from expertcast.commands.router_eval import main

    a = _study(tmp_path / "s0", 0, [_full("lm_only", "lru", 0.50, 2.0, 0.10), _full("t", "router-temporal", 0.80, 2.02, 0.10),
                                    _full("f", "router-full", 0.9, 2.1, 0.0, R=6)])
    b = _study(tmp_path / "s1", 1, [_full("lm_only", "lru", 0.54, 2.2, 0.20), _full("t", "router-temporal", 0.70, 2.2, 0.05)])
    rc = main(["--combine", str(a), str(b), "--out", str(tmp_path / "c")])
    assert rc == 0
    rows = json.loads((tmp_path / "c" / "table2_seeds.json").read_text())
    assert [(r["run"], r["policy"]) for r in rows] == [("lm_only", "lru"), ("t", "router-temporal")]  # rows in both
    t = rows[1]
    assert t["seeds"] == "0,1" and t["hit"] == pytest.approx(0.75) and t["hit_spread"] == pytest.approx(0.10)
    assert t["accuracy_spread"] == pytest.approx(0.05) and t["heldout_lm_by_seed"] == pytest.approx([2.02, 2.2])
    assert (tmp_path / "c" / "table2_seeds.csv").is_file()
    assert "Table 2 over seeds 0,1" in capsys.readouterr().out


@pytest.mark.parametrize("case,words", [("same_seed", "repeat a seed"), ("one", "two or more"),
                                        ("missing", "holds no table2.json"), ("disjoint", "share no")])
def test_combine_seeds_bad_input(tmp_path, capsys, case, words):
    from expertcast.commands.router_eval import main

    a = _study(tmp_path / "s0", 0, [_full("lm_only", "lru", 0.5, 2.0, 0.1)])
    other = {"same_seed": lambda: [_study(tmp_path / "s1", 0, [_full("lm_only", "lru", 0.5, 2.0, 0.1)])],
             "one": lambda: [], "missing": lambda: [tmp_path / "nothing"],
             "disjoint": lambda: [_study(tmp_path / "s1", 1, [_full("x", "lru", 0.5, 2.0, 0.1)])]}[case]()
    capsys.readouterr()
    rc = main(["--combine", str(a), *map(str, other), "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "c").exists()  # refused before the output folder is claimed


@pytest.mark.parametrize("case,words", [
    ("steps", "steps: 150 vs 10"), ("lr", "lr: 0.0005 vs 0.001"), ("prompts", "prompts: 32 vs 8"),
    ("max_new_tokens", "max_new_tokens: 64 vs 16"), ("no_settings", "holds no study.json"),
    ("not_json", "is not a readable JSON table"), ("object", "is not a list of Table 2 rows"),
    ("no_seed", "row 0 has no seed")])
def test_combine_seeds_refuses_other_settings_and_bad_tables(tmp_path, capsys, case, words):
    """Only the seed may differ between combined studies; a broken table2.json is one line, not a traceback."""
    import json

    from expertcast.commands.router_eval import main

    a = _study(tmp_path / "s0", 0, [_full("lm_only", "lru", 0.5, 2.0, 0.1)])
    other = {"steps": {"steps": 10}, "lr": {"lr": 1e-3}, "prompts": {"prompts": 8},
             "max_new_tokens": {"max_new_tokens": 16}}.get(case, {})
    b = _study(tmp_path / "s1", 1, [_full("lm_only", "lru", 0.6, 2.0, 0.1)], **other)
    if case == "no_settings":
        (b / "study.json").unlink()
    elif case == "not_json":
        (b / "table2.json").write_text("{not json")
    elif case == "object":
        (b / "table2.json").write_text(json.dumps({"rows": []}))
    elif case == "no_seed":
        (b / "table2.json").write_text(json.dumps([_full("lm_only", "lru", 0.6, 2.0, 0.1)]))
    capsys.readouterr()
    rc = main(["--combine", str(a), str(b), "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "c").exists()


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
    from expertcast.utils.provenance import verify_export_manifest

    [used] = [a for a in offline_contents(runs[0], lambda c: any(a["used"] for a in c["artifacts"]))["artifacts"]
              if a["used"]]  # the lineage: the evaluated export, by its export hash
    assert used["type"] == "router-export" and used["sha256"] == verify_export_manifest(exports / "clean")
    assert used["path"] == str((exports / "clean").resolve())


def test_without_wandb_no_run_is_made(exports, tmp_path, wandb_dir, data_dir, run_router_eval):
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--out", str(tmp_path / "study"), *EVAL])
    assert rc == 0, err
    assert not (wandb_dir / "wandb").exists() or not list((wandb_dir / "wandb").glob("offline-run-*"))


def test_an_export_of_another_base_is_refused_unless_allowed(exports, tmp_path, run_router_eval, data_dir):
    """--model names the base the given exports must have been adapted from: another base is another routing."""
    rc, err = run_router_eval(["--exports", str(exports / "clean"), "--model", "mixtral-tiny",
                               "--out", str(tmp_path / "o"), *EVAL])
    assert rc == 2 and len(err) == 1 and "was fitted on model 'qwen3_moe-tiny'" in err[0], err
    assert "'mixtral-tiny'" in err[0] and "--allow-model-mismatch" in err[0]
    assert not (tmp_path / "o").exists()
    from expertcast.commands.router_eval import check_export_models, given_exports

    same = check_export_models(given_exports([str(exports / "clean")]), "qwen3_moe-tiny", 0, False)
    assert same["clean"]["model_match"] is True
    allowed = check_export_models(given_exports([str(exports / "clean")]), "mixtral-tiny", 0, True)
    assert allowed["clean"]["model_match"] is False and allowed["clean"]["model_mismatch_allowed"] is True
