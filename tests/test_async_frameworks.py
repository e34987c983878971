"""Transfer with asyncio's combinators, under trio and under anyio on both backends.

Each asyncio combinator a user reaches for is driven with a real transfer; where a copy must still
be running when the combinator acts (a timeout, a shield), a gate on the copy holds it. The trio and
anyio tests run on both backends through anyio's pytest plugin, as anyio's own tests do.
"""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

import kvoffload
from support.caches import random_caches, same_bytes
from support.interrupts import NotingCancel


def snapshot(caches):
    return {n: t.clone() for n, t in caches.items()}


# -- asyncio combinators ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_asyncio_wait_and_as_completed_see_transfers_end():
    caches = random_caches(16, seed=31)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        t1, t2 = off.store({"a": 0}), off.store({"b": 1})
        done, pending = await asyncio.wait({t1, t2}, timeout=30)
        assert done == {t1, t2} and not pending
        t3, t4 = off.store({"c": 2}), off.store({"d": 3})
        first, rest = await asyncio.wait({t3, t4}, return_when=asyncio.FIRST_COMPLETED, timeout=30)
        assert first and first | rest == {t3, t4}
        if rest:
            await asyncio.wait(rest, timeout=30)
        results = [await f for f in asyncio.as_completed([off.load({"a": 8}), off.load({"b": 9})], timeout=30)]
        assert sorted(r.keys for r in results) == [("a",), ("b",)]
    for n in caches:
        assert same_bytes(caches[n][8:10], caches[n][0:2])


@pytest.mark.asyncio
async def test_asyncio_wait_first_completed_with_one_transfer_held(faults):
    caches = random_caches(16, seed=32)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        await off.store({"a": 0})
        gate = faults.gate(off, "to_host")
        held = off.store({"b": 1})
        await gate.entered_async()
        quick = off.load({"a": 5})  # the load worker is free
        done, pending = await asyncio.wait({held, quick}, return_when=asyncio.FIRST_COMPLETED, timeout=30)
        assert done == {quick} and pending == {held}
        gate.open()
        assert (await held).keys == ("b",)


@pytest.mark.asyncio
async def test_gather_ensure_future_and_task_group():
    caches = random_caches(16, seed=33)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        r1, r2 = await asyncio.gather(off.store({"a": 0}), off.store({"b": 1}))
        assert (r1.keys, r2.keys) == (("a",), ("b",))
        fut = asyncio.ensure_future(off.load({"a": 10}))
        assert (await fut).keys == ("a",)

        async def load(key, block):
            return await off.load({key: block})

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(load("a", 11)), tg.create_task(load("b", 12))]
        assert [t.result().keys for t in tasks] == [("a",), ("b",)]
    for n in caches:
        assert same_bytes(caches[n][10], orig[n][0]) and same_bytes(caches[n][11], orig[n][0])
        assert same_bytes(caches[n][12], orig[n][1])


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["wait_for", "timeout"])
async def test_a_timeout_cancels_the_transfer_and_raises_timeout_error(faults, how):
    caches = random_caches(16, seed=34)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await gate.entered_async()
        held = NotingCancel(t, gate.open)  # awaits t; the held copy ends once the timeout reached t
        with pytest.raises(TimeoutError):
            if how == "wait_for":
                await asyncio.wait_for(held, 0.01)
            else:
                async with asyncio.timeout(0.01):
                    await held
        assert t.done() and gate.in_flight == 0, "the timeout was raised while the copy still ran"
        assert t.cancelled() and "a" not in off
        assert off.stats().cancelled == 1


@pytest.mark.asyncio
async def test_shield_lets_the_transfer_finish(faults):
    caches = random_caches(16, seed=35)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await gate.entered_async()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(t), 0.01)
        gate.open()
        assert (await t).keys == ("a",) and not t.cancelled() and "a" in off


@pytest.mark.asyncio
async def test_a_transfer_cancelled_by_someone_else_raises_transfer_cancelled_not_cancelled_error(faults):
    caches = random_caches(16, seed=36)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await gate.entered_async()
        t.cancel()
        gate.open()
        async with asyncio.timeout(30):  # a CancelledError here would escape the timeout as is
            with pytest.raises(kvoffload.TransferCancelled):
                await t
        assert t.cancelled()
        with pytest.raises(kvoffload.TransferCancelled):
            t.result()
        with pytest.raises(kvoffload.TransferCancelled):
            t.exception()
        assert isinstance(kvoffload.TransferCancelled(), kvoffload.OffloadError)
        assert asyncio.current_task().cancelling() == 0  # nobody cancelled this task


@pytest.mark.asyncio
async def test_done_callbacks_run_on_the_loop_that_registered_them(faults):
    caches = random_caches(16, seed=37)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await gate.entered_async()
        here = threading.current_thread()
        seen: dict[str, threading.Thread] = {}
        ran = asyncio.Event()

        def on_loop(tr):
            seen["loop"] = threading.current_thread()
            ran.set()

        def removed(tr):
            seen["removed"] = threading.current_thread()

        registered_in_thread = threading.Event()

        def from_plain_thread():
            t.add_done_callback(lambda tr: seen.setdefault("thread", threading.current_thread()))
            registered_in_thread.set()

        t.add_done_callback(on_loop)
        t.add_done_callback(lambda tr: seen.setdefault("ending", threading.current_thread()), on_ending_thread=True)
        t.add_done_callback(removed)
        t.add_done_callback(removed)
        assert t.remove_done_callback(removed) == 2 and t.remove_done_callback(removed) == 0
        threading.Thread(target=from_plain_thread).start()
        registered_in_thread.wait(10)
        gate.open()
        await t
        await asyncio.wait_for(ran.wait(), 10)
        assert seen["loop"] is here and "removed" not in seen
        assert seen["thread"].name.startswith("kvoffload"), seen["thread"].name  # where the transfer ended
        assert seen["ending"] is seen["thread"]  # registered on the loop, but asked to run where it ends
        # registered after the end: on the loop, soon (as asyncio's futures do), not inline
        late: list[threading.Thread] = []
        late_ran = asyncio.Event()
        t.add_done_callback(lambda tr: (late.append(threading.current_thread()), late_ran.set()))
        assert late == []
        await asyncio.wait_for(late_ran.wait(), 10)
        assert late == [here]


def test_a_callback_whose_loop_closed_runs_where_the_transfer_ends(faults):
    caches = random_caches(16, seed=38)
    with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        gate.wait_entered()
        where = []
        ran = threading.Event()

        async def register():
            t.add_done_callback(lambda tr: (where.append(threading.current_thread().name), ran.set()))

        asyncio.run(register())  # that loop is closed when the transfer ends
        gate.open()
        t.result(10)
        assert ran.wait(10) and where[0].startswith("kvoffload"), where


# -- trio and anyio -----------------------------------------------------------------------------


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_await_under_each_backend_round_trips(anyio_backend):
    caches = random_caches(32, seed=40)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=32) as off:
        r = await off.store({i: i for i in range(16)})
        assert len(r.keys) == 16
        async def load(blocks):
            await off.load(blocks)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(load, {i: 16 + i})
        await off.load({i: 16 + i for i in range(4, 16)})
    for n in caches:
        assert same_bytes(caches[n][16:32], orig[n][0:16])


@pytest.mark.anyio
@pytest.mark.parametrize("scope", ["move_on_after", "fail_after", "cancel"])
async def test_a_cancel_scope_cancels_the_transfer_without_spinning(anyio_backend, faults, scope):
    """The scope's cancellation stops the transfer; while its held copy finishes, the waiting thread
    sleeps (anyio re-delivers cancellation at every await: a waiter that woke each time would spin)."""
    caches = random_caches(16, seed=41)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await anyio.to_thread.run_sync(gate.wait_entered)
        hold_s = 0.3
        cpu = []

        async def wait_in_scope():
            c0 = time.thread_time()
            try:
                if scope == "move_on_after":
                    with anyio.move_on_after(0.01):
                        await t
                elif scope == "fail_after":
                    with pytest.raises(TimeoutError):
                        with anyio.fail_after(0.01):
                            await t
                else:
                    with anyio.CancelScope() as cs:
                        cs.cancel()
                        await t
            finally:
                cpu.append(time.thread_time() - c0)

        threading.Timer(hold_s, gate.open).start()
        t0 = time.monotonic()
        await wait_in_scope()
        assert time.monotonic() - t0 >= hold_s * 0.9, "the scope ended while the copy was still held"
        assert t.cancelled() and "a" not in off and gate.in_flight == 0
        assert cpu[0] < 0.005, f"the waiting thread used {cpu[0] * 1e3:.0f} ms of CPU in {hold_s * 1e3:.0f} ms: it spun"


@pytest.mark.anyio
async def test_transfer_cancelled_elsewhere_is_an_offload_error_under_each_backend(anyio_backend, faults):
    caches = random_caches(16, seed=42)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0})
        await anyio.to_thread.run_sync(gate.wait_entered)
        t.cancel()
        gate.open()
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        assert t.cancelled()
        assert (await off.store({"b": 1})).keys == ("b",)  # the offloader goes on


def test_trio_run_directly():
    trio = pytest.importorskip("trio")
    caches = random_caches(8, seed=43)
    orig = snapshot(caches)

    async def main():
        async with kvoffload.Offloader(caches, host_blocks=8) as off:
            await off.store({"k": 1})
            await off.load({"k": 2})
            return off

    off = trio.run(main)
    assert off.closed
    for n in caches:
        assert same_bytes(caches[n][2], orig[n][1])


def test_trio_guest_mode_on_an_asyncio_loop():
    """Trio in guest mode runs its tasks in the thread of an asyncio loop: its tasks wait for transfers
    (and start and close an offloader) trio's way, while the host loop's asyncio tasks keep asyncio's."""
    trio = pytest.importorskip("trio")
    caches, own_caches = random_caches(16, seed=44), random_caches(8, seed=45)
    orig = snapshot(caches)

    async def trio_main(off):
        async with kvoffload.Offloader(own_caches, host_blocks=8) as own:
            assert (await own.store({"x": 0})).keys == ("x",)
        assert own.closed
        await off.store({"t": 1})
        return (await off.load({"t": 9})).keys

    async def host():
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        outcome = []
        async with kvoffload.Offloader(caches, host_blocks=16) as off:
            trio.lowlevel.start_guest_run(
                trio_main, off, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon, done_callback=lambda o: (outcome.append(o), ended.set()),
            )
            for i in range(4):  # asyncio tasks of the host loop, while the trio run awaits transfers
                await off.store({i: 2 + i})
                await off.load({i: 10 + i})
            await asyncio.wait_for(ended.wait(), 30)
        return outcome[0].unwrap()

    assert asyncio.run(host()) == ("t",)
    for n in caches:
        assert same_bytes(caches[n][9], orig[n][1])
        assert same_bytes(caches[n][10:14], orig[n][2:6])
