"""The one exception type for user mistakes (bad flags, bad files, refused resumes).

A command catches :class:`UsageError` at its top level (``expertcast.commands.common.run_command``) and
prints one line ``expertcast <command>: error: <message>`` with exit status 2; anything else is a bug and
keeps its traceback. Library code raises it (or a subclass) wherever the cause is the caller's input.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A mistake in the user's input: the message names the flag, file (with line) or setting at fault.

    Subclasses ``ValueError`` so library callers that already catch ``ValueError`` keep working.
    """


class ResumeMismatchError(UsageError):
    """An existing partial output was produced by different settings than the ones given now."""


class OutputDirError(UsageError):
    """An output folder cannot be used (foreign files, a protected path, a concurrent run)."""


class OverlapError(UsageError):
    """Evaluated sequences overlap a model's training sequences (train/test leakage)."""
