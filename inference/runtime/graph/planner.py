"""The graph decode path's forecast planner (docs/design.md, "Graph-compatible decode path"): at every step
boundary the step's routing (logged on the device) goes to the package's one background forecaster,
:class:`~expertcast.inference.policies.async_forecast.ForecastWorker`, which advances the policy's forecaster
through its public steps and publishes the scores and the proactive plan that the decoder copies to the device
tables at a later step boundary.

The forecaster state continues from the policy's (which consumed the prompt during the prefill replay); the
element of step t is the policy's (layers <= p of step t, layers > p of step t-1), so the forecasts equal the
online policy's. They are issued at the step boundary after step t instead of after layer p: layers > p already
ran in step t, so their plan targets their execution after (the forecast's second element).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from expertcast.inference.policies.async_forecast import ForecastJob, ForecastWorker
from expertcast.inference.policies.device import DeviceProgram


@dataclass
class Published:
    """One result of the planner: the forecast made after step ``t`` (its scores, as the policy installs them)
    and the proactive plan int64 [L, P] (keys, -1 padded)."""

    t: int
    scores: Any
    plan: np.ndarray


class GraphPlanner:
    """Forecasts of a forecast-rule :class:`DeviceProgram` (``program.forecaster``: the policy) on the worker.

    Args:
        program: the policy's device program.
        L / E: layers and experts.
        blocking: wait at each step boundary until the step before was forecast (deterministic).
    """

    def __init__(self, program: DeviceProgram, L: int, E: int, blocking: bool):
        self.policy = program.forecaster
        self.L, self.E, self.P = L, E, program.plan_width
        self.blocking = blocking
        self.worker = ForecastWorker(self.policy, every=True)
        self.stats = {"forecasts": 0}
        self._generation = 0

    def begin(self) -> None:
        """A decode call starts: results of an earlier call are forgotten."""
        self._generation += 1
        self.worker.begin(self._generation)

    def submit(self, t: int, members: list[int], positions: list[int], ids: torch.Tensor, w: torch.Tensor,
               event: Any) -> None:
        """Routing of step ``t``: ids / w [L, n, K] of the active ``members`` at ``positions`` (copies in flight
        until ``event``)."""
        pol, p = self.policy, self.policy.p
        held: dict[str, Any] = {}

        def element() -> tuple[list[int], np.ndarray | None]:
            if event is not None:
                event.synchronize()
            act = held["act"] = _activations(ids, w, self.E)
            if pol.precomputed:  # forecasts precomputed from the recorded routing (replay)
                held["F"] = pol.forecast_from_tables(members, positions)
                return [], None
            pol.record_element(members, act[:, :p + 1], slice(0, p + 1))
            rows = pol.forecast_rows(members, positions)
            return rows, (pol.element(rows) if rows else None)

        def publish(F: np.ndarray | None) -> Published | None:
            if pol.precomputed:
                F = held.get("F")
            else:
                pol.record_element(members, held["act"][:, p + 1:], slice(p + 1, None))
            if F is None:
                return None
            self.stats["forecasts"] += 1
            sc = pol.forecast_scores(t, F)
            nxt = sc.first_probs.copy()
            if sc.second_probs is not None:
                nxt[p + 1:] = sc.second_probs[p + 1:]  # layers > p already ran in step t: their next is element 2
            return Published(t, sc, pol.plan_keys(nxt, self.P))

        self.worker.submit(ForecastJob(self._generation, t, element, publish))
        if self.blocking:
            self.drain()

    def drain(self) -> None:
        """Wait until every submitted step was forecast."""
        self.worker.drain()

    def take(self) -> Published | None:
        """The newest result not taken yet (None when there is none)."""
        pub = self.worker.take()
        return None if pub is None else pub[2]

    def close(self) -> None:
        self.worker.close()


def _activations(ids: torch.Tensor, w: torch.Tensor, E: int) -> np.ndarray:
    """float32 [n, L, E] normalized activation vectors of routing ids / w [L, n, K] (weights rounded to float16,
    as traces record them)."""
    ids_np = ids.numpy().transpose(1, 0, 2)  # [n, L, K]
    w_np = w.numpy().astype(np.float16).astype(np.float32).transpose(1, 0, 2)
    n, L, _ = ids_np.shape
    act = np.zeros((n, L, E), np.float32)
    for r in range(n):
        for layer in range(L):
            np.add.at(act[r, layer], ids_np[r, layer], w_np[r, layer])
    act /= np.maximum(act.sum(-1, keepdims=True), 1e-9)
    return act
