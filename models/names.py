"""The one resolver of model names (docs/design.md, "Embedded default model"): what ``--model`` of every command, ``model:``
of the router YAMLs and the tokenizer a cue set names resolve to (:func:`resolve_model`), and where the
shipped embedded default model is (:func:`shipped_default_model`, which verifies its checksums).

Light on purpose (no torch at import): the command layer imports it at start-up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from expertcast.utils.errors import UsageError

EXPORT_FILE = "export.json"
"""The top-level JSON of a router-adaptation export (``expertcast.models.router_export.ADAPTATION_FILE``)."""
DEFAULT_MODEL_NAMES = ("tiny-default", "default")
"""Names of the embedded default model (built by ``expertcast build-default``, shipped in the repository):
:func:`resolve_model` returns the shipped folder once verified; no name ever trains it."""


class ModelNotFoundError(UsageError, FileNotFoundError):
    """A model name or path that names nothing loadable (a one-line usage error, and a FileNotFoundError
    for library callers)."""


def is_export_dir(name_or_path: str | os.PathLike) -> bool:
    """True for a folder holding a router-adaptation export (``export.json``)."""
    p = Path(str(name_or_path)).expanduser()
    return p.is_dir() and (p / EXPORT_FILE).is_file()


def _looks_local(name: str) -> bool:
    """A path rather than a Hub id ("owner/name"): absolute, relative with ./ or ../, ~, a dot, or not
    exactly one slash."""
    return (name.startswith(("/", "./", "../", "~", ".")) or name.count("/") != 1
            or os.sep == "\\" and "\\" in name)


SHIPPED_DEFAULT_DIR = Path(__file__).resolve().parent / "shipped" / "tiny-default"
"""The embedded default model's files, committed in the repository (docs/design.md, "Embedded default
model"): what :data:`DEFAULT_MODEL_NAMES` resolve to, after their checksums are verified."""
SHIPPED_REPORT = "report.json"
"""The build report in the shipped folder; its ``shipped_files`` maps every other file to its sha256 and size."""
_VERIFIED: dict[tuple, Path] = {}


def shipped_default_model(folder: str | os.PathLike | None = None) -> Path:
    """The shipped embedded default model's folder (``folder`` or :data:`SHIPPED_DEFAULT_DIR`), once every file
    its report lists has the recorded size and sha256; a :class:`ModelNotFoundError` naming the file at fault
    otherwise. Never builds anything: ``expertcast build-default`` rebuilds the model (into the cache)."""
    from expertcast.utils.provenance import sha256_file

    root = Path(folder) if folder is not None else SHIPPED_DEFAULT_DIR
    report = root / SHIPPED_REPORT
    try:
        listed = json.loads(report.read_text(encoding="utf-8"))["shipped_files"]
        if not isinstance(listed, dict) or not listed:
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelNotFoundError(f"the embedded default model is not shipped at {root} ({report} is missing or lists "
                                 f"no files): restore it from the repository, or rebuild it with "
                                 f"`expertcast build-default` and pass the printed folder as --model") from None
    stamp = tuple(sorted((name, *_stat(root / name)) for name in listed))
    if _VERIFIED.get((str(root), stamp)) is not None:
        return root
    for name, want in sorted(listed.items()):
        f = root / name
        size = _stat(f)[0]
        if size != want.get("bytes"):
            raise ModelNotFoundError(f"shipped default model: {f} has {size} bytes, its report records "
                                     f"{want.get('bytes')} (corrupt or replaced file; restore it from the repository)")
        got = sha256_file(f)
        if got != want.get("sha256"):
            raise ModelNotFoundError(f"shipped default model: {f} has sha256 {got[:16]}..., its report records "
                                     f"{str(want.get('sha256'))[:16]}... (corrupt or replaced file; restore it from "
                                     f"the repository)")
    _VERIFIED[(str(root), stamp)] = root
    return root


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return (-1, -1)
    return (st.st_size, st.st_mtime_ns)


def resolve_model(name: str | os.PathLike, *, announce: bool = False) -> str:
    """The one resolver of model names (``--model`` of every command, ``model:`` of the router YAMLs, the
    tokenizer a cue set names): returns what :func:`load_moe_model` loads.

    * ``tiny-default`` / ``default``: the shipped embedded default model's folder, its checksums verified
      (:func:`shipped_default_model`; nothing is ever trained here); ``announce`` says on stderr which folder;
    * a tiny preset name (``qwen3_moe-tiny``, ...) or a real-size preset: kept as is;
    * a local Hugging Face directory (must hold ``config.json``) or a router-adaptation export folder
      (``export.json``: ``model/`` merged, or a peft ``adapter/`` over its recorded base);
    * anything else with exactly one slash (``owner/name``): a Hub id (``trust_remote_code`` stays off).

    Anything else raises :class:`ModelNotFoundError` naming the problem.
    """
    name = str(name).strip()
    if not name:
        raise ModelNotFoundError("--model is empty")
    if name in DEFAULT_MODEL_NAMES:
        path = shipped_default_model()
        if announce:
            print(f"model: embedded default model at {path} (shipped, sha256 verified)", file=sys.stderr)
        return str(path)
    from expertcast.models.presets import is_preset, list_presets

    if is_preset(name):
        return name
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelNotFoundError(f"model path {p} is a file; expected a Hugging Face model directory")
        if is_export_dir(p):  # a router-adaptation export (`expertcast fit`): load_moe_model reads it
            return str(p)
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {p} has no config.json (not a Hugging Face model directory)")
        return str(p)
    if _looks_local(name):
        raise ModelNotFoundError(f"--model {name}: no such local directory, preset or Hub id ({p} does not exist; "
                                 f"presets: {', '.join(list_presets())}; or 'tiny-default')")
    return name
