"""The SAEM stages study's policies: the ``static`` baseline takes integer calibration counts, unknown labels are
refused."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.inference.saem.cues import counts_from_frequency
from expertcast.recipes.saem_eval import make_policies


def test_eval_static_baseline_needs_counts():
    freq = np.array([[0.5, 0.25, 0.125, 0.125]])
    cnt = counts_from_frequency(freq, 1000)
    assert cnt.tolist() == [[500, 250, 125, 125]]
    pols = make_policies(["Wait"], lambda i: b"x", freq, cnt, names=["static", "lru"])
    assert [p.label for p in pols] == ["static", "lru"]
    assert pols[0].freq.tolist() == cnt.tolist()
    with pytest.raises(ValueError, match="int selection counts"):
        make_policies(["Wait"], lambda i: b"x", freq, freq, names=["static"])
    with pytest.raises(ValueError, match="unknown"):
        make_policies(["Wait"], lambda i: b"x", freq, cnt, names=["mru"])
