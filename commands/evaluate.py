"""`expertcast evaluate` (moving here from expertcast.inference.eval_cli)."""

from expertcast.inference.eval_cli import main  # noqa: F401
