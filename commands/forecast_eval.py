"""`expertcast forecast_eval` (moving here from expertcast.train.forecast_eval)."""

from expertcast.train.forecast_eval import main  # noqa: F401
