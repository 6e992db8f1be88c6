"""llama.cpp moe-trace CSV: the indexed header (phase, token, rank) and the upstream layer,expert rows."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.utils.errors import UsageError


def test_indexed_rows_keep_phase_and_moe_layers(fixtures):
    _, imp = read_traces(fixtures / "llamacpp" / "indexed.csv", "llamacpp", ImportOptions(num_experts=8))
    (s,) = imp.sequences
    assert (s.seq_id, s.num_tokens, s.prompt_len, imp.moe_layers, imp.top_k) == ("indexed", 3, 2, [1, 3], 2)
    assert s.expert_ids.tolist() == [[[3, 1], [0, 2]], [[1, 4], [2, 5]], [[7, 6], [5, 0]]]


def test_upstream_rows_are_cut_into_tokens_of_k(fixtures):
    _, imp = read_traces(fixtures / "llamacpp-upstream" / "moe_trace.csv", "llamacpp",
                         ImportOptions(num_experts=8, top_k=2))
    (s,) = imp.sequences
    assert (s.num_tokens, s.prompt_len, imp.phase_known, imp.num_layers) == (3, 0, False, 2)
    assert s.expert_ids.tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[1, 2], [3, 4]]]
    with pytest.raises(UsageError, match="--top-k is required"):
        read_traces(fixtures / "llamacpp-upstream" / "moe_trace.csv", "llamacpp", ImportOptions(num_experts=8))


def test_refusal_names_the_line(fixtures):
    with pytest.raises(ImportFormatError, match=r"bad_ranks.csv:8: token 1 layer 3 has ranks \[0, 2\], expected"):
        read_traces(fixtures / "llamacpp" / "bad_ranks.csv", "llamacpp", ImportOptions(num_experts=8))
