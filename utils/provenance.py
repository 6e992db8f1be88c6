"""Provenance: content hashes, settings keys for resume, sequence-identity splits, leakage checks.

* :func:`sha256_file` / :func:`sha256_files` hash artefacts (exports, calibration traces, models).
* :func:`settings_key` + :func:`check_resume` make every resumable job resume only on an exact
  match of the settings that determine its results, naming the first setting that differs.
* :func:`split_of` assigns a sequence to train/val/test by a hash of its id, so the split of a
  sequence never depends on ``--limit``, shard order or how many other sequences exist.
* :func:`check_overlap` refuses (or, when allowed, reports) evaluation on sequences a model was
  trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from expertcast.utils.errors import OverlapError, ResumeMismatchError

CODE_FORMAT = 1
"""Bumped when a change in expertcast alters the numbers a resumable job writes for the same settings."""


# -- hashes -----------------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_files(root: str | os.PathLike, names: Iterable[str] | None = None, *, cached: bool = False) -> str:
    """One sha256 over the files ``names`` under ``root`` (default: every regular file below ``root``,
    hidden files excluded), each hashed with its relative path, in sorted order. ``cached``: each file's
    digest is kept by (real path, size, mtime) in ``sha256-cache.json`` under the cache folder
    (:func:`expertcast.utils.paths.cache_dir`), so a many-GB model folder is hashed once."""
    root = Path(root)
    if names is None:
        names = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    cache: dict[str, str] | None = _digest_cache() if cached else None
    changed = False
    h = hashlib.sha256()
    for n in sorted(names):
        if cache is None:
            digest = sha256_file(root / n)
        else:
            real = (root / n).resolve()
            st = real.stat()
            key = f"{real}:{st.st_size}:{st.st_mtime_ns}"
            if key not in cache:
                cache[key], changed = sha256_file(real), True
            digest = cache[key]
        h.update(n.encode() + b"\0" + digest.encode() + b"\n")
    if changed:
        from expertcast.utils.io import atomic_write_json

        atomic_write_json(_digest_cache_file(), cache)
    return h.hexdigest()


def _digest_cache_file() -> Path:
    from expertcast.utils.paths import cache_dir

    return cache_dir() / "sha256-cache.json"


def _digest_cache() -> dict[str, str]:
    try:
        cache = json.loads(_digest_cache_file().read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return cache if isinstance(cache, dict) else {}


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# -- resume keys ------------------------------------------------------------------------------------
def settings_key(**settings: Any) -> dict[str, Any]:
    """The settings of a resumable job as a JSON-normalised dict (plus the code format version)."""
    return json.loads(json.dumps({"code_format": CODE_FORMAT, **settings}, sort_keys=True, default=str))


def diff_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences, one per setting: ``"seed: 0 -> 1"``."""
    out = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k, "<unset>"), current.get(k, "<unset>")
        if a != b:
            sa, sb = json.dumps(a, default=str), json.dumps(b, default=str)
            out.append(f"{k}: {sa[:80]} (saved) vs {sb[:80]} (now)")
    return out


def check_resume(saved: Mapping[str, Any] | None, current: Mapping[str, Any], where: str | os.PathLike) -> None:
    """Raise :class:`ResumeMismatchError` unless ``saved`` equals ``current`` (both from :func:`settings_key`)."""
    if saved is None:
        raise ResumeMismatchError(f"{where} records no settings (written by an older expertcast?); cannot resume "
                                  f"from it: use --overwrite or another --out")
    if not isinstance(saved, Mapping):
        raise ResumeMismatchError(f"{where} records settings that are no JSON object ({json.dumps(saved)[:60]}); "
                                  f"cannot resume from it: use --overwrite or another --out")
    diff = diff_settings(saved, current)
    if diff:
        more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
        raise ResumeMismatchError(f"cannot resume {where}: it was produced with other settings: {diff[0]}{more}; "
                                  f"use --overwrite to start over or another --out")


# -- splits by sequence identity -------------------------------------------------------------------
def unit_hash(seq_id: str, seed: int = 0) -> float:
    """A number in [0, 1) fixed by ``seq_id`` and ``seed`` alone."""
    d = hashlib.sha256(f"{seed}\0{seq_id}".encode()).digest()
    return int.from_bytes(d[:8], "big") / 2.0**64


def split_of(seq_id: str, val_fraction: float, test_fraction: float = 0.0, seed: int = 0) -> str:
    """``"train"``, ``"val"`` or ``"test"`` for a sequence, by a hash of its id: stable under
    ``--limit`` (a larger set contains the smaller one with the same assignments) and shard order."""
    if not (0 <= val_fraction and 0 <= test_fraction and val_fraction + test_fraction < 1):
        raise ValueError(f"split fractions must be >= 0 with val + test < 1 (got val={val_fraction}, "
                         f"test={test_fraction})")
    u = unit_hash(seq_id, seed)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


# -- train/test leakage -----------------------------------------------------------------------------
def check_overlap(evaluated: Iterable[str], trained: Iterable[str] | None, *, what: str,
                  allow_overlap: bool = False) -> dict[str, Any]:
    """Compare the evaluated sequence ids with a model's training ids.

    Returns ``{"overlap": n, "evaluated": m, "allowed": bool}`` for the output's header. Raises
    :class:`OverlapError` when they overlap and ``allow_overlap`` is False. ``trained=None`` (an
    artefact that records no training ids) is an error too unless allowed: the check cannot be made.
    """
    ev = list(dict.fromkeys(evaluated))
    if trained is None:
        if not allow_overlap:
            raise OverlapError(f"{what} records no training sequence ids, so leakage into this evaluation cannot "
                               f"be ruled out; retrain it with this expertcast or pass --allow-overlap")
        return {"overlap": None, "evaluated": len(ev), "allowed": True}
    tr = set(trained)
    both = [s for s in ev if s in tr]
    if both and not allow_overlap:
        ex = ", ".join(both[:3]) + (" ..." if len(both) > 3 else "")
        raise OverlapError(f"{len(both)} of the {len(ev)} evaluated sequences were used to train {what} ({ex}); "
                           f"evaluate on held-out sequences or pass --allow-overlap (reported in the output)")
    return {"overlap": len(both), "evaluated": len(ev), "allowed": bool(allow_overlap)}


def trace_fingerprint(seq_ids: Iterable[str], contents: Iterable[bytes] | None = None) -> str:
    """sha256 over a trace set's sequence ids (sorted) and, when given, their contents in the same order."""
    h = hashlib.sha256()
    ids = list(seq_ids)
    if contents is None:
        for s in sorted(ids):
            h.update(s.encode() + b"\n")
    else:
        for s, c in sorted(zip(ids, contents, strict=True)):
            h.update(s.encode() + b"\0" + hashlib.sha256(c).digest())
    return h.hexdigest()


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# -- export integrity -------------------------------------------------------------------------------
EXPORT_MANIFEST = "export_manifest.json"
"""Written last into every export folder: the sha256 of each file of the export (JSON configs included)."""


def safe_member(root: str | os.PathLike, name: str) -> Path:
    """``root / name`` for a file name read from an export's JSON, refusing names that leave ``root``
    (absolute paths, ``..``, symlinks pointing outside)."""
    from expertcast.utils.errors import UsageError

    root_p = Path(root).resolve()
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise UsageError(f"{root}: export entry {name!r} must be a relative file name inside the export")
    target = (root_p / name).resolve()
    if root_p != target and root_p not in target.parents:
        raise UsageError(f"{root}: export entry {name!r} points outside the export folder")
    return target


def write_export_manifest(root: str | os.PathLike, files: Iterable[str]) -> str:
    """Write ``EXPORT_MANIFEST`` listing the sha256 of ``files`` (relative names); returns the export
    hash (sha256 over the listed files), which outputs record as the export's identity."""
    from expertcast.utils.io import atomic_write_json

    root = Path(root)
    names = sorted(set(files))
    entry = {n: sha256_file(safe_member(root, n)) for n in names}
    export_hash = sha256_files(root, names)
    atomic_write_json(root / EXPORT_MANIFEST, {"format": "expertcast-export-manifest", "format_version": 1,
                                               "files": entry, "export_hash": export_hash})
    return export_hash


def verify_export_manifest(root: str | os.PathLike) -> str:
    """Check every file the manifest lists (and that it lists every file of the export); returns the
    export hash. Raises UsageError naming the first file that is missing, extra or altered."""
    from expertcast.utils.errors import UsageError

    root = Path(root)
    mf = root / EXPORT_MANIFEST
    if not mf.is_file():
        raise UsageError(f"{root}: no {EXPORT_MANIFEST} (not an export of this expertcast, or an incomplete one)")
    try:
        m = json.loads(mf.read_text(encoding="utf-8"))
        files = dict(m["files"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError):
        raise UsageError(f"{mf}: corrupt export manifest") from None
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
               and p.name != EXPORT_MANIFEST and not p.name.startswith(".")}
    extra = sorted(present - set(files))
    if extra:
        raise UsageError(f"{root}: file {extra[0]} is not part of the export (its manifest does not list it)")
    for name, digest in sorted(files.items()):
        p = safe_member(root, name)
        if not p.is_file():
            raise UsageError(f"{root}: export file {name} is missing")
        if sha256_file(p) != digest:
            raise UsageError(f"{root}: export file {name} was modified after export (sha256 mismatch)")
    return str(m.get("export_hash") or sha256_files(root, list(files)))


def verify_named_export(root: str | os.PathLike, what: str, error: type[Exception] | None = None) -> str:
    """:func:`verify_export_manifest` for a ``what`` (e.g. ``"forecaster export"``): a missing manifest asks
    for a re-export, an altered file says the export is corrupt; raised as ``error`` (default UsageError)."""
    from expertcast.utils.errors import UsageError

    error = error or UsageError
    root = Path(root)
    if not (root / EXPORT_MANIFEST).is_file():
        raise error(f"{root}: {what} without {EXPORT_MANIFEST} (written by an older expertcast, or incomplete); "
                    f"re-export it with `expertcast fit`")
    try:
        return verify_export_manifest(root)
    except UsageError as e:
        raise error(f"{what} is corrupt or was modified: {e}") from None


_CODE_VERSION: dict[str, Any] | None = None


def pin_code_version() -> None:
    """Read the code's version and git state now, once per process (:func:`code_version` returns that reading from
    then on): a long job calls it at its start (``expertcast`` itself does, before running a command), so an output
    records the code the process loaded, not a commit made while the job ran. Two git calls, no imports."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        _CODE_VERSION = _read_code_version()


def host_record() -> dict[str, Any]:
    """What a job's speed depends on beyond its settings: the CPUs it may use, torch's intra-op threads and the
    ``OMP_NUM_THREADS`` it was started with, and whether its heap is held (:mod:`expertcast.utils.heap`)."""
    import os

    from expertcast.utils import heap

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count()
    try:
        threads = __import__("torch").get_num_threads()
    except ImportError:  # pragma: no cover
        threads = None
    return {"cpus": cpus, "torch_threads": threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "heap_held": heap.held}


def code_version() -> dict[str, Any]:
    """The code that wrote an output: expertcast's version and :data:`CODE_FORMAT`, the git commit of the
    package folder when it is a checkout (``dirty``: uncommitted changes to tracked files), as read once per
    process (:func:`pin_code_version`), and the torch / transformers versions when they are importable."""
    pin_code_version()
    out = dict(_CODE_VERSION)
    for mod in ("torch", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _read_code_version() -> dict[str, Any]:
    import subprocess

    from expertcast import __version__

    out: dict[str, Any] = {"expertcast": __version__, "code_format": CODE_FORMAT, "git_commit": None, "git_dirty": None}
    root = Path(__file__).resolve().parents[1]
    try:
        run = dict(cwd=root, capture_output=True, text=True, timeout=10, check=True)
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip() or None
        out["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "-uno"], **run).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out
