"""The one file lock: an exclusive advisory ``flock`` on one file, held by this process until released
(or until it exits: the kernel drops the lock of a dead process, so a crash never leaves it taken).

Used for the output folders (:mod:`expertcast.utils.outdir`, which records the holder's pid in the file),
the sharded collection (waiting while another rank holds a folder) and the embedded default's build
(concurrent callers wait for one build).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


class FileLock:
    """An exclusive lock on the file ``path`` (created when missing, with its parent folder). As a context
    manager it waits for the lock (calling ``on_wait`` once when another process holds it)."""

    def __init__(self, path: str | os.PathLike, *, on_wait: Callable[[], None] | None = None):
        self.path = Path(path)
        self.on_wait = on_wait
        self._fd: int | None = None

    @property
    def locked(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self, *, wait: bool = False, on_wait: Callable[[], None] | None = None,
                owner: str | None = None) -> bool:
        """Take the lock. Held by another process: False (``wait=False``), or call ``on_wait`` once and
        block until it is free. ``owner``: a line written into the file once taken (read by
        :meth:`holder`)."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    return False
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            if owner is not None:
                os.ftruncate(fd, 0)
                os.write(fd, f"{owner}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def holder(self) -> str:
        """The ``owner`` line the holder wrote (``?`` when none or unreadable)."""
        try:
            return self.path.read_text(errors="replace")[:64].strip() or "?"
        except OSError:
            return "?"

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (a missing file: no)."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire(wait=True, on_wait=self.on_wait)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
