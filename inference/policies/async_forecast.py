"""SeqMoE with its forecaster running asynchronously beside decoding (issue 7: "forecaster prefetch
running asynchronously beside decoding").

:class:`AsyncSeqMoEPolicy` is the ``seqmoe`` policy (same eviction score, prefetch tasks, scheduler and
admission) whose forecaster runs online on a worker thread instead of inside the runtime's hooks:

* at the trigger layer p of step t the hook copies the step's element (activation vectors [B, L, E]
  of the active members) into the worker's queue and returns at once;
* the worker consumes every element in order (the recurrent state must see them all), and after the
  last queued one rolls out ``horizon`` future elements and publishes ``(t_f, F [H, L, E])``;
* every hook (before/after each layer) reads the latest published forecast without blocking. A forecast
  made after element t_f that is applied at step t > t_f is shifted by d = t - t_f (its entry d is the
  next element) and its prefetch tasks get the deadlines of the current step; with d >= H it is dropped.

Decoding therefore never waits for the forecaster; when the forecaster is slower than a decode step the
forecasts are older (``stats["staleness"]`` sums d over the applied forecasts). With ``blocking=True``
the hook waits for the step's forecast: the result then equals the online synchronous ``seqmoe`` (a
test checks it), which makes the asynchronous mode's cost/benefit measurable against it.

Placement (the policies' ``device`` option, e.g. ``seqmoe-async:device=cuda``): on a GPU the worker
runs the forecaster on a CUDA stream of its own (:func:`forecaster_stream`), so its kernels overlap the
decoding thread's instead of queuing behind them; on the CPU it never touches CUDA (the Mamba kernels
are dispatched by device: :mod:`expertcast.models.mamba_kernels`).

Only the public forecaster API is used (``ExpertForecaster.step/rollout/probs``, ``ForecasterState``);
the policy overrides :class:`~expertcast.inference.policies.seqmoe.SeqMoEPolicy`'s ``_trigger`` and reuses its
score update by feeding it the shifted forecast.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from expertcast.inference.cache.options import option
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies.prefetch import generate_tasks
from expertcast.inference.policies.seqmoe import ForecastOptions, SeqMoEPolicy

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import ExpertCache

_STOP = object()


@contextmanager
def forecaster_stream(device: str | torch.device) -> Iterator[torch.cuda.Stream | None]:
    """Make a new CUDA stream current in this thread when ``device`` is CUDA (yields it); on any other
    device nothing happens (yields None)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        yield None
        return
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        yield stream


class _ForecastWorker:
    """Thread that owns the forecaster state of one batch: consumes elements, publishes forecasts."""

    def __init__(self, policy: AsyncSeqMoEPolicy):
        self.policy = policy
        self.jobs: queue.Queue = queue.Queue()
        self.latest: tuple[int, int, np.ndarray] | None = None  # (generation, t_f, F [H, L, E]) read lock-free
        self.error: BaseException | None = None
        self.generation = 0
        self.steps = 0
        self.rollouts = 0
        self._cv = threading.Condition()
        self._done_t = -1
        self.stream: torch.cuda.Stream | None = None
        self.thread = threading.Thread(target=self._run, name="expertcast-forecaster", daemon=True)
        self.thread.start()

    def submit(self, generation: int, t: int, rows: list[int], x: np.ndarray) -> None:
        """One element: rows of the active members, x float32 [len(rows), L, E]."""
        if self.error is not None:
            raise RuntimeError("the forecaster worker failed") from self.error
        self.jobs.put((generation, t, rows, x))

    def wait_for(self, t: int, timeout: float = 60.0) -> None:
        """Block until the forecast of element ``t`` is published (blocking mode, tests)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._done_t >= t or self.error is not None, timeout):
                raise TimeoutError(f"forecast of step {t} not published within {timeout} s")
        if self.error is not None:
            raise RuntimeError("the forecaster worker failed") from self.error

    def drain(self) -> None:
        """Wait until every queued element has been consumed."""
        self.jobs.join()
        if self.error is not None:
            raise RuntimeError("the forecaster worker failed") from self.error

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(_STOP)
            self.thread.join(timeout=30)

    @torch.no_grad()
    def _run(self) -> None:
        torch.set_num_threads(1)
        with forecaster_stream(self.policy.device) as self.stream:
            self._loop()

    def _loop(self) -> None:
        pol = self.policy
        model = pol.model
        while True:
            job = self.jobs.get()
            try:
                if job is _STOP:
                    return
                gen, t, rows, x = job
                if gen != self.generation or pol._state is None:
                    continue  # an element of a batch that has ended
                sub = pol._state.select(rows)
                logits, _ = model.step(torch.from_numpy(x).to(pol.device), sub, all_horizons=True)
                self.steps += 1
                last = self.jobs.unfinished_tasks <= 1  # nothing newer queued: forecast from here
                if last or pol.blocking:
                    roll = model.rollout(logits, sub, pol.horizon)
                    probs = model.probs(roll).cpu().numpy().astype(np.float16)  # [B, H, L, E], as seqmoe stores
                    miss = np.ones(probs.shape[1:], np.float32)
                    for pm in probs:
                        miss *= 1.0 - np.clip(pm.astype(np.float32), 0.0, 1.0)
                    self.rollouts += 1
                    pol._state.put_rows(rows, sub)
                    self.latest = (gen, t, 1.0 - miss)
                else:
                    pol._state.put_rows(rows, sub)
                with self._cv:
                    self._done_t = t
                    self._cv.notify_all()
            except BaseException as e:  # surfaced to the decoding thread on its next submit/wait
                self.error = e
                with self._cv:
                    self._cv.notify_all()
            finally:
                self.jobs.task_done()


class AsyncSeqMoEPolicy(SeqMoEPolicy):
    """``seqmoe`` with the forecaster on a worker thread beside decoding (registered in the bench as
    ``seqmoe-async``; arguments as :class:`SeqMoEPolicy`, forecasts always computed online).

    Args:
        blocking: wait in the trigger hook for the step's forecast (equals the synchronous online policy).
        **kwargs: :class:`SeqMoEPolicy` arguments (``precompute`` is forced off).
    """

    name = "seqmoe-async"

    def __init__(self, options: Any = None, *, forecaster: Any = None):
        super().__init__(options, forecaster=forecaster)
        self.precompute = False
        self.blocking = bool(self.options.blocking)
        self._worker: _ForecastWorker | None = None
        self._generation = 0
        self._applied: tuple[int, int] | None = None
        self._feed: np.ndarray | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def _ensure_worker(self) -> _ForecastWorker:
        if self._worker is None or not self._worker.thread.is_alive():
            self._worker = _ForecastWorker(self)
        return self._worker

    def reset(self, config) -> None:
        if self._worker is not None:
            self._worker.drain()
        super().reset(config)
        self.stats.update({"staleness": 0, "stale_dropped": 0, "worker_steps": 0, "worker_rollouts": 0})
        self._applied = None

    def begin_batch(self, batch: Any) -> None:
        w = self._ensure_worker()
        w.drain()  # the previous batch's elements are consumed before its state is replaced
        self._generation += 1
        w.generation = self._generation
        w.latest = None
        self._applied = None
        super().begin_batch(batch)
        self._traced = False  # always online: forecasts from the observed routing
        if self._state is None:
            self._state = self.model.init_state(len(self.members), self.device)
            self._latest = np.zeros((len(self.members), self.L, self.E), np.float32)
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # the state was made on this thread's stream; the worker has its own

    def close(self) -> None:
        """Stop the worker thread (also done at interpreter exit: it is a daemon)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------ forecasting
    def _trigger(self, t: int) -> None:
        """Hand the element of step ``t`` to the worker; apply the latest published forecast."""
        assert self._latest is not None
        rows = [b for b, pos in enumerate(self._pos) if pos >= 0 and pos - self.s >= 0]
        if rows:
            w = self._ensure_worker()
            w.submit(self._generation, t, rows, self._latest[rows].copy())
            if self.blocking:
                w.wait_for(t)
        self._apply_published(t, after_trigger=True)

    def _forecast(self, t: int) -> np.ndarray | None:  # fed by _apply_published
        return self._feed

    def _apply_published(self, t: int, after_trigger: bool) -> bool:
        """Install the latest published forecast if it is new. ``t``: the current step; before the trigger
        layer of step t the last trigger point is t - 1. Returns whether a forecast was installed."""
        w = self._worker
        pub = None if w is None else w.latest
        if pub is None or pub[0] != self._generation or (pub[0], pub[1]) == self._applied:
            return False
        _, t_f, F = pub
        self._applied = (pub[0], t_f)
        t_eff = t if after_trigger else t - 1
        d = max(t_eff - t_f, 0)
        if d >= F.shape[0]:
            self.stats["stale_dropped"] += 1
            return False
        self.stats["staleness"] += d
        self._feed = F[d:]
        try:
            SeqMoEPolicy._trigger(self, t_eff)  # scores, first_exec, first_probs from the shifted forecast
        finally:
            self._feed = None
        return True

    def _submit_tasks(self, cache: ExpertCache) -> None:
        tasks = generate_tasks(self.first_probs, self.first_exec.astype(np.float64), self._in_cache_mask(cache),
                               self.max_tasks, self.min_confidence)
        self.scheduler.clear()
        self.scheduler.submit(tasks)
        self.stats["tasks"] += len(tasks)

    # ------------------------------------------------------------------------------------------ hooks
    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        if self._apply_published(t, after_trigger=layer > self.p) and self.prefetch:
            self._submit_tasks(cache)
        return super().before_layer(t, layer, cache)

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        if layer != self.p and self._apply_published(t, after_trigger=layer > self.p) and self.prefetch:
            self._submit_tasks(cache)
        out = super().after_layer(t, layer, cache)  # at p: _trigger (submit + apply) then tasks
        if self._worker is not None:
            self.stats["worker_steps"] = self._worker.steps
            self.stats["worker_rollouts"] = self._worker.rollouts
        return out


@dataclass
class AsyncSeqMoEOptions(ForecastOptions):
    """SeqMoE with the forecaster on a background thread (forecasts may arrive late)."""

    blocking: bool = option(False, "wait for each forecast (deterministic; tests)")


AsyncSeqMoEPolicy.Options = AsyncSeqMoEOptions
SPECS = (
    PolicySpec("seqmoe-async", AsyncSeqMoEPolicy, AsyncSeqMoEOptions, needs={"forecaster"},
               help="seqmoe with the forecaster on a background thread"),
)
