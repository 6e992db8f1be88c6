"""The one file lock (utils/locks.py): exclusive, owner line, probe, waiting, released on exit."""

from __future__ import annotations

import threading
import time

from expertcast.utils.locks import FileLock


def test_lock_is_exclusive_and_records_its_owner(tmp_path):
    a, b = FileLock(tmp_path / "sub" / "x.lock"), FileLock(tmp_path / "sub" / "x.lock")
    assert not b.held_elsewhere()  # no file yet
    assert a.acquire(owner="123 eval") and a.locked
    assert b.held_elsewhere() and not b.acquire() and not b.locked
    assert b.holder() == "123 eval"
    a.release()
    assert not a.locked and not b.held_elsewhere() and b.acquire()
    b.release()


def test_context_manager_waits_for_the_holder(tmp_path):
    path = tmp_path / "k.lock"
    first = FileLock(path)
    assert first.acquire()
    waited, order = [], []

    def second():
        with FileLock(path, on_wait=lambda: waited.append(1)):
            order.append("second")

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.2)
    order.append("first")
    first.release()
    t.join(5)
    assert waited == [1] and order == ["first", "second"]
