"""Streaming stage-boundary detector: split cues, sequence starts, overlaps, batches, regex equality."""

from __future__ import annotations

import codecs
import json
import random
import re

import pytest
from expertcast.inference.saem.stages import StageDetector, TokenDecoder, detect_offline, is_word_char


def _table_decoder(pieces: list[str]):
    table = [p.encode("utf-8") for p in pieces]
    return lambda i: table[i]


def _events(cues, pieces, **kw):
    det = StageDetector(cues, _table_decoder(pieces), **kw)
    ev = []
    for i in range(len(pieces)):
        ev += det.feed_token(0, i)
    return ev + det.flush()


def test_cue_split_across_subword_tokens():
    pieces = ["So", " far", ".", " Altern", "atively", ",", " try", " x", "."]
    ev = _events(["Alternatively"], pieces)
    assert len(ev) == 1
    e = ev[0]
    assert (e.start_token, e.token_index) == (3, 5)  # starts in " Altern", confirmed by ","
    assert "".join(pieces)[e.char_start:e.char_end] == "Alternatively"


def test_cue_split_across_single_byte_tokens_of_byte_level_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"ĠAltern": 0, "atively": 1, ",": 2, "Ġx": 3, "Ã": 4, "©": 5, "W": 6, "ait": 7}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    dec = TokenDecoder(tok)
    assert dec.kind == "byte_level"
    assert dec(0) == b" Altern" and dec(4) + dec(5) == "é".encode()
    det = StageDetector(["Alternatively", "Wait"], dec)
    # "é" split over two byte tokens directly before a cue: the cue must still see a non-word neighbour?
    # no: "é" is a letter, so "éWait" is not at a word boundary; " Alternatively," is.
    ev = []
    for t in [4, 5, 6, 7, 2, 0, 1, 2]:
        ev += det.feed_token(0, t)
    assert [det.cues[e.cue] for e in ev] == ["Alternatively"]
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        dec(999)


def test_cue_at_sequence_start_and_end():
    ev = _events(["Wait", "Therefore"], ["Wait", ",", " so", " Therefore"])
    assert [(e.cue, e.start_token, e.token_index) for e in ev] == [(0, 0, 1), (1, 3, 3)]  # last via flush


def test_word_boundaries_and_case():
    text_pieces = ["awaited", " Waiting", " Wait", "ed", " wait", " Some", " So", ",", " (Wait)", " x_Wait"]
    ev = _events(["Wait", "So"], text_pieces)
    got = ["".join(text_pieces)[e.char_start:e.char_end] + f"@{e.start_token}" for e in ev]
    assert got == ["So@6", "Wait@8"]
    ev_ci = _events(["wait"], text_pieces, ignore_case=True)
    assert [e.start_token for e in ev_ci] == [4, 8]


def test_overlapping_cues_emit_one_boundary():
    pieces = ["Wait", ", let", " me", " check", " this", ". Let", " me", " check", " again"]
    ev = _events(["Wait", "Wait, let me check", "Let me", "Let me check"], pieces)
    # "Wait" is confirmed at "," and suppresses the longer overlapping cue; "Let me" suppresses
    # "Let me check" the same way
    assert [(e.cue, e.start_token) for e in ev] == [(0, 0), (2, 5)]
    # cues confirmed together: the longest wins
    ev2 = _events(["me check", "Let me check"], ["Let", " me", " check", "."])
    assert [e.cue for e in ev2] == [1]


def test_batch_sequences_hit_cues_at_different_steps():
    pieces = ["x", " Wait", ",", " Hmm", " y", "."]
    det = StageDetector(["Wait", "Hmm"], _table_decoder(pieces), batch_size=3)
    # seq 0: "x Wait, Hmm y."; seq 1: " Wait,xx" then idle; seq 2: "x Hmmx Hmm.x" (first Hmm is no word)
    steps = [[0, 1, 0], [1, 2, 3], [2, 0, 0], [3, 0, 3], [4, None, 5], [5, -1, 0]]
    got = []
    for t, ids in enumerate(steps):
        for e in det.step(ids):
            got.append((t, e.seq, det.cues[e.cue]))
    got += [(len(steps), e.seq, det.cues[e.cue]) for e in det.flush()]
    assert got == [(1, 1, "Wait"), (2, 0, "Wait"), (4, 0, "Hmm"), (4, 2, "Hmm")]
    with pytest.raises(ValueError, match="3 sequences"):
        det.step([0, 1])


def test_bad_cues_are_rejected():
    with pytest.raises(ValueError, match="at least one"):
        StageDetector([])
    with pytest.raises(ValueError, match="whitespace"):
        StageDetector([" Wait"])
    with pytest.raises(ValueError, match="duplicate"):
        StageDetector(["Wait", "Wait"])


# -- equality with an offline regex over the full decoded text ---------------------------------
def reference_matches(text: str, cues: list[str], ignore_case: bool = False) -> list[tuple[int, int, int]]:
    """Independent implementation of the match rules with `re` (lookarounds for word boundaries)."""
    flags = re.IGNORECASE if ignore_case else 0
    occ = []
    for i, c in enumerate(cues):
        pat = ("(?<!\\w)" if is_word_char(c[0]) else "") + re.escape(c) + ("(?!\\w)" if is_word_char(c[-1]) else "")
        for m in re.finditer("(?=(" + pat + "))", text, flags):
            s, e = m.start(1), m.end(1)
            pending = is_word_char(c[-1])
            occ.append(((e if pending else e - 1), 0 if pending else 1, -(e - s), s, e, i))
    occ.sort()
    out, last_end, k = [], 0, 0
    while k < len(occ):
        j = k
        while j < len(occ) and occ[j][:2] == occ[k][:2]:
            j += 1
        for o in occ[k:j]:
            if o[3] >= last_end:
                out.append((o[3], o[4], o[5]))
                last_end = o[4]
                break
        k = j
    return out


CUES = ["Wait", "Alternatively", "Let me check", "Let me", "So", "But wait", "Hmm", "Wait, let me check",
        "Therefore", "Another way", "e.g.", "I"]


@pytest.fixture(scope="module")
def bpe():
    from expertcast.models.tokenizer import train_bpe_tokenizer

    rows = [json.loads(line) for line in open(
        __import__("os").environ["EXPERTCAST_DATA_DIR"] + "/cot/math153.jsonl", encoding="utf-8")][:12]
    return train_bpe_tokenizer([r["thinking"] for r in rows], vocab_size=700), [r["thinking"] for r in rows]


def _adversarial(rng: random.Random) -> str:
    bits = ["Wait", "wait", "Alternatively", "Altern", "atively", "Let me", " check", "Let me check", "So", "Some",
            "But wait", "Hmm", "é", "—", ", ", ". ", "\n\n", " ", "x", "Therefore", "Another way", "e.g.", "I",
            "It", "_", "Wait, let me check", "∑", "Ã"]
    return "".join(rng.choice(bits) for _ in range(rng.randint(20, 120)))


def test_streaming_equals_offline_regex(bpe):
    tok, texts = bpe
    dec = TokenDecoder(tok)
    assert dec.kind == "byte_level"
    rng = random.Random(0)
    samples = [t[:3000] for t in texts[:4]] + [_adversarial(rng) for _ in range(40)]
    n_cmp = 0
    for ignore_case in (False, True):
        for text in samples:
            ids = tok.encode(text, add_special_tokens=False)
            assert dec.decode_text(ids) == text
            ev = detect_offline(CUES, ids, dec, ignore_case=ignore_case)
            got = [(e.char_start, e.char_end, e.cue) for e in ev]
            assert got == reference_matches(text, CUES, ignore_case), text
            # the start token is the token holding the cue's first character
            starts, pos, u = [], 0, codecs.getincrementaldecoder("utf-8")(errors="replace")
            for t in ids:
                starts.append(pos)
                pos += len(u.decode(dec(t)))
            for e in ev:
                assert starts[e.start_token] <= e.char_start
                assert e.start_token == len(ids) - 1 or starts[e.start_token + 1] > e.char_start or \
                    starts[e.start_token + 1] == starts[e.start_token]
            n_cmp += len(got)
    assert n_cmp > 100
