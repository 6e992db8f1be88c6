"""The one resolver of model names (docs/design.md, "Embedded default model"): what ``--model`` of every command, ``model:``
of the router YAMLs and the tokenizer a cue set names resolve to (:func:`resolve_model`), and where the
embedded default model's last build is (:func:`record_default_model`, :func:`default_model_path`).

Light on purpose (no torch at import): the command layer imports it at start-up.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from expertcast.utils.errors import UsageError

EXPORT_FILE = "export.json"
"""The top-level JSON of a router-adaptation export (``expertcast.models.router_export.ADAPTATION_FILE``)."""
DEFAULT_MODEL_NAMES = ("tiny-default", "default")
"""Names of the embedded default model (trained once by ``expertcast build-default``, then cached):
:func:`resolve_model` returns the directory of its last build; ``models/`` never builds it."""
DEFAULT_MODEL_RECORD = "tiny-default.json"
"""File under the cache folder naming the directory of the embedded default's last build
(:func:`record_default_model`)."""


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


def record_default_model(path: str | os.PathLike) -> None:
    """Record ``path`` (a complete build of the embedded default) as what :data:`DEFAULT_MODEL_NAMES`
    resolve to (the builder calls it whenever it returns a build)."""
    from expertcast.utils.io import atomic_write_json
    from expertcast.utils.paths import cache_dir

    record = cache_dir() / DEFAULT_MODEL_RECORD
    want = {"path": str(Path(path).resolve())}
    try:
        if json.loads(record.read_text(encoding="utf-8")) == want:
            return
    except (OSError, ValueError):
        pass
    atomic_write_json(record, want)


def default_model_path() -> Path:
    """The directory of the embedded default's last build (:func:`record_default_model`); a
    :class:`ModelNotFoundError` saying how to build it when there is none."""
    from expertcast.utils.paths import cache_dir

    record = cache_dir() / DEFAULT_MODEL_RECORD
    try:
        path = Path(json.loads(record.read_text(encoding="utf-8"))["path"])
    except (OSError, ValueError, KeyError, TypeError):
        path = None
    if path is None or not (path / "config.json").is_file():
        raise ModelNotFoundError("the embedded default model (tiny-default) is not built in "
                                 f"{cache_dir()}: run `expertcast build-default` (or name it as --model of a command)")
    return path


def resolve_model(name: str | os.PathLike, *, build_default: Callable[[], str | os.PathLike] | None = None,
                  announce: bool = False) -> str:
    """The one resolver of model names (``--model`` of every command, ``model:`` of the router YAMLs, the
    tokenizer a cue set names): returns what :func:`load_moe_model` loads.

    * ``tiny-default`` / ``default``: the embedded default model's directory; ``build_default`` (the
      command layer's builder, which trains it once and returns its cached build) when given, else its
      last build (:func:`default_model_path`); ``announce`` says on stderr which directory it is;
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
        path = Path(build_default()) if build_default is not None else default_model_path()
        if announce:
            print(f"model: embedded default model at {path}", file=sys.stderr)
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
