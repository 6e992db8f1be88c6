"""Megatron-LM RouterTracer JSONL: one sequence per rank, steps in order, MTP records skipped."""

from __future__ import annotations

import pytest
from expertcast.data.importers import ImportOptions, read_traces
from expertcast.data.importers.common import ImportFormatError


def test_ranks_become_sequences(fixtures):
    _, imp = read_traces(fixtures / "megatron" / "router_trace_rank0.jsonl", "megatron", ImportOptions(num_experts=8))
    r0, r1 = imp.sequences
    assert (r0.seq_id, r0.num_tokens, r1.seq_id, r1.num_tokens) == ("rank0", 4, "rank1", 2)
    assert (imp.moe_layers, imp.phase_known, imp.records) == ([1, 2], False, 7)  # 3 steps x 2 layers + 1 MTP
    # layer l's ids are the step's rows shifted by l (mod 8); the MTP record's [0, 1] rows are not read
    assert r0.expert_ids[3].tolist() == [[7, 0], [0, 1]] and r0.expert_ids[0].tolist() == [[1, 2], [2, 3]]
    assert imp.notes == ["skipped 1 MTP record(s)"]


def test_refusal_names_the_line(fixtures):
    with pytest.raises(ImportFormatError, match=r"bad_shape.jsonl:2: top_indices is \[3, 2\], num_tokens x topk is "
                                                 r"\[4, 2\]"):
        read_traces(fixtures / "megatron" / "bad_shape.jsonl", "megatron", ImportOptions(num_experts=8))
