"""The registry: `auto` detects every layout, ambiguity and unknown layouts are one-line errors, and an import
records its source format, the source's sha256, phase_known and per-sequence sources (read back from disk)."""

from __future__ import annotations

import json

import pytest
from expertcast.commands.traces import main as traces_main
from expertcast.data.importers import detect_format, fingerprint, registry
from expertcast.data.importers.common import ImportFormatError
from expertcast.data.traces import load_traces

# (fixture, layout, flags, summary)
CASES = [
    ("vllm/requests.jsonl", "vllm", ["--num-experts", "8"], "2 sequences (vllm layout, L=2, E=8, K=2, 7 tokens, 2 decode"),
    ("sglang/responses.jsonl", "sglang", ["--num-experts", "8", "--num-layers", "3", "--top-k", "2"],
     "2 sequences (sglang layout, L=2, E=8, K=2, 6 tokens, 3 decode"),
    ("llamacpp/indexed.csv", "llamacpp", ["--num-experts", "8"], "1 sequences (llamacpp layout, L=2, E=8, K=2, 3 tokens"),
    ("llamacpp-upstream/moe_trace.csv", "llamacpp", ["--num-experts", "8", "--top-k", "2"],
     "1 sequences (llamacpp layout, L=2, E=8, K=2, 3 tokens, 3 decode tokens, phase unknown"),
    ("megatron/router_trace_rank0.jsonl", "megatron", ["--num-experts", "8"],
     "2 sequences (megatron layout, L=2, E=8, K=2, 6 tokens"),
    ("moe-cache-lab/trace.jsonl", "moe-cache-lab", [], "1 sequences (moe-cache-lab layout, L=2, E=8, K=2, 3 tokens, 1 "),
    ("moe-beyond", "moe-beyond", ["--num-experts", "64"], "2 sequences (moe-beyond layout, L=2, E=64, K=6, 5 tokens"),
    ("gating-jsonl/routing.jsonl", "gating-jsonl", ["--num-experts", "8"],
     "2 sequences (gating-jsonl layout, L=2, E=8, K=2, 3 tokens"),
    ("hf-router-logits/logits.safetensors", "hf-router-logits", [],
     "2 sequences (hf-router-logits layout, L=2, E=4, K=2, 3 tokens, 1 decode"),
]


def test_every_layout_has_a_case():
    assert {c[1] for c in CASES} | {"jsonl", "granite"} == set(registry())


@pytest.mark.parametrize("rel,fmt,flags,summary", CASES, ids=[c[0] for c in CASES])
def test_auto_detects_and_imports(fixtures, tmp_path, capsys, rel, fmt, flags, summary):
    src = fixtures / rel
    assert detect_format(src) == fmt
    assert traces_main(["import", str(src), "--out", str(tmp_path / "t"), *flags]) == 0
    assert summary in capsys.readouterr().out
    meta, seqs = load_traces(tmp_path / "t")
    assert (meta.source_format, meta.source_sha256) == (fmt, fingerprint(src, fmt))
    assert meta.phase_known == (fmt not in ("megatron", "moe-beyond", "gating-jsonl") and "upstream" not in rel)
    assert meta.has_sources == (fmt in ("vllm", "sglang", "gating-jsonl", "hf-router-logits"))
    if meta.has_sources:
        assert all(s.source for s in seqs)


@pytest.mark.parametrize("rel,flags,message", [
    ("vllm/bad_count.jsonl", ["--num-experts", "8"], r"bad_count.jsonl:1: request 'r0' has 5 routed positions"),
    ("sglang/bad_size.jsonl", ["--num-experts", "8", "--num-layers", "3", "--top-k", "2"], r"bad_size.jsonl:1: "),
    ("llamacpp/bad_ranks.csv", ["--num-experts", "8"], r"bad_ranks.csv:8: token 1 layer 3 has ranks"),
    ("megatron/bad_shape.jsonl", ["--num-experts", "8"], r"bad_shape.jsonl:2: top_indices is \[3, 2\]"),
    ("moe-cache-lab/bad_order.jsonl", [], r"bad_order.jsonl:3: prompt records must come in ascending"),
    ("moe-beyond-bad", ["--num-experts", "64"], r"prompt_1_data.csv:2: experts must be a list of integers"),
    ("gating-jsonl/bad_ids.jsonl", ["--num-experts", "8"], r'bad_ids.jsonl:3: experts must be a list of integers'),
    ("hf-router-logits-bad/logits.safetensors", [], r"logits.json: norm_topk_prob must be true or false"),
])
def test_malformed_files_are_one_line_refusals(fixtures, tmp_path, capsys, rel, flags, message):
    import re

    assert traces_main(["import", str(fixtures / rel), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("expertcast traces import: error:") and re.search(message, err), err
    assert not (tmp_path / "o").exists()


def test_ambiguous_and_unknown_layouts(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"seq": 0, "token": 0, "layer": 0, "experts": [0], "step": 0, "rank": 0,
                             "top_indices": [[0]]}) + "\n")
    with pytest.raises(ImportFormatError, match="ambiguous trace layout: its first record fits jsonl, megatron"):
        detect_format(f)
    c = tmp_path / "x.csv"
    c.write_text("a,b\n1,2\n")
    with pytest.raises(ImportFormatError, match="unknown CSV trace layout"):
        detect_format(c)


@pytest.mark.parametrize("fill,argv,message", [
    (b"\0", [], "a binary file (NUL byte at offset 0)"),
    (b"\0", ["--format", "jsonl", "--num-experts", "8"], "a binary file (NUL byte at offset 0)"),
    (b"a", [], "unknown trace layout (no JSON object on its first line)"),
])
def test_a_large_file_that_is_no_layout_is_refused_without_reading_it_whole(tmp_path, capsys, fill, argv, message):
    """64 MiB on one line: the refusal reads a few KiB (`truncate -s 1G s.jsonl` once peaked at 3.2 GB)."""
    import tracemalloc

    src = tmp_path / "s.jsonl"
    with open(src, "wb") as f:
        if fill == b"\0":
            f.truncate(64 << 20)
        else:
            f.write(fill * (64 << 20))
    tracemalloc.start()
    try:
        assert traces_main(["import", str(src), "--out", str(tmp_path / "o"), *argv]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message in capsys.readouterr().err
    assert peak < (8 << 20), peak
