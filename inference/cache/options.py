"""Typed options of every registered cache policy, parsed from ``name:key=value,...`` (docs/design.md).

Each policy has a dataclass here whose fields are its options: the field's type is the option's type,
its default the policy constructor's default, and its metadata carries the help text and the valid
range, choices or file kind. :func:`parse_policy_options` turns ``"lrfu:lam=0.1"`` into
``LRFUOptions(lam=0.1)``, converting and validating every value; every mistake is a one-line
:class:`~expertcast.utils.errors.UsageError` that names the valid keys or the accepted values::

    lrfu has no option 'lamda'; options: lam, history
    lru has no options (got 'foo')
    static option calibration=/etc/passwd: not a trace set (no trace_meta.json); expected a trace
        directory written by `expertcast collect` or `expertcast traces import`

File options (``calibration``, ``forecaster``, ``cue_set``, ``replay``) must exist and be of the
right kind. :meth:`PolicyOptions.to_kwargs` returns the keyword arguments of the policy constructor
for the options that were given (defaults stay the constructor's), so a run's label names only what
the user set: ``lrfu(lam=0.1)``.

The constructors also take objects the command line cannot express (a loaded forecaster, a router
replay, a decoder function); :func:`constructor_options` lists those names for programmatic callers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


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
    """Options of a policy that takes none."""

    def __post_init__(self) -> None:
        self._given: tuple[str, ...] = ()
        self._policy = ""

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

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
    def parse(cls, policy: str, values: Mapping[str, str]) -> PolicyOptions:
        """Options of ``policy`` from ``{key: text}``; converts and validates every value (UsageError
        naming the key)."""
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        converted: dict[str, Any] = {}
        for key, text in values.items():
            if key not in fields:
                raise UsageError(_unknown_option(policy, key, list(fields)))
            converted[key] = _convert(policy, key, text, hints[key], fields[key].metadata)
        opts = cls(**converted)
        opts._given = tuple(converted)
        opts._policy = policy
        opts.check()
        return opts

    @property
    def policy(self) -> str:
        """Registry name of the policy these options belong to."""
        return self._policy

    def check(self) -> None:
        """Cross-option checks (subclasses); raise UsageError."""

    @property
    def given(self) -> tuple[str, ...]:
        """Names of the options set explicitly, in the order given."""
        return self._given

    def to_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the policy constructor for the options given (values as parsed: file
        options stay paths; :func:`materialize` loads what a constructor cannot take as a path)."""
        return {k: getattr(self, k) for k in self._given}

    def spec(self) -> str:
        """Canonical ``name:key=value,...`` of these options (only the given ones)."""
        kw = self.to_kwargs()
        return self.policy + (":" + ",".join(f"{k}={_text(v)}" for k, v in kw.items()) if kw else "")

    def files(self) -> dict[str, str]:
        """``{option: path}`` of the file options given."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.metadata.get("file") and v is not None and f.name in self._given:
                out[f.name] = str(v)
        return out


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
    elif kind == "cue_set":
        from expertcast.inference.saem.cues import CueSet

        if not p.is_file():
            raise UsageError(f"{where}: is a folder; expected {expected}")
        try:
            CueSet.load(p)
        except ValueError as e:
            raise UsageError(f"{where}: {e}") from None
    elif kind == "router_replay":
        if not (p.is_dir() and (p / "router_replay.json").is_file() and (p / "router_replay.npz").is_file()):
            raise UsageError(f"{where}: not a router replay; expected {expected}")


# ------------------------------------------------------------------------------------------------
# one options class per policy
# ------------------------------------------------------------------------------------------------
_HISTORY = ("perfect", "in-cache")


@dataclass
class LFUOptions(PolicyOptions):
    """Least frequently used."""

    history: str = option("perfect", "access counts kept for every expert (perfect) or only while resident "
                          "(in-cache)", choices=_HISTORY)


@dataclass
class LRFUOptions(PolicyOptions):
    """LRFU: combined recency and frequency with exponential decay."""

    lam: float = option(0.01, "decay per access in [0, 1]: 0 = LFU, 1 = LRU", low=0.0, high=1.0)
    history: str = option("perfect", "access history kept for every expert (perfect) or only while resident "
                          "(in-cache)", choices=_HISTORY)


@dataclass
class StaticOptions(PolicyOptions):
    """Fixed placement of the most frequently selected experts."""

    calibration: str | None = option(None, "traces whose selection counts fix the placement (default: the "
                                     "replayed traces, in-sample, or --calibration)", file="traces")
    miss: str = option("temp", "how a non-resident expert is served: temporary slot or CPU", choices=("temp", "cpu"))


@dataclass
class BeladyKOptions(PolicyOptions):
    """Belady that sees k decode steps ahead."""

    k: int = option(8, "decode steps of future visible to the oracle", low=0)


@dataclass
class _ForecastOptions(PolicyOptions):
    """Options shared by the SeqMoE policies."""

    forecaster: str | None = option(None, "forecaster export (required; or --forecaster)", file="forecaster")
    horizon: int = option(8, "forecast steps c read for eviction and prefetch", low=1)
    gamma: float = option(0.5, "discount per forecast step in (0, 1]", low=0.0, low_open=True, high=1.0)
    prefetch: bool = option(True, "issue proactive loads (false: eviction only)")
    max_tasks_per_layer: int | None = option(None, "most prefetches per layer (default: top-K)", low=1)
    min_confidence: float = option(0.2, "smallest forecast probability worth a prefetch", low=0.0, high=1.0)
    lookahead: float = option(2.0, "prefetch window in layer-execution times", low=0.0, low_open=True)
    transfer_layers: float | None = option(None, "one transfer's time in layer executions (default: from the "
                                           "link and compute settings)", low=0.0, low_open=True)
    bandwidth_gbps: float = option(25.0, "host-device link GB/s used for the transfer-time estimate", low=0.0,
                                   low_open=True)
    layer_compute_ms: float = option(0.15, "per-layer compute ms used for the transfer-time estimate", low=0.0,
                                     low_open=True)
    ema_alpha: float = option(0.2, "weight of the newest element in the recency average", low=0.0, high=1.0)
    device: str = option("cpu", "device of the forecaster: cpu, cuda[:N] or mps", pattern=_DEVICE)
    forecast_cache_mb: float = option(1024.0, "memory for precomputed forecasts, MB", low=0.0)

    def check(self) -> None:
        if self.forecaster is None:
            raise UsageError(f"{self.policy} needs a forecaster: {self.policy}:forecaster=EXPORT_DIR "
                             f"(or --forecaster EXPORT_DIR)")


@dataclass
class SeqMoEOptions(_ForecastOptions):
    """SeqMoE: forecaster-driven prefetch and probabilistic-Belady eviction."""

    precompute: bool = option(True, "compute every forecast of a sequence up front (same results, faster)")
    prefetch_rule: str = option("floor", "rank prefetches by probability above min_confidence, or by expected "
                                "benefit over the displaced resident (floor capped at chance K/E)",
                                choices=("floor", "benefit"))


@dataclass
class HybridOptions(SeqMoEOptions):
    """Forecaster + router + stage-boundary priorities in one eviction/prefetch score."""

    parts: str = option("auto", "terms of the priority: auto (forecast + every part given inputs) or a '+' list of "
                        "forecast, routers, stage", pattern=re.compile(r"^(auto|(forecast|routers|stage)"
                                                                       r"(\+(forecast|routers|stage))*)$"))
    replay: str | None = option(None, "recorded router outputs (routers part)", file="router_replay")
    router_weight: float = option(1.0, "weight of the routers' s^T term", low=0.0)
    cue_set: str | None = option(None, "calibrated cue set (stage part)", file="cue_set")
    cues: str | None = option(None, "explicit stage cues separated by '|' (stage part)")
    tokenizer: str | None = option(None, "tokenizer directory or Hub id decoding the token ids (stage part)")
    stage_weight: float = option(1.0, "weight of the stage-frequency term", low=0.0)
    min_stage_steps: int = option(1, "ignore stage boundaries closer than this many decode steps", low=1)


@dataclass
class AsyncSeqMoEOptions(_ForecastOptions):
    """SeqMoE with the forecaster on a background thread (forecasts may arrive late)."""

    blocking: bool = option(False, "wait for each forecast (deterministic; tests)")


@dataclass
class StageOptions(PolicyOptions):
    """SAEM stage-aware caching with CPU execution of cold experts."""

    cue_set: str | None = option(None, "calibrated cue set (cues, tokenizer, expert frequencies)", file="cue_set")
    cues: str | None = option(None, "explicit cues separated by '|' (overrides the cue set's)")
    tokenizer: str | None = option(None, "tokenizer directory or Hub id decoding the token ids")
    cpu_exec: bool = option(True, "execute cold experts on the CPU (false: temporary slot only)")
    stage_updates: bool = option(True, "refill at stage boundaries (false: calibration placement only)")
    min_stage_steps: int = option(1, "ignore boundaries closer than this many decode steps", low=1)

    def check(self) -> None:
        if self.stage_updates and self.cue_set is None and self.cues is None and self.tokenizer is None:
            raise UsageError(f"{self.policy} needs cues: {self.policy}:cue_set=CUES.json (expertcast stages "
                             f"calibrate), cues='Wait|Alternatively' or tokenizer=MODEL_DIR holding cues.json")


@dataclass
class StageOracleOptions(StageOptions):
    """SAEM stage-aware caching that knows each stage's experts in advance (upper bound)."""

    def check(self) -> None:
        super().check()
        if not self.stage_updates:
            raise UsageError(f"{self.policy}: stage_updates must stay true (the oracle acts at stage boundaries)")


@dataclass
class RouterOptions(PolicyOptions):
    """Cache-aware router policies fed by recorded router outputs."""

    replay: str | None = option(None, "recorded router outputs on the replayed traces (required)",
                                file="router_replay")
    R: int | None = option(None, "experts per layer kept by the Temporal router (R <= per-layer budget B)", low=1)

    def check(self) -> None:
        if self.replay is None:
            raise UsageError(f"{self.policy} needs the routers' recorded outputs: {self.policy}:replay=DIR")


OPTIONS: dict[str, type[PolicyOptions]] = {
    "lru": PolicyOptions, "fifo": PolicyOptions, "lfu": LFUOptions, "lrfu": LRFUOptions, "static": StaticOptions,
    "belady": PolicyOptions, "belady-k": BeladyKOptions, "belady-seq": PolicyOptions, "seqmoe": SeqMoEOptions,
    "hybrid": HybridOptions,
    "seqmoe-async": AsyncSeqMoEOptions, "stage": StageOptions, "stage-oracle": StageOracleOptions,
    "router-temporal": RouterOptions, "router-full": RouterOptions, "router-spatio": RouterOptions,
}
"""Registry name -> options class (every name of ``expertcast.inference.policies.REGISTRY``)."""


def options_class(name: str) -> type[PolicyOptions]:
    """The options class of registered policy ``name`` (UsageError listing the policies otherwise)."""
    from expertcast.inference.policies import REGISTRY, unknown_policy_message

    key = name.strip().lower()
    if key not in REGISTRY:
        raise UsageError(unknown_policy_message(name))
    return OPTIONS.get(key, PolicyOptions)


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


def parse_policy_options(spec: str) -> PolicyOptions:
    """``"lrfu:lam=0.1"`` -> ``LRFUOptions(lam=0.1)``; UsageError for an unknown policy, an unknown
    key (naming the valid ones), a repeated key, a malformed part or a value of the wrong type/range."""
    name, _, rest = str(spec).partition(":")
    cls = options_class(name)
    policy = name.strip().lower()
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        if "=" not in part:
            names = cls.option_names()
            raise UsageError(f"policy option {part!r} in {spec!r} must be key=value"
                             + (f"; options: {', '.join(names)}" if names else f" ({policy} has no options)"))
        k, v = (s.strip() for s in part.split("=", 1))
        if k in values:
            raise UsageError(f"{policy} option {k} is given twice in {spec!r}")
        values[k] = v
    return cls.parse(policy, values)


def constructor_options(cls: type) -> list[str]:
    """Keyword names a policy class's constructor accepts (following ``**kwargs`` into base classes)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            break
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                  and p.name not in names]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def check_kwargs(name: str, cls: type, kwargs: Mapping[str, Any]) -> None:
    """UsageError when ``kwargs`` hold a key the constructor of ``cls`` does not take, or a path for a
    file option that is not a file of the right kind."""
    accepted = constructor_options(cls)
    for k in kwargs:
        if k not in accepted:
            raise UsageError(_unknown_option(name, k, accepted))
    opts = OPTIONS.get(name, PolicyOptions)
    kinds = {f.name: f.metadata.get("file") for f in dataclasses.fields(opts)}
    for k, v in kwargs.items():
        if kinds.get(k) and isinstance(v, (str, os.PathLike)):
            check_file(kinds[k], v, f"{name} option {k}={v}")


def materialize(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor kwargs with trace-directory options loaded (``static:calibration=DIR`` -> its
    sequences); other file options are read by the constructors themselves."""
    opts = OPTIONS.get(name, PolicyOptions)
    out = dict(kwargs)
    for f in dataclasses.fields(opts):
        v = out.get(f.name)
        if f.metadata.get("file") == "traces" and isinstance(v, (str, os.PathLike)):
            from expertcast.data.traces import load_traces

            out[f.name] = load_traces(v)[1]
    return out
