"""Cancellation as documented: by the awaiting task, timeouts, Transfer.cancel(), before start, mid-transfer, shield."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvoffload
from conftest import check_every_visible_key, random_caches, same_bytes
from kvoffload._core.movers import CpuMover


class Gate:
    """Holds every chunk copy until the test lets it through."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)
        self.copied = 0

    def wrap(self, fn):
        def gated(mover, *args):
            self.entered.release()
            assert self.permits.acquire(timeout=20), "test never released the gate"
            out = fn(mover, *args)
            self.copied += 1
            return out

        return gated

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=20), "no chunk copy started"


@pytest.fixture
def gate(monkeypatch) -> Gate:
    g = Gate()
    monkeypatch.setattr(CpuMover, "to_host", g.wrap(CpuMover.to_host))
    monkeypatch.setattr(CpuMover, "to_device", g.wrap(CpuMover.to_device))
    return g


def one_block_chunks(caches) -> int:
    return kvoffload.BlockLayout.of(caches).slot_bytes


async def still_running(aw, seconds: float = 0.1) -> bool:
    done, _ = await asyncio.wait([aw], timeout=seconds)
    return not done


@pytest.mark.asyncio
async def test_cancel_awaiting_task_mid_store(gate):
    caches = random_caches(64, seed=11)
    orig = {n: t.clone() for n, t in caches.items()}
    blocks = {("s", i): i for i in range(10)}
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        transfer = off.store(blocks)

        async def waiter():
            return await transfer

        task = asyncio.create_task(waiter())
        gate.allow(3)  # three chunks land
        for _ in range(4):
            await asyncio.to_thread(gate.wait_entered)  # the fourth is now copying
        task.cancel()
        # CancelledError is held back while the fourth chunk is still being copied
        assert await still_running(task)
        gate.allow(100)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transfer.cancelled() and transfer.done()
        s = off.stats()
        assert s.pending == 0 and s.in_flight == 0 and s.cancelled == 1
        # the three chunks that landed are stored; the one being copied when the cancel came
        # may or may not be published (it is whole either way); none after it
        visible_n = off.lookup(list(blocks))
        assert visible_n in (3, 4)
        assert s.host_free == 16 - visible_n
        visible = await check_every_visible_key(off, caches, orig, blocks)
        assert len(visible) == visible_n
        # the offloader keeps working
        await off.store({("t", i): i for i in range(4)})
        assert off.lookup([("t", i) for i in range(4)]) == 4


@pytest.mark.asyncio
async def test_transfer_cancel_mid_load_stops_writing(gate):
    caches = random_caches(64, seed=12)
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        gate.allow(8)
        await off.store({i: i for i in range(8)})
        transfer = off.load({i: 20 + i for i in range(8)})
        gate.allow(2)
        for _ in range(3):
            await asyncio.to_thread(gate.wait_entered)
        assert transfer.cancel()
        assert not transfer.done()  # the third chunk is still being copied
        gate.allow(100)
        with pytest.raises(asyncio.CancelledError):
            await transfer
        copied = gate.copied
        after = {n: t.clone() for n, t in caches.items()}
        await asyncio.sleep(0.05)
        assert gate.copied == copied, "a cancelled load kept copying"
        for n in caches:
            assert same_bytes(caches[n], after[n]), "destination written after CancelledError"
        assert off.stats().pinned == 0
        assert not transfer.cancel()  # already finished


@pytest.mark.asyncio
async def test_cancel_before_start_runs_nothing(gate):
    caches = random_caches(64, seed=13)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        blocker = off.store({"first": 0})  # occupies the store loop until released
        await asyncio.to_thread(gate.wait_entered)
        t = off.store({"second": 1})
        assert t.cancel()
        gate.allow(100)
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await t
        assert gate.copied == 1  # only the blocker's chunk ran
        assert "second" not in off and off.stats().pending == 0 and off.stats().host_free == 15
        with pytest.raises(asyncio.CancelledError):
            t.result(1)


@pytest.mark.asyncio
async def test_wait_for_and_timeout_cancel_the_transfer(gate):
    caches = random_caches(64, seed=14)
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        t1 = off.store({("a", i): i for i in range(4)})
        threading.Timer(0.2, gate.allow).start()  # the first chunk resumes after the timeout fired
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(t1, timeout=0.05)
        assert t1.cancelled()
        t2 = off.store({("b", i): i for i in range(4)})
        threading.Timer(0.2, gate.allow).start()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await t2
        assert t2.done() and t2.cancelled()
        assert gate.copied == 2  # one chunk each: nothing was copied after the cancel
        assert off.stats().pending == 0 and off.stats().in_flight == 0


@pytest.mark.asyncio
async def test_shield_opts_out_of_cancellation(gate):
    caches = random_caches(64, seed=15)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        t = off.store({"a": 1, "b": 2})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(t), timeout=0.05)
        assert not t.done()
        gate.allow(100)
        r = await t
        assert r.keys == ("a", "b") and off.lookup(["a", "b"]) == 2


@pytest.mark.asyncio
async def test_close_cancels_in_flight_transfers(gate):
    caches = random_caches(64, seed=16)
    off = kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)).start()
    t = off.store({i: i for i in range(8)})
    await asyncio.to_thread(gate.wait_entered)
    threading.Timer(0.1, gate.allow, args=(100,)).start()
    await asyncio.to_thread(off.close)
    assert t.cancelled()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert not [th for th in threading.enumerate() if th.name.startswith("kvoffload")]


@pytest.mark.asyncio
async def test_random_cancellations_leave_a_consistent_store():
    caches = random_caches(256, seed=17)
    orig = {n: t.clone() for n, t in caches.items()}
    import random

    rng = random.Random(5)
    async with kvoffload.Offloader(caches, host_blocks=64, chunk_bytes=one_block_chunks(caches)) as off:
        keys = {}
        for round_ in range(20):
            blocks = {(round_, i): rng.randrange(256) for i in range(rng.randint(1, 12))}
            keys.update(blocks)
            t = off.store(blocks)
            await asyncio.sleep(rng.random() * 0.002)
            t.cancel()
            try:
                await t
            except asyncio.CancelledError:
                pass
        s = off.stats()
        assert s.pending == 0 and s.in_flight == 0 and s.pinned == 0
        assert s.host_free + s.ready == 64
        await check_every_visible_key(off, caches, orig, keys)
