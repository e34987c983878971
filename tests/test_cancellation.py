"""Cancellation as documented: by the awaiting task, timeouts, Transfer.cancel(), before start, mid-transfer, shield."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvoffload
from kvoffload._core.workers.job import Job
from support.caches import check_every_visible_key, random_caches, same_bytes
from support.interrupts import NotingCancel
from support.standins import StandInCopier, StandInEvent, StandInFlag


def one_block_chunks(caches) -> int:
    return kvoffload.BlockLayout.of(caches).slot_bytes


@pytest.mark.asyncio
async def test_cancel_awaiting_task_mid_store(faults):
    caches = random_caches(64, seed=11)
    orig = {n: t.clone() for n, t in caches.items()}
    blocks = {("s", i): i for i in range(10)}
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        gate = faults.gate(off, "to_host")
        transfer = off.store(blocks)
        told = asyncio.Event()
        in_flight_at_end = []
        transfer.add_done_callback(lambda _: in_flight_at_end.append(gate.in_flight))

        async def waiter():
            return await NotingCancel(transfer, told.set)

        task = asyncio.create_task(waiter())
        gate.allow(3)  # three chunks land
        await gate.entered_async(count=4)  # the fourth is now copying
        task.cancel()
        await asyncio.wait_for(told.wait(), 10)  # the transfer has been told to stop
        # CancelledError is held back while the fourth chunk is still being copied
        assert not task.done() and not transfer.done()
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert in_flight_at_end == [0], "the transfer ended while one of its copies was still running"
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
async def test_transfer_cancel_mid_load_stops_writing(faults):
    caches = random_caches(64, seed=12)
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        await off.store({i: i for i in range(8)})
        gate = faults.gate(off, "to_device")
        transfer = off.load({i: 20 + i for i in range(8)})
        gate.allow(2)
        await gate.entered_async(count=3)
        assert transfer.cancel()
        assert not transfer.done()  # the third chunk is still being copied
        gate.open()
        with pytest.raises(kvoffload.TransferCancelled):  # cancelled by t.cancel(), not by the awaiting task
            await transfer
        assert gate.in_flight == 0, "TransferCancelled arrived while a copy was still running"
        copied = len(gate.calls)
        after = {n: t.clone() for n, t in caches.items()}
        # a later load through the same worker loop: anything the cancelled one left queued would run first
        await off.load({0: 40})
        assert [list(c[3]) for c in gate.calls[copied:]] == [[40]], f"a cancelled load kept copying: {gate.calls[copied:]}"
        for n in caches:
            after[n][40] = caches[n][40]
            assert same_bytes(caches[n], after[n]), "destination written after TransferCancelled"
        assert off.stats().pinned == 0
        assert not transfer.cancel()  # already finished


@pytest.mark.asyncio
async def test_cancel_before_start_runs_nothing(faults):
    caches = random_caches(64, seed=13)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        blocker = off.store({"first": 0})  # occupies the store loop until released
        await gate.entered_async()
        t = off.store({"second": 1})
        assert t.cancel()
        gate.open()
        await blocker
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        assert gate.passed == 1  # only the blocker's chunk ran
        assert "second" not in off and off.stats().pending == 0 and off.stats().host_free == 15
        with pytest.raises(kvoffload.TransferCancelled):
            t.result(1)
        assert t.cancelled()


@pytest.mark.asyncio
async def test_wait_for_and_timeout_cancel_the_transfer(faults):
    caches = random_caches(64, seed=14)
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)) as off:
        # the first chunk's copy is held until the timeout has fired and the transfer was told to stop
        gate = faults.gate(off, "to_host")
        t1 = off.store({("a", i): i for i in range(4)})
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(NotingCancel(t1, lambda: gate.allow(1)), timeout=0.05)
        assert t1.cancelled()
        t2 = off.store({("b", i): i for i in range(4)})
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await NotingCancel(t2, lambda: gate.allow(1))
        assert t2.done() and t2.cancelled()
        assert gate.entered == gate.passed == 2  # one chunk each: nothing was copied after the cancel
        assert off.stats().pending == 0 and off.stats().in_flight == 0


@pytest.mark.asyncio
async def test_shield_opts_out_of_cancellation(faults):
    caches = random_caches(64, seed=15)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 1, "b": 2})
        await gate.entered_async()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(t), timeout=0.05)
        assert not t.done()
        gate.open()
        r = await t
        assert r.keys == ("a", "b") and off.lookup(["a", "b"]) == 2


@pytest.mark.asyncio
async def test_close_cancels_in_flight_transfers(faults):
    caches = random_caches(64, seed=16)
    off = kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=one_block_chunks(caches)).start()
    gate = faults.gate(off, "to_host")
    t = off.store({i: i for i in range(8)})
    await gate.entered_async()
    # close() while the copy is held: the worker cannot stop in 0 s, so close() raises CloseError once
    # it has asked the worker to stop; then the copy goes on and the second close() finishes the job
    with pytest.raises(kvoffload.CloseError):
        await asyncio.to_thread(off.close, 0)
    assert not t.done()
    gate.open()
    await asyncio.to_thread(off.close)
    assert t.cancelled()
    with pytest.raises(kvoffload.TransferCancelled):  # close() cancelled it, not the awaiting task
        await t
    assert not [th for th in threading.enumerate() if th.name.startswith("kvoffload")]


# -- loads enqueued whole that stop on a cancel flag (the GPU path), driven by a fake copier ----------


class _Steps(Job):
    """A load's job that counts its cleanups."""

    def __init__(self) -> None:
        super().__init__("load")
        self.cleanups = 0

    def result(self):
        return kvoffload.TransferResult("load", (), (), 0, 0.0)

    def cleanup(self) -> None:
        self.cleanups += 1


class _RingCountingCopier(StandInCopier):
    """Counts the rings the landing watcher asks for."""

    def __init__(self, flag: StandInFlag) -> None:
        super().__init__(flag)
        self.rings = 0

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        self.rings += 1
        super().ring_when_complete(event, alarm, in_order, for_thread)


def _worker_with_flag(flag: StandInFlag):
    """A GPU load worker over a stand-in copier, running a load of three chunks enqueued at call time."""
    import torch

    from kvoffload._core.workers.copy_submission import CopyCalls, CopyRequest
    from kvoffload._core.workers.copy_worker import CopyWorker

    copier = _RingCountingCopier(flag)
    worker = CopyWorker("load", "kvoffload-test-load", copier, CopyCalls(), gpu=True)
    host = torch.zeros((12, 16), dtype=torch.uint8)
    requests = [CopyRequest(False, host, [4 * c + i for i in range(4)], [4 * c + i for i in range(4)]) for c in range(3)]
    job = _Steps()
    worker.start(job, None, requests)
    return worker, copier, job, job.transfer


@pytest.mark.parametrize("raise_lands_at_once", [True, False], ids=["raised at once", "raise lands later"])
def test_a_load_enqueued_whole_ends_once_the_chunk_running_at_the_cancel_completes(monkeypatch, raise_lands_at_once):
    """A load of three chunks, enqueued whole with a cancel flag, cancelled while chunk 1 copies: the
    flag is raised, and the load ends cancelled when the first chunk not complete once the raise has
    landed completes (chunk 1, or chunk 2 if chunk 1 completed before the raise landed), not after
    the last chunk; the flag goes back only once the last chunk, which reads it, has completed, and
    meanwhile the landing watcher waits for one ring for that chunk (it does not ask again and again
    for the chunk the load ended with)."""
    from kvoffload._core.base.cross_thread import WakeSemaphore
    from kvoffload._core.workers import landings

    # it looks when rung (a semaphore of its own: none of the pool's stale rings), and every look asks for a ring
    monkeypatch.setattr(landings, "take_wake_semaphore", WakeSemaphore)
    monkeypatch.setattr(landings.LandingWatcher, "RECHECK_S", 60.0)
    flag = StandInFlag(raise_lands_at_once)
    worker, copier, steps, transfer = _worker_with_flag(flag)
    try:
        assert copier.flagged_chunks == 3, "the chunks were not enqueued reading the cancel flag"
        copier.events[0].complete()
        transfer.cancel()
        assert flag.raised is not None
        if raise_lands_at_once:
            running = copier.events[1]
        else:  # chunk 1 completes before the raise lands: chunk 2 may have started unflagged
            copier.events[1].complete()
            with pytest.raises(TimeoutError):
                transfer.result(timeout=0.05)
            flag.raised.complete()
            running = copier.events[2]
        with pytest.raises(TimeoutError):  # still copying
            transfer.result(timeout=0.05)
        running.complete()
        with pytest.raises(kvoffload.TransferCancelled):
            transfer.result(timeout=10)
        assert steps.cleanups == 1
        if running is not copier.events[-1]:
            rings = copier.rings
            assert not flag.released.wait(0.05), "the flag went back while a chunk reading it was queued"
            assert copier.rings - rings <= 1, f"the watcher asked for {copier.rings - rings} rings while the cancelled load's last chunk ran"
            copier.events[-1].complete()
        assert flag.released.wait(10)
    finally:
        for e in copier.events:
            e.complete()
        worker.stop(5)
        worker.close()


class _Words:
    """Stands in for the flags' device memory: records each write, returns a completed event."""

    base = 0x1000

    def __init__(self) -> None:
        self.writes: list[tuple[int, int]] = []
        self.closed = False

    def write(self, address: int, value: int) -> StandInEvent:
        assert not self.closed, "a raise wrote the flags' memory after it was freed"
        self.writes.append((address, value))
        return StandInEvent(done=True)

    def close(self) -> None:
        self.closed = True


def test_cancel_flags_are_reused_with_new_generations_and_never_written_after_close():
    """A flag taken again gets a new generation (a late raise for its previous user is ignored by the
    new user's kernels); releasing twice never frees a slot another transfer took; when all are
    taken there is none (the load is then cancelled the slow way); after close, raising writes nothing
    and none is handed out."""
    import torch

    from kvoffload._core.cuda.cancel_flags import CancelFlags

    words = _Words()
    pool = CancelFlags(torch.device("cuda", 0), count=2, words=words)  # type: ignore[arg-type]
    a, b = pool.take(), pool.take()
    assert a is not None and b is not None and pool.take() is None
    assert {a.address, b.address} == {0x1000, 0x1004}
    a.raise_flag()
    assert words.writes == [(a.address, a.generation)] and a.raised is not None and a.raised.query()
    a.release()
    a.release()  # idempotent
    again = pool.take()
    assert again is not None and again.address == a.address and again.generation != a.generation
    assert pool.take() is None, "a second release freed the slot twice"
    b.release()
    pool.close()  # a flag still held (again) is raised only after the pool closed
    again.raise_flag()
    assert again.raised is None and len(words.writes) == 1 and pool.take() is None
