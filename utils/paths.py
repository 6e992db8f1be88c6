"""Where expertcast looks for data and keeps its caches."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

DATA_DIR_ENV = "EXPERTCAST_DATA_DIR"
CACHE_DIR_ENV = "EXPERTCAST_CACHE_DIR"


def data_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """Local directory of the public benchmark files, or None (then loaders use the Hub).

    Order: the explicit argument, ``$EXPERTCAST_DATA_DIR``, then ``../shared/data`` beside the
    repository checkout (where the project's CI and sessions keep them).
    """
    if explicit:
        return Path(explicit)
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    sibling = REPO_ROOT.parent / "shared" / "data"
    return sibling if sibling.is_dir() else None


def cache_dir() -> Path:
    """Root of expertcast's caches (the embedded default model, tokenizers): ``$EXPERTCAST_CACHE_DIR``
    or ``~/.cache/expertcast``."""
    env = os.environ.get(CACHE_DIR_ENV)
    root = Path(env) if env else Path.home() / ".cache" / "expertcast"
    root.mkdir(parents=True, exist_ok=True)
    return root


def display_path(path: str | os.PathLike | None) -> str:
    """A path as plot titles and shipped reports show it, without the machine's folders: under the data folder
    ``$EXPERTCAST_DATA_DIR/...``, under the checkout, the working directory or the home folder relative to it
    (``~/...`` for home), else its last two parts (``.../parent/name``). Anything that is not an absolute path
    (a Hub id, a preset name, a relative path) is returned as it is."""
    if path is None:
        return ""
    text = str(path)
    p = Path(text)
    if not p.is_absolute():
        return text
    data = data_dir()
    for root, shown in ((data, f"${DATA_DIR_ENV}"), (REPO_ROOT, None), (Path.cwd(), None), (Path.home(), "~")):
        if root is None:
            continue
        for base in dict.fromkeys((Path(root), Path(root).resolve())):
            try:
                rel = p.relative_to(base)
            except ValueError:
                continue
            return str(Path(shown) / rel) if shown else (str(rel) or ".")
    return str(Path("...", *p.parts[-2:]))
