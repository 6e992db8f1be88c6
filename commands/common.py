"""What every command shares: its parser, its error handling, model names and capacity flags.

* :class:`CommandParser`: argparse with every default shown in ``--help`` and a one-line error
  (``expertcast <cmd>: error: ...``, exit 2) instead of usage + error.
* :func:`run_command`: runs a command body; a :class:`~expertcast.utils.errors.UsageError` (or another
  input error listed in ``USER_ERRORS``) becomes one line on stderr and exit status 2. Set
  ``EXPERTCAST_DEBUG=1`` to see the traceback instead.
* :data:`resolve_model`: the one model-name resolver (:func:`expertcast.models.names.resolve_model`:
  ``tiny-default``/``default``, tiny presets, local Hugging Face directories, Hub ids) with the embedded
  default built when named, used by every command that takes ``--model``.
* :func:`add_config_arg`: ``--config FILE``, a YAML mapping of the command's flags (keys: the flags' dest
  names or their spelling with dashes), read by :class:`CommandParser` as if given on the command line before
  the flags, so an explicit flag overrides it (``docs/design.md``, "Provenance").
* :func:`add_capacity_args` / :func:`capacities_from_args`: ``--capacity`` is always a fraction of all
  experts in (0, 1]; ``--slots`` is always a slot count; ``--budget-gb`` decimal GB of expert weights. The
  unit is in the flag, never in the number; each value becomes a typed ``Budget`` that travels to the cache.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from expertcast.utils.errors import UsageError

if TYPE_CHECKING:
    from expertcast.inference.cache.expert_cache import Budget


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class CommandParser(argparse.ArgumentParser):
    """argparse for ``expertcast <command>``: defaults shown, one-line errors with exit status 2."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # noqa: D401 - argparse API
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)

    def parse_known_args(self, args: Any = None, namespace: Any = None):  # noqa: D401 - argparse API
        """argparse's, with the values of a ``--config FILE`` (:func:`add_config_arg`) as defaults: each value
        converted and checked by its flag's own type and choices, required flags satisfied by the file, and
        every flag on the command line overriding the file."""
        argv = list(sys.argv[1:] if args is None else args)
        if not any(isinstance(a, _ConfigAction) for a in self._actions):
            return super().parse_known_args(argv, namespace)
        path = _config_path(argv)
        if path is None:
            return self._config_read_as_given(super().parse_known_args(argv, namespace), path)
        values = read_config(self, path)
        relaxed = [a for a in self._actions if a.required and a.dest in values]
        saved = {a.dest: a.default for a in self._actions if a.dest in values}
        try:
            for a in relaxed:
                a.required = False
            self.set_defaults(**values)
            return self._config_read_as_given(super().parse_known_args(argv, namespace), path)
        finally:
            for a in relaxed:
                a.required = True
            self.set_defaults(**saved)

    def _config_read_as_given(self, parsed: Any, path: str | None) -> Any:
        """``parsed``, unless argparse took a ``--config`` spelling other than the one read (an abbreviation)."""
        if getattr(parsed[0], CONFIG_DEST, None) != path:
            self.error("spell --config in full (--config FILE or --config=FILE)")
        return parsed


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the input is wrong" rather than "expertcast has a bug"."""
    errs: list[type[BaseException]] = [UsageError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                       PermissionError]
    try:
        from expertcast.models.spec import UnsupportedModelError

        errs.append(UnsupportedModelError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errs)


def run_command(prog: str, body: Callable[[], int | None]) -> int:
    """Run ``body``; input errors -> one line on stderr and 2; KeyboardInterrupt -> 130."""
    try:
        return int(body() or 0)
    except user_errors() as exc:
        if os.environ.get("EXPERTCAST_DEBUG"):
            raise
        msg = str(exc) if not isinstance(exc, OSError) or not exc.filename else (
            f"{exc.strerror or exc}: {exc.filename}" if exc.strerror else str(exc))
        print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def parse_and_run(parser: argparse.ArgumentParser, argv: list[str] | None, prog: str,
                  body: Callable[[argparse.Namespace], int | None]) -> int:
    """``main`` of a command: parse ``argv`` (``--help`` and argparse's one-line errors return their exit
    status to in-process callers instead of raising SystemExit), then :func:`run_command` the body."""
    parsed: list[argparse.Namespace] = []
    try:  # a bad --config file is a UsageError: one line, exit status 2
        rc = run_command(prog, lambda: parsed.append(parser.parse_args(argv)))
    except SystemExit as e:
        return int(e.code or 0)
    return rc if not parsed else run_command(prog, lambda: body(parsed[0]))


# -- config files ------------------------------------------------------------------------------------------
CONFIG_DEST = "config"


class _ConfigAction(argparse._StoreAction):
    """The ``--config FILE`` of :func:`add_config_arg` (other commands' ``--config`` flags mean other files)."""


def add_config_arg(p: argparse.ArgumentParser) -> None:
    """``--config FILE``: a YAML mapping of this parser's flags (read by :class:`CommandParser`)."""
    p.add_argument("--config", dest=CONFIG_DEST, default=None, metavar="FILE", action=_ConfigAction,
                   help="YAML mapping of this command's flags (keys: dest names such as max_new_tokens, or "
                        "max-new-tokens; true/false for switches); flags given on the command line override it")


def _config_path(argv: list[str]) -> str | None:
    """The last ``--config FILE`` (or ``--config=FILE``) in ``argv``."""
    path = None
    for i, tok in enumerate(argv):
        if tok == "--":
            break
        if tok == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
    return path


def _config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``{key: action}``: every flag's dest name and its spellings without the leading dashes."""
    keys: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if a.dest in (CONFIG_DEST, argparse.SUPPRESS) or isinstance(a, argparse._HelpAction):
            continue
        keys[a.dest] = a
        for opt in a.option_strings:
            keys[opt.lstrip("-")] = a
    return keys


def _scalar_text(value: Any) -> str | None:
    """A YAML scalar as the text a command line would carry (None: not a string or a number)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return value if isinstance(value, str) else str(value)


def read_config(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """``{dest: value}`` of a ``--config`` YAML file, each value converted and checked as its flag's
    argument would be. UsageError (one line, naming the file and the key) on a missing file, a YAML syntax
    error, a document that is not a mapping, an unknown key, a key given twice, or a value of the wrong type."""
    import yaml

    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise UsageError(f"--config {path}: YAML syntax error{where}: {problem}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values, got "
                         f"{type(doc).__name__ if doc is not None else 'an empty document'}")
    keys = _config_keys(parser)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        action = keys.get(str(key))
        if action is None:
            valid = ", ".join(sorted({a.dest for a in keys.values()}))
            raise UsageError(f"--config {path}: unknown key {key!r}; valid keys: {valid}")
        if action.dest in out:
            raise UsageError(f"--config {path}: key {key!r} sets {action.dest} a second time")
        out[action.dest] = _config_value(parser, action, value, f"--config {path}: key {key!r}")
    return out


def _config_value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` converted and checked the way ``action``'s command-line argument would be."""
    if action.nargs == 0:  # a switch: the value it leaves in the namespace
        if not isinstance(value, bool) or value not in (action.default, action.const):
            raise UsageError(f"{where}: expected true or false, got {value!r}")
        return value
    many = action.nargs in ("*", "+") or isinstance(action.nargs, int)
    items = value if many and isinstance(value, list) else [value] if not many else None
    texts = [_scalar_text(v) for v in items] if items is not None else None
    if texts is None or None in texts:
        wanted = "a list of strings or numbers" if many else "a string or a number"
        hint = " (quote yes/no/on/off/true/false to pass them as text)" if isinstance(value, bool) else ""
        raise UsageError(f"{where}: expected {wanted}, got {type(value).__name__} {value!r}{hint}")
    try:
        return parser._get_values(action, texts if many else texts[:1])
    except argparse.ArgumentError as exc:
        raise UsageError(f"{where}: {exc.message}") from None


def config_record(args: argparse.Namespace) -> dict[str, str] | None:
    """``{"path", "sha256"}`` of the ``--config`` file the arguments came from (None without one)."""
    from pathlib import Path

    from expertcast.utils.provenance import sha256_file

    path = getattr(args, CONFIG_DEST, None)
    return None if path is None else {"path": str(Path(path).resolve()), "sha256": sha256_file(path)}


# -- validated argument types ------------------------------------------------------------------------
def _number_type(kind: type, minimum: float, inclusive: bool, what: str) -> Callable[[str], Any]:
    """An argparse type converting to ``kind`` and requiring a finite value ``>= minimum`` (``inclusive``)
    or ``> minimum``; errors read ``expected a <what>, got ...``."""
    import math

    def convert(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {what}, got {text!r}") from None
        if not math.isfinite(v) or (v < minimum if inclusive else v <= minimum):
            shown = v if kind is int else text
            raise argparse.ArgumentTypeError(f"expected a {'' if kind is int else 'finite '}{what}, got {shown}")
        return v

    return convert


positive_int = _number_type(int, 1, True, "positive integer")
"""argparse type: an integer >= 1."""
nonneg_int = _number_type(int, 0, True, "non-negative integer")
"""argparse type: an integer >= 0."""
positive_float = _number_type(float, 0.0, False, "positive number")
"""argparse type: a finite number > 0."""
nonneg_float = _number_type(float, 0.0, True, "non-negative number")
"""argparse type: a finite number >= 0."""


# -- capacities ---------------------------------------------------------------------------------------
def parse_fractions(text: str, flag: str = "--capacity") -> list[float]:
    """``"0.15,0.25"`` -> [0.15, 0.25]; each a fraction of all experts in (0, 1] (``1`` = all experts)."""
    import math

    out = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            v = float(part)
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not a number (capacities are fractions of all experts in (0, 1]; "
                             f"use --slots for slot counts)") from None
        if not math.isfinite(v) or not 0 < v <= 1:
            raise UsageError(f"{flag}: {part} is outside (0, 1]: capacities are fractions of all experts "
                             f"(use --slots for a number of slots)")
        out.append(v)
    if not out:
        raise UsageError(f"{flag}: no value given")
    return out


def parse_counts(text: str, flag: str = "--slots") -> list[int]:
    """``"8,16"`` -> [8, 16]; positive integers."""
    out = []
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        try:
            v = int(part)
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not an integer slot count") from None
        if v < 1:
            raise UsageError(f"{flag}: {v} slots; a slot count must be at least 1")
        out.append(v)
    if not out:
        raise UsageError(f"{flag}: no value given")
    return out


def add_capacity_args(p: argparse.ArgumentParser, *, multiple: bool, default: str | None = None,
                      budget_gb: bool = False) -> None:
    """``--capacity`` (fractions of all L*E experts) and ``--slots`` (slot counts: per layer for the
    per-layer pool, in all for the shared pool); ``multiple`` allows comma lists. ``budget_gb``: also
    ``--budget-gb`` (decimal GB of resident expert weights, whatever their format), exclusive of the other two."""
    s = "comma list of " if multiple else ""
    p.add_argument("--capacity", default=default,
                   help=f"{s}fraction(s) of all experts kept resident, in (0, 1] (1 = every expert)")
    p.add_argument("--slots", default=None,
                   help=f"{s}slot count(s) instead of a fraction: per layer (per-layer pool) or in all (shared pool)")
    if budget_gb:
        p.add_argument("--budget-gb", default=None,
                       help=f"{s}decimal GB of resident expert weights instead (budget // bytes per expert slots, "
                            "split over the layers of a per-layer pool): a smaller expert format buys more slots")


def capacities_from_args(args: argparse.Namespace, *, multiple: bool) -> list[Budget]:
    """The :class:`~expertcast.inference.cache.expert_cache.Budget` of each value of the capacity flags
    (``--capacity``: fractions, ``--slots``: counts, ``--budget-gb``: decimal GB), in that order."""
    from expertcast.inference.cache.expert_cache import Budget

    gb = getattr(args, "budget_gb", None)
    if gb is not None and (args.capacity is not None or args.slots is not None):
        given = "--capacity" if args.capacity is not None else "--slots"
        raise UsageError(f"give --budget-gb (bytes of experts) or {given}, not both")
    if args.capacity is not None and args.slots is not None and not multiple:
        raise UsageError("give --capacity (a fraction) or --slots (a count), not both")
    out: list[Budget] = []
    if args.capacity is not None:
        out += [Budget.fraction(v) for v in parse_fractions(args.capacity)]
    if args.slots is not None:
        out += [Budget.slots(v) for v in parse_counts(args.slots)]
    if gb is not None:
        out += [Budget.gb(v) for v in parse_gigabytes(gb)]
    if not multiple and len(out) > 1:
        raise UsageError("this command takes one capacity; give a single --capacity, --slots or --budget-gb value")
    return out


def parse_gigabytes(text: str, flag: str = "--budget-gb") -> list[float]:
    """Comma-separated positive decimal gigabytes."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not a number of gigabytes") from None
        if not v > 0 or v != v or v == float("inf"):
            raise UsageError(f"{flag}: {part}; a byte budget must be a positive number of GB")
        out.append(v)
    if not out:
        raise UsageError(f"{flag}: no value given")
    return out


# -- models ---------------------------------------------------------------------------------------------
from expertcast.models.names import DEFAULT_MODEL_NAMES  # noqa: E402,F401
from expertcast.models.names import resolve_model as _resolve_model  # noqa: E402
from expertcast.utils.devices import resolve_device  # noqa: E402,F401  (the one device resolver)

resolve_model = functools.partial(_resolve_model, announce=True)
"""``--model`` of every command: the one resolver (:func:`expertcast.models.names.resolve_model`); the
embedded default is the shipped, checksum-verified folder (never trained implicitly)."""
