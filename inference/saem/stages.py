"""Streaming stage-boundary detection over generated token ids (SAEM IV-1, docs/design.md "SAEM").

A chain-of-thought trace changes reasoning stage at discourse cues ("Alternatively", "Wait", "Let me
check", ...). The detector turns the token ids a model emits into text, one token at a time, and
reports a :class:`BoundaryEvent` as soon as a cue is complete. It is built from three parts:

- :class:`TokenDecoder`: token id -> the raw bytes that token contributes to the text (byte-level BPE
  pieces such as ``"ĠAltern"`` are mapped back through the GPT-2 byte table, SentencePiece pieces
  through ``▁`` and ``<0xNN>`` byte fallback). Bytes, not strings, so that a multi-byte character split
  across two tokens is reassembled by an incremental UTF-8 decoder instead of becoming U+FFFD.
- :class:`CueAutomaton`: an Aho-Corasick automaton over characters built once per cue set; one
  transition per character, so the work per token is bounded by the token's length, independent of
  how much text came before and of how many cues there are.
- :class:`StageDetector`: one small state per sequence of a batch (automaton state, a bit mask of which
  recent characters were word characters, the recent token start offsets, a pending match).

Match rules (identical to the offline regex used as reference in the tests):

- word boundaries: when a cue starts with a word character (``str.isalnum()`` or ``_``) the character
  before it must not be one (or the cue starts the text): "Wait" matches "Wait," and " Wait" but not
  "awaited"; when a cue ends with a word character the character after it must not be one: "So"
  matches "So," but not "Some". The right boundary is known only when the next character arrives, so
  such a cue is *confirmed* one character after it completes (at the end of text by :meth:`flush`).
- case: cues match as written ("Wait" with a capital marks a sentence start, "wait" inside "But wait"
  does not) unless ``ignore_case`` is set.
- overlapping cues: among matches confirmed at the same character the longest wins (pending matches
  before immediate ones); a match that starts before the end of the previously emitted one is
  suppressed, so "Wait, let me check" yields one boundary (emitted when "Wait" is confirmed), not two.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from expertcast.utils.errors import UsageError

__all__ = [
    "BoundaryEvent",
    "CueAutomaton",
    "StageDetector",
    "TokenDecoder",
    "detect_offline",
    "is_word_char",
]


def is_word_char(c: str) -> bool:
    """A character that continues a word (letters and digits of any script, and ``_``)."""
    return c.isalnum() or c == "_"


@lru_cache(maxsize=1)
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _component_types(tok: Any, attr: str) -> set[str]:
    """Type names in a `tokenizers` pipeline component (``decoder`` / ``pre_tokenizer``), nested
    Sequences unrolled; empty when the tokenizer is not backed by `tokenizers`."""
    import json

    backend = getattr(tok, "backend_tokenizer", None) or tok
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return set()
    try:
        comp = json.loads(to_str()).get(attr)
    except Exception:
        return set()
    out: set[str] = set()
    stack = [comp]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if "type" in x:
                out.add(str(x["type"]))
            stack.extend(v for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend(x)
    return out


class TokenDecoder:
    """Maps a token id to the bytes it adds to the decoded text (special tokens add nothing).

    Accepts a transformers tokenizer (``PreTrainedTokenizerFast``) or a raw ``tokenizers.Tokenizer``.
    Byte-level BPE (GPT-2, Qwen, Llama-3, the embedded default model) is detected from the tokenizer's
    decoder/pre-tokenizer; SentencePiece-style pieces (``▁``, ``<0xNN>``) are handled too; anything
    else falls back to ``decode([id])``. Results are memoized per id.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        kinds = _component_types(tokenizer, "decoder") | _component_types(tokenizer, "pre_tokenizer")
        if "ByteLevel" in kinds:
            self.kind = "byte_level"
        elif kinds & {"Metaspace", "ByteFallback", "Replace", "Strip"}:
            self.kind = "sentencepiece"
        else:
            self.kind = "decode"
        self._special = self._special_ids(tokenizer)
        self._cache: dict[int, bytes] = {}
        self._u2b = _gpt2_unicode_to_byte()
        self.vocab_size = self._vocab_size(tokenizer)

    @staticmethod
    def _vocab_size(tok: Any) -> int:
        for getter in ("__len__", "get_vocab_size"):
            f = getattr(tok, getter, None)
            if f is not None:
                try:
                    return int(f())
                except TypeError:
                    continue
        raise TypeError(f"cannot read the vocabulary size of {type(tok).__name__}")

    @staticmethod
    def _special_ids(tok: Any) -> set[int]:
        ids: set[int] = set()
        all_ids = getattr(tok, "all_special_ids", None)
        if all_ids:
            ids.update(int(i) for i in all_ids)
        added = getattr(tok, "get_added_tokens_decoder", None) or getattr(tok, "added_tokens_decoder", None)
        try:
            table = added() if callable(added) else added
        except Exception:
            table = None
        if isinstance(table, dict):
            for i, t in table.items():
                if getattr(t, "special", False):
                    ids.add(int(i))
        return ids

    def check_ids(self, token_ids: Any, what: str) -> None:
        """Refuse (one line: the first few and a count) ids of ``token_ids`` outside the vocabulary: text
        decoded from them would be meaningless (another model's tokenizer, or a random-init model's ids)."""
        import numpy as np

        ids = np.unique(np.asarray(token_ids, dtype=np.int64).ravel())
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            shown = ", ".join(str(int(i)) for i in bad[:5]) + (" ..." if bad.size > 5 else "")
            raise UsageError(f"{what}: {bad.size} distinct token ids outside the tokenizer's vocabulary (size "
                             f"{self.vocab_size}): {shown}; were they produced by another model's tokenizer "
                             f"(or by a random-init model, whose ids are no text)?")

    def _token_str(self, token_id: int) -> str | None:
        tok = self.tokenizer
        if hasattr(tok, "convert_ids_to_tokens"):
            return tok.convert_ids_to_tokens(int(token_id))
        return tok.id_to_token(int(token_id))

    def _decode_one(self, token_id: int) -> str:
        tok = self.tokenizer
        if hasattr(tok, "convert_ids_to_tokens"):
            return tok.decode([int(token_id)], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return tok.decode([int(token_id)], skip_special_tokens=True)

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is not None:
            return b
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise UsageError(f"token id {token_id} is outside the tokenizer's vocabulary (size {self.vocab_size}): "
                             "were these ids produced by another model's tokenizer?")
        if token_id in self._special:
            b = b""
        else:
            piece = self._token_str(token_id)
            if piece is None:
                b = b""
            elif self.kind == "byte_level" and all(ch in self._u2b for ch in piece):
                b = bytes(self._u2b[ch] for ch in piece)
            elif self.kind == "sentencepiece":
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    b = bytes([int(piece[3:5], 16)])
                else:
                    b = piece.replace("\u2581", " ").encode("utf-8")
            else:  # added (non-special) tokens of a byte-level vocabulary, or an unknown scheme
                b = self._decode_one(token_id).encode("utf-8")
        self._cache[token_id] = b
        return b

    def decode_text(self, token_ids: Sequence[int]) -> str:
        """The whole text of ``token_ids`` by the same byte mapping (for offline checks)."""
        return b"".join(self(int(i)) for i in token_ids).decode("utf-8", errors="replace")


class CueAutomaton:
    """Aho-Corasick automaton over the characters of a cue set (built once, read-only afterwards).

    ``goto[s]`` maps a character to the next state (missing entries already resolved through failure
    links, so a transition is a single dict lookup plus at most a walk of failure links bounded by the
    depth of the state); ``outputs[s]`` lists the cues ending at ``s`` (own and via suffix links), the
    longest first.
    """

    def __init__(self, cues: Sequence[str], ignore_case: bool = False) -> None:
        if not cues:
            raise ValueError("a cue set needs at least one cue")
        clean = []
        for c in cues:
            if not isinstance(c, str) or not c.strip():
                raise ValueError(f"cue {c!r} is empty: cues must contain visible text")
            if c != c.strip():
                raise ValueError(f"cue {c!r} has leading/trailing whitespace: word boundaries are handled by the "
                                 "matcher, write the cue without it")
            clean.append(c)
        if len(set(clean)) != len(clean):
            dup = sorted({c for c in clean if clean.count(c) > 1})
            raise ValueError(f"duplicate cues: {dup}")
        self.cues = list(clean)
        self.ignore_case = ignore_case
        self.lengths = [len(c) for c in clean]
        self.first_word = [is_word_char(c[0]) for c in clean]
        self.last_word = [is_word_char(c[-1]) for c in clean]
        self.max_len = max(self.lengths)
        goto: list[dict[str, int]] = [{}]
        own: list[list[int]] = [[]]
        for i, cue in enumerate(clean):
            s = 0
            for ch in self._fold(cue):
                nxt = goto[s].get(ch)
                if nxt is None:
                    goto.append({})
                    own.append([])
                    nxt = len(goto) - 1
                    goto[s][ch] = nxt
                s = nxt
            own[s].append(i)
        fail = [0] * len(goto)
        outputs: list[tuple[int, ...]] = [()] * len(goto)
        order = []
        queue = list(goto[0].values())
        for s in queue:
            fail[s] = 0
        while queue:
            order.extend(queue)
            nxt_q = []
            for s in queue:
                for ch, t in goto[s].items():
                    f = fail[s]
                    while f and ch not in goto[f]:
                        f = fail[f]
                    cand = goto[f].get(ch, 0)
                    fail[t] = cand if cand != t else 0
                    nxt_q.append(t)
            queue = nxt_q
        for s in order:
            outs = own[s] + list(outputs[fail[s]])
            outputs[s] = tuple(sorted(set(outs), key=lambda i: -self.lengths[i]))
        self.goto = goto
        self.fail = fail
        self.outputs = outputs

    def _fold(self, s: str) -> str:
        return s.lower() if self.ignore_case else s

    def step(self, state: int, ch: str) -> int:
        """The state after reading ``ch`` from ``state``."""
        goto, fail = self.goto, self.fail
        while True:
            t = goto[state].get(ch)
            if t is not None:
                return t
            if state == 0:
                return 0
            state = fail[state]


@dataclass(frozen=True)
class BoundaryEvent:
    """A detected stage boundary.

    Attributes:
        seq: index of the sequence in the batch.
        token_index: index (in the tokens fed to that sequence) of the token at which the boundary was
            emitted: the token completing the cue, or the next one when the cue ends in a word character
            (its right boundary shows only then), or the last token at :meth:`StageDetector.flush`.
        start_token: index of the token holding the cue's first character (where the new stage starts).
        cue: index of the cue in the cue set.
        char_start: character offset of the cue in that sequence's decoded text.
        char_end: character offset one past the cue's last character.
    """

    seq: int
    token_index: int
    start_token: int
    cue: int
    char_start: int
    char_end: int


class _SeqState:
    __slots__ = ("state", "mask", "n_chars", "n_tokens", "pending", "last_end", "ring", "utf8")

    def __init__(self) -> None:
        self.state = 0
        self.mask = 0
        self.n_chars = 0
        self.n_tokens = 0
        self.pending: tuple[int, ...] = ()
        self.last_end = 0
        self.ring: list[tuple[int, int]] = []  # (token index, char offset of its first char), recent tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")


class StageDetector:
    """Batched streaming cue matcher: feed one token id per sequence per step, get boundary events.

    Args:
        cues: the cue strings (see the module docstring for the match rules).
        decoder: token id -> bytes (a :class:`TokenDecoder`); needed for :meth:`step` /
            :meth:`feed_token`, not for :meth:`feed_text`.
        batch_size: number of sequences (each has its own state).
        ignore_case: match cues case-insensitively.
        all_matches: report every cue occurrence that satisfies the word-boundary rules, longest first
            among those confirmed together, without the overlap suppression (used by calibration to
            score many cue subsets from one pass: see :func:`expertcast.inference.saem.cues.select_boundaries`).
    """

    def __init__(self, cues: Sequence[str], decoder: Callable[[int], bytes] | None = None, batch_size: int = 1,
                 ignore_case: bool = False, all_matches: bool = False) -> None:
        self.automaton = CueAutomaton(cues, ignore_case=ignore_case)
        self.all_matches = all_matches
        self.decoder = decoder
        self._ring_len = self.automaton.max_len + 2
        self._mask_bits = (1 << (self.automaton.max_len + 2)) - 1
        self.reset(batch_size)

    @property
    def cues(self) -> list[str]:
        return self.automaton.cues

    @property
    def batch_size(self) -> int:
        return len(self._states)

    def reset(self, batch_size: int | None = None) -> None:
        """Forget all text; ``batch_size`` sequences start empty."""
        n = self.batch_size if batch_size is None else int(batch_size)
        if n < 1:
            raise ValueError(f"batch_size must be >= 1, got {n}")
        self._states = [_SeqState() for _ in range(n)]

    def step(self, token_ids: Sequence[int | None]) -> list[BoundaryEvent]:
        """Feed the token each sequence produced at this step (``None`` or a negative id: that sequence
        is idle or finished). Returns the boundaries completed by these tokens."""
        if len(token_ids) != len(self._states):
            raise ValueError(f"step got {len(token_ids)} token ids for a batch of {len(self._states)} sequences")
        events: list[BoundaryEvent] = []
        for i, tid in enumerate(token_ids):
            if tid is None or tid < 0:
                continue
            self._feed(i, self._bytes(tid), events)
        return events

    def feed_token(self, seq: int, token_id: int) -> list[BoundaryEvent]:
        """Feed one token to sequence ``seq``."""
        events: list[BoundaryEvent] = []
        self._feed(seq, self._bytes(token_id), events)
        return events

    def feed_text(self, seq: int, text: str) -> list[BoundaryEvent]:
        """Feed a piece of text (counted as one token) to sequence ``seq``: text-level detection."""
        events: list[BoundaryEvent] = []
        st = self._states[seq]
        self._feed_chars(seq, st, text, events)
        st.n_tokens += 1
        return events

    def flush(self, seq: int | None = None) -> list[BoundaryEvent]:
        """End of text for ``seq`` (all sequences when None): confirms a cue that ends the text."""
        events: list[BoundaryEvent] = []
        for i in range(len(self._states)) if seq is None else [seq]:
            st = self._states[i]
            tail = st.utf8.decode(b"", final=True)
            if tail:
                self._feed_chars(i, st, tail, events, token_index=max(st.n_tokens - 1, 0))
            if st.pending:
                self._confirm(i, st, st.pending, st.n_chars - 1, max(st.n_tokens - 1, 0), events)
                st.pending = ()
        return events

    # -- internals --------------------------------------------------------------------------------
    def _bytes(self, token_id: int) -> bytes:
        if self.decoder is None:
            raise ValueError("this StageDetector has no token decoder: build it with decoder=TokenDecoder(tokenizer)")
        return self.decoder(int(token_id))

    def _feed(self, seq: int, data: bytes, events: list[BoundaryEvent]) -> None:
        st = self._states[seq]
        text = st.utf8.decode(data) if data else ""
        if text:
            self._feed_chars(seq, st, text, events)
        st.n_tokens += 1

    def _feed_chars(self, seq: int, st: _SeqState, text: str, events: list[BoundaryEvent],
                    token_index: int | None = None) -> None:
        ac = self.automaton
        goto, fail, outputs = ac.goto, ac.fail, ac.outputs
        lengths, first_word, last_word = ac.lengths, ac.first_word, ac.last_word
        fold = ac.ignore_case
        tok = st.n_tokens if token_index is None else token_index
        if token_index is None:
            st.ring.append((tok, st.n_chars))
            if len(st.ring) > self._ring_len:
                del st.ring[0]
        state, mask, pos, bits = st.state, st.mask, st.n_chars, self._mask_bits
        for ch in text:
            w = ch.isalnum() or ch == "_"
            if st.pending:
                if not w:
                    st.state, st.mask, st.n_chars = state, mask, pos
                    self._confirm(seq, st, st.pending, pos - 1, tok, events)
                st.pending = ()
            mask = ((mask << 1) | w) & bits
            c = ch.lower() if fold else ch
            # Aho-Corasick transition
            while True:
                t = goto[state].get(c)
                if t is not None:
                    state = t
                    break
                if state == 0:
                    break
                state = fail[state]
            outs = outputs[state]
            if outs:
                pend: list[int] = []
                now: list[int] = []
                for cue in outs:
                    n = lengths[cue]
                    # left boundary: the char before the cue (bit n of the mask) must not be a word char
                    if first_word[cue] and pos - n + 1 > 0 and (mask >> n) & 1:
                        continue
                    (pend if last_word[cue] else now).append(cue)
                if pend:
                    st.pending = tuple(pend)
                if now:
                    st.state, st.mask, st.n_chars = state, mask, pos + 1
                    self._confirm(seq, st, tuple(now), pos, tok, events)
            pos += 1
        st.state, st.mask, st.n_chars = state, mask, pos

    def _confirm(self, seq: int, st: _SeqState, cues: tuple[int, ...], end_pos: int, tok: int,
                 events: list[BoundaryEvent]) -> None:
        """Emit the longest of ``cues`` (all ending at char ``end_pos``) that does not overlap the last
        emitted match."""
        lengths = self.automaton.lengths
        for cue in cues:  # longest first
            start = end_pos - lengths[cue] + 1
            if start < st.last_end and not self.all_matches:
                continue
            st.last_end = end_pos + 1
            start_tok = tok
            for ti, off in reversed(st.ring):
                if off <= start:
                    start_tok = ti
                    break
            events.append(BoundaryEvent(seq, tok, start_tok, cue, start, end_pos + 1))
            if not self.all_matches:
                return


def detect_offline(cues: Sequence[str], token_ids: Sequence[int], decoder: Callable[[int], bytes],
                   ignore_case: bool = False, all_matches: bool = False) -> list[BoundaryEvent]:
    """All boundaries of one finished sequence (streaming detector run to the end, then flushed)."""
    det = StageDetector(cues, decoder, batch_size=1, ignore_case=ignore_case, all_matches=all_matches)
    events: list[BoundaryEvent] = []
    for tid in token_ids:
        det._feed(0, det._bytes(tid), events)
    events += det.flush(0)
    return events


def synthetic_cue_decoder(cue_token: int):
    """Token decoder for :func:`expertcast.data.synthetic.staged_traces`: the cue token reads
    " Wait", every other token " x"."""

    def dec(i: int) -> bytes:
        return b" Wait" if int(i) == cue_token else b" x"

    return dec
