"""Trace sets on disk: round trip, resume, corrupt/truncated/foreign/empty inputs, JSONL import, stats."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.trace_import import ImportFormatError, read_import_jsonl
from expertcast.data.trace_stats import trace_stats
from expertcast.data.traces import (
    MANIFEST_FILE,
    TraceFormatError,
    TraceWriter,
    iter_traces,
    load_traces,
    read_meta,
    write_traces,
)
from expertcast.data.traces_cli import main as traces_main

L, K, E = 3, 2, 8


def _meta(probs: bool = False, **kw) -> TraceMeta:
    return TraceMeta(model_id="tiny", num_layers=L, num_experts=E, top_k=K, expert_bytes=1234,
                     moe_layers=[1, 2, 3], dataset="gsm8k", split="test", has_router_probs=probs, **kw)


def _seqs(n: int, probs: bool = False, seed: int = 0) -> list[TraceSequence]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(1, 40))
        ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)]).astype(np.int16)
        p = rng.random((T, L, E)).astype(np.float16) if probs else None
        out.append(TraceSequence(f"s{i}", rng.integers(0, 500, T).astype(np.int32), int(rng.integers(0, T + 1)),
                                 ids, rng.random((T, L, K)).astype(np.float16), p))
    return out


def _same(a: list[TraceSequence], b: list[TraceSequence]) -> None:
    assert [s.seq_id for s in a] == [s.seq_id for s in b]
    for x, y in zip(a, b, strict=True):
        assert x.prompt_len == y.prompt_len
        for f in ("token_ids", "expert_ids", "expert_weights", "router_probs"):
            u, v = getattr(x, f), getattr(y, f)
            if u is None:
                assert v is None
                continue
            assert u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v), f


@pytest.mark.parametrize("probs", [False, True])
def test_round_trip(tmp_path, probs):
    seqs = _seqs(7, probs)
    write_traces(tmp_path / "t", _meta(probs), seqs, shard_size=3)
    assert sorted(p.name for p in (tmp_path / "t").glob("shard-*")) == ["shard-00000", "shard-00001", "shard-00002"]
    meta, back = load_traces(tmp_path / "t")
    assert meta == _meta(probs)
    _same(seqs, back)
    assert back[0].expert_ids.dtype == np.int16 and back[0].expert_weights.dtype == np.float16
    _same(seqs, list(iter_traces(tmp_path / "t")))
    # metadata also in the dataset info of every shard
    import datasets

    info = datasets.load_from_disk(str(tmp_path / "t" / "shard-00001")).info
    assert '"num_experts": 8' in info.description


def test_writer_rejects_bad_sequences(tmp_path):
    w = TraceWriter(tmp_path / "t", _meta())
    bad = _seqs(1)[0]
    bad.expert_ids = bad.expert_ids.copy()
    bad.expert_ids[0, 0, 0] = E  # out of range
    with pytest.raises(ValueError, match=r"outside \[0, E=8\)"):
        w.write_shard(0, [bad])
    wrong_k = _seqs(1)[0]
    wrong_k.expert_ids, wrong_k.expert_weights = wrong_k.expert_ids[:, :, :1], wrong_k.expert_weights[:, :, :1]
    with pytest.raises(ValueError, match="K=2"):
        w.write_shard(0, [wrong_k])
    with pytest.raises(ValueError, match="router_probs"):
        w.write_shard(0, _seqs(1, probs=True))


def test_resume_skips_finished_and_adopts_renamed_shards(tmp_path):
    d = tmp_path / "t"
    seqs = _seqs(6)
    w = TraceWriter(d, _meta(), run={"limit": 6})
    w.write_shard(0, seqs[:2])
    w.write_shard(1, seqs[2:4])
    # crash between the rename of shard 2 and the manifest update
    w.write_shard(2, seqs[4:])
    man = json.loads((d / MANIFEST_FILE).read_text())
    del man["shards"]["00002"]
    (d / MANIFEST_FILE).write_text(json.dumps(man))
    (d / ".tmp-shard-00003-x").mkdir()  # leftover of a write that died before the rename
    w2 = TraceWriter(d, _meta(), run={"limit": 6})
    assert w2.finished_shards == {0, 1, 2}
    assert not (d / ".tmp-shard-00003-x").exists()
    with pytest.raises(TraceFormatError, match="already finished"):
        w2.write_shard(1, seqs[2:4])
    w2.check_done_shard(2, ["s4", "s5"])  # adopted shard: its ids were read back
    with pytest.raises(TraceFormatError, match="input changed"):
        w2.check_done_shard(1, ["s2", "sX"])
    w2.finalize()
    _same(seqs, load_traces(d)[1])
    # a finished shard damaged later is dropped on resume (and redone by the caller), the others kept
    arrow = next((d / "shard-00001").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])
    w3 = TraceWriter(d, _meta(), run={"limit": 6})
    assert w3.finished_shards == {0, 2} and not (d / "shard-00001").exists()
    w3.write_shard(1, seqs[2:4])
    w3.finalize()
    _same(seqs, load_traces(d)[1])
    # another model or other settings in the same directory: refused
    with pytest.raises(TraceFormatError, match="num_experts"):
        TraceWriter(d, TraceMeta("tiny", L, 16, K, 1234, moe_layers=[1, 2, 3], dataset="gsm8k", split="test"),
                    run={"limit": 6})
    with pytest.raises(TraceFormatError, match="changed: limit"):
        TraceWriter(d, _meta(), run={"limit": 7})
    # --overwrite starts afresh
    assert TraceWriter(d, _meta(), run={"limit": 7}, overwrite=True).finished_shards == set()


def test_incomplete_set_loads_finished_shards_with_warning(tmp_path):
    w = TraceWriter(tmp_path / "t", _meta())
    w.write_shard(0, _seqs(2))
    with pytest.warns(UserWarning, match="incomplete"):
        _, seqs = load_traces(tmp_path / "t")
    assert len(seqs) == 2


def test_clear_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_traces(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("hi")
    with pytest.raises(TraceFormatError, match="not a trace set: no trace_meta.json"):
        load_traces(tmp_path / "plain")
    # a trace set without a single shard (empty split)
    TraceWriter(tmp_path / "empty", _meta())
    with pytest.raises(TraceFormatError, match="holds no shards"):
        load_traces(tmp_path / "empty")
    with pytest.raises(TraceFormatError, match="no shard was written"):
        TraceWriter(tmp_path / "empty", _meta()).finalize()
    write_traces(tmp_path / "t", _meta(), _seqs(6), shard_size=2)
    # truncated shard file
    arrow = next((tmp_path / "t" / "shard-00001").glob("*.arrow"))
    data = arrow.read_bytes()
    arrow.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="shard-00001 .*truncated"):
        load_traces(tmp_path / "t")
    # same size but garbage (manifest sizes cannot see it; the Arrow reader must)
    arrow.write_bytes(b"\0" * len(data))
    with pytest.raises(TraceFormatError, match="shard-00001 .*corrupt"):
        load_traces(tmp_path / "t")
    # a shard listed in the manifest but gone
    write_traces(tmp_path / "u", _meta(), _seqs(4), shard_size=2)
    import shutil

    shutil.rmtree(tmp_path / "u" / "shard-00000")
    with pytest.raises(TraceFormatError, match="missing shard.*shard-00000"):
        load_traces(tmp_path / "u")
    # corrupt meta file
    (tmp_path / "u" / "trace_meta.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match="trace_meta.json"):
        read_meta(tmp_path / "u")


def test_check_compatible_names_the_mismatch():
    with pytest.raises(ValueError, match="L=3, E=8, K=2 but the model has L=3, E=16, K=2"):
        _meta().check_compatible(3, 16, 2)
    _meta().check_compatible(3, 8, 2)
    from expertcast.data.traces import check_model_compatible
    from expertcast.models.presets import get_config
    from expertcast.models.spec import MoESpec

    spec = MoESpec.from_config(get_config("mixtral-tiny"))  # L=2, E=8, K=2
    with pytest.raises(ValueError, match="L=3, E=8, K=2 but the model 'preset:mixtral-tiny' has L=2, E=8, K=2"):
        check_model_compatible(_meta(), spec)
    ok = TraceMeta("m", 2, 8, 2, 1, moe_layers=[0, 1])
    check_model_compatible(ok, spec)
    with pytest.raises(ValueError, match=r"MoE layers \[1, 2\]"):
        check_model_compatible(TraceMeta("m", 2, 8, 2, 1, moe_layers=[1, 2]), spec)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _import_rows() -> list[dict]:
    rows = []
    # seq "a": 2 prefill tokens, 3 decode tokens; token 3 misses layer 1 (dropped)
    sets = {0: [[0, 1], [2, 3]], 1: [[1, 2], [3, 4]], 2: [[2, 3], [4, 5]], 3: [[0, 5], [0, 6]], 4: [[3, 2], [5, 4]]}
    for t, per_layer in sets.items():
        for li, ex in enumerate(per_layer):
            if t == 3 and li == 1:
                continue
            rows.append({"seq": "a", "token": t, "layer": li, "experts": ex, "weights": [0.75, 0.25],
                         "phase": "prefill" if t < 2 else "decode", "token_id": 100 + t})
    for t in range(2):  # seq 7: decode only, listed out of order
        for li in (1, 0):
            rows.append({"seq": 7, "token": 1 - t, "layer": li, "experts": [7, 6], "weights": [0.5, 0.5],
                         "phase": "decode"})
    return rows


def test_import_jsonl(tmp_path):
    f = _jsonl(tmp_path / "r.jsonl", _import_rows())
    with pytest.warns(UserWarning, match="dropped 1 incomplete token"):
        seqs, counts = read_import_jsonl(f, num_experts=8)
    assert counts["num_layers"] == 2 and counts["top_k"] == 2 and counts["dropped_tokens"] == 1
    a, b = seqs
    assert a.seq_id == "a" and a.prompt_len == 2 and a.num_tokens == 4
    assert a.token_ids.tolist() == [100, 101, 102, 104]
    assert a.expert_ids[3].tolist() == [[3, 2], [5, 4]]  # router order kept
    assert a.expert_weights[0, 0].tolist() == [0.75, 0.25]
    assert b.seq_id == "7" and b.prompt_len == 0 and b.token_ids.tolist() == [-1, -1]

    out = tmp_path / "imp"
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8", "--expert-bytes", "99",
                        "--model", "vllm-x"]) == 0
    meta, back = load_traces(out)
    assert (meta.model_id, meta.num_layers, meta.num_experts, meta.top_k, meta.expert_bytes) == ("vllm-x", 2, 8, 2, 99)
    _same(seqs, back)
    # a second import into the same directory needs --overwrite
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8"]) == 2


@pytest.mark.parametrize("bad,match", [
    ({"seq": 1, "token": 0, "layer": 0, "experts": [0, 9]}, r"outside \[0, E=8\)"),
    ({"seq": 1, "token": 0, "layer": 0, "experts": [0]}, "earlier rows have K=2"),
    ({"seq": 1, "token": 0, "layer": 0, "experts": [1, 1]}, "repeated expert"),
    ({"seq": 1, "token": 0, "layer": 0}, "missing field.*experts"),
    ({"seq": 1, "token": 0, "layer": 0, "experts": [0, 1], "phase": "gen"}, "phase must be"),
    ({"seq": 9, "token": 0, "layer": 0, "experts": [2, 3]}, "duplicate row"),
])
def test_import_errors_name_the_line(tmp_path, bad, match):
    rows = [{"seq": 9, "token": 0, "layer": 0, "experts": [2, 3]}, bad]
    f = _jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(ImportFormatError, match=match) as ei:
        read_import_jsonl(f, num_experts=8)
    assert "r.jsonl:2" in str(ei.value)


def test_import_rejects_prefill_after_decode(tmp_path):
    rows = [{"seq": 0, "token": 0, "layer": 0, "experts": [0], "weights": [1.0], "phase": "decode"},
            {"seq": 0, "token": 1, "layer": 0, "experts": [1], "weights": [1.0], "phase": "prefill"}]
    with pytest.raises(ImportFormatError, match="prefill token after decode"):
        read_import_jsonl(_jsonl(tmp_path / "r.jsonl", rows), num_experts=4)


def test_stats_values_and_cli(tmp_path, capsys):
    # one layer, K=2, E=4; decode sets {0,1} {1,2} {2,3}: overlaps 1/2 and 1/2; counts [1,2,2,1]
    ids = np.array([[[9, 9]], [[9, 8]], [[0, 1]], [[1, 2]], [[2, 3]]], dtype=np.int16) % 4
    ids[:2] = [[[0, 3]], [[3, 0]]]  # prefill: {0,3} then {3,0}: overlap 1
    seq = TraceSequence("x", np.arange(5, dtype=np.int32), 2, ids, np.full((5, 1, 2), 0.5, np.float16))
    meta = TraceMeta("m", 1, 4, 2, 10)
    rows, freqs = trace_stats(meta, [seq])
    dec = next(r for r in rows if r["phase"] == "decode" and r["layer"] == 0)
    assert dec["tokens"] == 3 and dec["overlap"] == pytest.approx(0.5)
    p = np.array([1, 2, 2, 1]) / 6
    assert dec["entropy"] == pytest.approx(-(p * np.log(p)).sum() / math.log(4))
    assert dec["top1_share"] == pytest.approx(2 / 6) and dec["min_share"] == pytest.approx(1 / 6)
    pre = next(r for r in rows if r["phase"] == "prefill" and r["layer"] == 0)
    assert pre["overlap"] == pytest.approx(1.0) and pre["experts_used"] == 2
    np.testing.assert_allclose(freqs["decode"][0], p)

    write_traces(tmp_path / "t", meta, [seq])
    js, cs, png = tmp_path / "s.json", tmp_path / "s.csv", tmp_path / "s.png"
    assert traces_main(["stats", str(tmp_path / "t"), "--json", str(js), "--csv", str(cs), "--plot", str(png)]) == 0
    got = json.loads(js.read_text())
    assert {(r["phase"], r["layer"]) for r in got} == {("decode", 0), ("decode", "all"), ("prefill", 0),
                                                       ("prefill", "all")}
    assert cs.read_text().startswith("phase,layer,tokens")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "overlap" in capsys.readouterr().out
    # errors: one line on stderr, exit code 2
    assert traces_main(["stats", str(tmp_path)]) == 2
    assert "not a trace set" in capsys.readouterr().err


def test_import_without_weights_warns_and_uses_uniform(tmp_path):
    rows = [{"seq": 0, "token": 0, "layer": 0, "experts": [0, 3]}]
    with pytest.warns(UserWarning, match="no weights: using 1/K"):
        seqs, _ = read_import_jsonl(_jsonl(tmp_path / "r.jsonl", rows), num_experts=4)
    assert seqs[0].expert_weights.tolist() == [[[0.5, 0.5]]] and seqs[0].prompt_len == 0


def test_complete_set_loads_without_warning(tmp_path):
    """A complete trace set loads without the incomplete-run warning."""
    write_traces(tmp_path / "t", _meta(), _seqs(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_traces(tmp_path / "t")
