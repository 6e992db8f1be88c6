"""`expertcast fit` (moving here from expertcast.train.cli)."""

from expertcast.train.cli import main  # noqa: F401
