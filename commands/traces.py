"""`expertcast traces` (moving here from expertcast.data.traces_cli)."""

from expertcast.data.traces_cli import main  # noqa: F401
