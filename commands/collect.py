"""`expertcast collect` (moving here from expertcast.data.collect)."""

from expertcast.data.collect import main  # noqa: F401
