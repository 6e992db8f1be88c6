"""Fit/eval splits of imported traces: by hash of the sequence id (what the generalisation protocol used before),
and by source (a domain shift)."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.trace_format import TraceSequence
from expertcast.data.trace_split import split_by_hash, split_by_source
from expertcast.utils.errors import UsageError
from expertcast.utils.provenance import split_of


def _seqs(sources):
    ids = np.zeros((2, 1, 1), dtype=np.int16)
    return [TraceSequence(f"s{i}", np.zeros(2, np.int32), 0, ids, np.ones((2, 1, 1), np.float16), source=src)
            for i, src in enumerate(sources)]


def test_split_by_hash_is_the_split_of_assignment():
    from expertcast.train.generalisation import in_domain_split

    seqs = _seqs([None] * 40)
    fit, ev = split_by_hash(seqs, 0.25, seed=3)
    assert [s.seq_id for s in ev] == [s.seq_id for s in seqs if split_of(s.seq_id, 0.25, seed=3) == "val"]
    assert 0 < len(ev) < 40 and len(fit) + len(ev) == 40
    f2, e2 = in_domain_split(seqs, 0.25, seed=3)
    assert [s.seq_id for s in f2] == [s.seq_id for s in fit] and [s.seq_id for s in e2] == [s.seq_id for s in ev]


def test_split_by_source():
    seqs = _seqs(["gsm8k", "math", "cot", "gsm8k", "cot"])
    fit, ev = split_by_source(seqs, ["cot"])
    assert [s.seq_id for s in ev] == ["s2", "s4"] and [s.seq_id for s in fit] == ["s0", "s1", "s3"]
    fit, ev = split_by_source(seqs, ["cot"], fit_sources=["gsm8k"])
    assert [s.seq_id for s in fit] == ["s0", "s3"]
    with pytest.raises(UsageError, match=r"source\(s\) chat not in the traces \(their sources: cot, gsm8k, math\)"):
        split_by_source(seqs, ["chat"])
    with pytest.raises(UsageError, match="named for both fit and eval"):
        split_by_source(seqs, ["cot"], fit_sources=["cot", "math"])
    with pytest.raises(UsageError, match="needs sequences on both sides"):
        split_by_source(_seqs(["a", "a"]), ["a"])
    with pytest.raises(UsageError, match="sequence 's1' records no source"):
        split_by_source(_seqs(["a", None]), ["a"])
