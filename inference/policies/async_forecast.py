"""SeqMoE with its forecaster running asynchronously beside decoding (docs/design.md,
"Graph-compatible decode path").

:class:`AsyncSeqMoEPolicy` is the ``seqmoe`` policy (same eviction score, prefetch tasks, scheduler and
admission) whose forecaster runs online in a worker instead of inside the runtime's hooks: by default on the CPU a
worker process (:class:`~expertcast.inference.policies.forecast_process.ProcessForecastWorker`, no interpreter lock
shared with decoding), on CUDA (or with ``worker=thread``) the worker thread below. The thread's protocol:

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

The policy is a composition: it holds a :class:`~expertcast.inference.policies.seqmoe.SeqMoEPolicy` and
calls its public steps (``trigger_rows``, ``element``, ``forecast``, ``trigger``, ``plan_prefetch``,
``issue_after``), installing the shifted published forecast through ``trigger``. The worker thread,
:class:`ForecastWorker`, is the one background forecaster of the package: the graph decode path's planner
(:mod:`expertcast.inference.runtime.graph.planner`) runs on it too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from expertcast.inference.cache.options import option
from expertcast.inference.cache.policy import Policy
from expertcast.inference.cache.spec import PolicySpec
from expertcast.inference.policies.forecast_process import WINDOW_MAX, ProcessForecastWorker
from expertcast.inference.policies.seqmoe import ForecastOptions, SeqMoEPolicy

if TYPE_CHECKING:  # pragma: no cover
    from expertcast.inference.cache.expert_cache import ExpertCache

_STOP = object()
WORKER_KINDS = ("auto", "process", "thread")
"""Where ``seqmoe-async`` runs its forecaster (:class:`ForecastWorker`, a thread; :class:`ProcessForecastWorker`)."""


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


@dataclass
class ForecastJob:
    """One element for :class:`ForecastWorker`, run on its thread in submission order.

    Attributes:
        generation: the batch it belongs to (jobs of an ended batch are skipped).
        t: the step whose element it is.
        element: returns ``(rows, x)``: the members consuming the element and the element float32
            [len(rows), L, E] (``rows`` empty: nothing to consume, e.g. precomputed forecasts).
        publish: ``F -> value`` turns the forecast (None when none was rolled out) into what the worker
            publishes (None: nothing new); default: F itself.
        state: the batch's recurrent state, so that a job still running when its batch ends never touches the next
            batch's (the decoding thread does not wait for it).
    """

    generation: int
    t: int
    element: Callable[[], tuple[list[int], np.ndarray | None]]
    publish: Callable[[np.ndarray | None], Any] | None = None
    state: Any = None
    """The recurrent state the element advances (None: the policy's current one)."""


class ForecastWorker:
    """The background forecasting thread of a :class:`~expertcast.inference.policies.seqmoe.SeqMoEPolicy`: consumes
    the submitted elements in order through the policy's public :meth:`~SeqMoEPolicy.forecast` (the recurrent
    state sees them all), rolls out after the last queued one (after every one with ``every``), and publishes
    ``(generation, t, value)``. Used by :class:`AsyncSeqMoEPolicy` and by the graph decode path's planner.

    Args:
        policy: the SeqMoE policy whose forecaster state it advances.
        every: roll out after every element (blocking modes: each step's forecast is published).
    """

    def __init__(self, policy: SeqMoEPolicy, every: bool = False):
        self.policy = policy
        self.every = bool(every)
        self.jobs: queue.Queue = queue.Queue()
        self.latest: tuple[int, int, Any] | None = None
        """(generation, t, value) of the newest publication (read lock-free, or popped by :meth:`take`)."""
        self.error: BaseException | None = None
        self.generation = 0
        self.steps = 0
        self.rollouts = 0
        self.published = 0
        self.dropped = 0
        """Forecasts that never reached the decode: rollouts skipped for a newer queued element, publications
        replaced before they were taken, elements of an ended batch."""
        self._cv = threading.Condition()
        self._done_t = -1
        self.stream: torch.cuda.Stream | None = None
        self.thread = threading.Thread(target=self._run, name="expertcast-forecaster", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def has_new(self) -> bool:
        """Whether a publication waits (a lock-free read)."""
        return self.latest is not None

    def begin(self, generation: int, wait: bool = True, batch_size: int | None = None) -> None:
        """A new batch: forget the previous one's publication, after its queued elements are consumed (``wait``; the
        graph planner's jobs write the policy's online state) or skipping them (no wait: a job still running keeps its
        own batch's state, :attr:`ForecastJob.state`, and the decoding thread never waits for it). ``batch_size``:
        unused here (each job carries its state; :class:`ProcessForecastWorker` makes its own)."""
        if wait:
            self.drain()
        self.generation = generation
        with self._cv:
            if self.latest is not None:
                self.dropped += 1
            self.latest = None
            self._done_t = -1

    def submit(self, job: ForecastJob) -> None:
        self._raise()
        self.jobs.put(job)

    def submit_element(self, t: int, rows: list[int], x: np.ndarray, state: Any = None) -> None:
        """Element ``x`` [len(rows), L, E] of step ``t`` for members ``rows``, advancing ``state`` (None: the policy's
        current one); returns at once."""
        self.submit(ForecastJob(self.generation, t, lambda: (rows, x), state=state))

    def wait_for(self, t: int, timeout: float = 60.0) -> None:
        """Block until element ``t`` was consumed and its forecast, if any, published (blocking mode)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._done_t >= t or self.error is not None, timeout):
                raise TimeoutError(f"forecast of step {t} not published within {timeout} s")
        self._raise()

    def drain(self) -> None:
        """Wait until every queued element has been consumed."""
        self.jobs.join()
        self._raise()

    def take(self) -> tuple[int, int, Any] | None:
        """The newest publication of the current batch not taken yet (None when there is none)."""
        with self._cv:
            pub, self.latest = self.latest, None
        return pub if pub is not None and pub[0] == self.generation else None

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(_STOP)
            self.thread.join(timeout=30)

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"the forecaster worker failed: {err}") from err

    @torch.no_grad()
    def _run(self) -> None:
        torch.set_num_threads(1)
        with forecaster_stream(self.policy.device) as self.stream:
            self._loop()

    def _backlog(self, job: ForecastJob, rows: list[int]) -> list[tuple[ForecastJob, np.ndarray]]:
        """The jobs queued right after ``job`` that continue it (same batch, state and members, nothing to publish
        but the forecast), at most :data:`WINDOW_MAX` - 1, with their elements, taken off the queue (and marked done:
        their elements are consumed with ``job``'s, in one call)."""
        taken: list[tuple[ForecastJob, np.ndarray]] = []
        with self.jobs.mutex:
            q = self.jobs.queue
            while q and len(taken) < WINDOW_MAX - 1:
                nxt = q[0]
                if nxt is _STOP or nxt.generation != job.generation or nxt.state is not job.state \
                        or nxt.publish is not None:
                    break
                r, x = nxt.element()
                if r != rows:
                    break
                taken.append((q.popleft(), x))
        for _ in taken:
            self.jobs.task_done()
        return taken

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is _STOP:
                    return
                if job.generation != self.generation:
                    self.dropped += 1
                    continue  # an element of a batch that has ended
                rows, x = job.element()
                F = None
                if rows:
                    n = 1
                    if not self.every and job.publish is None:  # fell behind: the queued run in one call
                        later = self._backlog(job, rows)
                        if later:
                            job = later[-1][0]
                            x = np.stack([x] + [xl for _, xl in later], axis=1)
                            n += len(later)
                    last = self.jobs.unfinished_tasks <= 1  # nothing newer queued: forecast from here
                    F = self.policy.forecast(rows, x, rollout=last or self.every, state=job.state)
                    self.steps += n
                    self.rollouts += F is not None
                    self.dropped += n - (F is not None)
                value = job.publish(F) if job.publish is not None else F
                with self._cv:
                    if value is not None and job.generation == self.generation:
                        self.dropped += self.latest is not None  # replaced before the decode took it
                        self.latest = (job.generation, job.t, value)
                        self.published += 1
                    self._done_t = job.t
                    self._cv.notify_all()
            except BaseException as e:  # surfaced to the decoding thread on its next submit/wait/drain
                self.error = e
                with self._cv:
                    self._cv.notify_all()
            finally:
                self.jobs.task_done()


class AsyncSeqMoEPolicy(Policy):
    """``seqmoe`` with the forecaster on a worker thread beside decoding (registered as ``seqmoe-async``;
    arguments as :class:`SeqMoEPolicy`, forecasts always computed online).

    It holds a :class:`SeqMoEPolicy` (:attr:`inner`) and runs its hooks, except that at the trigger layer the
    element goes to a :class:`ForecastWorker` and the forecast installed is the newest published one.

    Args:
        blocking: wait in the trigger hook for the step's forecast (equals the synchronous online policy).
        **kwargs: :class:`SeqMoEPolicy` arguments (``precompute`` is forced off).
    """

    name = "seqmoe-async"

    def __init__(self, options: Any = None, *, forecaster: Any = None):
        super().__init__(options)
        self.inner = SeqMoEPolicy(self.options, forecaster=forecaster)  # its options have no precompute
        self.blocking = bool(self.options.blocking)
        self.worker: ForecastWorker | ProcessForecastWorker | None = None
        self.worker_kind = self.options.worker if self.options.worker != "auto" else \
            ("thread" if torch.device(self.inner.device).type == "cuda" else "process")
        self._generation = 0
        self._dropped0 = 0
        self._counters0: dict[str, float] = {}

    @property
    def demand_only(self) -> bool:
        return self.inner.demand_only

    @property
    def model(self) -> Any:
        """The forecaster (the inner policy's)."""
        return self.inner.model

    @property
    def device(self) -> str:
        return self.inner.device

    @property
    def stats(self) -> dict:
        """The inner policy's stats plus ``staleness``, ``stale_dropped``, ``worker_steps``, ``worker_rollouts``; the
        worker's counters are read when the stats are (not on every layer)."""
        st = self.inner.stats
        w = self.worker
        if w is not None and "stale_dropped" in st:
            st["worker_steps"] = w.steps
            st["worker_rollouts"] = w.rollouts
            st["dropped"] = st["stale_dropped"] + w.dropped - self._dropped0
            if isinstance(w, ProcessForecastWorker):  # the process's own cost, since this run's reset
                counters = w.counters
                for k in ("forecast_seconds", "forecast_cpu_seconds", "forecast_calls", "forecast_flops"):
                    st[k] = counters.get(k, 0) - self._counters0.get(k, 0)
        return st

    def check_compatible(self, num_layers: int, num_experts: int, top_k: int, what: str = "model") -> None:
        self.inner.check_compatible(num_layers, num_experts, top_k, what)

    # ------------------------------------------------------------------------------------------ lifecycle
    def _ensure_worker(self) -> ForecastWorker | ProcessForecastWorker:
        w = self.worker
        if w is not None and w.alive:
            return w
        if self.worker_kind == "process":
            w = ProcessForecastWorker(self.inner.model, self.inner.horizon, every=self.blocking,
                                      step_flops=self.inner._step_flops, device=self.inner.device)
        else:
            w = ForecastWorker(self.inner, every=self.blocking)
        w.generation = self._generation
        self.worker = w
        return w

    def reset(self, config) -> None:
        if self.blocking and self.worker is not None:
            self.worker.drain()
        super().reset(config)
        self.inner.reset(config)
        self.inner.stats.update({"staleness": 0, "stale_dropped": 0, "worker_steps": 0, "worker_rollouts": 0,
                                 "worker_start_seconds": 0.0})
        if self.worker_kind == "process" and self.inner.forecasting:
            # started (and its start timed) before any batch: never inside a decode step
            self.inner.stats["worker_start_seconds"] = self._ensure_worker().start_seconds
        self._dropped0 = self.worker.dropped if self.worker is not None else 0
        self._counters0 = dict(self.worker.counters) if isinstance(self.worker, ProcessForecastWorker) else {}

    def begin_batch(self, batch: Any) -> None:
        w = self._ensure_worker()
        self._generation += 1
        self.inner.begin_batch(batch)
        # a thread's job still running keeps its own batch's state; the process makes the new batch's
        w.begin(self._generation, wait=self.blocking, batch_size=len(self.inner.members))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # the state was made on this thread's stream; the worker has its own

    def prepare_sequences(self, sequences: Sequence[Any]) -> None:
        self.inner.prepare_sequences(sequences)

    def close(self) -> None:
        """Stop the worker thread or process (also done at interpreter exit: both are daemons)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------------------------------ forecasting
    def _trigger(self, t: int) -> None:
        """Hand the element of step ``t`` to the worker; apply the latest published forecast."""
        t0 = time.perf_counter()
        rows = self.inner.trigger_rows()
        if rows:
            w = self.worker or self._ensure_worker()  # started at begin_batch: no liveness check on every step
            w.submit_element(t, rows, self.inner.element(rows), state=self.inner._state)
            if self.blocking:
                w.wait_for(t)
        self._apply_published(t, after_trigger=True)
        self.inner.stats["forecast_path_seconds"] += time.perf_counter() - t0

    def _apply_published(self, t: int, after_trigger: bool) -> bool:
        """Install the latest published forecast if it is new. ``t``: the current step; before the trigger
        layer of step t the last trigger point is t - 1. Returns whether a forecast was installed."""
        w = self.worker
        if w is None or not w.has_new():
            return False  # nothing new (a lock-free read: the thread's attribute or the process's mailbox)
        pub = w.take()
        if pub is None:
            return False
        _, t_f, F = pub
        t_eff = t if after_trigger else t - 1
        d = max(t_eff - t_f, 0)
        st = self.inner.stats
        if d >= F.shape[0]:
            st["stale_dropped"] += 1
            st["dropped"] += 1
            return False
        st["staleness"] += d
        self.inner.trigger(t_eff, F[d:])  # scores, first_exec, first_probs from the shifted forecast
        return True

    # ------------------------------------------------------------------------------------------ hooks
    def on_step(self, t: int, info: Any) -> None:
        self.inner.on_step(t, info)

    def observe_routing(self, t: int, layer: int, expert_ids: np.ndarray, weights: np.ndarray) -> None:
        self.inner.observe_routing(t, layer, expert_ids, weights)

    def on_miss(self, t: int, layer: int, expert: int, n_tokens: int, cache: ExpertCache) -> Any:
        return self.inner.on_miss(t, layer, expert, n_tokens, cache)

    def choose_victim(self, t: int, layer: int, candidates: np.ndarray, cache: ExpertCache) -> int:
        return self.inner.choose_victim(t, layer, candidates, cache)

    def on_access(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray, cache: ExpertCache) -> None:
        self.inner.on_access(t, layer, selected, counts, cache)

    def on_insert(self, layer: int, expert: int, proactive: bool) -> None:
        self.inner.on_insert(layer, expert, proactive)

    def on_evict(self, layer: int, expert: int) -> None:
        self.inner.on_evict(layer, expert)

    def before_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        if self._apply_published(t, after_trigger=layer > self.inner.p):
            self.inner.plan_prefetch(cache, rule="floor")
        return self.inner.before_layer(t, layer, cache)

    def after_layer(self, t: int, layer: int, cache: ExpertCache) -> Sequence[tuple[int, int]]:
        inner = self.inner
        if layer != inner.p and self._apply_published(t, after_trigger=layer > inner.p):
            inner.plan_prefetch(cache, rule="floor")
        inner.mark_after(t, layer)
        if layer == inner.p:
            self._trigger(t)
            inner.plan_prefetch(cache)
        return inner.issue_after(t, layer, cache)

    def after_routing(self, t: int, layer: int, selected: np.ndarray, counts: np.ndarray,
                      cache: ExpertCache) -> Sequence[tuple[int, int]]:
        return self.inner.replan_after_routing(t, layer, selected, counts, cache)


@dataclass
class AsyncSeqMoEOptions(ForecastOptions):
    """SeqMoE with the forecaster in a background process or thread (forecasts may arrive late)."""

    blocking: bool = option(False, "wait for each forecast (deterministic; tests)")
    worker: str = option("auto", "where the forecaster runs: process (its own interpreter: no lock shared with "
                         "decoding), thread, or auto (process on the CPU, thread on CUDA)",
                         choices=WORKER_KINDS)


AsyncSeqMoEPolicy.Options = AsyncSeqMoEOptions
SPECS = (
    PolicySpec("seqmoe-async", AsyncSeqMoEPolicy, AsyncSeqMoEOptions, needs={"forecaster"},
               help="seqmoe with the forecaster in a background process (CPU) or thread (CUDA)"),
)
