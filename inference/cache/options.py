"""The generic machinery of typed policy options, parsed from ``name:key=value,...`` (docs/design.md).

Each policy's options dataclass lives beside the policy class (its ``Options``, derived from
:class:`PolicyOptions`); its fields are the options: the field's type is the option's type, its default the
one default, and its metadata (:func:`option`) carries the help text and the valid range, choices, pattern
or file kind. :func:`parse_policy_options` turns ``"lrfu:lam=0.1"`` into ``LRFUPolicy.Options(lam=0.1)``,
converting and validating every value; every mistake is a one-line
:class:`~expertcast.utils.errors.UsageError` that names the valid keys or the accepted values::

    lrfu has no option 'lamda'; options: lam, history
    lru has no options (got 'foo')
    static option calibration=/etc/passwd: not a trace set (no trace_meta.json); expected a trace
        directory written by `expertcast collect` or `expertcast traces import`

File options (``calibration``, ``forecaster``, ``cue_set``, ``replay``) must exist and be of the
right kind; :mod:`expertcast.inference.policies.artifacts` loads them. The options given are remembered
(:attr:`PolicyOptions.given`), so a run's label names only what the user set: ``lrfu(lam=0.1)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from expertcast.utils.errors import UsageError

FILE_KINDS = {
    "traces": "a trace directory written by `expertcast collect` or `expertcast traces import`",
    "forecaster": "a forecaster export directory (`expertcast fit --config configs/forecaster/...`)",
    "cue_set": "a cue-set JSON file written by `expertcast stages calibrate`",
    "router_replay": "a router replay directory (router_replay.json + router_replay.npz)",
}
"""What each file option must point at."""

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
DEVICE_PATTERN = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def option(default: Any, help: str, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, choices: tuple[str, ...] | None = None, file: str | None = None,
           pattern: re.Pattern | None = None) -> Any:
    """A dataclass field for one policy option.

    Args:
        default: the policy constructor's default.
        help: one line for ``expertcast simulate --list-policies``.
        low / high: inclusive bounds of a number (``low_open``: the lower bound is exclusive).
        choices: accepted strings.
        file: the kind of file the value names (a key of :data:`FILE_KINDS`).
        pattern: a regular expression a string must match.
    """
    meta = {"help": help, "low": low, "high": high, "low_open": low_open, "choices": choices, "file": file,
            "pattern": pattern}
    return field(default=default, metadata=meta)


@dataclass
class PolicyOptions:
    """Options of a policy that takes none; each policy's options class (beside the policy, in its module)
    derives from it."""

    def __post_init__(self) -> None:
        self._given: tuple[str, ...] = ()
        self._policy = ""

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def file_options(cls) -> dict[str, str]:
        """``{option: file kind}`` of the options naming a file (a key of :data:`FILE_KINDS`)."""
        return {f.name: f.metadata["file"] for f in dataclasses.fields(cls) if f.metadata.get("file")}

    @classmethod
    def describe(cls) -> list[dict[str, Any]]:
        """One dict per option: name, type, default, help (for ``--list-policies``)."""
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            m = f.metadata
            kind = FILE_KINDS.get(m.get("file") or "", "")
            help_ = m.get("help", "") + (f" ({kind})" if kind else "")
            if m.get("choices"):
                help_ += f"; one of {', '.join(m['choices'])}"
            out.append({"name": f.name, "type": _type_name(hints[f.name], m), "default": f.default, "help": help_})
        return out

    @classmethod
    def parse(cls, policy: str, values: Mapping[str, Any]) -> PolicyOptions:
        """Options of ``policy`` from ``{key: text}`` (the command line), with the cross-option checks
        (:meth:`check`); UsageError naming the key."""
        opts = cls.build(policy, values)
        opts.check()
        return opts

    @classmethod
    def build(cls, policy: str, values: Mapping[str, Any]) -> PolicyOptions:
        """Options of ``policy`` from ``{key: value}``: a text value is converted, a typed one checked, both
        against the field's type, range, choices, pattern and file kind (UsageError naming the key). The
        keys given are remembered (:attr:`given`), in order: they name the run."""
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        converted: dict[str, Any] = {}
        for key, value in values.items():
            if key not in fields:
                raise UsageError(_unknown_option(policy, key, list(fields)))
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            conv = _convert if isinstance(value, str) else _check_typed
            converted[key] = conv(policy, key, value, hints[key], fields[key].metadata)
        opts = cls(**converted)
        opts._given = tuple(converted)
        opts._policy = policy
        return opts

    @property
    def policy(self) -> str:
        """Registry name of the policy these options belong to."""
        return self._policy

    def check(self) -> None:
        """Cross-option checks of a command line (subclasses); raise UsageError."""

    def reads_tokens(self) -> bool:
        """True when the policy decodes the generated tokens with these options (it then needs a tokenizer
        or a decoder)."""
        return False

    @property
    def given(self) -> tuple[str, ...]:
        """Names of the options set explicitly, in the order given."""
        return self._given

    def given_values(self) -> dict[str, Any]:
        """``{option: value}`` of the options set explicitly, in the order given."""
        return {k: getattr(self, k) for k in self._given}

    def spec(self) -> str:
        """Canonical ``name:key=value,...`` of these options (only the given ones)."""
        kw = self.given_values()
        return self.policy + (":" + ",".join(f"{k}={_text(v)}" for k, v in kw.items()) if kw else "")

    def label(self) -> str:
        """Name of a run: the policy with the options given (``lrfu(lam=0.1)``)."""
        kw = {k: v for k, v in self.given_values().items() if isinstance(v, (int, float, str, bool))}
        return f"{self.policy}({','.join(f'{k}={v}' for k, v in kw.items())})" if kw else self.policy

    def files(self) -> dict[str, str]:
        """``{option: path}`` of the file options given."""
        kinds = self.file_options()
        return {k: str(v) for k, v in self.given_values().items() if k in kinds and v is not None}


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _type_name(tp: Any, meta: Mapping[str, Any]) -> str:
    if meta.get("file"):
        return "path"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    name = getattr(base, "__name__", str(base))
    return f"{name} or none" if args and type(None) in typing.get_args(tp) else name


def _unknown_option(policy: str, key: str, names: list[str]) -> str:
    if not names:
        return f"{policy} has no options (got {key!r})"
    return f"{policy} has no option {key!r}; options: {', '.join(names)}"


def _convert(policy: str, key: str, text: str, tp: Any, meta: Mapping[str, Any]) -> Any:
    """Text of option ``key`` -> a value of type ``tp`` within the bounds in ``meta``."""
    where = f"{policy} option {key}={text}"
    args = typing.get_args(tp)
    if args and type(None) in args:
        if text.strip().lower() in ("none", "null"):
            return None
        tp = next(a for a in args if a is not type(None))
    t = text.strip()
    if tp is bool:
        if t.lower() in _TRUE:
            return True
        if t.lower() in _FALSE:
            return False
        raise UsageError(f"{where}: expected true or false")
    if tp is int:
        try:
            v: Any = int(t)
        except ValueError:
            raise UsageError(f"{where}: expected an integer") from None
        return _check_range(where, v, meta)
    if tp is float:
        try:
            v = float(t)
        except ValueError:
            raise UsageError(f"{where}: expected a number") from None
        if not math.isfinite(v):
            raise UsageError(f"{where}: expected a finite number")
        return _check_range(where, v, meta)
    if not t:
        raise UsageError(f"{where}: empty value")
    if meta.get("choices") and t not in meta["choices"]:
        raise UsageError(f"{where}: expected one of {', '.join(meta['choices'])}")
    if meta.get("pattern") is not None and not meta["pattern"].match(t):
        raise UsageError(f"{where}: expected {meta.get('help', 'another value')}")
    if meta.get("file"):
        check_file(meta["file"], t, where)
    return t


def _check_typed(policy: str, key: str, value: Any, tp: Any, meta: Mapping[str, Any]) -> Any:
    """A typed value of option ``key`` (a programmatic caller's) checked as :func:`_convert` checks text."""
    where = f"{policy} option {key}={value}"
    args = typing.get_args(tp)
    if isinstance(value, (list, tuple)) and any(typing.get_origin(a) is tuple for a in args):
        if not all(isinstance(v, str) for v in value):
            raise UsageError(f"{where}: expected text")
        return tuple(value)
    if args and type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise UsageError(f"{where}: expected true or false")
        return bool(value)
    if tp is int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise UsageError(f"{where}: expected an integer")
        return _check_range(where, int(value), meta)
    if tp is float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise UsageError(f"{where}: expected a number")
        if not math.isfinite(float(value)):
            raise UsageError(f"{where}: expected a finite number")
        return _check_range(where, float(value), meta)
    raise UsageError(f"{where}: expected text")


def _check_range(where: str, v: float, meta: Mapping[str, Any]) -> float:
    low, high, low_open = meta.get("low"), meta.get("high"), meta.get("low_open")
    below = low is not None and (v <= low if low_open else v < low)
    if below or (high is not None and v > high):
        if high is None:
            bound = f"> {low}" if low_open else f">= {low}"
        elif low is None:
            bound = f"<= {high}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise UsageError(f"{where}: must be {bound}")
    return v


def check_file(kind: str, path: str | os.PathLike, where: str) -> None:
    """Raise UsageError unless ``path`` is a file of ``kind`` (see :data:`FILE_KINDS`)."""
    p = Path(path).expanduser()
    expected = FILE_KINDS[kind]
    if not p.exists():
        raise UsageError(f"{where}: {p} does not exist; expected {expected}")
    if kind == "traces":
        from expertcast.data.traces import META_FILE, is_trace_dir

        if not p.is_dir() or not is_trace_dir(p):
            raise UsageError(f"{where}: not a trace set (no {META_FILE}); expected {expected}")
    elif kind == "forecaster":
        from expertcast.models.forecaster_export import CONFIG_NAME, ForecasterExportError, read_export_config

        if not p.is_dir() or not (p / CONFIG_NAME).is_file():
            raise UsageError(f"{where}: not a forecaster export (no {CONFIG_NAME}); expected {expected}")
        try:
            read_export_config(p)
        except ForecasterExportError as e:
            raise UsageError(f"{where}: {e}") from None
    elif kind == "cue_set":  # its shape; the loader (inference/policies/artifacts.py) reads the rest
        if not p.is_file():
            raise UsageError(f"{where}: is a folder; expected {expected}")
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise UsageError(f"{where}: cue set {p} is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("cues"), list):
            raise UsageError(f"{where}: cue set {p} has no \"cues\" list; expected {expected}")
    elif kind == "router_replay":
        if not (p.is_dir() and (p / "router_replay.json").is_file() and (p / "router_replay.npz").is_file()):
            raise UsageError(f"{where}: not a router replay; expected {expected}")


def split_policy_list(text: str) -> list[str]:
    """``"lru,lrfu:lam=0.1,history=in-cache,belady"`` -> ``["lru", "lrfu:lam=0.1,history=in-cache",
    "belady"]`` (a ``key=value`` part without ``:`` belongs to the policy before it)."""
    out: list[str] = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        if "=" in part and ":" not in part.split("=", 1)[0]:
            if not out:
                raise UsageError(f"policy option {part!r} has no policy before it (write name:key=value)")
            out[-1] += "," + part
        else:
            out.append(part)
    if not out:
        raise UsageError("no policy given")
    return out
