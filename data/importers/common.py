"""What every importer of :mod:`expertcast.data.importers` shares, public: the error type and value bounds, the
options and result types, the strict value checks (integers, ids, weights; errors name ``file:line`` or ``file:
record``) and the two assemblers, :class:`RowCollector` for layouts of one record per (token, layer) and
:func:`request_sequences` for layouts of one [T, L, K] array per request (docs/design.md, "Trace importers")."""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.data.trace_format import TraceSequence
from expertcast.utils.errors import UsageError
from expertcast.utils.io import iter_jsonl
from expertcast.utils.jsonfields import int_field, is_int

FLOAT16_MAX = 65504.0
INT16_MAX = 32767
INT32_MAX = 2**31 - 1
SNIFF_BYTES = 1 << 16
"""Bytes read from the start of a text layout before anything is parsed (a binary file is refused there)."""


class ImportFormatError(UsageError):
    """An imported file is malformed (the message names the file and line or record)."""


def int_value(v: Any, what: str, where: str, lo: int, hi: int) -> int:
    """``v`` if it is a JSON integer in [lo, hi], else ImportFormatError."""
    return int_field(v, what, where, lo, hi, ImportFormatError)


def expert_list(v: Any, num_experts: int, where: str) -> list[int]:
    """A record's expert ids: a non-empty JSON list of distinct integers in [0, E)."""
    if not isinstance(v, list) or not v:
        raise ImportFormatError(f"{where}: experts must be a non-empty list of integers, got {json.dumps(v)}")
    out = []
    for e in v:
        if not is_int(e):
            raise ImportFormatError(f"{where}: experts must be a list of integers, got {json.dumps(e)} in {json.dumps(v)}")
        if not 0 <= e < num_experts:
            raise ImportFormatError(f"{where}: expert id(s) {[x for x in v if is_int(x) and not 0 <= x < num_experts]} "
                                    f"outside [0, E={num_experts})")
        out.append(e)
    if len(set(out)) != len(out):
        raise ImportFormatError(f"{where}: repeated expert in {out}")
    return out


def weight_list(v: Any, k: int, where: str) -> list[float]:
    """A record's K weights: finite JSON numbers in [0, 65504] (stored as float16)."""
    if not isinstance(v, list):
        raise ImportFormatError(f"{where}: weights must be a list of numbers, got {json.dumps(v)}")
    for w in v:
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ImportFormatError(f"{where}: weights must be numbers, got {json.dumps(w)}")
        if not math.isfinite(w):
            raise ImportFormatError(f"{where}: weight {w} is not finite")
        if not 0 <= w <= FLOAT16_MAX:
            raise ImportFormatError(f"{where}: weight {w} outside [0, {FLOAT16_MAX:g}] (weights are stored as float16)")
    if len(v) != k:
        raise ImportFormatError(f"{where}: {len(v)} weights for {k} experts")
    return [float(w) for w in v]


def check_text(path: Path) -> None:
    """ImportFormatError when the start of ``path`` holds a NUL byte: a binary file is no text layout (refused
    before any line is read whole, so that a large binary file costs :data:`SNIFF_BYTES` of memory)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    i = head.find(b"\0")
    if i >= 0:
        raise ImportFormatError(f"{path}: a binary file (NUL byte at offset {i}), not a text trace layout")


@dataclass
class ImportOptions:
    """What the user told ``traces import`` about the model (None: not given)."""

    num_experts: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    model_id: str | None = None


@dataclass
class Imported:
    """The sequences an importer read and the model shape they show."""

    sequences: list[TraceSequence]
    num_layers: int
    num_experts: int
    top_k: int
    phase_known: bool
    model_id: str | None = None
    moe_layers: list[int] | None = None
    """The source's layer index of each trace layer, when they are not 0..L-1."""
    has_router_probs: bool = False
    records: int = 0
    """Records (lines, rows, requests or tensors) read."""
    dropped_positions: int = 0
    """Positions left out because they lack some layers' records (a write cut short), counted in the trace meta."""
    dropped_sequences: int = 0
    """Sequences left out because none of their positions has every layer."""
    cut_lines: list[str] = field(default_factory=list)
    """``file:line`` of each last line a write cut short mid-line (left out; its records are lost)."""
    notes: list[str] = field(default_factory=list)
    """What the summary line should say about the import (dropped dense layers, skipped records, ...)."""


def need(value: int | None, flag: str, fmt: str, what: str = "its records do not name it") -> int:
    """``value``, or a UsageError saying ``flag`` is required for the ``fmt`` layout."""
    if value is None:
        raise UsageError(f"{flag} is required for the {fmt} layout ({what})")
    return value


def check_num_experts(E: int | None) -> None:
    """UsageError unless ``E`` (``--num-experts``; None: not given) fits the trace's int16 expert ids."""
    if E is not None and not 1 <= E <= INT16_MAX + 1:
        raise UsageError(f"--num-experts must be in [1, {INT16_MAX + 1}] (expert ids are stored as int16), got {E}")


# -- strict values ---------------------------------------------------------------------------------------
def int_grid(v: Any, ndim: int, what: str, where: str) -> np.ndarray:
    """A nested JSON list of integers with ``ndim`` dimensions (rectangular) -> int64 array; ImportFormatError
    naming ``where`` for ragged lists, floats, strings or booleans (nothing is coerced)."""
    if not isinstance(v, list):
        raise ImportFormatError(f"{where}: {what} must be a {ndim}-D list of integers, got {type(v).__name__}")
    try:
        obj = np.array(v, dtype=object)
    except ValueError:
        obj = None
    if obj is None or obj.ndim != ndim:
        raise ImportFormatError(f"{where}: {what} must be a rectangular {ndim}-D list of integers "
                                f"(got {'a ragged list' if obj is None or obj.ndim < ndim else f'{obj.ndim} dimensions'})")
    bad = next((x for x in obj.flat if type(x) is not int), None) if set(map(type, obj.flat)) - {int} else None
    if bad is not None:
        raise ImportFormatError(f"{where}: {what} must hold integers only, got {json.dumps(bad)}")
    try:
        return obj.astype(np.int64)
    except OverflowError:
        raise ImportFormatError(f"{where}: {what} holds an integer too large for an expert id") from None


def check_ids(ids: np.ndarray, num_experts: int, where: str, hint: str = "") -> None:
    """Expert ids [..., K]: in [0, E) and no expert twice in one row; ImportFormatError naming the first bad row
    (``hint``, e.g. which flags gave the rows their shape, ends the message)."""
    flat = ids.reshape(-1, ids.shape[-1])
    out = (flat < 0) | (flat >= num_experts)
    tail = f"; {hint}" if hint else ""
    if out.any():
        r = int(np.argmax(out.any(axis=1)))
        raise ImportFormatError(f"{where}: expert id(s) {flat[r][out[r]].tolist()} outside [0, E={num_experts}) "
                                f"(row {_row_index(ids.shape, r)}){tail}")
    srt = np.sort(flat, axis=1)
    rep = (np.diff(srt, axis=1) == 0).any(axis=1)
    if rep.any():
        r = int(np.argmax(rep))
        raise ImportFormatError(f"{where}: repeated expert in {flat[r].tolist()} (row {_row_index(ids.shape, r)})"
                                f"{tail}")


SPLIT_EVIDENCE = 8.0
"""Same-position expert coincidences two independent routers would show (K^2/E per position) before the absence
of any counts as evidence that they are one router's top-K cut in two."""


def check_not_split(seqs: list[np.ndarray], num_experts: int, axis: str, where: str, hint: str) -> None:
    """Refuse rows that look like one router's top-K cut into neighbours by a wrong shape flag.

    ``seqs``: [T, L, K] ids. Along ``axis`` (``"layer"``: layers l and l+1 at the same position; ``"position"``:
    positions t and t+1 of a layer, in aligned blocks of m = 2..8), the neighbours of a row never share an expert
    when they are the two halves of one top-K row (a router picks K distinct experts), whereas separate routers or
    tokens do by chance. When they never do over enough rows that ``SPLIT_EVIDENCE`` coincidences were expected
    (uniform routing: K^2/E per pair), the shape the flags gave is refused with ``hint`` (the file does not record
    its shape)."""
    K = seqs[0].shape[2]
    per = K * K / num_experts
    if axis == "layer":
        L = seqs[0].shape[1]
        for li in range(L - 1):
            pairs = sum(len(a) for a in seqs)
            if pairs * per < SPLIT_EVIDENCE:
                return
            if not any(_shared(a[:, li], a[:, li + 1]).any() for a in seqs):
                raise ImportFormatError(f"{where}: layers {li} and {li + 1} never select a common expert at the same "
                                        f"position over {pairs} positions (about {pairs * per:.0f} expected from two "
                                        f"routers): they look like one router's top-K cut in two; {hint}")
        return
    for m in range(2, 9):
        blocks = [a[: len(a) // m * m].reshape(-1, m, *a.shape[1:]) for a in seqs]
        pairs = sum(b.shape[0] * (m - 1) * b.shape[2] for b in blocks)
        if not pairs or pairs * per < SPLIT_EVIDENCE:
            continue
        if not any(_shared(b[:, i], b[:, i + 1]).any() for b in blocks for i in range(m - 1)):
            raise ImportFormatError(f"{where}: in every block of {m} positions the positions never share an expert "
                                    f"within a layer ({pairs} pairs, about {pairs * per:.0f} expected from separate "
                                    f"tokens): each looks like one token's top-K cut in {m}; {hint}")


def _shared(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[..., K] x [..., K] -> [...]: whether the two rows share an expert."""
    return (a[..., :, None] == b[..., None, :]).any(axis=(-1, -2))


def _row_index(shape: tuple[int, ...], r: int) -> list[int]:
    return [int(i) for i in np.unravel_index(r, shape[:-1])]


def check_weights(w: np.ndarray, where: str) -> np.ndarray:
    """Finite weights in [0, 65504] (stored as float16) -> float16; ImportFormatError naming ``where``."""
    if not np.isfinite(w).all():
        raise ImportFormatError(f"{where}: non-finite weight")
    if (w < 0).any() or (w > FLOAT16_MAX).any():
        raise ImportFormatError(f"{where}: weight outside [0, {FLOAT16_MAX:g}] (weights are stored as float16)")
    return w.astype(np.float16)


def str_field(v: Any, what: str, where: str) -> str:
    if isinstance(v, str) and v:
        return v
    raise ImportFormatError(f"{where}: {what} must be a non-empty string, got {json.dumps(v)}")


def id_field(v: Any, what: str, where: str) -> str:
    """A sequence id: a non-empty string or a JSON integer, as a string."""
    if is_int(v) or (isinstance(v, str) and v):
        return str(v)
    raise ImportFormatError(f"{where}: {what} must be a non-empty string or an integer, got {json.dumps(v)}")


def csv_int(s: str, what: str, where: str, lo: int = 0, hi: int = INT32_MAX) -> int:
    """A CSV cell holding a decimal integer in [lo, hi] (no sign other than '-', no spaces, no decimals)."""
    t = s[1:] if s.startswith("-") else s
    if not t.isdigit() or not t.isascii():
        raise ImportFormatError(f"{where}: {what} must be an integer, got {s!r}")
    return int_value(int(s), what, where, lo, hi)


def b64_bytes(v: Any, what: str, where: str) -> bytes:
    if not isinstance(v, str):
        raise ImportFormatError(f"{where}: {what} must be a base64 string, got {type(v).__name__}")
    try:
        return base64.b64decode(v.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ImportFormatError(f"{where}: {what} is not valid base64") from None


def npy_array(raw: bytes, what: str, where: str) -> np.ndarray:
    """A ``.npy`` payload of integers (never unpickled: ``allow_pickle=False``)."""
    try:
        a = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ImportFormatError(f"{where}: {what} is not a .npy array of integers ({str(e).splitlines()[0]})") from None
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu":
        raise ImportFormatError(f"{where}: {what} must hold integers, got dtype {getattr(a, 'dtype', type(a).__name__)}")
    return a.astype(np.int64)


def first_value(path: Path) -> tuple[int, str] | None:
    """(line number, text) of the first non-blank line of a text file (None when there is none)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for ln, line in enumerate(f, 1):
            if line.strip():
                return ln, line
    return None


def csv_rows(path: Path, header: tuple[str, ...]) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of the data rows of a CSV file whose first line is exactly ``header``."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        first = next(reader, None)
        if first is None:
            raise ImportFormatError(f"{path} is empty: nothing to import")
        if tuple(c.strip() for c in first) != header:
            raise ImportFormatError(f"{path}:1: expected the header {','.join(header)}, got {','.join(first)}")
        for cells in reader:
            ln = reader.line_num
            if not cells or all(not c.strip() for c in cells):
                continue
            if len(cells) != len(header):
                raise ImportFormatError(f"{path}:{ln}: {len(cells)} columns, the header has {len(header)}")
            yield ln, cells


def cut_line_number(path: Path) -> int | None:
    """The number of the last line of a text file that does not end with a newline (a write cut short mid-line
    leaves one), else None. Streams the file: its newlines are counted, nothing is kept."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return None
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return None
        f.seek(0)
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + 1


class JsonLines:
    """The values of a JSON-lines file (``(line number, value)``, :func:`expertcast.utils.io.iter_jsonl`), except a
    last line that a write cut short: a file that does not end with a newline and whose last line is not valid
    JSON ends one record early, and :attr:`cut` names that line (every other bad line is an ImportFormatError)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cut: int | None = None
        self._last = cut_line_number(path)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        try:
            yield from iter_jsonl(self.path, error=ImportFormatError)
        except ImportFormatError as e:
            if self._last is None or not str(e).startswith(f"{self.path}:{self._last}: not valid JSON"):
                raise
            self.cut = self._last

    def cut_lines(self) -> list[str]:
        """``[file:line]`` of the cut line (empty when there is none), as :class:`Imported` keeps it."""
        return [f"{self.path}:{self.cut}"] if self.cut else []


def files_of(path: Path, ext: str) -> list[Path]:
    """``path`` itself, or the ``*.ext`` files of the folder ``path`` in name order (ImportFormatError if none)."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == f".{ext}" and not p.name.startswith("."))
    if not files:
        raise ImportFormatError(f"{path} holds no .{ext} files to import")
    return files


# -- assembly: one record per (token, layer) --------------------------------------------------------------
class RowCollector:
    """Gathers validated (sequence, position, layer) records and builds the sequences.

    Rules (every violation an ImportFormatError naming ``file:line``): expert ids are JSON integers in [0, E), none
    twice in a record, K the same in every record; a (sequence, position, layer) appears once; every position of a
    sequence has every layer of the file (layers are the distinct layer values of the whole file, mapped in order
    to 0..L-1) and positions run without a gap; a position has one phase, and prefill positions come before decode
    ones. Weights, when given, are K finite numbers in [0, 65504]; without them each expert gets 1/K.
    """

    def __init__(self, num_experts: int) -> None:
        self.E = num_experts
        self.K: int | None = None
        self._seqs: dict[str, dict[str, list]] = {}
        self._sources: dict[str, str | None] = {}
        self._where: dict[str, list[str]] = {}
        self.records = 0
        self.with_weights = 0
        self.dropped_positions = 0
        """Trailing positions :meth:`build` dropped for lacking some layers' records (a write cut short)."""
        self.dropped_sequences = 0
        """Sequences :meth:`build` dropped because none of their positions had every layer."""

    def add(self, where: str, seq: str, pos: int, layer: int, experts: Any, weights: Any = None,
            phase: str | None = None, token_id: int = -1, source: str | None = None) -> None:
        ids = expert_list(experts, self.E, where)
        if self.K is not None and len(ids) != self.K:
            raise ImportFormatError(f"{where}: {len(ids)} experts, earlier records have K={self.K}")
        self.K = len(ids)
        w = weight_list(weights, len(ids), where) if weights is not None else None
        s = self._seqs.get(seq)
        if s is None:
            s = self._seqs[seq] = {"pos": [], "layer": [], "ids": [], "w": [], "phase": [], "tok": []}
            self._sources[seq] = source
            self._where[seq] = []
        elif self._sources[seq] != source:
            raise ImportFormatError(f"{where}: sequence {seq!r} has source {source!r}, earlier records "
                                    f"{self._sources[seq]!r}")
        s["pos"].append(pos)
        s["layer"].append(layer)
        s["ids"].append(ids)
        s["w"].append(w)
        s["phase"].append(phase)
        s["tok"].append(token_id)
        self._where[seq].append(where)
        self.records += 1
        self.with_weights += w is not None

    def layer_values(self) -> list[int]:
        return sorted({v for s in self._seqs.values() for v in s["layer"]})

    def build(self, source_name: str) -> tuple[list[TraceSequence], int, list[int]]:
        """(sequences in first-seen order, L, the source's layer value of each trace layer).

        A write cut short leaves the last positions of a sequence without some layers' records: those trailing
        positions are dropped (counted in :attr:`dropped_positions`; a sequence left with none in
        :attr:`dropped_sequences`). A position lacking a layer before a complete one is no cut-short write and
        is refused, as is a source with no complete position at all."""
        if not self.records or self.K is None:
            raise ImportFormatError(f"{source_name} holds no routing records")
        layers = self.layer_values()
        L, K = len(layers), self.K
        lmap = {v: i for i, v in enumerate(layers)}
        out = []
        self.dropped_positions = self.dropped_sequences = 0
        for sid, s in self._seqs.items():
            where = self._where[sid]
            pos = np.asarray(s["pos"], dtype=np.int64)
            li = np.asarray([lmap[v] for v in s["layer"]], dtype=np.int64)
            toks, ti = np.unique(pos, return_inverse=True)
            gap = np.nonzero(np.diff(toks) != 1)[0]
            if len(gap):
                raise ImportFormatError(f"{source_name}: sequence {sid!r} has no record for position "
                                        f"{int(toks[gap[0]]) + 1} (its positions run from {int(toks[0])} to "
                                        f"{int(toks[-1])})")
            flat = ti * L + li
            order = np.argsort(flat, kind="stable")
            dup = np.nonzero(np.diff(flat[order]) == 0)[0]
            if len(dup):
                r = int(order[dup[0] + 1])
                raise ImportFormatError(f"{where[r]}: duplicate record for sequence {sid!r} position {int(pos[r])} "
                                        f"layer {s['layer'][r]}")
            T = len(toks)
            sel = np.arange(len(flat))
            if len(flat) != T * L:
                have = np.zeros(T * L, dtype=bool)
                have[flat] = True
                full = have.reshape(T, L).all(axis=1)
                cut = int(np.argmin(full))  # the first position lacking a layer
                if full[cut:].any():
                    miss = int(np.argmin(have))
                    raise ImportFormatError(
                        f"{source_name}: sequence {sid!r} position {int(toks[miss // L])} has no record for layer "
                        f"{layers[miss % L]}, and later positions have every layer (a hole, not a write cut short: "
                        f"every position before the last complete one needs all {L} layers)")
                self.dropped_positions += T - cut
                if cut == 0:
                    self.dropped_sequences += 1
                    continue
                T, sel = cut, np.nonzero(ti < cut)[0]
                flat = flat[sel]
                order = np.argsort(flat, kind="stable")
            rows = sel[order]
            ids = np.asarray(s["ids"], dtype=np.int16)[rows].reshape(T, L, K)
            w = np.full((len(s["w"]), K), 1.0 / K, dtype=np.float32)
            wi = [i for i, x in enumerate(s["w"]) if x is not None]
            if wi:
                w[np.asarray(wi)] = np.asarray([s["w"][i] for i in wi], dtype=np.float32)
            w = w[rows].reshape(T, L, K)
            phases = np.asarray([p or "" for p in s["phase"]], dtype=object)[rows].reshape(T, L)
            tok = np.asarray(s["tok"], dtype=np.int64)[rows].reshape(T, L)
            prompt_len = _prompt_len(phases, toks, sid, source_name)
            if (tok != tok[:, :1]).any():
                t = int(np.argmax((tok != tok[:, :1]).any(axis=1)))
                raise ImportFormatError(f"{source_name}: sequence {sid!r} position {int(toks[t])} has token ids "
                                        f"{sorted(set(tok[t].tolist()))} across layers")
            out.append(TraceSequence(sid, tok[:, 0].astype(np.int32), prompt_len, ids, w.astype(np.float16),
                                     source=self._sources[sid]))
        if not out:
            raise ImportFormatError(f"{source_name}: no position has every one of the {L} layers' records (nothing "
                                    f"left to import once the positions a cut-short write left incomplete are "
                                    f"dropped)")
        return out, L, layers

    def dropped(self) -> dict[str, int]:
        """What :meth:`build` left out, as :class:`Imported` counts it."""
        return {"dropped_positions": self.dropped_positions, "dropped_sequences": self.dropped_sequences}


def _prompt_len(phases: np.ndarray, toks: np.ndarray, sid: str, where: str) -> int:
    """Number of prefill positions of a [T, L] grid of phases ('' = not recorded: 0)."""
    per = phases[:, 0]
    mixed = (phases != per[:, None]).any(axis=1)
    if mixed.any():
        t = int(np.argmax(mixed))
        raise ImportFormatError(f"{where}: sequence {sid!r} position {int(toks[t])} has phases "
                                f"{sorted(set(phases[t].tolist()))} across layers")
    pre = per == "prefill"
    n = int(pre.sum())
    if n and not pre[:n].all():
        t = int(np.argmin(pre[:n]))
        raise ImportFormatError(f"{where}: sequence {sid!r} has a prefill position after decode position "
                                f"{int(toks[t])}")
    return n


# -- assembly: one [T, L, K] array per request ------------------------------------------------------------
@dataclass
class Request:
    """One request's routing as a source gives it: ``ids`` int64 [T, L, K] (-1 allowed where a layer has no
    routed expert), its prompt length when known, token ids when known, the line it came from."""

    seq_id: str
    ids: np.ndarray
    where: str
    prompt_len: int | None
    token_ids: np.ndarray | None = None
    source: str | None = None


def request_sequences(reqs: list[Request], num_experts: int, source_name: str, hint: str = ""
                      ) -> tuple[list[TraceSequence], list[int] | None, list[str]]:
    """Sequences of ``reqs`` (one each, weights 1/K), the kept layers and notes.

    A layer whose ids are -1 in every request is a dense (non-MoE) layer: it is dropped and the kept layers are
    returned (None when all are kept). Any other negative id, an id >= E, an expert twice in one row, a repeated
    sequence id or requests of different L or K is an ImportFormatError naming ``file:line``.
    """
    if not reqs:
        raise ImportFormatError(f"{source_name} holds no requests with routed experts")
    shape = reqs[0].ids.shape[1:]
    seen: dict[str, str] = {}
    for r in reqs:
        if r.ids.shape[1:] != shape:
            raise ImportFormatError(f"{r.where}: routed experts of [tokens, {r.ids.shape[1]} layers, "
                                    f"{r.ids.shape[2]} experts], earlier requests have [tokens, {shape[0]}, {shape[1]}]")
        if r.seq_id in seen:
            raise ImportFormatError(f"{r.where}: request {r.seq_id!r} again (first at {seen[r.seq_id]})")
        seen[r.seq_id] = r.where
    dense = np.ones(shape[0], dtype=bool)
    for r in reqs:
        dense &= (r.ids == -1).all(axis=(0, 2))
    keep = np.nonzero(~dense)[0]
    if not len(keep):
        raise ImportFormatError(f"{source_name}: every layer's expert ids are -1 (no routed expert recorded)")
    notes = [f"dropped {int(dense.sum())} dense layer(s) {np.nonzero(dense)[0].tolist()} (ids all -1)"] if dense.any() else []
    out = []
    for r in reqs:
        ids = r.ids[:, keep]
        check_ids(ids, num_experts, f"{r.where}: request {r.seq_id!r}", hint)
        T, L, K = ids.shape
        pl = r.prompt_len or 0
        tok = r.token_ids if r.token_ids is not None else np.full(T, -1, dtype=np.int64)
        out.append(TraceSequence(r.seq_id, tok.astype(np.int32), pl, ids.astype(np.int16),
                                 np.full(ids.shape, 1.0 / K, dtype=np.float16), source=r.source))
    return out, (keep.tolist() if dense.any() else None), notes


def token_ids_of(prompt: Any, completion: Any, T: int, where: str) -> np.ndarray | None:
    """The token ids of a request's T routed positions (prompt ids then completion ids, cut to T), or None when
    either list is absent."""
    if prompt is None or completion is None:
        return None
    p = int_grid(prompt, 1, "prompt_token_ids", where) if prompt else np.zeros(0, np.int64)
    c = int_grid(completion, 1, "token_ids", where) if completion else np.zeros(0, np.int64)
    ids = np.concatenate([p, c])[:T]
    if len(ids) < T or (ids < 0).any() or (ids > INT32_MAX).any():
        raise ImportFormatError(f"{where}: token ids do not cover the {T} routed positions or are out of range")
    return ids
