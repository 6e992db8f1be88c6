"""The held-out routing statistics of the default model's build report, on known values."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.recipes import tiny_default_eval as tde


def test_routing_stats_known_values():
    # One layer, E=4, K=2. Sequence: {0,1},{0,1},{2,3}: usage uniform (1 each of 4 -> entropy 1, share
    # 1/4 ... counts 0:2,1:2,2:1,3:1), overlaps 2/2 then 0/2.
    r = np.array([[[0, 1]], [[1, 0]], [[2, 3]]], dtype=np.int16)
    (row,) = tde.routing_stats([r], num_experts=4)
    p = np.array([2, 2, 1, 1]) / 6
    assert row["entropy_norm"] == pytest.approx(float(-(p * np.log(p)).sum() / np.log(4)))
    assert row["max_share"] == pytest.approx(2 / 6)
    assert row["overlap"] == pytest.approx((2 + 0) / (2 * 2))
    # Overlap never crosses sequence boundaries.
    (row2,) = tde.routing_stats([r[:2], r[2:]], num_experts=4)
    assert row2["overlap"] == pytest.approx(1.0)
