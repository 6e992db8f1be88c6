"""SeqMoE with the forecaster on a worker thread or process beside decoding (inference/policies/async_forecast.py,
forecast_process.py)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from expertcast.inference.policies import make_policy
from expertcast.inference.policies.async_forecast import AsyncSeqMoEPolicy
from expertcast.inference.policies.forecast_process import ProcessForecastWorker
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
from expertcast.models.presets import build_tiny

torch.set_num_threads(1)
NEW = 10


def _setup():
    model = build_tiny("qwen3_moe-tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 500, (2, 9), generator=g)
    am = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    c = model.config
    torch.manual_seed(0)
    fc = ExpertForecaster(ForecasterConfig(num_layers=c.num_hidden_layers, num_experts=c.num_experts,
                                           top_k=c.num_experts_per_tok, hidden_size=32, num_blocks=1, state_size=8,
                                           head_dim=16, chunk_size=16)).eval()
    return model, ids, am, ref, fc


def _run(model, pol, ids, am, cap):
    om = OffloadedModel(model, pol, cap, pool="per-layer")
    out = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    st = om.stats
    counters = (st.A, st.D, st.P, int(np.sum(st.hits)), st.bytes_moved)
    return out.sequences, counters, om.restore()


WORKERS = ("thread", "process")


def test_the_default_worker_is_a_process_on_the_cpu():
    _, _, _, _, fc = _setup()
    assert AsyncSeqMoEPolicy(forecaster=fc).worker_kind == "process"


@pytest.mark.parametrize("worker", WORKERS)
def test_blocking_async_equals_synchronous_online_seqmoe(worker):
    """Waiting for each step's forecast reproduces the synchronous online policy exactly (same forecasts,
    same prefetches, same evictions), and the tokens equal the full-load model's: on a thread and in a process."""
    model, ids, am, ref, fc = _setup()
    K = model.config.num_experts_per_tok
    sync = make_policy("seqmoe", forecaster=fc, precompute=False, prefetch_rule="floor")  # the async policy's rule
    seq_s, cnt_s, model = _run(model, sync, ids, am, K + 1)
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(blocking=True, worker=worker), forecaster=fc)
    try:
        seq_a, cnt_a, model = _run(model, pol, ids, am, K + 1)
    finally:
        pol.close()
    assert torch.equal(seq_s, ref) and torch.equal(seq_a, ref)
    assert cnt_s[2] > 0, "the synchronous policy must prefetch for the comparison to mean something"
    assert cnt_a == cnt_s
    assert pol.stats["forecasts"] == sync.stats["forecasts"] > 0
    assert pol.stats["staleness"] == 0


@pytest.mark.parametrize("worker", WORKERS)
def test_nonblocking_async_keeps_tokens_and_consumes_every_element(worker):
    model, ids, am, ref, fc = _setup()
    K = model.config.num_experts_per_tok
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(worker=worker), forecaster=fc)
    try:
        seq, cnt, model = _run(model, pol, ids, am, K)
        pol.worker.drain()
        # 9 prompt positions + NEW - 1 decode forwards, each hands one element to the worker
        assert pol.worker.steps == 9 + NEW - 1
        assert pol.worker.rollouts >= 1
        if worker == "thread":
            assert pol.stats["forecasts"] > 0
        else:  # the process may publish after the last decode step: then its forecast waits in the pipe
            assert pol.stats["forecasts"] > 0 or pol.worker.take() is not None
        assert pol.worker.rollouts <= pol.worker.steps
    finally:
        pol.close()
    assert torch.equal(seq, ref)
    assert cnt[0] > 0


def test_worker_failure_surfaces_in_the_decoding_thread():
    model, ids, am, ref, fc = _setup()
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(blocking=True, worker="thread"), forecaster=fc)

    def broken(*a, **k):
        raise ValueError("forecaster exploded")

    pol.model.step = broken
    try:
        with pytest.raises(RuntimeError, match="forecaster worker failed"):
            _run(model, pol, ids, am, model.config.num_experts_per_tok)
    finally:
        pol.close()


def test_worker_process_failure_surfaces_in_the_decoding_thread():
    """An element the forecaster cannot take fails in the worker process; the failure, with its traceback, is
    raised on the caller's thread at its next wait, and nothing hangs."""
    _, _, _, _, fc = _setup()
    w = ProcessForecastWorker(fc, horizon=4)
    try:
        w.begin(1, batch_size=2)
        w.submit_element(0, [0, 1], np.zeros((2, 3, 3), np.float32))  # not [rows, L, E]
        with pytest.raises(RuntimeError, match="(?s)forecaster worker process failed.*ValueError"):
            w.drain(timeout=120)
    finally:
        w.close()
    assert not w.proc.is_alive()


def test_forecaster_process_never_blocks_a_decode_step():
    """With the worker process stopped (SIGSTOP) for the whole run, two generate() calls (a new batch and a policy
    reset between them) return with the full-load model's tokens and no forecast installed; once it runs again it
    consumes what was sent, and the first batch's forecasts count as dropped."""
    model, ids, am, ref, fc = _setup()
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(worker="process"), forecaster=fc)
    w = pol._ensure_worker()
    os.kill(w.proc.pid, signal.SIGSTOP)
    try:
        seq1, cnt1, model = _run(model, pol, ids, am, model.config.num_experts_per_tok)
        seq2, cnt2, model = _run(model, pol, ids, am, model.config.num_experts_per_tok)
        assert pol.worker is w and w.steps == 0 and pol.stats["forecasts"] == 0
        os.kill(w.proc.pid, signal.SIGCONT)
        w.drain(timeout=120)
        assert w.dropped >= 9 + NEW - 1  # the first batch's elements were skipped once the second began
        assert w.steps == 9 + NEW - 1  # the second batch's were all consumed
    finally:
        os.kill(w.proc.pid, signal.SIGCONT)
        pol.close()
    assert torch.equal(seq1, ref) and torch.equal(seq2, ref)
    assert cnt1[0] > 0 and cnt2[0] > 0


def test_forecaster_worker_never_blocks_a_decode_step():
    """A forecaster whose step blocks (on an Event not set until decoding is over) never holds the decode: two
    generate() calls (a new batch and a policy reset between them) return while the worker is still inside its
    first step, with the full-load model's tokens; the forecasts that never arrived are counted dropped."""
    import threading

    model, ids, am, ref, fc = _setup()
    entered, release, left = threading.Event(), threading.Event(), threading.Event()
    step = fc.step

    def stuck(*a, **k):
        entered.set()
        release.wait(120)
        left.set()
        return step(*a, **k)

    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(worker="thread"), forecaster=fc)
    pol.model.step = stuck
    try:
        seq1, cnt1, model = _run(model, pol, ids, am, model.config.num_experts_per_tok)
        seq2, cnt2, model = _run(model, pol, ids, am, model.config.num_experts_per_tok)
        blocked = entered.is_set() and not left.is_set()  # the worker is still inside its first step
        assert pol.stats["forecasts"] == 0
        release.set()
        pol.worker.drain()
        assert blocked, "a decode step waited for the forecaster worker"
        assert pol.worker.dropped >= 9 + NEW - 2  # the first batch's elements after the stuck one were abandoned
    finally:
        release.set()
        pol.close()
    assert torch.equal(seq1, ref) and torch.equal(seq2, ref)
    assert cnt1[0] > 0 and cnt2[0] > 0


def test_runtime_reports_the_forecasters_cost():
    """A run with a forecaster reports its time per decode step (ms, share of the step, and the share the decoding
    thread spent on it), calls and FLOPs per step; the synchronous policy's steps all run on the decode path."""
    model, ids, am, ref, fc = _setup()
    pol = make_policy("seqmoe", forecaster=fc, precompute=False)
    om = OffloadedModel(model, pol, model.config.num_experts_per_tok, pool="per-layer")
    om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    st = om.stats
    m = st.metrics()
    om.restore()
    assert st.forecaster and st.decode_steps == NEW - 1
    assert st.forecaster_calls == NEW - 1  # one forecast per decode step (both rows in one batched step)
    assert m["forecaster_calls_per_step"] == 1.0
    # two rows; one direct head, so the step and horizon - 1 recursive rollout steps
    assert m["forecaster_flops_per_step"] == 2 * fc.step_flops() * pol.horizon
    assert 0 < m["forecaster_ms_per_step"] <= m["forecaster_path_ms_per_step"]
    assert 0 < m["forecaster_share"] <= m["forecaster_path_share"] < 1
    assert 0 < m["forecaster_cpu_ms_per_step"] <= m["forecaster_ms_per_step"] * 1.01 + 1e-3
    lru = OffloadedModel(model, make_policy("lru"), model.config.num_experts_per_tok, pool="per-layer")
    lru.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert not lru.stats.forecaster and "forecaster_ms_per_step" not in lru.stats.metrics()
    lru.restore()


def test_the_forecasters_cpu_time_leaves_out_its_waits(monkeypatch):
    """The forecaster's time per step is reported twice: wall, and the CPU time of the thread that ran its steps. A
    step that waits (here 20 ms asleep, as a worker waits for a core beside decoding) adds to the first only."""
    import expertcast.inference.policies.seqmoe as seqmoe_mod

    model, ids, am, ref, fc = _setup()
    real = seqmoe_mod.online_forecast

    def waiting(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(seqmoe_mod, "online_forecast", waiting)
    pol = make_policy("seqmoe", forecaster=fc, precompute=False)
    om = OffloadedModel(model, pol, model.config.num_experts_per_tok, pool="per-layer")
    om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    m = om.stats.metrics()
    om.restore()
    assert m["forecaster_ms_per_step"] >= 20
    assert 0 < m["forecaster_cpu_ms_per_step"] < m["forecaster_ms_per_step"] - 15


def test_the_worker_process_reports_its_cost_off_the_decode_path():
    """seqmoe-async with its process: the forecaster's time, calls and FLOPs come from the process (every element
    consumed, blocking mode: one call per element), its start is timed apart, and the decoding thread's part is only
    the hand-over."""
    model, ids, am, ref, fc = _setup()
    pol = AsyncSeqMoEPolicy(AsyncSeqMoEPolicy.Options(worker="process", blocking=True), forecaster=fc)
    try:
        om = OffloadedModel(model, pol, model.config.num_experts_per_tok, pool="per-layer")
        om.generate(ids, am, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        st = om.stats
        om.restore()
        calls = pol.stats["forecast_calls"]
        assert calls == pol.worker.steps == 9 + NEW - 1  # prompt elements and every decode step's
        assert pol.stats["forecast_flops"] == calls * 2 * fc.step_flops() * pol.inner.horizon
        assert pol.stats["forecast_seconds"] > 0 and pol.stats["worker_start_seconds"] > 0
        assert 0 < pol.stats["forecast_cpu_seconds"] <= pol.stats["forecast_seconds"] * 1.01 + 1e-3
        assert st.forecaster
    finally:
        pol.close()


def test_worker_process_stops_while_its_answers_fill_the_pipe():
    """Unread forecasts (here 40 of them, far more than a pipe holds) never keep the process from its stop: close()
    drains them and the process exits by itself (not terminated)."""
    _, _, _, _, fc = _setup()
    c = fc.config
    w = ProcessForecastWorker(fc, horizon=32, every=True)
    w.begin(1, batch_size=64)
    for t in range(40):  # each answer: [32, L, E] float32 probabilities (8 KB), every one rolled out
        w.submit_element(t, list(range(64)), np.full((64, c.num_layers, c.num_experts), 1.0 / c.num_experts, np.float32))
    time.sleep(1.0)
    w.close(timeout=60)
    assert not w.proc.is_alive() and w.proc.exitcode == 0


def test_worker_process_that_cannot_start_says_why(tmp_path):
    """A script without a main guard makes the process re-run it on import and die before it is ready: the caller
    gets one clear error naming the fix, not a broken pipe."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from expertcast.inference.policies.forecast_process import ProcessForecastWorker\n"
        "from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig\n"
        "fc = ExpertForecaster(ForecasterConfig(num_layers=2, num_experts=8, top_k=2, hidden_size=16, num_blocks=1,\n"
        "                                       state_size=8, head_dim=16, chunk_size=16)).eval()\n"
        "ProcessForecastWorker(fc, horizon=2)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith(
        "RuntimeError: the forecaster worker process did not start (exit code 1): a script that runs the policy must "
        "keep its entry under `if __name__ == \"__main__\":`")


def test_mailbox_reader_takes_the_newest_publication_and_never_waits_for_the_writer():
    """The forecasts come back through shared memory (forecast_process.Mailbox): the reader gets the newest
    publication, and while the process holds the mailbox's lock (it is writing one) the reader gets nothing at once,
    never a half-written forecast and never a wait; the publication is taken at the next check."""
    import multiprocessing as mp

    from expertcast.inference.policies.forecast_process import Mailbox

    box = Mailbox(mp.get_context("forkserver"), (3, 2, 4))
    assert box.read(0) is None
    F = [np.full((3, 2, 4), float(i), np.float32) for i in range(4)]
    box.publish(7, 10, F[1])
    box.publish(7, 11, F[2])
    k, g, t, got = box.read(0)
    assert (k, g, t) == (2, 7, 11) and np.array_equal(got, F[2])
    assert box.read(k) is None

    box.publish(7, 12, F[3])
    assert box.lock.acquire(False)  # the process in the middle of its next publication
    try:
        t0 = time.perf_counter()
        assert box.read(k) is None
        assert time.perf_counter() - t0 < 0.5
    finally:
        box.lock.release()
    k, g, t, got = box.read(k)
    assert (k, t) == (3, 12) and np.array_equal(got, F[3])


def test_the_decoding_thread_checks_for_forecasts_without_a_system_call():
    """has_new() is a read of shared memory: it answers with the pipe unusable, and the publication it announces is
    the process's forecast of the element submitted."""
    _, _, _, _, fc = _setup()
    c = fc.config
    w = ProcessForecastWorker(fc, horizon=4)
    try:
        w.begin(1, batch_size=2)
        assert not w.has_new()
        x = np.zeros((2, c.num_layers, c.num_experts), np.float32)
        x[:, :, 0] = 1.0
        w.submit_element(0, [0, 1], x)
        w.drain(timeout=120)
        conn = w._conn

        class NoPoll:
            def poll(self, *a):
                raise AssertionError("has_new() polled the pipe")

        w._conn = NoPoll()
        try:
            assert w.has_new()
        finally:
            w._conn = conn
        g, t, F = w.take()
        assert (g, t) == (1, 0) and F.shape == (4, c.num_layers, c.num_experts)
        assert not w.has_new() and w.take() is None
        assert w.steps == 1 and w.rollouts == 1
    finally:
        w.close()


def test_the_worker_process_consumes_a_backlog_in_one_call_with_the_steps_forecast(activation_inputs):
    """Elements queued faster than the process consumes them (a prompt's replay hands it one per position) are consumed
    in one parallel pass and rolled out once: the forecast it publishes is the one stepping through them gives (up to
    the float16 rounding of forecasts), and every element is counted consumed and answered. The process's loop runs
    here on a thread, with the whole backlog in its pipe before it starts, so the backlog is certain."""
    import multiprocessing as mp
    import threading

    from expertcast.inference.policies.forecast_process import BEGIN, ELEMENT, STOP, Mailbox, _encode, _serve
    from expertcast.inference.policies.forecast_tables import online_forecast

    L, E, K, B, T, H = 3, 8, 2, 3, 9, 4
    torch.manual_seed(0)
    cfg = ForecasterConfig(num_layers=L, num_experts=E, top_k=K, hidden_size=32, num_blocks=1, state_size=8,
                           head_dim=16, chunk_size=4, direct_horizons=2, online_half_lives=[0.0, 2.0, 8.0],
                           online_hedge_rate=1.0, learned_gate_rate=2.0, component_half_lives=[16.0],
                           selection=[[-1] * L, [-1] * L], switch_half_life=8.0)
    fc = ExpertForecaster(cfg).eval()
    torch.nn.init.normal_(fc.head.weight, std=0.1)  # a learned part that matters
    x = activation_inputs(B, T, L, E, K).numpy()
    rows = [0, 2]  # not every member: the state's rows are selected and put back
    with torch.no_grad():
        st = fc.init_state(B)
        for t in range(T):
            ref, _ = online_forecast(fc, st, rows, x[rows, t], H, rollout=t == T - 1)

    ctx = mp.get_context("forkserver")
    box = Mailbox(ctx, (H, L, E))
    parent, child = ctx.Pipe(duplex=True)
    parent.send_bytes(_encode(BEGIN, 1, B))
    for t in range(T):
        parent.send_bytes(_encode(ELEMENT, 1, t, rows, x[rows, t]))
    parent.send_bytes(_encode(STOP, 0, -1))
    weights = {k: v.detach().clone() for k, v in fc.state_dict().items()}
    th = threading.Thread(target=_serve, args=(child, box, cfg.to_dict(), weights, H, False, 7, "cpu"))
    th.start()
    th.join(timeout=120)
    assert not th.is_alive()
    assert parent.recv() == ("ready", None)
    c = {k: box.count(k) for k in Mailbox.COUNTERS}
    assert (c["forecast_calls"], c["steps"], c["rollouts"], c["dropped"]) == (1, T, 1, T - 1)
    assert c["forecast_flops"] == 7 * (T + H - cfg.direct_horizons) * len(rows)
    assert int(box.head[Mailbox.ANSWERED]) == T and int(box.head[Mailbox.DONE_T]) == T - 1
    k, g, t, F = box.read(0)
    assert (k, g, t) == (1, 1, T - 1)
    np.testing.assert_allclose(F, ref, atol=2e-3)
    assert np.abs(F - ref).max() < np.abs(ref - ref.mean()).max()  # not a trivially flat forecast


def test_the_worker_thread_consumes_a_backlog_in_one_call_with_the_steps_forecast(activation_inputs):
    """The thread worker does as the process: elements of the same batch, state and members queued behind the one in
    hand are consumed with it in one parallel pass, and the forecast published after the last is the one stepping
    through them gives. The worker is held on its first element until the backlog is queued."""
    import threading

    from expertcast.inference.cache.expert_cache import Budget, CacheConfig
    from expertcast.inference.policies.async_forecast import ForecastJob, ForecastWorker
    from expertcast.inference.policies.forecast_tables import online_forecast
    from expertcast.inference.policies.seqmoe import SeqMoEPolicy

    L, E, K, B, T = 3, 8, 2, 3, 9
    torch.manual_seed(0)
    fc = ExpertForecaster(ForecasterConfig(num_layers=L, num_experts=E, top_k=K, hidden_size=32, num_blocks=1,
                                           state_size=8, head_dim=16, chunk_size=4, direct_horizons=2,
                                           online_half_lives=[0.0, 2.0, 8.0])).eval()
    torch.nn.init.normal_(fc.head.weight, std=0.1)
    pol = SeqMoEPolicy(SeqMoEPolicy.Options(horizon=4), forecaster=fc)
    pol.reset(CacheConfig(num_layers=L, num_experts=E, top_k=K, pool="shared", budget=Budget.fraction(0.5)))
    x = activation_inputs(B, T, L, E, K).numpy()
    rows = [0, 2]
    with torch.no_grad():
        st = fc.init_state(B)
        for t in range(T):
            ref, _ = online_forecast(fc, st, rows, x[rows, t], 4, rollout=t == T - 1)
    state = fc.init_state(B)
    gate = threading.Event()
    w = ForecastWorker(pol)
    try:
        w.generation = 1

        def first():
            gate.wait(30)
            return rows, x[rows, 0]

        w.submit(ForecastJob(1, 0, first, state=state))
        for t in range(1, T):
            w.submit_element(t, rows, x[rows, t], state=state)
        gate.set()
        w.drain()
        assert (w.steps, w.rollouts, w.dropped) == (T, 1, T - 1)
        assert pol.stats["forecast_calls"] == 1
        g, t, F = w.take()
        assert (g, t) == (1, T - 1)
        np.testing.assert_allclose(F, ref, atol=2e-3)
        assert np.abs(F - ref).max() < np.abs(ref - ref.mean()).max()
    finally:
        w.close()
