"""Every command, fed its typical bad inputs, exits 2 with one line naming the problem (no traceback).

Set ``EXPERTCAST_BAD_INPUT_TABLE=PATH`` to also write the table (command, input, exit code, message)
as markdown, e.g. for an issue's closing note.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from expertcast.cli import main as cli_main

ROWS: list[tuple[str, str, int, str]] = []


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with a small trace set, a trace set with no decode tokens, a foreign folder, bad imports
    and a cue set of another model."""
    from expertcast.data.synthetic import zipf_traces
    from expertcast.data.trace_format import TraceSequence
    from expertcast.data.traces import write_traces

    w = tmp_path_factory.mktemp("bad-inputs")
    tr = zipf_traces(num_sequences=3, num_tokens=24, num_layers=2, num_experts=8, top_k=2)
    write_traces(w / "traces", tr.meta, tr.sequences)
    prefill_only = [TraceSequence(s.seq_id, s.token_ids, s.num_tokens, s.expert_ids, s.expert_weights)
                    for s in tr.sequences]
    write_traces(w / "prefill-only", tr.meta, prefill_only)
    (w / "foreign").mkdir()
    (w / "foreign" / "notes.txt").write_text("not expertcast's")
    rows = {"string-experts": {"experts": "12"}, "float-experts": {"experts": [1.7, 2]},
            "nan-weight": {"weights": [float("nan"), 0.5]}, "negative-weight": {"weights": [-0.25, 1.0]},
            "inf-weight": {"weights": [float("inf"), 0.5]}}
    good = {"seq": "a", "token": 0, "layer": 0, "experts": [1, 2], "weights": [0.5, 0.5], "phase": "decode"}
    for name, patch in rows.items():
        lines = [json.dumps(good), json.dumps({**good, "token": 1, **patch})]
        (w / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    from expertcast.inference.saem.cues import CueSet

    CueSet(cues=["Wait"], model_id="other/model").save(w / "foreign-cues.json")
    from expertcast.utils.outdir import claim_output_dir

    with claim_output_dir(w / "bad-settings", "simulate") as od:  # a simulate output whose settings are no object
        od.file("simulate.settings.json").write_text(json.dumps({"settings": 5}))
    (w / "nested.json").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    return w


TINY_EVAL = ["eval", "--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--limit", "1", "--max-new-tokens", "2"]

CASES: list[tuple[str, list[str], str]] = [
    # (id, argv with {w} for the work folder, a fragment the one error line must contain)
    ("collect-limit-negative", ["collect", "--model", "qwen3_moe-tiny", "--limit", "-1", "--out", "{w}/c1"], "--limit"),
    ("collect-limit-zero", ["collect", "--model", "qwen3_moe-tiny", "--limit", "0", "--out", "{w}/c2"], "--limit"),
    ("collect-out-dot", ["collect", "--model", "qwen3_moe-tiny", "--limit", "1", "--out", "."], "current working"),
    ("collect-out-dot-overwrite", ["collect", "--model", "qwen3_moe-tiny", "--limit", "1", "--out", ".",
                                   "--overwrite"], "current working"),
    ("collect-foreign-folder", ["collect", "--model", "qwen3_moe-tiny", "--limit", "1", "--out", "{w}/foreign"],
     "not written by expertcast"),
    ("collect-unknown-model", ["collect", "--model", "./no-such-model", "--limit", "1", "--out", "{w}/c3"],
     "no-such-model"),
    ("import-string-experts", ["traces", "import", "{w}/string-experts.jsonl", "--num-experts", "8", "--out",
                               "{w}/i1"], ":2"),
    ("import-float-experts", ["traces", "import", "{w}/float-experts.jsonl", "--num-experts", "8", "--out",
                              "{w}/i2"], ":2"),
    ("import-nan-weight", ["traces", "import", "{w}/nan-weight.jsonl", "--num-experts", "8", "--out", "{w}/i3"],
     "not finite"),
    ("import-inf-weight", ["traces", "import", "{w}/inf-weight.jsonl", "--num-experts", "8", "--out", "{w}/i4"],
     "not finite"),
    ("import-negative-weight", ["traces", "import", "{w}/negative-weight.jsonl", "--num-experts", "8", "--out",
                                "{w}/i5"], "-0.25"),
    ("import-overwrite-foreign", ["traces", "import", "{w}/string-experts.jsonl", "--num-experts", "8", "--out",
                                  "{w}/foreign", "--overwrite"], ":2"),
    ("stats-missing", ["traces", "stats", "{w}/nope"], "nope"),
    ("simulate-unknown-option", ["simulate", "--traces", "{w}/traces", "--policies", "lru:foo=1", "--out", "{w}/s1"],
     "foo"),
    ("simulate-misspelt-option", ["simulate", "--traces", "{w}/traces", "--policies", "lrfu:lamda=0.1", "--out",
                                  "{w}/s2"], "lam"),
    ("simulate-calibration-not-traces", ["simulate", "--traces", "{w}/traces", "--policies",
                                         "static:calibration=/etc/passwd", "--out", "{w}/s3"], "/etc/passwd"),
    ("simulate-unknown-policy", ["simulate", "--traces", "{w}/traces", "--policies", "nope", "--out", "{w}/s4"],
     "nope"),
    ("simulate-capacity-above-1", ["simulate", "--traces", "{w}/traces", "--capacity", "1.5", "--out", "{w}/s5"],
     "(0, 1]"),
    ("simulate-slots-below-topk", ["simulate", "--traces", "{w}/traces", "--slots", "1", "--out", "{w}/s6"], "top-K"),
    ("simulate-no-decode-tokens", ["simulate", "--traces", "{w}/prefill-only", "--out", "{w}/s7"], "decode"),
    ("simulate-max-sequences-zero", ["simulate", "--traces", "{w}/traces", "--max-sequences", "0", "--out",
                                     "{w}/s8"], "--max-sequences"),
    ("simulate-settings-not-an-object", ["simulate", "--traces", "{w}/traces", "--capacity", "0.5", "--out",
                                         "{w}/bad-settings"], "no JSON object"),
    ("import-deeply-nested", ["traces", "import", "{w}/nested.json", "--out", "{w}/i6"], "nested too deeply"),
    ("simulate-out-dot", ["simulate", "--traces", "{w}/traces", "--capacity", "0.5", "--out", "."], "current working"),
    ("forecast-eval-missing-export", ["forecast-eval", "--forecaster", "{w}/nope", "--traces", "{w}/traces",
                                      "--out", "{w}/f1"], "nope"),
    ("fit-missing-config", ["fit", "--config", "{w}/nope.yaml"], "nope.yaml"),
    ("eval-unknown-policy", [*TINY_EVAL, "--policy", "nope", "--capacity", "0.5", "--out", "{w}/e1"], "nope"),
    ("eval-bad-option", [*TINY_EVAL, "--policy", "lru:foo=1", "--capacity", "0.5", "--out", "{w}/e2"], "foo"),
    ("eval-capacity-above-1", [*TINY_EVAL, "--policy", "lru", "--capacity", "1.5", "--out", "{w}/e3"], "(0, 1]"),
    ("eval-slots-below-topk", [*TINY_EVAL, "--policy", "lru", "--slots", "1", "--out", "{w}/e4"], "top-K"),
    ("eval-slots-above-E", [*TINY_EVAL, "--policy", "lru", "--slots", "1000", "--out", "{w}/e5"], "1000"),
    ("eval-max-new-tokens-zero", ["eval", "--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--limit", "1",
                                  "--max-new-tokens", "0", "--policy", "lru", "--capacity", "0.5", "--out", "{w}/e6"],
     "--max-new-tokens"),
    ("eval-limit-negative", ["eval", "--model", "qwen3_moe-tiny", "--benchmark", "gsm8k", "--limit", "-1",
                             "--policy", "lru", "--capacity", "0.5", "--out", "{w}/e7"], "--limit"),
    ("eval-negative-link", [*TINY_EVAL, "--policy", "lru", "--capacity", "0.5", "--link-gbps", "-1", "--out",
                            "{w}/e8"], "--link-gbps"),
    ("eval-cues-of-another-model", [*TINY_EVAL, "--policy", "stage:cue_set={w}/foreign-cues.json", "--capacity",
                                    "0.5", "--out", "{w}/e10"], "other/model"),
    ("stages-out-dir-spelling", ["stages", "eval", "--synthetic", "--out-dir", "{w}/st1"], "--out-dir"),
    ("stages-capacities-spelling", ["stages", "eval", "--synthetic", "--capacities", "0.1", "--out", "{w}/st2"],
     "--capacities"),
    ("stages-calibrate-missing-traces", ["stages", "calibrate", "--traces", "{w}/nope", "--model", "qwen3_moe-tiny",
                                         "--out", "{w}/cues.json"], "nope"),
    ("router-eval-heldout-count", ["router-eval", "--heldout", "96", "--out", "{w}/r1"], "--heldout"),
    ("router-eval-steps-zero", ["router-eval", "--steps", "0", "--out", "{w}/r2"], "--steps"),
    ("build-default-time-budget", ["build-default", "--time-budget", "60"], "--time-budget"),
]
if not __import__("torch").cuda.is_available():
    CASES.append(("eval-cuda-without-cuda", [*TINY_EVAL, "--policy", "lru", "--capacity", "0.5", "--device", "cuda",
                                             "--out", "{w}/e9"], "CUDA"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(case, work, capsys, monkeypatch):
    name, argv, fragment = case
    monkeypatch.chdir(work)
    argv = [a.replace("{w}", str(work)) for a in argv]
    try:
        rc = cli_main(argv)
    except SystemExit as e:  # argparse errors
        rc = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "warn" not in ln.lower()]
    shown = " ".join(a if str(work) not in a else a.replace(str(work), "W") for a in argv)
    ROWS.append((argv[0] if argv[0] not in ("traces", "stages") else " ".join(argv[:2]), shown, rc,
                 (lines[-1] if lines else "").replace(str(work), "W")))
    assert rc == 2, f"{name}: exit {rc}\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1 and "error:" in lines[0], f"{name}: expected one error line, got:\n{err}"
    assert fragment in lines[0], f"{name}: {fragment!r} not in {lines[0]!r}"
    assert (work / "foreign" / "notes.txt").read_text() == "not expertcast's"


def teardown_module(module) -> None:
    path = os.environ.get("EXPERTCAST_BAD_INPUT_TABLE")
    if path and ROWS:
        body = "\n".join(f"| {c} | `{a}` | {rc} | {m.replace('|', '/')} |" for c, a, rc, m in ROWS)
        Path(path).write_text("| command | input | exit | message |\n|---|---|---|---|\n" + body + "\n")
