"""``expertcast replay``: forced routing of a trace through the offloaded runtime, its header (the mapping) and
its one-line refusals."""

from __future__ import annotations

import json

import pytest
from expertcast.cli import main as cli


@pytest.fixture
def granite_like(tmp_path):
    """A trace set with more layers, fewer experts and a larger K than qwen3_moe-tiny (L=4, E=16, K=4)."""
    from expertcast.data.synthetic import markov_traces
    from expertcast.data.traces import write_traces

    tr = markov_traces(num_sequences=2, num_tokens=16, num_layers=6, num_experts=12, top_k=6, seed=2)
    write_traces(tmp_path / "t", tr.meta, tr.sequences)
    return tmp_path / "t"


def test_replay_maps_the_trace_and_reports_every_cell(granite_like, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli(["replay", "--model", "qwen3_moe-tiny", "--traces", str(granite_like), "--truncate-trace",
              "--policy", "lru", "--policy", "belady", "--capacity", "0.25,0.5", "--tokens", "4", "--threads", "1",
              "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "the first 4 of the trace's 6 layers" in text and "each token's 4 highest-weight of the trace's 6" in text
    assert "12 of 16 per layer named; 4 never routed" in text
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", 0.25), ("belady", 0.25), ("lru", 0.5),
                                                            ("belady", 0.5)]
    assert all(r["decoded_tokens"] == 2 * 4 for r in rows)
    lru, bel = rows[0], rows[1]
    assert bel["demand_misses"] <= lru["demand_misses"] and lru["demand_misses"] > 0
    assert doc["mapping"]["layers"] == "first" and doc["mapping"]["trace_shape"] == [6, 12, 6]
    assert doc["trace_fingerprint"] and doc["code"]["expertcast"]


@pytest.mark.parametrize("extra,match", [
    ([], "the trace has 6 MoE layers, the model 4"),
    (["--truncate-trace", "--store", "disk"], "--store disk"),
    (["--truncate-trace", "--disk-path", "x"], "--disk-path, --readers and --prefetch-chunk-kb apply to --store disk"),
    (["--truncate-trace", "--prefetch-chunk-kb", "0"], "--prefetch-chunk-kb apply to --store disk"),
    (["--truncate-trace", "--store", "disk", "--disk-path", "x", "--prefetch-chunk-kb", "-1"], "non-negative integer"),
    (["--truncate-trace", "--expert-dtype", "int3"], "expert format 'int3'"),
])
def test_refusals_are_one_line(granite_like, capsys, extra, match):
    rc = cli(["replay", "--model", "qwen3_moe-tiny", "--traces", str(granite_like), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err


def test_synthetic_traces_take_the_model_shape(capsys):
    rc = cli(["replay", "--model", "qwen3_moe-tiny", "--synthetic", "zipf", "--synthetic-size", "1,12",
              "--slots", "4", "--threads", "1"])
    text = capsys.readouterr().out
    assert rc == 0 and "trace layer l -> MoE layer l (L=4)" in text and "K=4 as recorded" in text


def test_disk_store_replays_the_same_routing_as_ram(tmp_path, capsys):
    """Where the runtime has the disk store (``load_offloaded(store="disk")``), the same replay through it counts
    the same misses as through RAM, and every miss is read from the file."""
    import inspect

    from expertcast.inference.runtime.loading import load_offloaded

    if "store" not in inspect.signature(load_offloaded).parameters:
        pytest.skip("this expertcast has no disk store")
    args = ["replay", "--model", "qwen3_moe-tiny", "--synthetic", "markov", "--synthetic-size", "2,16",
            "--capacity", "0.25", "--threads", "1"]
    assert cli([*args, "--json", str(tmp_path / "ram.json")]) == 0
    assert cli([*args, "--store", "disk", "--disk-path", str(tmp_path / "e.store"), "--json",
                str(tmp_path / "disk.json")]) == 0
    capsys.readouterr()
    ram = json.loads((tmp_path / "ram.json").read_text())["rows"][0]
    disk = json.loads((tmp_path / "disk.json").read_text())["rows"][0]
    assert disk["demand_misses"] == ram["demand_misses"] > 0 and disk["hit"] == ram["hit"]
    assert disk["read_mb_per_token"] == disk["mb_per_token"] and disk["rss_bound_gb"] > 0


def test_quantized_experts_replay_the_same_routing_with_fewer_bytes(tmp_path, capsys):
    """``--expert-dtype int4`` (docs/design.md, "Expert formats"): the same forced routing counts the same misses
    as bfloat16, each miss moves the int4 row (>= 3x fewer bytes), and the JSON names the kernel that ran."""
    args = ["replay", "--model", "qwen3_moe-tiny", "--synthetic", "markov", "--synthetic-size", "2,16",
            "--capacity", "0.25", "--threads", "1", "--dtype", "bfloat16"]
    assert cli([*args, "--json", str(tmp_path / "bf.json")]) == 0
    assert cli([*args, "--expert-dtype", "int4", "--json", str(tmp_path / "q.json")]) == 0
    assert "experts stored as int4" in capsys.readouterr().out
    bf = json.loads((tmp_path / "bf.json").read_text())
    q = json.loads((tmp_path / "q.json").read_text())
    a, b = bf["rows"][0], q["rows"][0]
    assert a["expert_dtype"] == "bfloat16" and b["expert_dtype"] == "int4" and bf["quant_kernels"] == []
    assert b["demand_misses"] == a["demand_misses"] > 0 and b["mb_per_token"] * 3 < a["mb_per_token"]
    assert {k["kernel"] for k in q["quant_kernels"]} <= {"aten::_weight_int4pack_mm_for_cpu", "dequantize+mm"}
    assert q["quant_kernels"] and q["load"]["plan"]["expert_format"] == "int4"


def test_two_policies_on_the_disk_store_load_once_and_report_each_rows_own_peak(tmp_path, capsys, monkeypatch):
    """A second policy reuses the model and its disk store (before, a second load overlapped the first and broke
    the stated bound), and every row reports its own peak RSS (the high-water mark reset before it) against its
    own bound (its own slots)."""
    import functools

    from expertcast.inference.runtime import loading

    real, loads = loading.load_offloaded, []

    @functools.wraps(real)  # the real function, counted (its signature stays visible)
    def counted(*args, **kwargs):
        loads.append(kwargs.get("store"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_offloaded", counted)
    from expertcast.inference.runtime.disk_store import ReaderPoolEngine

    pool_init, chunks = ReaderPoolEngine.__init__, []

    def init(self, *a, **k):
        pool_init(self, *a, **k)
        chunks.append(self.chunk)

    monkeypatch.setattr(ReaderPoolEngine, "__init__", init)
    out = tmp_path / "disk.json"
    assert cli(["replay", "--model", "qwen3_moe-tiny", "--synthetic", "markov", "--synthetic-size", "2,16",
                "--policy", "lru", "--policy", "lfu", "--capacity", "0.25,0.5", "--threads", "1", "--store", "disk",
                "--disk-path", str(tmp_path / "e.store"), "--prefetch-chunk-kb", "0", "--json", str(out)]) == 0
    capsys.readouterr()
    rows = json.loads(out.read_text())["rows"]
    assert loads == ["disk"] and len(rows) == 4  # loaded once for the four rows
    assert chunks == [0] * 4  # every row's reader pool reads whole prefetches, as --prefetch-chunk-kb 0 asked
    assert all(r["peak_rss_scope"] == "row" and r["peak_rss_gb"] > 0 for r in rows)
    by_cap = {r["capacity"]: r["rss_bound_gb"] for r in rows}
    slot_gb = 4 * 4 * 24576 / 1e9  # 4 more slots in each of the L=4 layers at 0.5 than at 0.25, of 24 kB experts
    assert by_cap[0.5] - by_cap[0.25] == pytest.approx(slot_gb, rel=0.01)  # each row's own slots in its bound


def test_a_byte_budget_buys_more_slots_of_a_smaller_expert_format(tmp_path, capsys):
    """``--budget-gb``: the same bytes of resident experts hold >= 3x the int4 experts of bfloat16 (the cache
    resolves the budget with the format's row size); the row reports the budget and the slots it bought."""
    from expertcast.inference.runtime.session import model_spec

    spec = model_spec("qwen3_moe-tiny")
    L, K = spec.num_layers, spec.top_k
    gb = L * K * (spec.expert_bytes // 2) / 1e9  # top-K bfloat16 experts per layer (the model is float32)
    args = ["replay", "--model", "qwen3_moe-tiny", "--synthetic", "markov", "--synthetic-size", "2,16",
            "--budget-gb", str(gb), "--threads", "1", "--dtype", "bfloat16"]
    assert cli([*args, "--json", str(tmp_path / "bf.json")]) == 0
    assert cli([*args, "--expert-dtype", "int4", "--json", str(tmp_path / "q.json")]) == 0
    out = capsys.readouterr().out
    assert f"replay: budget {gb:.4g} GB of bfloat16 experts" in out and f"{L * K} slots (per-layer pool)" in out
    a = json.loads((tmp_path / "bf.json").read_text())["rows"][0]
    b = json.loads((tmp_path / "q.json").read_text())["rows"][0]
    assert a["budget_gb"] == b["budget_gb"] == a["capacity"] == gb
    assert a["slots"] == L * K and b["slots"] >= 3 * a["slots"]
    assert b["hit"] > a["hit"]  # more resident experts, same forced routing


@pytest.mark.parametrize(("flags", "match"), [
    (["--capacity", "0.5", "--budget-gb", "1"], "give --budget-gb (bytes of experts) or --capacity, not both"),
    (["--budget-gb", "0"], "--budget-gb: 0; a byte budget must be a positive number of GB"),
    (["--budget-gb", "1e-9"], "budget 1e-09 GB of 24576-byte experts gives 0 slots per layer, below top-K"),
])
def test_byte_budget_refusals_are_one_line(flags, match, capsys):
    rc = cli(["replay", "--model", "qwen3_moe-tiny", "--synthetic", "markov", "--synthetic-size", "1,16", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1


def test_the_reader_flags_help_states_the_reader_pools_own_defaults():
    """replay leaves --readers / --prefetch-chunk-kb unset (the runtime's defaults apply, READER_KEYS) and its parser
    stays free of the runtime's imports, so its help states the defaults in words: they must be the reader pool's."""
    import re

    from expertcast.commands.replay import build_parser
    from expertcast.inference.runtime.disk_store import PREFETCH_CHUNK_KB, READERS

    helps = {a.dest: a.help for a in build_parser()._actions}
    assert re.search(r"default (\d+)", helps["readers"]).group(1) == str(READERS)
    assert re.search(r"default (\d+)", helps["prefetch_chunk_kb"]).group(1) == str(PREFETCH_CHUNK_KB)
