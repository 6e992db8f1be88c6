"""`expertcast simulate` (moving here from expertcast.inference.simulate_cli)."""

from expertcast.inference.simulate_cli import main  # noqa: F401
