"""Routing-study JSONL: sequences by (dataset, problem_id), the dataset kept as the source."""

from __future__ import annotations

import numpy as np
import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError


def test_rows_import_with_sources_and_gates(fixtures):
    _, imp = read_traces(fixtures / "gating-jsonl" / "routing.jsonl", "gating-jsonl", ImportOptions(num_experts=8))
    a, b = imp.sequences
    assert (a.seq_id, a.num_tokens, a.source, b.seq_id, b.num_tokens, b.source) == (
        "gsm8k/1", 2, "gsm8k", "math/4", 1, "math")
    assert a.expert_ids[1].tolist() == [[2, 5], [3, 6]] and b.expert_ids[0].tolist() == [[4, 7], [5, 0]]
    np.testing.assert_allclose(a.expert_weights[0, 0].astype(float), [0.625, 0.375])
    assert not imp.phase_known and a.prompt_len == 0


def test_refusal_names_the_line(fixtures):
    with pytest.raises(ImportFormatError, match=r'bad_ids.jsonl:3: experts must be a list of integers, got "3"'):
        read_traces(fixtures / "gating-jsonl" / "bad_ids.jsonl", "gating-jsonl", ImportOptions(num_experts=8))
