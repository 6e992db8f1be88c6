"""The ``seqmoe-async`` forecaster in a worker process (docs/design.md, "Graph-compatible decode path").

On the CPU a worker *thread* shares the interpreter lock with decoding: the forecaster's step is hundreds of small
torch calls whose Python overhead holds the lock, so the decode waits for it even on an idle core (docs/results.md,
"Forecaster cost per decode step (default model, CPU, contended)"). :class:`ProcessForecastWorker` runs the same
step (:func:`~expertcast.inference.policies.forecast_tables.online_forecast`) in a process of its own: the decoding
thread only sends each step's element (a few KB through a pipe) and reads the newest published forecast without
blocking; nothing of the forecaster runs on its interpreter.

The process starts from a fork server that has imported torch and the forecaster once (the first worker of a run
pays that, later ones start in milliseconds) and receives the forecaster as its config and weights (its own
in-memory copy; nothing is read from disk there). It consumes every element in order (the recurrent state must see
them all), rolls out only after the last element queued (after every one with ``every``: the blocking mode), and
answers each element with ``(generation, t, F or None, counters)``: the forecaster's cumulative seconds, calls,
steps, rollouts and FLOPs, which the policy reports as its cost. Elements of a batch that has ended are skipped and
counted as dropped. A failure in the process is raised on the decoding thread at its next submit or take.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import torch

START_TIMEOUT_S = 300.0
"""Longest wait for a new worker process to load the forecaster and say it is ready."""

WORKER_NICE = 10
"""Niceness added to the worker process: it runs on cycles the decoding thread and the transfer thread leave (on a
host with as many cores as threads it changes nothing)."""

_PRELOAD = ["torch", "expertcast.models.forecaster", "expertcast.inference.policies.forecast_tables"]


def _context() -> Any:
    """The fork-server context, its server preloading torch and the forecaster (set once per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _serve(conn: Any, config: dict[str, Any], weights: dict[str, torch.Tensor], horizon: int, every: bool,
           step_flops: int, device: str) -> None:
    """The worker process's loop (see the module docstring)."""
    from expertcast.inference.policies.forecast_tables import online_forecast
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig

    torch.set_num_threads(1)
    try:
        os.nice(WORKER_NICE)  # decoding and transfers first when they want the core
    except OSError:  # pragma: no cover - not permitted here: same priority
        pass
    try:
        model = ExpertForecaster(ForecasterConfig.from_dict(config))
        model.load_state_dict(weights, strict=True)
        model.to(device).eval()
        conn.send(("ready", None, -1, None, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", None, -1, traceback.format_exc(), None))
        return
    counters = {"forecast_seconds": 0.0, "forecast_calls": 0, "forecast_flops": 0, "steps": 0, "rollouts": 0,
                "dropped": 0}
    state, generation = None, None
    pending: deque = deque()
    while True:
        if not pending:
            pending.append(conn.recv())
        while conn.poll():
            pending.append(conn.recv())
        kind, g, t, payload = pending.popleft()
        if kind == "stop":
            return
        if kind == "begin":
            generation, state = g, model.init_state(int(payload), device)
            continue
        rows, x = payload
        try:
            if g != generation or any(m[0] == "begin" for m in pending):  # its batch has ended
                counters["dropped"] += 1
                conn.send(("done", g, t, None, dict(counters)))
                continue
            last = every or not any(m[0] == "element" for m in pending)
            t0 = time.perf_counter()
            F, steps = online_forecast(model, state, rows, x, horizon, rollout=last, device=device)
            counters["forecast_seconds"] += time.perf_counter() - t0
            counters["forecast_calls"] += 1
            counters["forecast_flops"] += step_flops * steps * len(rows)
            counters["steps"] += 1
            counters["rollouts"] += F is not None
            counters["dropped"] += F is None  # a rollout skipped for a newer element
            conn.send(("done", g, t, F, dict(counters)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", g, t, traceback.format_exc(), dict(counters)))
            return


class ProcessForecastWorker:
    """The forecaster of a ``seqmoe-async`` policy in a worker process (module docstring).

    Args:
        model: the forecaster (its config and weights are copied into the process).
        horizon: forecast steps rolled out.
        every: roll out after every element (blocking mode).
        step_flops: FLOPs of one forecaster step at batch 1 (for the cost report).
        device: where the process runs the forecaster.
    """

    kind = "process"

    def __init__(self, model: Any, horizon: int, every: bool = False, step_flops: int = 0, device: str = "cpu"):
        ctx = _context()
        self._conn, child = ctx.Pipe(duplex=True)
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        self.proc = ctx.Process(target=_serve, name="expertcast-forecaster", daemon=True,
                                args=(child, model.config.to_dict(), weights, int(horizon), bool(every),
                                      int(step_flops), str(device)))
        self.proc.start()
        child.close()
        self.generation = 0
        self.counters: dict[str, float] = {}
        self.latest: tuple[int, int, np.ndarray] | None = None
        self.dropped_here = 0
        """Publications replaced before the decode took them."""
        self._done_t = -1
        self._sent = self._answered = 0  # elements submitted / answered (every element gets one answer)
        self._error: str | None = None
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise EOFError
            self._receive()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            self.close()
            if code is None:
                raise RuntimeError(f"the forecaster worker process did not start within {START_TIMEOUT_S:.0f} s") from None
            raise RuntimeError(
                f"the forecaster worker process did not start (exit code {code}): a script that runs the policy must "
                "keep its entry under `if __name__ == \"__main__\":` (the process imports the script's main module), "
                "or pass worker=thread") from None
        self._raise()
        self.start_seconds = time.perf_counter() - t0
        """Wall time from starting the process to its forecaster being ready."""

    # -- what the policy reads ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def steps(self) -> int:
        return int(self.counters.get("steps", 0))

    @property
    def rollouts(self) -> int:
        return int(self.counters.get("rollouts", 0))

    @property
    def dropped(self) -> int:
        return int(self.counters.get("dropped", 0)) + self.dropped_here

    def has_new(self) -> bool:
        """Whether a publication may be waiting (a non-blocking check)."""
        return self.latest is not None or self._conn.poll()

    # -- commands ----------------------------------------------------------------------------------------
    def begin(self, generation: int, wait: bool = False, batch_size: int | None = None) -> None:
        """A new batch of ``batch_size`` members: a fresh recurrent state; the previous batch's publication and
        queued elements are dropped (``wait`` changes nothing: the process takes the batches in order)."""
        if batch_size is None:
            raise ValueError("the forecaster worker process needs the batch's size")
        self._raise()
        self.generation = generation
        self._conn.send(("begin", generation, -1, int(batch_size)))
        self.take()
        self._done_t = -1

    def submit_element(self, t: int, rows: list[int], x: np.ndarray, state: Any = None) -> None:
        """Element ``x`` float32 [len(rows), L, E] of step ``t`` for members ``rows`` (returns at once; ``state`` is
        ignored: the process advances its own copy of the batch's)."""
        self._raise()
        self._conn.send(("element", self.generation, t, (list(rows), np.ascontiguousarray(x, np.float32))))
        self._sent += 1

    def take(self) -> tuple[int, int, np.ndarray] | None:
        """The newest publication of the current batch not taken yet (None when there is none)."""
        self._receive()
        self._raise()
        pub, self.latest = self.latest, None
        return pub

    def wait_for(self, t: int, timeout: float = 60.0) -> None:
        """Block until element ``t`` of the current batch has been consumed (blocking mode)."""
        self._wait(lambda: self._done_t >= t, timeout, f"forecast of step {t} not published within {timeout} s")

    def drain(self, timeout: float = 60.0) -> None:
        """Block until every submitted element has been consumed."""
        self._wait(lambda: self._answered >= self._sent, timeout,
                   f"the forecaster worker did not consume its elements within {timeout} s")

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        end = time.perf_counter() + timeout
        self._receive()
        self._raise()
        while not done():
            left = end - time.perf_counter()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(what)
            self._receive()
            self._raise()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the process: it finishes the element in hand (its answers are read and discarded meanwhile, so a
        process blocked on a full pipe can reach the stop), else it is terminated after ``timeout`` seconds."""
        if self.proc.is_alive() and not self._conn.closed:
            try:
                self._conn.send(("stop", None, -1, None))
                end = time.perf_counter() + timeout
                while self.proc.is_alive() and time.perf_counter() < end:
                    if self._conn.poll(0.05):
                        self._conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=5)
        self._conn.close()

    # -- internals ---------------------------------------------------------------------------------------
    def _receive(self) -> None:
        """Read every message waiting in the pipe (never blocks)."""
        while self._conn.poll():
            kind, g, t, payload, counters = self._conn.recv()
            if counters is not None:
                self.counters = counters
            self._answered += kind in ("done", "error") and t >= 0
            if kind == "error":
                self._error = payload
                return
            if kind != "done" or g != self.generation:
                continue
            self._done_t = max(self._done_t, t)
            if payload is not None:
                self.dropped_here += self.latest is not None
                self.latest = (g, t, payload)

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the forecaster worker process failed:\n{err}")
        if not self.proc.is_alive() and self.proc.exitcode not in (None, 0):
            raise RuntimeError(f"the forecaster worker process exited with code {self.proc.exitcode}")
