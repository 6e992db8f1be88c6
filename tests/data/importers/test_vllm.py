"""vLLM routed experts: an offline RequestOutput dump and a server response (base64 .npy) in one file."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError
from expertcast.utils.errors import UsageError


def test_requests_import_with_prompt_lengths_and_sources(fixtures):
    fmt, imp = read_traces(fixtures / "vllm" / "requests.jsonl", "vllm", ImportOptions(num_experts=8))
    a, b = imp.sequences
    assert (imp.num_layers, imp.num_experts, imp.top_k, imp.phase_known) == (2, 8, 2, True)
    assert (a.seq_id, a.num_tokens, a.prompt_len, a.source) == ("r0", 4, 3, "gsm8k")  # T = 3 + 2 - 1
    assert a.token_ids.tolist() == [11, 12, 13, 14] and a.expert_ids[2].tolist() == [[4, 5], [6, 7]]
    assert (b.seq_id, b.num_tokens, b.prompt_len, b.source) == ("cmpl-b", 3, 2, "math")
    assert b.expert_ids[0].tolist() == [[7, 6], [5, 4]] and b.token_ids.tolist() == [21, 22, 23]
    assert float(a.expert_weights[0, 0, 0]) == 0.5


def test_refusals(fixtures):
    with pytest.raises(ImportFormatError, match=r"bad_count.jsonl:1: request 'r0' has 5 routed positions, but 3 "
                                                 r"prompt \+ 2 completion tokens make 4"):
        read_traces(fixtures / "vllm" / "bad_count.jsonl", "vllm", ImportOptions(num_experts=8))
    with pytest.raises(ImportFormatError, match=r"requests.jsonl:1: .*outside \[0, E=4\)"):
        read_traces(fixtures / "vllm" / "requests.jsonl", "vllm", ImportOptions(num_experts=4))
    with pytest.raises(UsageError, match="--num-experts is required for the vllm layout"):
        read_traces(fixtures / "vllm" / "requests.jsonl", "vllm")
