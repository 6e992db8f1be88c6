"""The one resolver of model names (``--model`` of every command, ``model:`` of the router YAMLs).

Lives in ``train/`` because resolving ``tiny-default`` may build the embedded default model
(:mod:`expertcast.train.tiny_default`); ``models/`` only loads what it is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

from expertcast.utils.errors import UsageError

DEFAULT_MODEL_NAMES = ("tiny-default", "default")
"""Names of the embedded default model (trained once by the project's recipe, then cached)."""


def resolve_model(name: str, *, announce: bool = True) -> str:
    """The one resolver of ``--model``: returns what :func:`expertcast.models.backbone.load_moe_model`
    loads.

    * ``tiny-default`` / ``default``: the embedded default model (trained once, then cached; the run
      says in one line when it reuses the cached build);
    * a tiny preset name (``qwen3_moe-tiny``, ...) or a real-size preset: kept as is;
    * a local Hugging Face directory: must exist and hold ``config.json``; or a router-adaptation export
      folder (``export.json``: ``model/`` merged, or a peft ``adapter/`` over its recorded base);
    * anything else that looks like ``owner/name``: a Hub id (``trust_remote_code`` stays off).
    """
    from expertcast.models.presets import is_preset

    name = str(name).strip()
    if not name:
        raise UsageError("--model is empty")
    if name in DEFAULT_MODEL_NAMES:
        from expertcast.models.tiny_default import ensure_default_model

        path = Path(ensure_default_model())
        if announce:
            print(f"model: embedded default model at {path}", file=sys.stderr)
        return str(path)
    if is_preset(name):
        return name
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"--model {name}: is a file; expected a Hugging Face model directory")
        if (p / "export.json").is_file():  # a router-adaptation export (`expertcast fit`): load_moe_model reads it
            return str(p)
        if not (p / "config.json").is_file():
            raise UsageError(f"--model {name}: folder has no config.json (not a Hugging Face model directory)")
        return str(p)
    looks_local = name.startswith(("/", "./", "../", "~", ".")) or name.count("/") != 1
    if looks_local:
        from expertcast.models.presets import list_presets

        raise UsageError(f"--model {name}: no such local directory, preset or Hub id (presets: "
                         f"{', '.join(list_presets())}; or 'tiny-default')")
    return name


