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


def test_a_tracer_killed_mid_write_imports_its_complete_steps(fixtures, tmp_path):
    """The tracer was killed while writing step 2: layer 1's record is whole, layer 2's line is cut mid-record (no
    newline). The cut line and step 2's position (it lacks layer 2) are dropped and counted; a hole before a
    complete step is still refused."""
    lines = (fixtures / "megatron" / "router_trace_rank0.jsonl").read_text().splitlines()[:5]
    step2 = '{"step": 2, "stage": "pre_dispatch", "block": "decoder", "layer": %d, "rank": 0, "num_tokens": 1, ' \
            '"topk": 2, "top_indices": [[3, 5]]}'
    f = tmp_path / "router_trace_rank0.jsonl"
    f.write_text("\n".join([*lines, step2 % 1, (step2 % 2)[:40]]))
    with pytest.warns(UserWarning, match="cut short"):
        _, imp = read_traces(f, "megatron", ImportOptions(num_experts=8))
    (r0,) = imp.sequences
    assert r0.num_tokens == 4 and (imp.dropped_positions, imp.cut_lines) == (1, [f"{f}:7"])
    assert f"dropped the last line of {f}:7 (cut short mid-write)" in imp.notes
    f.write_text("\n".join([*lines[:3], lines[4], step2 % 1, step2 % 2]) + "\n")  # step 1 lacks layer 1
    with pytest.raises(ImportFormatError, match=r"rank 0 step 1 has no record for layer\(s\) \[1\], and later steps"):
        read_traces(f, "megatron", ImportOptions(num_experts=8))
    f.write_text("\n".join(lines) + '\n{"step": 2, "sta\n')  # a bad line that ends with a newline: no cut write
    with pytest.raises(ImportFormatError, match=r"router_trace_rank0.jsonl:6: not valid JSON"):
        read_traces(f, "megatron", ImportOptions(num_experts=8))
