"""Calls into the worker loops' mailboxes (woken through a pipe written without releasing the GIL):
each runs once, in the order each thread posted it; a stopped loop refuses posts and keeps no fd.
The mailbox of any other loop keeps neither its loop nor what was posted to it alive. Alarms wake a sleeping thread when rung from Python or from C, and keep a ring that came first."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys
import threading
import weakref

import pytest

from kvoffload._core.base.cross_thread import WakeSemaphore, give_back_wake_semaphore, mailbox_of, resolve, take_wake_semaphore
from kvoffload._core.workers.worker_loop import WorkerLoop


def test_posts_from_many_threads_each_run_once_in_each_threads_order():
    loop = WorkerLoop("kvoffload-test-mailbox")
    try:
        seen: list[tuple[int, int]] = []
        done = threading.Event()
        total = 4 * 500

        def note(thread: int, i: int) -> None:
            seen.append((thread, i))
            if len(seen) == total:
                done.set()

        def poster(thread: int) -> None:
            for i in range(500):
                loop.mailbox.post(note, thread, i)

        threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert done.wait(10), f"{len(seen)} of {total} posted calls ran"
        for t in range(4):
            assert [i for th, i in seen if th == t] == list(range(500))
    finally:
        loop.stop(5)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_stopped_loop_refuses_posts_and_keeps_no_fd():
    before = _open_fds()
    for _ in range(20):
        loop = WorkerLoop("kvoffload-test-mailbox")
        ran = threading.Event()
        loop.mailbox.post(ran.set)
        assert ran.wait(10)
        assert loop.stop(5)
        with pytest.raises(RuntimeError):
            loop.mailbox.post(ran.set)
    assert _open_fds() == before


def test_a_loop_that_closed_before_running_its_posts_is_freed_with_them():
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    mailbox_of(loop).post(resolve, fut)  # a wake-up the loop never runs: it closes first
    loop.close()
    with pytest.raises(RuntimeError):
        mailbox_of(loop).post(resolve, fut)
    freed = [weakref.ref(loop), weakref.ref(fut)]
    del loop, fut
    gc.collect()
    assert [ref() for ref in freed] == [None, None]


def test_a_wake_semaphore_wakes_its_sleeper_when_rung_from_c_and_keeps_an_early_ring():
    semaphore = WakeSemaphore()
    assert semaphore.sleep(0.01) is None  # nobody rang
    semaphore.ring()
    assert semaphore.sleep(10) is not None  # rung before the sleep: kept
    semaphore.ring()
    assert semaphore.sleep(10, keep_gil=True) == 0.0  # kept too; no GIL to take back
    assert semaphore.sleep(0.01, keep_gil=True) is None
    ring_from_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(WakeSemaphore.RING_FUNCTION)  # as the driver's host function
    woke: list[float | None] = []
    sleeper = threading.Thread(target=lambda: woke.append(semaphore.sleep(10)))
    sleeper.start()
    ring_from_c(semaphore.address)
    sleeper.join(10)
    assert len(woke) == 1 and woke[0] is not None and 0 <= woke[0] < 10


def test_a_thread_woken_behind_a_thread_running_python_learns_how_long_the_gil_took():
    """What a sleeper on several chunks decides by: the wait to take the GIL back after the ring."""
    semaphore = WakeSemaphore()
    interval = sys.getswitchinterval()
    asleep = threading.Event()
    woke: list[float | None] = []

    def sleeper() -> None:
        asleep.set()
        woke.append(semaphore.sleep(10))

    thread = threading.Thread(target=sleeper)
    thread.start()
    asleep.wait(10)
    semaphore.ring()  # rung while this thread keeps running Python
    while thread.is_alive():  # pure Python: the sleeper gets the GIL only when this thread is made to drop it
        pass
    assert len(woke) == 1 and woke[0] is not None and woke[0] >= interval / 2


def test_wake_semaphores_go_back_to_the_pool_not_away():
    """A semaphore handed to the driver may be rung after its sleeper left: the pool keeps it alive."""
    semaphore = take_wake_semaphore()
    give_back_wake_semaphore(semaphore)
    assert take_wake_semaphore() is semaphore
    give_back_wake_semaphore(semaphore)


def test_a_wake_semaphore_taken_from_the_pool_has_no_ring_left_from_its_last_use():
    """Rings that came after a sleeper left (a ring for a copy it found landed, its job's end) would
    wake the next sleeper at once, which behind a thread running Python then waits up to a switch
    interval for the GIL: taking the semaphore again throws them away."""
    semaphore = take_wake_semaphore()
    semaphore.ring()
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(WakeSemaphore.RING_FUNCTION)(semaphore.address)  # as the driver rings
    give_back_wake_semaphore(semaphore)
    again = take_wake_semaphore()
    try:
        assert again is semaphore
        assert again.sleep(0.01) is None
        again.ring()
        assert again.sleep(10) is not None  # a ring after the take is kept
        assert again.drain() == 0
        again.ring()
        again.ring()
        assert again.drain() == 2
    finally:
        give_back_wake_semaphore(again)
