"""`expertcast build_default` (moving here from expertcast.train.tiny_default)."""

from expertcast.train.tiny_default import main  # noqa: F401
