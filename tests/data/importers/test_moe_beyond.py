"""MoE-Beyond per-prompt CSV files: a folder of files, one sequence each, positions by (batch, token)."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.trace_import import ImportFormatError


def test_folder_of_prompts(fixtures):
    _, imp = read_traces(fixtures / "moe-beyond", "moe-beyond", ImportOptions(num_experts=8))
    a, b = imp.sequences
    assert (a.seq_id, a.num_tokens, b.seq_id, b.num_tokens) == ("prompt_7", 2, "prompt_9", 3)
    assert (imp.num_layers, imp.top_k, imp.phase_known) == (2, 2, False)
    assert b.expert_ids.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 3], [5, 7]]]


def test_refusal_names_the_line(fixtures):
    with pytest.raises(ImportFormatError, match=r"prompt_1.csv:2: experts must be a list of integers, got 1.5"):
        read_traces(fixtures / "moe-beyond-bad", "moe-beyond", ImportOptions(num_experts=8))
