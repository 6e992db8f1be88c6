"""The ``seqmoe-async`` forecaster in a worker process (docs/design.md, "Graph-compatible decode path").

On the CPU a worker *thread* shares the interpreter lock with decoding: the forecaster's step is hundreds of small
torch calls whose Python overhead holds the lock, so the decode waits for it even on an idle core (docs/results.md,
"Forecaster cost per decode step (default model, CPU, contended)"). :class:`ProcessForecastWorker` runs the same
step (:func:`~expertcast.inference.policies.forecast_tables.online_forecast`) in a process of its own: the decoding
thread only writes each step's element into a pipe (a few KB as raw bytes, no pickling) and reads the newest
published forecast from shared memory without blocking; nothing of the forecaster runs on its interpreter.

The process starts from a fork server that has imported torch and the forecaster once (the first worker of a run
pays that, later ones start in milliseconds) and receives the forecaster as its config and weights (its own
in-memory copy; nothing is read from disk there). It consumes every element in order (the recurrent state must see
them all; a run of queued elements of the same members, as a prompt's replay leaves, in one parallel pass of at most
:data:`WINDOW_MAX`), rolls out only after the last element queued (after every one with ``every``: the blocking mode), and
answers through a :class:`Mailbox` in shared memory: the newest forecast F [H, L, E] and its sequence number, written
under a lock that the decoding thread only tries (while the process writes, the forecast is taken at the next
check), the last element consumed, and the forecaster's cumulative seconds, calls, steps, rollouts and FLOPs, which the
policy reports as its cost. The decoding thread's check for a new forecast is a memory read, never a system call
(docs/results.md, "The hand-over in shared memory"). Elements of a batch that has ended are skipped and counted as dropped. A failure
in the process sets the mailbox's error flag and sends its traceback through the pipe; it is raised on the decoding
thread at its next submit or take.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import time
import traceback
from collections import deque
from typing import Any

import numpy as np
import torch

START_TIMEOUT_S = 300.0
"""Longest wait for a new worker process to load the forecaster and say it is ready."""

WINDOW_MAX = 64
"""Most queued elements a worker (this process or the thread) consumes in one call (:func:`_serve`)."""

WORKER_NICE = 10
"""Niceness added to the worker process: it runs on cycles the decoding thread and the transfer thread leave (on a
host with as many cores as threads it changes nothing). Not the idle scheduling class: that starves it behind any
other job on the host, and the forecasts go stale (docs/results.md, "The hand-over in shared memory")."""

_PRELOAD = ["torch", "expertcast.models.forecaster", "expertcast.inference.policies.forecast_tables"]


def _context() -> Any:
    """The fork-server context, its server preloading torch and the forecaster (set once per process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class Mailbox:
    """What the worker process answers, in shared memory (the module docstring): ``head`` int64 [8] (publication
    sequence number, last element consumed: its generation and step, elements answered, error flag), ``meta`` int64
    [2] (the forecast's generation and step), ``fbuf`` float32 [H, L, E] (the newest forecast), ``counts`` float64
    [7] (:data:`COUNTERS`), and a lock that the process holds while it publishes and the reader while it copies (the
    lock orders the writes on any CPU; the reader only tries it, so it never waits for the process). Made by the
    parent and handed to the process when it starts."""

    SEQ, DONE_GEN, DONE_T, ANSWERED, ERROR = range(5)
    COUNTERS = ("forecast_seconds", "forecast_cpu_seconds", "forecast_calls", "forecast_flops", "steps", "rollouts",
                "dropped")

    def __init__(self, ctx: Any, shape: tuple[int, int, int]):
        self.shape = tuple(int(v) for v in shape)
        self._raw = (ctx.RawArray("q", 8), ctx.RawArray("q", 2), ctx.RawArray("f", int(np.prod(self.shape))),
                     ctx.RawArray("d", len(self.COUNTERS)))
        self.lock = ctx.Lock()
        self._views()

    def _views(self) -> None:
        head, meta, fbuf, counts = self._raw
        self.head = np.frombuffer(head, np.int64)
        self.meta = np.frombuffer(meta, np.int64)
        self.fbuf = np.frombuffer(fbuf, np.float32).reshape(self.shape)
        self.counts = np.frombuffer(counts, np.float64)

    def __getstate__(self) -> dict[str, Any]:
        return {"shape": self.shape, "_raw": self._raw, "lock": self.lock}

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.shape, self._raw, self.lock = st["shape"], st["_raw"], st["lock"]
        self._views()

    def count(self, name: str) -> float:
        """The process's cumulative counter ``name`` (one of :data:`COUNTERS`)."""
        return float(self.counts[self.COUNTERS.index(name)])

    # -- the process's side --------------------------------------------------------------------------------
    def publish(self, generation: int, t: int, F: np.ndarray) -> None:
        """Make forecast ``F`` [H, L, E] of element ``t`` the newest (under the lock: a reader copies all or none)."""
        with self.lock:
            self.fbuf[...] = F
            self.meta[:] = (generation, t)
            self.head[self.SEQ] += 1

    def answered(self, generation: int, t: int, counters: dict[str, float], n: int = 1) -> None:
        """Elements up to ``t`` of ``generation`` were consumed, ``n`` of them in this call (after the forecast, if
        any, was published)."""
        self.counts[:] = [counters[k] for k in self.COUNTERS]
        self.head[self.DONE_GEN], self.head[self.DONE_T] = generation, t
        self.head[self.ANSWERED] += n

    # -- the decoding thread's side ----------------------------------------------------------------------------
    def read(self, seen: int) -> tuple[int, int, int, np.ndarray] | None:
        """The newest publication after sequence number ``seen``: (its number, generation, step, a copy of F), or
        None when there is none or the process is writing one right now (then it is taken at the next check: the
        decoding thread never waits for the process)."""
        if int(self.head[self.SEQ]) == seen or not self.lock.acquire(False):
            return None
        try:
            k = int(self.head[self.SEQ])
            g, t = (int(v) for v in self.meta)
            F = self.fbuf.copy()
        finally:
            self.lock.release()
        return k, g, t, F


ELEMENT, BEGIN, STOP = 0, 1, 2
"""The kinds of message the process receives."""


def _encode(kind: int, generation: int, t: int, rows: list[int] | None = None, x: np.ndarray | None = None) -> bytes:
    """A message to the process, raw bytes: kind (:data:`ELEMENT`, :data:`BEGIN` with ``t`` the batch size, or
    :data:`STOP`), generation, step, then for an element its rows (int32) and its float32 [rows, L, E] values."""
    n = len(rows) if rows is not None else 0
    msg = struct.pack("<bqqq", kind, generation, t, n)
    if rows is not None:
        msg += np.asarray(rows, np.int32).tobytes() + np.ascontiguousarray(x, np.float32).tobytes()
    return msg


def _decode(msg: bytes) -> tuple[int, int, int, Any]:
    """:func:`_encode`'s message back: (kind, generation, step, (rows, float32 [rows, L·E]) or None); the forecaster
    takes the element flat and checks its size."""
    kind, g, t, n = struct.unpack_from("<bqqq", msg)
    if kind != ELEMENT:
        return kind, g, t, None
    off = struct.calcsize("<bqqq")
    rows = np.frombuffer(msg, np.int32, n, off).tolist()
    x = np.frombuffer(msg, np.float32, offset=off + 4 * n).reshape(n, -1).copy()  # writable, for torch
    return kind, g, t, (rows, x)


def _serve(conn: Any, box: Mailbox, config: dict[str, Any], weights: dict[str, torch.Tensor], horizon: int,
           every: bool, step_flops: int, device: str) -> None:
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
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        box.head[Mailbox.ERROR] = 1
        conn.send(("error", traceback.format_exc()))
        return
    counters = dict.fromkeys(Mailbox.COUNTERS, 0.0)
    state, generation = None, None
    pending: deque = deque()
    while True:
        if not pending:
            pending.append(_decode(conn.recv_bytes()))
        while conn.poll():
            pending.append(_decode(conn.recv_bytes()))
        kind, g, t, payload = pending.popleft()
        if kind == STOP:
            return
        if kind == BEGIN:
            generation, state = g, model.init_state(int(t), device)
            continue
        rows, x = payload
        try:
            if g != generation or any(m[0] == BEGIN for m in pending):  # its batch has ended
                counters["dropped"] += 1
                box.answered(g, t, counters)
                continue
            xs = [x]
            while not every and len(xs) < WINDOW_MAX and pending and pending[0][0] == ELEMENT \
                    and pending[0][1] == g and pending[0][3][0] == rows:  # fell behind: the queued run in one call
                _, _, t, (_, x) = pending.popleft()
                xs.append(x)
            if len(xs) > 1:
                x = np.stack(xs, axis=1).reshape(len(rows), len(xs), model.config.num_layers, -1)
            last = every or not any(m[0] == ELEMENT for m in pending)
            t0, c0 = time.perf_counter(), time.thread_time()
            F, steps = online_forecast(model, state, rows, x, horizon, rollout=last, device=device)
            counters["forecast_seconds"] += time.perf_counter() - t0
            counters["forecast_cpu_seconds"] += time.thread_time() - c0
            counters["forecast_calls"] += 1
            counters["forecast_flops"] += step_flops * steps * len(rows)
            counters["steps"] += len(xs)
            counters["rollouts"] += F is not None
            counters["dropped"] += len(xs) - (F is not None)  # rollouts skipped for newer elements
            if F is not None:
                box.publish(g, t, F)
            box.answered(g, t, counters, len(xs))
        except BaseException:  # noqa: BLE001
            box.head[Mailbox.ERROR] = 1
            box.answered(g, t, counters)
            conn.send(("error", traceback.format_exc()))
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
        c = model.config
        self._conn, child = ctx.Pipe(duplex=True)
        self.box = Mailbox(ctx, (int(horizon), c.num_layers, c.num_experts))
        weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        self.proc = ctx.Process(target=_serve, name="expertcast-forecaster", daemon=True,
                                args=(child, self.box, c.to_dict(), weights, int(horizon), bool(every),
                                      int(step_flops), str(device)))
        self.proc.start()
        child.close()
        self.generation = 0
        self.dropped_here = 0
        """Publications replaced before the decode took them."""
        self._seen = 0  # the mailbox's sequence number last taken
        self._sent = 0  # elements submitted (every element is answered once)
        self._error: str | None = None
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise EOFError
            kind, payload = self._conn.recv()
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
        if kind == "error":
            self.close()
            raise RuntimeError(f"the forecaster worker process failed:\n{payload}")
        self.start_seconds = time.perf_counter() - t0
        """Wall time from starting the process to its forecaster being ready."""

    # -- what the policy reads ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def counters(self) -> dict[str, float]:
        """The process's cumulative cost counters (:data:`Mailbox.COUNTERS`)."""
        return dict(zip(Mailbox.COUNTERS, self.box.counts.tolist(), strict=True))

    @property
    def steps(self) -> int:
        return int(self.box.count("steps"))

    @property
    def rollouts(self) -> int:
        return int(self.box.count("rollouts"))

    @property
    def dropped(self) -> int:
        return int(self.box.count("dropped")) + self.dropped_here

    def has_new(self) -> bool:
        """Whether a publication is waiting (a read of shared memory: no system call)."""
        return int(self.box.head[Mailbox.SEQ]) != self._seen

    # -- commands ----------------------------------------------------------------------------------------
    def begin(self, generation: int, wait: bool = False, batch_size: int | None = None) -> None:
        """A new batch of ``batch_size`` members: a fresh recurrent state; the previous batch's publication and
        queued elements are dropped (``wait`` changes nothing: the process takes the batches in order)."""
        if batch_size is None:
            raise ValueError("the forecaster worker process needs the batch's size")
        self._check_alive()
        self._raise()
        self.generation = generation
        self._send(_encode(BEGIN, generation, int(batch_size)))
        self.take()

    def submit_element(self, t: int, rows: list[int], x: np.ndarray, state: Any = None) -> None:
        """Element ``x`` float32 [len(rows), L, E] of step ``t`` for members ``rows`` (returns at once; ``state`` is
        ignored: the process advances its own copy of the batch's)."""
        self._raise()
        self._send(_encode(ELEMENT, self.generation, t, list(rows), x))
        self._sent += 1

    def take(self) -> tuple[int, int, np.ndarray] | None:
        """The newest publication of the current batch not taken yet (None when there is none)."""
        self._raise()
        pub = self.box.read(self._seen)
        if pub is None:
            return None
        k, g, t, F = pub
        self.dropped_here += k - self._seen - 1  # publications replaced before this take
        self._seen = k
        return (g, t, F) if g == self.generation else None

    def wait_for(self, t: int, timeout: float = 60.0) -> None:
        """Block until element ``t`` of the current batch has been consumed (blocking mode)."""
        h = self.box.head
        self._wait(lambda: int(h[Mailbox.DONE_GEN]) == self.generation and int(h[Mailbox.DONE_T]) >= t, timeout,
                   f"forecast of step {t} not published within {timeout} s")

    def drain(self, timeout: float = 60.0) -> None:
        """Block until every submitted element has been consumed."""
        self._wait(lambda: int(self.box.head[Mailbox.ANSWERED]) >= self._sent, timeout,
                   f"the forecaster worker did not consume its elements within {timeout} s")

    def _wait(self, done: Any, timeout: float, what: str) -> None:
        end = time.perf_counter() + timeout
        while True:
            self._raise()
            if done():
                return
            if time.perf_counter() > end:
                raise TimeoutError(what)
            self._check_alive()
            time.sleep(1e-4)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the process: it finishes the element in hand and exits (it answers through the mailbox, so nothing it
        sends can keep it from the stop), else it is terminated after ``timeout`` seconds."""
        if self.proc.is_alive() and not self._conn.closed:
            try:
                self._conn.send_bytes(_encode(STOP, 0, -1))
                self.proc.join(timeout)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=5)
        self._conn.close()

    # -- internals ---------------------------------------------------------------------------------------
    def _send(self, msg: bytes) -> None:
        try:
            self._conn.send_bytes(msg)
        except (BrokenPipeError, OSError):
            self._check_alive()
            raise

    def _check_alive(self) -> None:
        if not self.proc.is_alive() and self.proc.exitcode not in (None, 0) and self._error is None:
            raise RuntimeError(f"the forecaster worker process exited with code {self.proc.exitcode}")

    def _raise(self) -> None:
        if self._error is None and self.box.head[Mailbox.ERROR]:
            while self._error is None and self._conn.poll(5.0):  # its traceback follows the flag
                kind, payload = self._conn.recv()
                if kind == "error":
                    self._error = payload
            if self._error is None:
                self._error = "(no traceback received)"
            self.box.head[Mailbox.ERROR] = 0  # raised once, as any failure
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the forecaster worker process failed:\n{err}")
