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


def test_a_top_k_the_file_contradicts_is_refused(fixtures, tmp_path):
    """The indexed header records the rank: --top-k must agree. The upstream header records no token: a wrong
    --top-k that divides a layer's rows (top-4 of 16 over 60 tokens read as top-2 or top-8) is refused from
    what the rows show, naming the flag."""
    import numpy as np

    with pytest.raises(UsageError, match=r"--top-k 3, but .*indexed.csv records 2 ranks per token"):
        read_traces(fixtures / "llamacpp" / "indexed.csv", "llamacpp", ImportOptions(num_experts=8, top_k=3))
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(16, 4, replace=False) for _ in range(2)] for _ in range(60)])  # [T, L, K]
    f = tmp_path / "moe_trace.csv"
    f.write_text("layer,expert\n" + "".join(f"{li},{e}\n" for li in range(2) for e in ids[:, li].ravel()))
    _, imp = read_traces(f, "llamacpp", ImportOptions(num_experts=16, top_k=4))
    assert imp.sequences[0].expert_ids.tolist() == ids.tolist()
    with pytest.raises(ImportFormatError, match=r"in every block of 2 positions .* --top-k 2 must be the model's"):
        read_traces(f, "llamacpp", ImportOptions(num_experts=16, top_k=2))
    with pytest.raises(ImportFormatError, match=r"repeated expert in .* --top-k 8 must be the model's"):
        read_traces(f, "llamacpp", ImportOptions(num_experts=16, top_k=8))
