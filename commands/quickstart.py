"""`expertcast quickstart` (moving here from expertcast.quickstart)."""

from expertcast.quickstart import main  # noqa: F401
