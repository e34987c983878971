"""The compiled lock the index shares between callers' threads and the workers
(``_core/base/convoy_free_lock.c``): mutual exclusion, and never held by a thread that waits
for the GIL (``threading.Lock``'s convoy, which doubled the time of a burst of small stores)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvoffload._core.base.convoy_free_lock import ConvoyFreeLock


@pytest.fixture
def switch_interval():
    """Set the GIL switch interval for the test; restore it after."""
    before = sys.getswitchinterval()
    yield sys.setswitchinterval
    sys.setswitchinterval(before)


def test_acquire_release_and_refusals() -> None:
    lock = ConvoyFreeLock()
    assert not lock.locked()
    assert lock.acquire() is True and lock.locked()
    assert lock.acquire(False) is False and lock.acquire(blocking=False) is False  # not reentrant
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()
    with pytest.raises(TypeError):
        lock.acquire(True, 1.0)  # no timeout


def test_threads_updating_shared_state_under_it_lose_no_update(switch_interval) -> None:
    switch_interval(1e-6)  # the GIL changes hands between any two bytecodes' worth of work
    lock, state, n, threads = ConvoyFreeLock(), {"count": 0}, 20_000, 4

    def add() -> None:
        for _ in range(n):
            with lock:
                value = state["count"]
                time.sleep(0) if value % 997 == 0 else None  # now and then, give the GIL away inside
                state["count"] = value + 1

    workers = [threading.Thread(target=add) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert state["count"] == n * threads
    assert not lock.locked()


@pytest.mark.parametrize("kind", [ConvoyFreeLock, threading.Lock])
def test_a_waiting_thread_never_holds_the_lock_while_it_waits_for_the_gil(kind, switch_interval) -> None:
    """The holder releases the lock and keeps running Python (the GIL held, no switch for 10 s),
    taking and releasing it again and again for half a second: a waiting thread never takes it
    meanwhile. ``threading.Lock`` is the counter-example: its waiter takes the lock as soon as it is
    free, then waits for the GIL."""
    switch_interval(10.0)  # before any thread waits: the GIL changes hands only where a thread gives it up
    lock = kind()
    lock.acquire()
    waiting, took = threading.Event(), threading.Event()

    def waiter() -> None:
        waiting.set()
        with lock:
            took.set()

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait()
    time.sleep(0.05)  # the waiter is inside acquire(), the GIL released
    lock.release()
    taken_without_the_gil = False
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:  # Python only: this thread keeps the GIL all along
        if not lock.acquire(False):  # (threading.Lock's locked() says False until its waiter has the GIL too)
            taken_without_the_gil = True
            break
        lock.release()
    t.join()  # gives the GIL away: the waiter takes the lock now
    assert took.is_set()
    assert taken_without_the_gil == (kind is threading.Lock)
