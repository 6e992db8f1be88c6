"""Checks of fields read from JSON documents, shared by the readers of trace imports
(:mod:`expertcast.data.importers.common`), cue sets (:mod:`expertcast.inference.saem.cues`) and forecaster exports
(:mod:`expertcast.models.forecaster_export`).

JSON values are checked, never coerced: an integer field takes a JSON integer (not a string, a float or a
boolean, which Python counts as an ``int``), a format tag must match exactly and a format version must be
a whole number this code reads. Each check raises the error class its caller passes (every reader has its
own, e.g. ``ImportFormatError``), with the message the caller's words give, so readers keep their own
one-line errors while the rules live here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def is_int(v: Any) -> bool:
    """True for a JSON integer (a Python ``int`` that is not a ``bool``)."""
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(v: Any, what: str, where: str, lo: int, hi: int, error: type[Exception] = ValueError) -> int:
    """``v`` if it is a JSON integer in [lo, hi]; else ``error("{where}: {what} must be an integer, got {v}")``
    or ``error("{where}: {what} {v} outside [{lo}, {hi}]")`` (``v`` as JSON)."""
    if not is_int(v):
        raise error(f"{where}: {what} must be an integer, got {json.dumps(v)}")
    if not lo <= v <= hi:
        raise error(f"{where}: {what} {v} outside [{lo}, {hi}]")
    return v


def missing_keys(d: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """The names of ``keys`` that ``d`` lacks, in the order given."""
    return [k for k in keys if k not in d]


def require_keys(d: Mapping[str, Any], keys: Iterable[str], error: type[Exception],
                 message: Callable[[list[str]], str]) -> None:
    """``error(message(missing))`` when ``d`` lacks any of ``keys``."""
    missing = missing_keys(d, keys)
    if missing:
        raise error(message(missing))


def is_str_list(v: Any, nonempty: bool = True) -> bool:
    """True for a list of non-empty strings (and, with ``nonempty``, at least one)."""
    return isinstance(v, list) and (bool(v) or not nonempty) and all(isinstance(s, str) and s for s in v)


def check_format(d: Any, fmt: str, max_version: int, error: type[Exception], *,
                 wrong_format: Callable[[Any], str], bad_version: Callable[[Any], str]) -> int:
    """The ``format_version`` of the versioned JSON document ``d``, after checking that ``d`` is an object whose
    ``format`` is ``fmt`` (else ``error(wrong_format(found))``, ``found`` the format it holds or, for a non-object,
    its type name) and whose ``format_version`` is a JSON integer in 1..``max_version`` (else
    ``error(bad_version(version))``)."""
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise error(wrong_format(d.get("format") if isinstance(d, dict) else type(d).__name__))
    ver = d.get("format_version")
    if not is_int(ver) or not 1 <= ver <= max_version:
        raise error(bad_version(ver))
    return ver
