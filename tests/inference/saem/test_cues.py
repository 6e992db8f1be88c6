"""Cue sets: subset selection from one all-matches pass, stage statistics, calibration pruning, JSON."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from expertcast.inference.saem.cues import (
    CalibrationConfig,
    CalibSequence,
    CueSet,
    adjacent_cosine,
    calibrate,
    raw_matches,
    segmentation_stats,
    select_boundaries,
    stage_counts,
    stage_starts,
    uniform_starts,
)
from expertcast.inference.saem.stages import detect_offline

WORDS = [" Wait", ",", " So", " Some", " x", " y", ".", " Let", " me", " check", " Therefore", " Hmm", " Rare"]


def _dec(i: int) -> bytes:
    return WORDS[i].encode()


def test_select_boundaries_equals_detector_with_subset():
    rng = random.Random(0)
    cands = ["Wait", "So", "Let me", "Let me check", "me check", "Therefore", "Hmm", "Wait, So"]
    for _ in range(30):
        ids = [rng.randrange(len(WORDS)) for _ in range(rng.randint(5, 80))]
        raw = raw_matches([CalibSequence("s", np.array(ids), np.zeros((len(ids), 1, 1), np.int16))], _dec, cands)[0]
        for _ in range(5):
            sub = sorted(rng.sample(range(len(cands)), rng.randint(1, len(cands))))
            want = detect_offline([cands[i] for i in sub], ids, _dec)
            got = select_boundaries(raw, set(sub))
            assert [(e.char_start, e.char_end, cands[e.cue]) for e in got] == \
                [(e.char_start, e.char_end, [cands[i] for i in sub][e.cue]) for e in want]


def test_stage_counts_and_tcseq():
    # T=6, L=2, K=1: stage 0 = positions 0-2, stage 1 = 3-5
    e = np.array([[[0], [1]], [[0], [1]], [[1], [1]], [[2], [3]], [[2], [3]], [[2], [1]]], np.int16)
    starts = stage_starts([], 6)
    assert starts.tolist() == [0]
    c = stage_counts(e, np.array([0, 3]), 4)
    assert c.shape == (2, 2, 4)
    assert c[0, 0].tolist() == [2, 1, 0, 0] and c[1, 1].tolist() == [0, 1, 0, 2]
    cos = adjacent_cosine(c)
    assert cos.shape == (1, 2)
    assert cos[0, 0] == pytest.approx(0.0)
    assert cos[0, 1] == pytest.approx(3 / (3 * np.sqrt(5)))
    assert uniform_starts(10, 3).tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="outside"):
        stage_counts(e, starts, 3)


def _planted(seed: int = 0, n_seq: int = 6, T: int = 600):
    """Tokens and routing where 'Wait' starts coherent stages, 'Therefore' starts an abrupt change of
    routing, 'So' is every few tokens (noise) and 'Rare' occurs once."""
    rng = np.random.default_rng(seed)
    L, E = 2, 16
    seqs = []
    for s in range(n_seq):
        ids, route = [], []
        base = rng.dirichlet(np.ones(E) * 2, size=L)
        t = 0
        abrupt = 0
        while t < T:
            r = rng.random()
            if t % 100 == 0 and t:
                tok = 0  # Wait
            elif t % 150 == 75:
                tok, abrupt = 10, 40  # Therefore: the next 40 tokens route to experts 14/15 only
            elif t % 7 == 3:
                tok = 2  # So
            elif t == 333 and s == 0:
                tok = 12  # Rare
            else:
                tok = 4 if r < 0.5 else 5
            ids.append(tok)
            if abrupt:
                route.append([[14], [15]])
                abrupt -= 1
            else:
                route.append([[rng.choice(E, p=base[lyr])] for lyr in range(L)])
            t += 1
        seqs.append(CalibSequence(f"s{s}", np.array(ids), np.array(route, np.int16)))
    return seqs


def test_calibration_prunes_rare_noisy_and_incoherent_cues(tmp_path):
    seqs = _planted()
    cfg = CalibrationConfig(min_stage_tokens=16, min_rate_per_1k=1.0, max_noise=0.3, tcseq_tolerance=0.02)
    cs = calibrate(seqs, _dec, 16, ["Wait", "So", "Therefore", "Rare", "Never"], cfg, model_id="m", tokenizer_id="t")
    assert cs.cues == ["Wait"]
    sc = cs.scores
    assert sc["Wait"]["kept"] and sc["Wait"]["count"] == 6 * 5
    assert sc["So"]["reason"].startswith("noisy")
    assert sc["Therefore"]["reason"].startswith("incoherent")
    assert sc["Rare"]["reason"].startswith("rare") and sc["Never"]["count"] == 0
    assert np.asarray(cs.expert_frequency).shape == (2, 16)
    # round trip and validation
    p = tmp_path / "cues.json"
    cs.save(p)
    back = CueSet.load(p)
    assert back.cues == cs.cues and back.scores == json.loads(p.read_text())["scores"]
    d = json.loads(p.read_text())
    d["format_version"] = 99
    (tmp_path / "new.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="format_version 99"):
        CueSet.load(tmp_path / "new.json")
    (tmp_path / "foreign.json").write_text(json.dumps({"cues": ["x"]}))
    with pytest.raises(ValueError, match="not an expertcast cue set"):
        CueSet.load(tmp_path / "foreign.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CueSet.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="L=2, E=16"):
        back.check_compatible(4, 16)


def test_segmentation_stats_against_controls():
    seqs = _planted(1)
    starts = []
    for s in seqs:
        ev = detect_offline(["Therefore"], s.token_ids.tolist(), _dec)
        starts.append(stage_starts(ev, len(s.token_ids)))
    st = segmentation_stats([s.expert_ids for s in seqs], starts, 16, min_stage_tokens=16)
    summ = st.summary()
    assert summ["stages"] == sum(len(x) for x in starts)
    assert summ["stage_len_min"] >= 1 and summ["stage_len_max"] <= 600
    # boundaries at abrupt routing changes make adjacent stages less similar than uniform cuts
    assert st.tcseq < st.tcseq_uniform - 0.02
    assert st.tcseq_layer.shape == (2,)


@pytest.mark.parametrize("content,words", [
    ('{"format": "expertcast.saem.cueset", "format_version": 1, "cues": []}', "non-empty list of strings"),
    ('{"format": "expertcast.saem.cueset", "format_version": 1, "cues": ["So", 3]}', "non-empty list of strings"),
    ('{"format": "expertcast.saem.cueset", "format_version": 0, "cues": ["So"]}', "format_version 0"),
    ('{"format": "expertcast.saem.cueset", "format_version": 1, "cues": ["So"], "expert_frequency": [1, 2]}',
     r"must be \[L\]\[E\], got shape \(2,\)"),
    ('{"format": "expertcast.saem.cueset", "format_version": 1, "cues": ["So"], "expert_frequency": [["a"]]}',
     "list of numbers"),
    ("[1, 2]", "not an expertcast cue set"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_cue_set_validation_is_a_usage_error(tmp_path, content, words):
    from expertcast.utils.errors import UsageError

    p = tmp_path / "cues.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UsageError, match=words) as e:
        CueSet.load(p)
    assert str(p) in str(e.value)


def test_cue_set_model_check_names_both_models(tmp_path):
    from expertcast.utils.errors import UsageError

    cs = CueSet(cues=["So"], model_id="org/model-a")
    cs.check_model("org/model-a")
    cs.check_model(None)  # traces that name no model: nothing to compare
    with pytest.raises(UsageError, match="'org/model-a' but the traces come from model 'org/model-b'"):
        cs.check_model("org/model-b")
    # two spellings of one folder are one model
    (tmp_path / "m").mkdir()
    CueSet(cues=["So"], model_id=str(tmp_path / "m")).check_model(str(tmp_path / "." / "m"))


def test_load_tokenizer_of_a_preset_needs_no_hub():
    from expertcast.models.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3_moe-tiny")
    assert tok.decode(tok.encode("Wait, so", add_special_tokens=False)) == "Wait, so"
    with pytest.raises(FileNotFoundError, match="cannot load a tokenizer from"):
        load_tokenizer("/nonexistent/tokenizer-folder")


def test_load_tokenizer_resolves_the_default_model_name_through_the_one_resolver(monkeypatch, tmp_path):
    """A cue set records its tokenizer as --model named it (`tiny-default`); eval, sweep and simulate read it
    through the one model resolver (expertcast.models.names): the shipped default's tokenizer, nothing built."""
    from expertcast.models.tokenizer import load_tokenizer

    monkeypatch.setenv("EXPERTCAST_CACHE_DIR", str(tmp_path / "cache"))
    tok = load_tokenizer("tiny-default")
    assert tok.decode(tok.encode("Wait, so", add_special_tokens=False)) == "Wait, so"
    assert len(tok) == 4096 and not (tmp_path / "cache").exists()
    with pytest.raises(FileNotFoundError, match="cannot load a tokenizer from"):  # a missing path stays missing
        load_tokenizer("/nonexistent/tokenizer-folder")
