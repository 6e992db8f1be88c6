"""eval's resumable samples file (``samples.jsonl``, docs/design.md "Provenance"): one JSON row per graded problem.

The rows of a batch are written by one ``write`` + ``fsync``, each carrying its batch id, the batch's size and the
settings hash; :func:`read_samples` drops a torn tail (a line cut mid-write, or the first rows of a batch whose other
rows are missing: an interrupted run) with a warning, and refuses a corrupt line elsewhere, a row of other settings or
a problem seen twice, naming ``file:line``; ``repair`` cuts the torn tail from the file."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.errors import ResumeMismatchError, UsageError


# -- samples file -------------------------------------------------------------------------------------
@dataclass
class SampleFile:
    """What :func:`read_samples` found: the complete rows and the byte length of the valid prefix."""

    rows: list[dict[str, Any]]
    valid_bytes: int
    dropped_rows: int = 0
    """Complete rows of a torn last batch that were dropped with it."""
    torn_tail: bool = False
    """True when the file ends in a torn line or a torn batch."""


def read_samples(path: str | os.PathLike, settings_hash: str | None = None, *, repair: bool = False
                 ) -> list[dict[str, Any]]:
    """Rows of a samples file in file order (the module docstring says what is dropped or refused).

    ``settings_hash``: refuse rows written under other settings. ``repair``: cut a torn tail from the
    file so that the next append starts on a fresh line.
    """
    path = Path(path)
    found = scan_samples(path, settings_hash)
    if found.torn_tail:
        what = f"a torn last batch ({found.dropped_rows} complete rows dropped with it)" if found.dropped_rows \
            else "a torn last line"
        print(f"warning: {path}: dropping {what}: an interrupted run; those problems run again", file=sys.stderr)
        if repair:
            from expertcast.utils.io import atomic_write_bytes

            atomic_write_bytes(path, path.read_bytes()[: found.valid_bytes])
    return found.rows


def scan_samples(path: Path, settings_hash: str | None = None) -> SampleFile:
    """Parse ``path`` without changing it (see :func:`read_samples`)."""
    if not path.is_file():
        return SampleFile([], 0)
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else a line cut mid-write
    rows: list[dict[str, Any]] = []
    ends: list[int] = []  # byte offset just after each kept row
    first_line: dict[str, int] = {}
    pos = 0
    for i, raw in enumerate(lines):
        pos += len(raw) + 1
        if not raw.strip():
            continue
        row = _parse_row(path, i + 1, raw, settings_hash)
        if row["id"] in first_line:
            raise UsageError(f"{path}:{i + 1}: problem {row['id']} already has a sample (line {first_line[row['id']]}): "
                             f"the file mixes runs; use --overwrite to start over")
        first_line[row["id"]] = i + 1
        rows.append(row)
        ends.append(pos)
    torn = bool(tail.strip())
    keep = _complete_prefix(rows)
    dropped = len(rows) - keep
    valid = ends[keep - 1] if keep else 0
    return SampleFile(rows[:keep], valid, dropped, torn or dropped > 0)


def _parse_row(path: Path, lineno: int, raw: bytes, settings_hash: str | None) -> dict[str, Any]:
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{path}:{lineno}: not a JSON sample row (the file is corrupt); use --overwrite to start "
                         f"over") from None
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or not isinstance(row.get("batch"), int) \
            or not isinstance(row.get("batch_stats"), dict):
        raise UsageError(f"{path}:{lineno}: not a sample row of `expertcast eval` (needs id, batch, batch_stats)")
    if settings_hash is not None and row.get("settings_hash") != settings_hash:
        raise ResumeMismatchError(f"{path}:{lineno}: sample {row['id']} was written with other settings "
                                  f"(settings hash {row.get('settings_hash')!r}); use --overwrite or another --out")
    return row


def _complete_prefix(rows: list[dict[str, Any]]) -> int:
    """Number of leading rows to keep: all but a last batch that has fewer rows than it recorded."""
    if not rows:
        return 0
    last = rows[-1]["batch"]
    start = len(rows)
    while start > 0 and rows[start - 1]["batch"] == last:
        start -= 1
    size = rows[-1].get("batch_rows")
    if isinstance(size, int) and len(rows) - start < size:
        return start
    return len(rows)


def append_samples(path: str | os.PathLike, rows: list[dict[str, Any]]) -> None:
    """Append whole rows in one write and fsync (a batch is recorded whole, or its torn tail is dropped)."""
    data = "".join(json.dumps(r, default=_jsonable) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
