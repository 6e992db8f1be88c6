"""Table assembly of `expertcast router-eval`: which R a table shows, and the same-weights LRU delta."""

from __future__ import annotations

import math

import pytest
from expertcast.commands.router_eval import _base_budget, _table_R, add_lru_deltas


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


def test_study_runs_take_the_base_sw():
    from expertcast.commands.router_eval import StudyConfig, select_runs, study_runs

    runs = {r.name: r for r in study_runs([0.3], [], 0.25, base_sw=1.0)}
    assert {n: (r.mode, r.sw) for n, r in runs.items() if n != "lm_only"} == {
        "aux_temporal_sw1": ("aux_only", 1.0), "aux_full_sw1": ("aux_only", 1.0), "temporal_sw1": ("temporal", 1.0),
        "full_sw1": ("full", 1.0), "spatio_sw1": ("spatio_only", 1.0), "temporal_sw0.3": ("temporal", 0.3),
        "full_sw0.3": ("full", 0.3)}
    assert runs["lm_only"].sw == 0.0
    cfg = StudyConfig(sw=1.0, sw_sweep=[], modes=["lm_only", "spatio_sw1"])
    assert [(r.name, r.sw) for r in select_runs(cfg)] == [("lm_only", 0.0), ("spatio_sw1", 1.0)]
    # the decode batch is part of what the cached evaluation is keyed by
    assert StudyConfig().decode_settings()["decode_batch_size"] == 1
    assert StudyConfig(decode_batch_size=4).decode_settings()["decode_batch_size"] == 4


def _study(d, seed, rows, **settings):
    import json
    from dataclasses import replace

    from expertcast.commands.router_eval import STUDY, StudyConfig

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
