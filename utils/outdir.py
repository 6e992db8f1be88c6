"""Output folders that never clobber foreign files and never mix two runs.

Every command that writes a folder claims it first with :func:`claim_output_dir`:

* the folder must be empty, absent, or already carry this command kind's marker file
  ``.expertcast-output.json`` (written when the command first claimed it);
* the working directory, the home folder, the file-system root and the project checkout are refused;
* ``overwrite=True`` removes only the entries the marker lists as written by expertcast, never a
  foreign file;
* a lock file (``.expertcast.lock``, ``fcntl.flock``) held for the command's lifetime makes a second
  concurrent run on the same folder fail fast with a message naming the holder's pid.

Commands register what they write with :meth:`OutputDir.track` (a file or a sub-folder name relative
to the folder), so ``--overwrite`` knows what is theirs.

A file-valued output flag (``--json``, ``--csv``, ``--plot``, ``--disk-path``, a cue set's ``--out``) follows
the same rules through :func:`claim_output_file`: only a new path, or expertcast's own earlier output of the
same kind. What expertcast wrote is listed (kind, size, mtime) in ``.expertcast-files.json`` beside the file
(:meth:`OutputFile.written`); a file that is not listed, or was changed since, is somebody else's and is never
replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from expertcast.utils.errors import OutputDirError
from expertcast.utils.locks import FileLock

MARKER = ".expertcast-output.json"
LOCK = ".expertcast.lock"
FILES = ".expertcast-files.json"
"""Beside file outputs: ``{name: {"kind", "size", "mtime_ns"}}`` of the files expertcast wrote there."""
_INTERNAL = {MARKER, LOCK, FILES}
DISK_STORE_KIND = "disk-store"
"""The kind of an expert disk store file (``--store disk --disk-path``): every command's store is the same kind."""


def _protected(path: Path) -> str | None:
    """Why ``path`` must never be an output folder, or None."""
    from expertcast.utils.paths import REPO_ROOT

    p = path.resolve()
    if p == Path(p.anchor):
        return "the file-system root"
    if p == Path.cwd().resolve():
        return "the current working directory"
    if p == Path.home().resolve():
        return "the home folder"
    if p == REPO_ROOT.resolve():
        return "the expertcast checkout"
    if p in REPO_ROOT.resolve().parents:
        return "a folder containing the expertcast checkout"
    for sub in ("commands", "configs", "data", "docs", "inference", "models", "scripts", "tests", "train", "utils",
                ".git"):
        if p == (REPO_ROOT / sub).resolve():
            return f"the checkout's {sub}/ folder"
    return None


class OutputDir:
    """A claimed output folder (use as a context manager, or call :meth:`release`)."""

    def __init__(self, path: Path, kind: str, lock: FileLock | None):
        self.path = path
        self.kind = kind
        self._lock = lock

    # -- bookkeeping ------------------------------------------------------------------------------
    def _read_marker(self) -> dict[str, Any]:
        return read_marker(self.path) or {"kind": self.kind, "written": []}

    def track(self, *names: str | os.PathLike) -> None:
        """Record ``names`` (relative to the folder, or absolute paths inside it) as written by us."""
        from expertcast.utils.io import atomic_write_json

        m = self._read_marker()
        written = list(m.get("written", []))
        for n in names:
            rel = Path(n)
            if rel.is_absolute():
                try:
                    rel = rel.resolve().relative_to(self.path.resolve())
                except ValueError:
                    raise OutputDirError(f"{n} is outside the output folder {self.path}") from None
            first = rel.parts[0] if rel.parts else ""
            if first and first not in written and first not in _INTERNAL:
                written.append(first)
        if written != m.get("written"):
            m["written"] = written
            atomic_write_json(self.path / MARKER, m)

    def file(self, name: str) -> Path:
        """``folder / name``, tracked as ours."""
        self.track(name)
        return self.path / name

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> OutputDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __fspath__(self) -> str:
        return str(self.path)


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The marker of an expertcast output folder, or None when it has none (or it is unreadable)."""
    f = Path(path) / MARKER
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        raise OutputDirError(f"{f}: marker file is corrupt; remove the folder {Path(path)} by hand") from None
    return m if isinstance(m, dict) else None


def _check_written(path: Path, marker: dict[str, Any]) -> list[str]:
    """The marker's ``written`` list, each entry a plain name inside the folder (no separator, not ``.``/``..``,
    not absolute); a marker listing anything else is refused so ``--overwrite`` can never delete outside it."""
    written = marker.get("written", [])
    if not isinstance(written, list):
        raise OutputDirError(f"{path / MARKER}: 'written' is not a list; remove the folder {path} by hand")
    for name in written:
        if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
                or "\0" in name or Path(name).is_absolute() or Path(name).name != name):
            raise OutputDirError(f"{path / MARKER}: 'written' lists {name!r}, not a plain name inside the folder; "
                                 f"refusing to use it (nothing deleted); remove the folder {path} by hand")
    return written


def _is_internal(name: str) -> bool:
    """The marker, the lock, and a marker being written right now by a concurrent run (an atomic write's
    temp file ``.<marker>.<random>.tmp``): that run is reported by the lock, not as foreign files."""
    return name in _INTERNAL or (name.startswith(f".{MARKER}.") and name.endswith(".tmp"))


def _take_lock(path: Path, kind: str) -> FileLock:
    lock = FileLock(path / LOCK)
    if not lock.acquire(owner=f"{os.getpid()} {kind}"):
        raise OutputDirError(f"{path} is in use by another expertcast run (pid {lock.holder()}); wait for it to "
                             f"finish or choose another --out")
    return lock


def claim_output_dir(path: str | os.PathLike, kind: str, *, overwrite: bool = False, lock: bool = True) -> OutputDir:
    """Claim ``path`` as the output folder of a ``kind`` command (e.g. ``"simulate"``).

    Raises :class:`OutputDirError` (one line, names the folder and the cause) when the folder holds
    foreign files, another kind's output, is a protected path, or is locked by a concurrent run. With
    ``overwrite`` the entries this kind wrote before are deleted (foreign files are never touched: a
    folder that also holds foreign files is refused).
    """
    p = Path(path).expanduser()
    why = _protected(p)
    if why:
        raise OutputDirError(f"refusing to use {why} ({p.resolve()}) as an output folder; give a dedicated --out")
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"output path {p} exists and is not a folder")
    p.mkdir(parents=True, exist_ok=True)
    marker = read_marker(p)
    entries = [e.name for e in p.iterdir() if not _is_internal(e.name)]
    if marker is None:
        if entries:
            shown = ", ".join(sorted(entries)[:5]) + (" ..." if len(entries) > 5 else "")
            raise OutputDirError(f"output folder {p} is not empty and was not written by expertcast ({shown}); "
                                 f"choose an empty or new folder")
    elif marker.get("kind") != kind:
        raise OutputDirError(f"output folder {p} holds the output of `expertcast {marker.get('kind')}`, not of "
                             f"`expertcast {kind}`; choose another folder")
    else:
        ours = set(_check_written(p, marker))
        foreign = [e for e in entries if e not in ours]
        if foreign and overwrite:
            raise OutputDirError(f"output folder {p} also holds files expertcast did not write "
                                 f"({', '.join(sorted(foreign)[:5])}); --overwrite only removes its own output, "
                                 f"so move those first or choose another folder")
    held = _take_lock(p, kind) if lock else None
    try:
        from expertcast.utils.io import atomic_write_json

        if marker is not None and overwrite:
            for name in marker.get("written", []):
                t = p / name
                if t.is_dir() and not t.is_symlink():
                    shutil.rmtree(t)
                elif t.exists() or t.is_symlink():
                    t.unlink()
            marker = None
        if marker is None:
            atomic_write_json(p / MARKER, {"kind": kind, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                           "written": []})
    except BaseException:
        if held is not None:
            held.release()
        raise
    return OutputDir(p, kind, held)


# -- file-valued output flags -----------------------------------------------------------------------------
def _files_registry(folder: Path) -> dict[str, Any]:
    try:
        reg = json.loads((folder / FILES).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return reg if isinstance(reg, dict) else {}


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


class OutputFile:
    """A claimed output file (:func:`claim_output_file`); call :meth:`written` once the file is in place."""

    def __init__(self, path: Path, kind: str):
        self.path = path
        self.kind = kind

    def written(self) -> None:
        """Record the file as this kind's output, so that a later run of the same kind may replace it."""
        from expertcast.utils.io import atomic_write_json

        if not self.path.is_file():
            return
        folder = self.path.parent
        reg = _files_registry(folder)
        reg[self.path.name] = {"kind": self.kind, **_stamp(self.path)}
        atomic_write_json(folder / FILES, reg)

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)


def claim_output_file(path: str | os.PathLike, flag: str, kind: str, *, overwrite: bool = False,
                      recognise: Any = None, what: str | None = None,
                      hint: str = "choose a new path or remove the file first") -> OutputFile:
    """Check the file-valued output flag ``flag`` (e.g. ``"--json"``) of a ``kind`` command (e.g.
    ``"replay --json"``) before any work starts: ``path`` must be new, or this kind's earlier output (listed in
    ``.expertcast-files.json`` with its size and mtime unchanged, or accepted by ``recognise(path) -> bool`` for a
    self-describing format such as a cue set). ``overwrite`` replaces any existing file (never a folder). Raises
    :class:`OutputDirError` in one line naming the flag and the file (``what``, e.g. ``"a cue set"``: what the
    file must be; ``hint`` how to get past it); nothing is written or removed."""
    p = Path(path).expanduser()
    if p.name in _INTERNAL or p.name.startswith(f".{MARKER}."):
        raise OutputDirError(f"{flag} {p}: that name is expertcast's own bookkeeping file; choose another path")
    if p.is_dir():
        raise OutputDirError(f"{flag} {p} is a folder; give the file to write")
    if p.exists() or p.is_symlink():
        if not p.is_file():
            raise OutputDirError(f"{flag} {p} exists and is not a regular file; choose a new path")
        if not overwrite:
            entry = _files_registry(p.parent).get(p.name)
            ours = isinstance(entry, dict) and entry.get("kind") == kind and not p.is_symlink() and \
                {k: entry.get(k) for k in ("size", "mtime_ns")} == _stamp(p)
            if not ours and not (recognise is not None and recognise(p)):
                if what is not None:
                    why = f"is not {what}"
                elif isinstance(entry, dict) and entry.get("kind") != kind:
                    why = f"was written by `expertcast {entry.get('kind')}`"
                else:
                    why = "was not written by expertcast as this output (or was changed since)"
                raise OutputDirError(f"{flag} {p} exists and {why}; refusing to replace it ({hint})")
    return OutputFile(p, kind)
