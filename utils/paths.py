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
