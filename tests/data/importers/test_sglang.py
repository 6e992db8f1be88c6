"""SGLang /generate responses: flat base64 ids reshaped by --num-layers/--top-k, a dense layer (-1) dropped."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.utils.errors import UsageError

OPTS = ImportOptions(num_experts=8, num_layers=3, top_k=2)


def test_batched_and_single_responses(fixtures):
    _, imp = read_traces(fixtures / "sglang" / "responses.jsonl", "sglang", OPTS)
    a, b = imp.sequences
    assert (imp.num_layers, imp.top_k, imp.moe_layers, imp.phase_known) == (2, 2, [1, 2], True)
    assert (a.seq_id, a.num_tokens, a.prompt_len) == ("req-a", 3, 2)  # int32, T = P + C - 1
    assert (b.seq_id, b.num_tokens, b.prompt_len) == ("req-b", 3, 1)  # int16, T = P + C
    assert a.expert_ids[2].tolist() == [[5, 6], [7, 0]] and b.expert_ids[0].tolist() == [[6, 7], [0, 1]]
    assert a.source == b.source == "gsm8k" and "dropped 1 dense layer(s) [0]" in imp.notes[0]


def test_refusals(fixtures):
    with pytest.raises(ImportFormatError, match=r"bad_size.jsonl:1: routed_experts holds 17 int32 ids, not a "
                                                 r"multiple of --num-layers x --top-k = 3 x 2"):
        read_traces(fixtures / "sglang" / "bad_size.jsonl", "sglang", OPTS)
    with pytest.raises(UsageError, match="--top-k is required for the sglang layout"):
        read_traces(fixtures / "sglang" / "responses.jsonl", "sglang", ImportOptions(num_experts=8, num_layers=3))
