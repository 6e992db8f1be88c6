"""`expertcast router_eval` (moving here from expertcast.train.router_eval)."""

from expertcast.train.router_eval import main  # noqa: F401
