"""Atomic file writes, the JSON-lines reader (:func:`iter_jsonl`) and result reporting (terminal table, CSV,
JSON) shared by every job."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from expertcast.utils.errors import UsageError


def _umask_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (0o666 minus the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, _umask_mode())  # mkstemp creates 0600; outputs get the usual permissions
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir(tmp: str | os.PathLike, dest: str | os.PathLike) -> None:
    """Put the finished folder ``tmp`` in place of ``dest`` (renames only; an old ``dest`` is removed after), so
    readers see either the old folder or the whole new one."""
    import shutil

    tmp, dest = Path(tmp), Path(dest)
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}"
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> None:
    """Save a matplotlib figure as PNG at ``path`` atomically (through :func:`atomic_write_bytes`, whose
    temporary name is unique, so two concurrent writers never collide), then close the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def series_colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinct colours (RGBA) for the ``n`` series of one plot, never repeating (matplotlib's default cycle
    repeats after 10): tab10 up to 10 series, tab20 up to 20, else ``n`` evenly spaced hues of ``turbo``."""
    import matplotlib

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_csv(path: str | os.PathLike, rows: Sequence[dict[str, Any]]) -> None:
    """Atomically write ``rows`` (dicts; columns = union of keys in first-seen order) as CSV."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt_csv(r.get(k)) for k in cols})
    atomic_write_text(path, buf.getvalue())


def _fmt_csv(v: Any) -> Any:
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=_json_default)
    return v


def print_table(rows: Sequence[dict[str, Any]], title: str | None = None, columns: Sequence[str] | None = None,
                floatfmt: str = "{:.4f}") -> None:
    """Print ``rows`` as a table in the terminal (rich when it is installed)."""
    if not rows:
        print(f"{title or 'results'}: (no rows)")
        return
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return floatfmt.format(v)
        if isinstance(v, (list, tuple, dict)):
            return json.dumps(v, default=_json_default)
        return "" if v is None else str(v)

    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*[fmt(r.get(c)) for c in cols])
        Console(width=max(120, 14 * len(cols))).print(t)
    except ImportError:  # pragma: no cover
        if title:
            print(title)
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(fmt(r.get(c)) for c in cols))


def report(rows: Sequence[dict[str, Any]], *, title: str, json_path: str | os.PathLike | None = None,
           csv_path: str | os.PathLike | None = None, columns: Sequence[str] | None = None) -> None:
    """Table in the terminal, plus JSON (a list of records) and CSV when paths are given (a path claimed with
    :func:`expertcast.utils.outdir.claim_output_file` is recorded as written)."""
    print_table(rows, title=title, columns=columns)
    if json_path:
        atomic_write_json(json_path, list(rows))
        _record(json_path)
    if csv_path:
        write_csv(csv_path, rows)
        _record(csv_path)


def _record(path: Any) -> None:
    """Mark a claimed output file (:class:`~expertcast.utils.outdir.OutputFile`) as written; a plain path: nothing."""
    written = getattr(path, "written", None)
    if callable(written):
        written()


def iter_jsonl(path: str | os.PathLike, *, limit: int | None = None,
               error: type[Exception] = UsageError) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of the non-blank lines of a JSON-lines file, in order, at most ``limit``
    values. A line that is not JSON (or nested past the parser's depth) raises ``error`` in one line: ``PATH:N: not
    valid JSON (why)``."""
    with open(path, encoding="utf-8") as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise error(f"{path}:{lineno}: JSON nested too deeply") from None
            n += 1
            yield lineno, value


def read_jsonl(path: str | os.PathLike, *, limit: int | None = None,
               error: type[Exception] = UsageError) -> list[Any]:
    """The values of :func:`iter_jsonl` (without line numbers)."""
    return [v for _, v in iter_jsonl(path, limit=limit, error=error)]
