"""Trace sets on disk: round trip, resume, corrupt/truncated/foreign/empty inputs, JSONL import, stats."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from expertcast.commands.traces import main as traces_main
from expertcast.data.importers.common import ImportFormatError
from expertcast.data.importers.jsonl import read_import_jsonl
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.trace_stats import trace_stats
from expertcast.data.traces import (
    MANIFEST_FILE,
    TraceFormatError,
    TraceWriter,
    iter_traces,
    load_traces,
    read_manifest,
    read_meta,
    require_decode_tokens,
    write_traces,
)
from expertcast.utils.errors import OutputDirError, ResumeMismatchError

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


def test_resume_keeps_verified_shards_and_redoes_unlisted_ones(tmp_path):
    d = tmp_path / "t"
    seqs = _seqs(6)
    with TraceWriter(d, _meta(), run={"limit": 6}) as w:
        w.write_shard(0, seqs[:2])
        w.write_shard(1, seqs[2:4])
        # crash between the rename of shard 2 and the manifest update
        w.write_shard(2, seqs[4:])
    man = json.loads((d / MANIFEST_FILE).read_text())
    assert set(man["shards"]["00000"]["sha256"]) == set(man["shards"]["00000"]["files"])
    del man["shards"]["00002"]
    (d / MANIFEST_FILE).write_text(json.dumps(man))
    (d / ".tmp-shards" / "shard-00003-x").mkdir(parents=True)  # leftover of a write that died before the rename
    with TraceWriter(d, _meta(), run={"limit": 6}) as w2:
        assert w2.finished_shards == {0, 1}  # the unlisted shard 2 was never verified: removed, to be redone
        assert not (d / "shard-00002").exists() and not (d / ".tmp-shards").exists()
        with pytest.raises(TraceFormatError, match="already finished"):
            w2.write_shard(1, seqs[2:4])
        w2.write_shard(2, seqs[4:])
        w2.finalize()
    _same(seqs, load_traces(d)[1])
    # a finished shard damaged later: resume names the file; once removed by hand it is redone
    arrow = next((d / "shard-00001").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-8] ^= 0xFF  # same size, one bit pattern changed
    arrow.write_bytes(bytes(data))
    with pytest.raises(TraceFormatError, match=f"{arrow}.*sha256"):
        TraceWriter(d, _meta(), run={"limit": 6})
    import shutil

    shutil.rmtree(d / "shard-00001")
    with TraceWriter(d, _meta(), run={"limit": 6}) as w3:
        assert w3.finished_shards == {0, 2}
        w3.write_shard(1, seqs[2:4])
        w3.finalize()
    _same(seqs, load_traces(d)[1])
    # another model or other settings in the same directory: refused, naming the difference
    with pytest.raises(ResumeMismatchError, match="num_experts: 8 \\(saved\\) vs 16"):
        TraceWriter(d, TraceMeta("tiny", L, 16, K, 1234, moe_layers=[1, 2, 3], dataset="gsm8k", split="test"),
                    run={"limit": 6})
    with pytest.raises(ResumeMismatchError, match="limit: 6 \\(saved\\) vs 7 \\(now\\)"):
        TraceWriter(d, _meta(), run={"limit": 7})
    # --overwrite starts afresh
    with TraceWriter(d, _meta(), run={"limit": 7}, overwrite=True) as w4:
        assert w4.finished_shards == set()


def _plan(ids: list[str], size: int) -> list[list[tuple[str, str]]]:
    pairs = [(i, f"digest-{i}") for i in ids]
    return [pairs[s:s + size] for s in range(0, len(pairs), size)]


def test_reconcile_extends_a_smaller_run_and_refuses_anything_else(tmp_path):
    d = tmp_path / "t"
    seqs = _seqs(5)
    ids = [s.seq_id for s in seqs]
    with TraceWriter(d, _meta()) as w:  # a run of 3 items in shards of 2: shard 1 is partial
        w.write_shard(0, seqs[:2], inputs=[f"digest-{i}" for i in ids[:2]])
        w.write_shard(1, seqs[2:3], inputs=[f"digest-{ids[2]}"])
        w.finalize()
    with TraceWriter(d, _meta()) as w:
        assert w.reconcile(_plan(ids[:3], 2)) == []  # the same run: everything kept
        with pytest.raises(ResumeMismatchError, match="shard-00001 .*smaller --limit"):
            w.reconcile(_plan(ids[:2], 2))
        changed = _plan(ids[:3], 2)
        changed[0][1] = (ids[1], "another digest")
        with pytest.raises(ResumeMismatchError, match=f"input of sequence {ids[1]} changed"):
            w.reconcile(changed)
        other = _plan([ids[0], "zz", ids[2]], 2)
        with pytest.raises(ResumeMismatchError, match=f"holds {ids[1]} where this run puts zz"):
            w.reconcile(other)
        # a larger limit: the full shard 0 is kept, the partial shard 1 is redone
        assert w.reconcile(_plan(ids, 2)) == [1]
        assert w.finished_shards == {0} and not (d / "shard-00001").exists()
        assert read_manifest(d)["complete"] is False


def test_writer_claims_its_folder(tmp_path, monkeypatch):
    foreign = tmp_path / "f"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not empty and was not written by expertcast"):
        write_traces(foreign, _meta(), _seqs(2))
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    d = tmp_path / "t"
    write_traces(d, _meta(), _seqs(2))
    (d / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="did not write"):
        write_traces(d, _meta(), _seqs(3), overwrite=True)
    assert (d / "notes.txt").read_text() == "mine" and len(load_traces(d)[1]) == 2
    with TraceWriter(d, _meta()), pytest.raises(OutputDirError, match="in use by another expertcast run"):
        TraceWriter(d, _meta())
    monkeypatch.chdir(d)
    with pytest.raises(OutputDirError, match="current working directory"):
        write_traces(".", _meta(), _seqs(2))


def test_an_unfinished_set_is_refused_by_every_reader(tmp_path):
    """A writer that stopped before marking the set complete left part of it: replaying that part would pass for
    the whole set, so the readers every consumer goes through refuse it, naming it unfinished."""
    with TraceWriter(tmp_path / "t", _meta()) as w:
        w.write_shard(0, _seqs(2))
    with pytest.raises(TraceFormatError, match=r"is unfinished: its writer stopped after 1 shard\(s\)"):
        load_traces(tmp_path / "t")
    with pytest.raises(TraceFormatError, match="is unfinished"):
        next(iter_traces(tmp_path / "t"))
    with TraceWriter(tmp_path / "t", _meta()) as w:  # resumed and finished: readable
        w.finalize()
    assert len(load_traces(tmp_path / "t")[1]) == 2


def test_clear_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_traces(tmp_path / "nope")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x.txt").write_text("hi")
    with pytest.raises(TraceFormatError, match="not a trace set: no trace_meta.json"):
        load_traces(tmp_path / "plain")
    # a trace set without a single shard (empty split)
    TraceWriter(tmp_path / "empty", _meta()).close()
    with pytest.raises(TraceFormatError, match="holds no shards"):
        load_traces(tmp_path / "empty")
    with TraceWriter(tmp_path / "empty", _meta()) as w, pytest.raises(TraceFormatError, match="no shard was written"):
        w.finalize()
    write_traces(tmp_path / "t", _meta(), _seqs(6), shard_size=2)
    # truncated shard file
    arrow = next((tmp_path / "t" / "shard-00001").glob("*.arrow"))
    data = arrow.read_bytes()
    arrow.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError, match="shard-00001 .*truncated"):
        load_traces(tmp_path / "t")
    # same size but garbage (sizes cannot see it; the sha256 in the manifest does, naming the file)
    arrow.write_bytes(b"\0" * len(data))
    with pytest.raises(TraceFormatError, match=f"shard-00001 .*corrupt: {arrow} does not match the sha256"):
        load_traces(tmp_path / "t")
    # a corrupt manifest names the file
    (tmp_path / "t" / MANIFEST_FILE).write_text(json.dumps({"shards": {"00000": {"seq_ids": "s0"}}}))
    with pytest.raises(TraceFormatError, match=f"{tmp_path / 't' / MANIFEST_FILE} is corrupt"):
        load_traces(tmp_path / "t")
    (tmp_path / "t" / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(TraceFormatError, match="manifest.json is unreadable or not valid JSON"):
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


def test_require_decode_tokens(tmp_path):
    seqs = _seqs(3)
    for s in seqs:
        s.prompt_len = s.num_tokens
    with pytest.raises(TraceFormatError, match=r"somewhere \(tiny, 3 sequences\) holds no decode tokens"):
        require_decode_tokens(_meta(), seqs, "somewhere")
    seqs[1].prompt_len -= 1
    assert require_decode_tokens(_meta(), seqs, "somewhere") == 1


_GOOD = {"seq": 9, "token": 0, "layer": 0, "experts": [2, 3], "weights": [0.5, 0.5]}


def _bad_line(**change) -> str:
    row = {**_GOOD, "token": 1, **change}
    return json.dumps({k: v for k, v in row.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize("line,message", [
    (_bad_line(experts="12"), 'experts must be a non-empty list of integers, got "12"'),
    (_bad_line(experts=[1.7, 2]), "experts must be a list of integers, got 1.7"),
    (_bad_line(experts=[1.0, 2]), "experts must be a list of integers, got 1.0"),
    (_bad_line(experts=[True, 2]), "experts must be a list of integers, got true"),
    (_bad_line(experts=[0]), "1 experts, earlier rows have K=2"),
    (_bad_line(experts=[0, 9]), r"expert id\(s\) \[9\] outside \[0, E=8\)"),
    (_bad_line(weights=[float("nan"), 0.5]), "weight nan is not finite"),
    (_bad_line(weights=[float("inf"), 0.5]), "weight inf is not finite"),
    (_bad_line(weights=[-0.25, 0.5]), r"weight -0.25 outside \[0, 65504\]"),
    (_bad_line(weights=[1e6, 0.5]), r"weight 1000000.0 outside \[0, 65504\]"),
    (_bad_line(weights=["0.5", 0.5]), 'weights must be numbers, got "0.5"'),
    (_bad_line(weights=[0.2, 0.3, 0.5]), "3 weights for 2 experts"),
    (_bad_line(token="1"), 'token must be an integer, got "1"'),
    (_bad_line(token=1.5), "token must be an integer, got 1.5"),
    (_bad_line(token=-1), r"token -1 outside \[0, "),
    (_bad_line(layer=True), "layer must be an integer, got true"),
    (_bad_line(token_id=3.5), "token_id must be an integer, got 3.5"),
    (_bad_line(seq=None), "seq must be a non-empty string or an integer, got null"),
    (_bad_line(seq=[1]), r"seq must be a non-empty string or an integer, got \[1\]"),
    (_bad_line(phase="gen"), 'phase must be .prefill. or .decode., got "gen"'),
    (_bad_line(experts=_DROP), "missing field.*experts"),
    ("[1, 2]", "expected a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_import_cli_refuses_bad_rows_naming_file_and_line(tmp_path, capsys, line, message):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(_GOOD) + "\n" + line + "\n")
    out = tmp_path / "out"
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"expertcast traces import: error: {f}:2: ")
    import re

    assert re.search(message, err), err
    assert not out.exists()  # the file is validated before the output folder is touched


@pytest.mark.parametrize("argv,message", [
    (["--num-experts", "0"], "--num-experts: expected a positive integer, got 0"),
    (["--num-experts", "8", "--num-layers", "-1"], "--num-layers: expected a positive integer, got -1"),
    (["--num-experts", "8", "--expert-bytes", "-5"], "--expert-bytes: expected a non-negative integer, got -5"),
    (["--num-experts", "40000"], r"--num-experts must be in \[1, 32768\]"),
])
def test_import_cli_refuses_bad_flags(tmp_path, capsys, argv, message):
    f = _jsonl(tmp_path / "r.jsonl", [_GOOD])
    try:
        rc = traces_main(["import", str(f), "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:  # argparse refuses at parse time
        rc = e.code
    err = capsys.readouterr().err
    import re

    assert rc == 2 and err.count("\n") == 1 and re.search(message, err), err


def test_import_overwrite_never_deletes_foreign_files(tmp_path, capsys):
    f = _jsonl(tmp_path / "r.jsonl", [_GOOD])
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8", "--overwrite"]) == 2
    assert "not empty and was not written by expertcast" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8"]) == 0
    (out / "notes.txt").write_text("mine")
    assert traces_main(["import", str(f), "--out", str(out), "--num-experts", "8", "--overwrite"]) == 2
    assert "also holds files expertcast did not write (notes.txt)" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine" and len(load_traces(out)[1]) == 1


def test_stats_cli_errors_are_one_line(tmp_path, capsys):
    cases = {tmp_path / "missing": "does not exist", tmp_path / "plain": "not a trace set"}
    (tmp_path / "plain").mkdir()
    TraceWriter(tmp_path / "noshards", _meta()).close()
    cases[tmp_path / "noshards"] = "holds no shards"
    for d, msg in cases.items():
        assert traces_main(["stats", str(d)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("expertcast traces stats: error: ") and msg in err, err
    write_traces(tmp_path / "pre", TraceMeta("m", 1, 4, 2, 10), [TraceSequence(
        "x", np.arange(3, dtype=np.int32), 3, np.zeros((3, 1, 2), np.int16) + [0, 1], np.ones((3, 1, 2), np.float16))])
    assert traces_main(["stats", str(tmp_path / "pre"), "--phase", "decode"]) == 2
    assert "no decode positions" in capsys.readouterr().err


def test_corrupt_meta_or_manifest_is_named_on_resume(tmp_path):
    d = tmp_path / "t"
    write_traces(d, _meta(), _seqs(2))
    good = (d / MANIFEST_FILE).read_text()
    (d / MANIFEST_FILE).write_text('{"shards": []}')
    with pytest.raises(TraceFormatError, match=f"{d / MANIFEST_FILE} is corrupt"):
        TraceWriter(d, _meta())
    (d / MANIFEST_FILE).write_text(good)
    meta = json.loads((d / "trace_meta.json").read_text())
    (d / "trace_meta.json").write_text(json.dumps({**meta, "top_k": "2"}))
    with pytest.raises(TraceFormatError, match=r"trace_meta.json: L, E, K must be positive integers"):
        TraceWriter(d, _meta())
    (d / "trace_meta.json").write_text("[1, 2]")
    with pytest.raises(TraceFormatError, match="trace_meta.json is not a trace meta file"):
        load_traces(d)
