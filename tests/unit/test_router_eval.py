"""Table assembly of `expertcast router-eval`: which R a table shows, and the same-weights LRU delta."""

from __future__ import annotations

import math

import pytest
from expertcast.train.router_eval import _base_budget, _table_R, add_lru_deltas


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
    from expertcast.train.router_eval import add_lm_only_refs, greedy_agreement

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
