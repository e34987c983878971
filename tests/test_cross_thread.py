"""Calls into the worker loops' mailboxes (woken through a pipe written without releasing the GIL):
each runs once, in the order each thread posted it; a stopped loop refuses posts and keeps no fd.
The mailbox of any other loop keeps neither its loop nor what was posted to it alive. Alarms wake a sleeping thread when rung from Python or from C, and keep a ring that came first."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import threading
import weakref

import pytest

from kvoffload._core.base.cross_thread import (
    Doorbell, WakeSemaphore, doorbell_of, give_back_wake_semaphore, mailbox_of, resolve, take_wake_semaphore,
)
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
    assert not semaphore.sleep(0.01)  # nobody rang
    semaphore.ring()
    assert semaphore.sleep(10)  # rung before the sleep: kept
    ring_from_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(WakeSemaphore.RING_FUNCTION)  # as the driver's host function
    woke: list[bool] = []
    sleeper = threading.Thread(target=lambda: woke.append(semaphore.sleep(10)))
    sleeper.start()
    ring_from_c(semaphore.address)
    sleeper.join(10)
    assert woke == [True]


def test_wake_semaphores_go_back_to_the_pool_not_away():
    """An semaphore handed to the driver may be rung after its sleeper left: the pool keeps it alive."""
    semaphore = take_wake_semaphore()
    give_back_wake_semaphore(semaphore)
    assert take_wake_semaphore() is semaphore
    give_back_wake_semaphore(semaphore)


class _Listener:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.rings = loop, 0
        self.heard = asyncio.Event()

    def rung(self, bell: Doorbell) -> None:
        assert asyncio.get_running_loop() is self.loop, "not called on the doorbell's loop"
        self.rings += 1
        self.heard.set()


def test_a_doorbell_rung_from_c_on_another_thread_calls_its_listeners_on_its_loop():
    """The driver's host function (C, in piece_copies.c) rings a loop's doorbell from its own
    thread: the loop calls what it was told to, on the loop, once per drained ring."""
    assert Doorbell.RING_FUNCTION, "the compiled ring function is missing"
    ring_from_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(Doorbell.RING_FUNCTION)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        bell = doorbell_of(loop)
        assert bell is not None and doorbell_of(loop) is bell
        listener = _Listener(loop)
        bell.tell(listener)
        for _ in range(3):
            listener.heard.clear()
            ringer = threading.Thread(target=ring_from_c, args=(bell.address,))
            ringer.start()
            await asyncio.wait_for(listener.heard.wait(), 10)
            ringer.join()
        return listener.rings

    assert asyncio.run(main()) == 3


def test_a_gone_loops_doorbell_goes_back_to_the_pool_open_and_a_late_ring_wakes_nobody_wrongly():
    """A ring may come after the loop that asked for it has gone: its eventfd is never closed (the
    number is never reused for another file), and the next loop takes it over."""

    async def bell_here() -> Doorbell:
        bell = doorbell_of(asyncio.get_running_loop())
        assert bell is not None
        return bell

    first = asyncio.run(bell_here())
    fd = first.address
    gc.collect()
    first.ring()  # late: its loop has gone
    os.fstat(fd)  # still open
    second = asyncio.run(bell_here())
    assert second is first, "the pooled doorbell was not taken again"
