"""`expertcast stages` (moving here from expertcast.inference.stages_cli)."""

from expertcast.inference.stages_cli import main  # noqa: F401
