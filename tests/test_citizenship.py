"""kvoffload as a citizen of its caller's process: it keeps no event loop alive that awaited a
transfer, a failed transfer's error does not grow (nor pin its callers' frames) each time it is
raised, cancel() never raises because the offloader is closing, a user's thread is never mistaken
for one of kvoffload's (whatever its name), tensor names are checked on every transfer, and a
transfer made before fork() fails at once in the child instead of hanging."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import traceback
import warnings
import weakref

import pytest

import kvoffload
from support.caches import random_caches
from support.process import open_fds

# -- event loops that awaited a transfer -------------------------------------------------------


def _load_awaiter(off: kvoffload.Offloader, loops: list[weakref.ref[asyncio.AbstractEventLoop]]):
    async def await_a_load(block: int) -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        t = off.load({"k": block})
        t.add_done_callback(lambda _: None)  # a callback registered on the loop, too
        await t

    return await_a_load


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_event_loops_that_awaited_transfers_are_freed_with_their_fds(make_offloader):
    """A sync wrapper that runs ``asyncio.run`` per request, or makes loops and drops them unclosed,
    must not keep one loop (and its selector's fds) alive per request."""
    off = make_offloader(random_caches(8, seed=90), host_blocks=8)
    off.store({"k": 0}).result(10)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
    await_a_load = _load_awaiter(off, loops)
    asyncio.run(await_a_load(1))  # the first run imports and caches what later runs reuse
    gc.collect()
    fds = open_fds()
    for i in range(50):
        asyncio.run(await_a_load(1 + i % 7))
    for i in range(20):
        loop = asyncio.new_event_loop()  # never closed: only collection frees its fds
        loop.run_until_complete(await_a_load(1 + i % 7))
        del loop
    off.load({"k": 1}).result(10)  # the load worker is past ending the last awaited load (it held that loop meanwhile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # "unclosed event loop", as asyncio warns
        gc.collect()
    alive = sum(ref() is not None for ref in loops)
    assert alive == 0, f"{alive} of {len(loops)} event loops that awaited a transfer are still alive"
    assert open_fds() == fds


# -- a failed transfer's error, raised again and again ------------------------------------------


def test_raising_a_failed_transfers_error_again_neither_grows_it_nor_pins_callers(make_offloader, faults):
    off = make_offloader(random_caches(8, seed=91), host_blocks=8)
    faults.fail(off, "to_host", OSError(5, "injected EIO"))
    t = off.store({"a": 0})

    class CallerState:  # something each caller's frame holds
        pass

    held: list[weakref.ref[CallerState]] = []

    def caller() -> int:
        state = CallerState()
        held.append(weakref.ref(state))
        try:
            t.result(10)
        except kvoffload.OffloadError as e:
            return len(traceback.extract_tb(e.__traceback__))
        raise AssertionError("the failed store did not raise")

    first = caller()
    for _ in range(199):
        last = caller()
    assert last == first, f"the traceback grew from {first} to {last} entries over 200 result() calls"
    gc.collect()
    pinned = sum(ref() is not None for ref in held)
    assert pinned <= 1, f"{pinned} callers' frames are kept alive by the transfer's error"
    assert isinstance(t.exception(), kvoffload.TransferError)


# -- cancel() racing close() ----------------------------------------------------------------------


def test_cancel_racing_close_does_not_raise(faults, monkeypatch):
    """``cancel()`` found the transfer running; before it reached the worker, ``close()`` stopped it.
    The cancel returns quietly: close() ended the transfer already."""
    caches = random_caches(16, seed=92)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    off = kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=slot).start()  # one block per chunk: a task
    try:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0, "b": 1, "c": 2})
        gate.wait_entered()
        job = t._job
        assert job is not None and job.task is not None, "the store did not run as a worker task"
        worker = job.worker
        cancel_on_worker = worker.cancel

        def close_then_cancel_on_worker(j) -> None:  # cancel() passed its check; close() gets in first
            gate.open()
            off.close()
            cancel_on_worker(j)

        monkeypatch.setattr(worker, "cancel", close_then_cancel_on_worker)
        t.cancel()  # must not raise
        assert t.done()
        with pytest.raises(kvoffload.TransferCancelled):
            t.result(10)
    finally:
        off.close()


# -- a user's thread named like one of ours ---------------------------------------------------------


def test_close_on_a_users_thread_named_kvoffload_closes_before_returning():
    before = set(threading.enumerate())
    off = kvoffload.Offloader(random_caches(8, seed=93), host_blocks=8).start()
    off.store({"a": 0}).result(10)
    assert set(threading.enumerate()) - before, "the offloader started no thread"
    still_running: list[str] = []

    def close_here() -> None:
        off.close()
        still_running.extend(t.name for t in set(threading.enumerate()) - before if t is not threading.current_thread())

    user = threading.Thread(target=close_here, name="kvoffload-user")
    user.start()
    user.join(30)
    assert not user.is_alive()
    assert still_running == [], f"close() returned with {still_running} still running"


# -- tensor names -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_name_that_is_no_tensor_of_the_caches_is_refused_by_every_transfer():
    caches = random_caches(8, seed=94)
    async with kvoffload.Offloader(caches, host_blocks=8) as off:
        transfers = [off.store({"a": 0, "b": 1})]
        await transfers[0]
        transfers += [off.store({"a": 0}), off.load({}), off.load({"a": 5})]  # all stored already; nothing; a load
        for t in transfers:
            await t
            with pytest.raises(ValueError, match="no tensor 'nope'"):
                t.tensor_done("nope")
            with pytest.raises(ValueError, match="no tensor 'nope'"):
                await t.wait_tensor("nope")
        t = off.load({"a": 6})
        for name in caches:  # a load knows its tensors
            await t.wait_tensor(name)
            assert t.tensor_done(name), name


@pytest.mark.asyncio
async def test_every_transfer_knows_the_caches_tensors():
    caches = random_caches(8, seed=95)
    async with kvoffload.Offloader(caches, host_blocks=8) as off:
        transfers = [off.store({"a": 0})]
        await transfers[0]
        transfers += [off.store({"a": 0}), off.load({}), off.load({"a": 5})]
        for t in transfers:
            await t
            for name in caches:
                await t.wait_tensor(name)
                assert t.tensor_done(name), name


# -- fork() -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_transfer_pending_at_fork_fails_at_once_in_the_child(make_offloader, faults):
    off = make_offloader(random_caches(8, seed=96), host_blocks=8)
    gate = faults.gate(off, "to_host")
    t = off.store({"a": 0})
    gate.wait_entered()
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "use of fork() may lead to deadlocks"
        pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        report = "child crashed"
        hung = threading.Timer(10, lambda: (os.write(write_end, b"the child hung"), os._exit(1)))  # fails, never hangs, the test
        hung.start()
        try:
            outcomes = []
            for how in ("result", "exception", "await", "add_done_callback"):
                try:
                    if how == "result":
                        t.result(2)
                    elif how == "exception":
                        t.exception(2)
                    elif how == "await":
                        asyncio.run(asyncio.wait_for(t, 2))
                    else:
                        t.add_done_callback(lambda _: None)
                    outcomes.append(f"{how}: returned")
                except kvoffload.ClosedError as e:
                    outcomes.append(f"{how}: ClosedError" if "fork" in str(e) else f"{how}: unclear {e}")
                except BaseException as e:
                    outcomes.append(f"{how}: {type(e).__name__}")
            outcomes.append(f"cancel: {t.cancel()}, done: {t.done()}")
            report = "; ".join(outcomes)
        finally:
            os.write(write_end, report.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        report = f.read()
    os.waitpid(pid, 0)
    expected = "result: ClosedError; exception: ClosedError; await: ClosedError; add_done_callback: ClosedError; cancel: False, done: False"
    assert report == expected
    gate.open()
    assert t.result(10).keys == ("a",)  # the parent's transfer went on
