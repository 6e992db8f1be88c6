"""`expertcast stages calibrate | stats | detect | eval` end to end on a tiny model directory (a trained
byte-level BPE) and routing traces whose expert profile changes at "Wait" and stays at "So"; every
user mistake is one line on stderr and exit status 2; `--model tiny-default` resolves offline."""

from __future__ import annotations

import json

import numpy as np
import pytest
from expertcast.commands.stages import main
from expertcast.data.trace_format import TraceMeta, TraceSequence
from expertcast.data.traces import write_traces

L, E, K = 2, 32, 4


def _texts(rng: np.random.Generator, n: int) -> list[str]:
    words = ["x", "y", "z", "plus", "equals", "two", "three", "value", "term", "sum"]
    out = []
    for _ in range(n):
        parts = []
        for _s in range(6):
            cue = str(rng.choice(["Wait,", "So"]))
            body = " ".join(str(w) for w in rng.choice(words, size=int(rng.integers(25, 40))))
            parts.append(f"{cue} {body}.")
        out.append(" ".join(parts))
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from expertcast.models.tokenizer import train_bpe_tokenizer
    from transformers import Qwen3MoeConfig

    root = tmp_path_factory.mktemp("stages_cli")
    rng = np.random.default_rng(0)
    texts = _texts(rng, 6)
    tok = train_bpe_tokenizer(texts * 4, vocab_size=290)
    model = root / "model"
    # a model folder: config.json (stages reads only the tokenizer, so no weights) and this tokenizer
    Qwen3MoeConfig(vocab_size=len(tok), num_hidden_layers=L, num_experts=E, num_experts_per_tok=K).save_pretrained(model)
    tok.save_pretrained(model)
    w_id = tok.encode("Wait", add_special_tokens=False)[0]  # the token holding the cue's first character
    assert tok.decode([w_id]).startswith("W")
    seqs = []
    for i, text in enumerate(texts):
        ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int32)
        T = len(ids)
        # each "Wait" starts a new expert profile (a hot set of 6 experts per layer); "So" does not
        rows = np.empty((T, L, K), np.int16)
        for t in range(T):
            if t == 0 or int(ids[t]) == w_id:
                hot = np.stack([rng.choice(E, 6, replace=False) for _ in range(L)])
            for lyr in range(L):
                rows[t, lyr] = rng.choice(hot[lyr], K, replace=False)
        seqs.append(TraceSequence(f"s{i}", ids, 4, rows, np.full((T, L, K), 0.25, np.float16)))
    meta = TraceMeta(str(model), L, E, K, expert_bytes=1000)
    traces = write_traces(root / "traces", meta, seqs)
    gold = root / "gold.jsonl"
    with open(gold, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts[:3]):
            sents = [s.strip() + "." for s in text.split(".") if s.strip()]
            chunks = [{"text": s, "function_tags": ["uncertainty_management" if s.startswith("Wait") else
                                                    "active_computation"]} for s in sents]
            f.write(json.dumps({"id": i, "thinking": text, "chunks": chunks}) + "\n")
    return root, model, traces, gold


IN_SAMPLE = ["--split", "all", "--allow-overlap"]
"""The cue set below is calibrated on every trace: its eval is in-sample, explicitly (reported in guard.json)."""


def test_calibrate_stats_detect_eval(setup, capsys):
    root, model, traces, gold = setup
    cues = model / "cues.json"
    assert main(["calibrate", "--traces", str(traces), "--model", str(model), "--out", str(cues),
                 "--min-rate", "1", "--min-stage-tokens", "4"]) == 0
    cs = json.loads(cues.read_text())
    sc = cs["scores"]
    assert set(cs["cues"]) <= {"Wait", "So"} and sc["Wait"]["count"] > 0 and sc["So"]["count"] > 0
    # every "Wait" plants a new profile: adjacent Wait-stages are less alike than uniform chunks, so the
    # finished stage mispredicts the next and calibration must not prefer Wait over So
    assert sc["Wait"]["tcseq"] < sc["Wait"]["tcseq_uniform"] and sc["Wait"]["tcseq"] < sc["So"]["tcseq"]
    assert cs["cues"] == ["So"]
    # stats and eval find the cue set in the model directory
    out = root / "out"
    assert main(["stats", "--traces", str(traces), "--model", str(model), "--out", str(out / "stats")]) == 0
    out_stats = out / "stats"
    st = json.loads((out_stats / "stage_stats.json").read_text())
    assert st["cues"] == "So" and st["stages"] > st["sequences"] and 0 < st["tcseq"] <= 1
    assert (out_stats / "tcseq_layers.csv").is_file() and (out_stats / "stage_stats.png").is_file()
    assert main(["detect", "--gold", str(gold), "--model", str(model), "--cues", str(cues),
                 "--out", str(out / "detect")]) == 0
    det = json.loads((out / "detect" / "detect_gold.json").read_text())
    full = [r for r in det if r["cue_set"].startswith("all candidates") and r["tolerance_tokens"] == 4][0]
    assert full["recall"] == pytest.approx(1.0) and 0.2 < full["precision"] < 0.8  # Wait = gold, So = not
    out = out / "eval"
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2", *IN_SAMPLE,
                 "--capacity", "0.03,0.25", "--policies", "stage,stage-oracle,lru,static",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "saem_eval.json").read_text())
    assert len(rows) == 2 * 4 and (out / "saem_eval.png").is_file() and (out / "saem_eval.csv").is_file()
    assert {r["slots_per_layer"] for r in rows} == {1, 8}  # 3% of 32 experts: 1 slot < top-4, accepted
    by = {(r["capacity"], r["policy"]): r for r in rows}
    for cap in (0.03, 0.25):
        st, lru = by[cap, "stage"], by[cap, "lru"]
        assert 0 < st["oracle_eff_hit"] <= 1.0 + 1e-9 and st["updates"] > 0
        assert st["cpu_share"] > 0 and st["transfers_per_token"] < lru["transfers_per_token"]
        assert lru["cpu_share"] == 0 and lru["speedup_vs_lru"] == pytest.approx(1.0)
    # resume: a second run reuses every record of the partial file
    partial = json.loads((out / "partial-cot.json").read_text())
    assert len(partial["records"]) == len(rows) and partial["settings"]["cues"] == ["So"]
    capsys.readouterr()
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2", *IN_SAMPLE,
                 "--capacity", "0.03,0.25", "--policies", "stage,stage-oracle,lru,static",
                 "--out", str(out)]) == 0
    assert json.loads((out / "saem_eval.json").read_text()) == rows
    # other settings (another expert size) must not silently reuse those records
    capsys.readouterr()
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2", *IN_SAMPLE, "--capacity", "0.25",
                 "--policies", "lru", "--expert-bytes", "1000000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other settings: cost:" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    # --overwrite starts over with the new settings
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--batch-sizes", "2", *IN_SAMPLE, "--slots", "2",
                 "--policies", "lru", "--expert-bytes", "1000000", "--out", str(out), "--overwrite"]) == 0
    (row,) = json.loads((out / "saem_eval.json").read_text())
    assert row["slots_per_layer"] == 2 and row["capacity"] == pytest.approx(2 / E)


def test_errors_name_the_problem(setup, tmp_path, capsys):
    root, model, traces, gold = setup
    bare = tmp_path / "bare"
    bare.mkdir()
    assert main(["stats", "--traces", str(traces), "--model", str(bare), "--out", str(tmp_path / "o")]) == 2
    assert "has no cues.json" in capsys.readouterr().err
    assert main(["eval", "--traces", str(tmp_path / "none"), "--cues", "x.json", "--out", str(tmp_path / "o")]) == 2
    assert "no such trace folder" in capsys.readouterr().err


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, stderr and stdout of `expertcast stages ...` (argparse errors exit via SystemExit)."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.err, cap.out


@pytest.fixture(scope="module")
def bad_files(setup, tmp_path_factory):
    """A foreign file, a foreign JSON, a cue set of another model (same shape), a non-empty foreign folder."""
    from expertcast.inference.saem.cues import CueSet

    d = tmp_path_factory.mktemp("bad")
    (d / "notes.txt").write_text("my notes\n")
    (d / "other.json").write_text('{"hello": 1}\n')
    CueSet(cues=["So"], model_id="other/model", expert_frequency=np.zeros((L, E)).tolist()).save(d / "foreign_cues.json")
    (d / "busy").mkdir()
    (d / "busy" / "data.csv").write_text("a,b\n")
    return d


BAD_INPUTS = [
    # (arguments, words the one-line message must contain); {T} traces, {M} model, {G} gold, {B} bad files
    (["calibrate", "--traces", "{B}/missing", "--out", "{B}/c.json"], "no such trace folder"),
    (["calibrate", "--traces", "{T}", "--model", "{B}/nope", "--out", "{B}/c.json"], "no such local directory"),
    (["calibrate", "--traces", "{T}", "--model", "{M}", "--out", "{B}/notes.txt"], "is not a cue set"),
    (["calibrate", "--traces", "{T}", "--model", "{M}", "--out", "{B}"], "is a folder"),
    (["calibrate", "--traces", "{T}", "--out", "{B}/c.json", "--max-noise", "1.5"], "fraction in [0, 1]"),
    (["calibrate", "--traces", "{T}", "--out", "{B}/c.json", "--min-rate", "-1"], "non-negative"),
    (["calibrate", "--traces", "{T}", "--out", "{B}/c.json", "--max-cues", "zero"], "positive integer"),
    (["calibrate", "--traces", "{T}", "--model", "{M}", "--out", "{B}/c.json", "--candidates", "{B}/none.txt"],
     "does not exist"),
    (["stats", "--traces", "{T}", "--cues", "{B}/missing.json", "--out", "{B}/o1"], "does not exist"),
    (["stats", "--traces", "{T}", "--cues", "{B}/other.json", "--out", "{B}/o1"], "not an expertcast cue set"),
    (["stats", "--traces", "{T}", "--cues", "{B}/foreign_cues.json", "--out", "{B}/o1"],
     "calibrated on model 'other/model' but the traces"),
    (["stats", "--traces", "{T}", "--model", "{M}", "--cues", "{B}/foreign_cues.json", "--out-dir", "{B}/o1"],
     "unrecognized arguments: --out-dir"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--capacity", "8", "--out", "{B}/o2"], "outside (0, 1]"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--slots", "0", "--out", "{B}/o2"], "at least 1"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--capacities", "0.1", "--out", "{B}/o2"],
     "unrecognized arguments: --capacities"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--batch-sizes", "0", "--out", "{B}/o2"], "--batch-sizes: 0"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--policies", "lru,bogus", "--out", "{B}/o2"], "unknown bogus"),
    (["eval", "--out", "{B}/o2"], "nothing to evaluate"),
    (["eval", "--synthetic", "--out", "{B}/busy"], "not written by expertcast"),
    (["eval", "--traces", "{T}", "--model", "{M}", "--expert-bytes", "-5", "--out", "{B}/o2"], "positive integer"),
    (["detect", "--gold", "{B}/missing.jsonl", "--model", "{M}", "--out", "{B}/o3"], "no such file"),
    (["detect", "--gold", "{G}", "--model", "{M}", "--tolerances", "a", "--out", "{B}/o3"], "not an integer"),
    (["detect", "--gold", "{G}", "--out", "{B}/o3"], "give --model"),
]


@pytest.mark.parametrize("argv,words", BAD_INPUTS, ids=[" ".join(a[:1] + [w]) for a, w in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(setup, bad_files, argv, words, capsys):
    root, model, traces, gold = setup
    argv = [a.format(T=traces, M=model, G=gold, B=bad_files) for a in argv]
    rc, err, _ = _run(argv, capsys)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("expertcast stages") and "error:" in lines[0], err
    assert words in lines[0], lines[0]
    assert (bad_files / "notes.txt").read_text() == "my notes\n"  # a foreign file is never replaced
    assert not (bad_files / "o2").exists() or not any((bad_files / "o2").iterdir())


def test_calibrate_model_tiny_default_resolves_offline(setup, tmp_path, monkeypatch, capsys, data_dir):
    """`--model tiny-default` goes through the one resolver: the shipped default model's tokenizer, no Hub."""
    from expertcast.models.names import SHIPPED_DEFAULT_DIR

    root, model, traces, gold = setup
    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCAST_DATA_DIR", str(data_dir))
    out = tmp_path / "cues.json"
    rc, err, _ = _run(["calibrate", "--traces", str(traces), "--model", "tiny-default", "--out", str(out),
                       "--min-stage-tokens", "4"], capsys)
    assert rc == 0, err
    assert f"embedded default model at {SHIPPED_DEFAULT_DIR}" in err
    cs = json.loads(out.read_text())
    assert cs["tokenizer"] == "tiny-default" and cs["cues"]
    # the cue set of a calibrate run replaces an earlier cue set, never a foreign file
    rc, err, stdout = _run(["calibrate", "--traces", str(traces), "--model", "tiny-default", "--out", str(out),
                            "--min-stage-tokens", "4"], capsys)
    assert rc == 0 and f"replaced the cue set {out}" in stdout, err


def test_calibrate_refuses_token_ids_beyond_the_tokenizer(setup, tmp_path, capsys):
    """Traces of a random-init preset hold ids past the tokenizer: one line naming the first few and a count."""
    root, model, traces, gold = setup
    rng = np.random.default_rng(1)
    seqs = [TraceSequence(f"r{i}", rng.integers(0, 100_000, 400).astype(np.int32), 4,
                          rng.integers(0, E, (400, L, K)).astype(np.int16), np.full((400, L, K), 0.25, np.float16))
            for i in range(3)]
    bad = write_traces(tmp_path / "random", TraceMeta(str(model), L, E, K, expert_bytes=1000), seqs)
    rc, err, _ = _run(["calibrate", "--traces", str(bad), "--model", str(model), "--out", str(tmp_path / "c.json")],
                      capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "outside the tokenizer's vocabulary" in lines[0], err
    assert " ..." in lines[0] and len(lines[0]) < 400  # the first few ids and a count, not every id
    assert not (tmp_path / "c.json").exists()


def test_eval_wandb_run_declares_its_traces_and_cue_set(setup, tmp_path, wandb_dir, offline_contents):
    from expertcast.data.trace_format import sequences_fingerprint
    from expertcast.data.traces import load_traces
    from expertcast.utils.provenance import sha256_file

    root, model, traces, _ = setup
    cues = tmp_path / "cues.json"
    assert main(["calibrate", "--traces", str(traces), "--model", str(model), "--out", str(cues), "--heldout", "0.5",
                 "--min-rate", "1", "--min-stage-tokens", "4"]) == 0
    assert main(["eval", "--traces", str(traces), "--model", str(model), "--cues", str(cues), "--batch-sizes", "2",
                 "--capacity", "0.25", "--policies", "stage,lru", "--out", str(tmp_path / "eval"),
                 "--wandb", "--wandb-project", "t"]) == 0
    [run] = sorted((wandb_dir / "wandb").glob("offline-run-*"))
    got = offline_contents(run, lambda c: len([a for a in c["artifacts"] if a["used"]]) == 2)
    used = {a["type"]: a for a in got["artifacts"] if a["used"]}
    assert used["cue-set"]["sha256"] == sha256_file(cues) and used["cue-set"]["files"] == ["cues.json"]
    assert used["trace-set"]["sha256"] == sequences_fingerprint(load_traces(traces)[1])


def test_eval_scores_only_held_out_sequences(setup, tmp_path, capsys):
    """calibrate --heldout keeps a hash split of the traces out of the cue set; eval scores only those; an
    in-sample eval (--split all) is refused unless --allow-overlap, then reported in guard.json."""
    from expertcast.utils.provenance import split_of

    root, model, traces, gold = setup
    cues = tmp_path / "cues.json"
    assert main(["calibrate", "--traces", str(traces), "--model", str(model), "--out", str(cues), "--heldout", "0.5",
                 "--min-rate", "1", "--min-stage-tokens", "4"]) == 0
    cal = json.loads(cues.read_text())["calibration"]
    held = {f"s{i}" for i in range(6) if split_of(f"s{i}", 0.5) == "val"}
    assert 0 < len(held) < 6 and set(cal["sequence_ids"]) == {f"s{i}" for i in range(6)} - held
    assert cal["model"]["path"] == str(model)
    args = ["eval", "--traces", str(traces), "--cues", str(cues), "--model", str(model), "--batch-sizes", "1",
            "--capacity", "0.25", "--policies", "lru,stage"]
    assert main([*args, "--out", str(tmp_path / "e1")]) == 0
    guard = json.loads((tmp_path / "e1" / "guard.json").read_text())["cue_set"]
    assert guard["overlap"] == 0 and guard["evaluated"] == len(held) and guard["model_match"] is True
    capsys.readouterr()
    rc, err, _ = _run([*args, "--split", "all", "--out", str(tmp_path / "e2")], capsys)
    assert rc == 2 and "were used to train the cue set" in err and "--allow-overlap" in err
    assert main([*args, "--split", "all", "--allow-overlap", "--out", str(tmp_path / "e3")]) == 0
    guard = json.loads((tmp_path / "e3" / "guard.json").read_text())["cue_set"]
    assert guard["overlap"] == 6 - len(held) and guard["allowed"] is True


def test_eval_refuses_another_models_routing(setup, tmp_path, capsys):
    """A cue set calibrated on one model's routing, scored on traces of another model (same shape), is refused
    unless --allow-model-mismatch; then the title and guard.json say so."""
    from expertcast.data.traces import iter_traces, read_meta, write_traces

    root, model, traces, gold = setup
    cues = tmp_path / "cues.json"
    assert main(["calibrate", "--traces", str(traces), "--model", str(model), "--out", str(cues), "--heldout", "0.5",
                 "--min-rate", "1", "--min-stage-tokens", "4"]) == 0
    meta = read_meta(traces)
    meta.model_id = "org/router-adapted"
    other = write_traces(tmp_path / "other", meta, list(iter_traces(traces, read_meta(traces))))
    args = ["eval", "--traces", str(other), "--cues", str(cues), "--model", str(model), "--batch-sizes", "1",
            "--capacity", "0.25", "--policies", "lru"]
    rc, err, _ = _run([*args, "--out", str(tmp_path / "m1")], capsys)
    assert rc == 2 and "'org/router-adapted'" in err and "--allow-model-mismatch" in err
    assert main([*args, "--allow-model-mismatch", "--out", str(tmp_path / "m2")]) == 0
    out = capsys.readouterr().out
    assert "--allow-model-mismatch" in out
    guard = json.loads((tmp_path / "m2" / "guard.json").read_text())["cue_set"]
    assert guard["model_match"] is False and guard["scored_model"]["path"] == "org/router-adapted"
