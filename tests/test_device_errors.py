"""A copy that fails on the device (an asynchronous CUDA error such as an illegal address, which
only its completion event reports) fails its transfer with TransferError, the CUDA error as
``__cause__``: a store publishes none of the chunks that had not landed, a load gives its pins
back, slots go back, no waiter hangs, and later transfers work once the device does. So for every
path that learns a copy completed: the worker's bridge (both kinds), an awaiting task, a thread
in ``result()`` (asleep in the driver, or on an alarm for a load that can stop early), ``done()``,
the cancel path, and transfers run as tasks (the disk tier, spills).

Driven on the CPU: an offloader over CPU caches runs its GPU path (copies enqueued at call time,
completion through a bridge), each copy returning the real ``DriverEvent`` over a stand-in driver
(``standin_driver``) that the test completes, or fails with CUDA error 700, by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest
import torch

import kvoffload
from support.caches import block_bytes, random_caches
from support.standins import StandInDriver, StandInFlag
from support.waiting import HANG_S, spin_until

ILLEGAL_ADDRESS = StandInDriver.ILLEGAL_ADDRESS


class EventCopier:
    """Stands in for the CUDA copier of an offloader over CPU caches: copies as the CPU copier does,
    and returns a real ``DriverEvent`` (over the stand-in driver) per chunk. Each event completes at
    once with ``complete_at_once`` (0: success, else that CUDA error), or, if None, when the test says."""

    def __init__(self, real, driver: StandInDriver, *, cancel_flags: bool) -> None:
        self.real = real
        self.driver = driver
        self.chunk_blocks = real.chunk_blocks
        self.cancel_flags = cancel_flags
        self.complete_at_once: int | None = 0
        self.events: list = []
        self.flags: list[StandInFlag] = []

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: object) -> None:
        pass

    def take_cancel_flag(self) -> StandInFlag | None:
        if not self.cancel_flags:
            return None
        self.flags.append(StandInFlag(raise_lands_at_once=True))
        return self.flags[-1]

    def stops_on(self, flag: object):
        return contextlib.nullcontext()

    def ring_when_complete(self, event, alarm) -> None:
        self.driver.ring_when_complete(event, alarm)

    def to_host(self, block_ids, host, rows):
        self.real.to_host(block_ids, host, rows)
        return self._event()

    def to_device(self, host, rows, block_ids):
        self.real.to_device(host, rows, block_ids)
        return self._event()

    def _event(self):
        from kvoffload._core.cuda.driver import DriverEvent

        event = DriverEvent(0)
        self.events.append(event)
        if self.complete_at_once is not None:
            self.driver.complete(event, self.complete_at_once)
        return event

    def close(self) -> None:
        self.real.close()


class GpuPath:
    """``off`` (started, over CPU caches) made to take its GPU path: its store and load workers copy
    through :class:`EventCopier` and follow the events with a ``completion`` bridge."""

    def __init__(self, off: kvoffload.Offloader, driver: StandInDriver, completion: str) -> None:
        from kvoffload._core.cuda.events import make_bridge

        rt = off._running_runtime()
        storage = off._running_storage()
        self.store_worker, self.load_worker = rt.workers[0], rt.workers[1]
        for w in (self.store_worker, self.load_worker):
            w.copier = EventCopier(w.copier, driver, cancel_flags=w.kind == "load")
            w.bridge = make_bridge(completion, w.loop.loop, f"{w.loop.name}-events")  # closed with the offloader
        storage.layout = dataclasses.replace(storage.layout, device=torch.device("cuda", 0))  # enqueue at call time
        self.driver = driver

    @property
    def store_copier(self) -> EventCopier:
        return self.store_worker.copier

    @property
    def load_copier(self) -> EventCopier:
        return self.load_worker.copier

    def copier(self, kind: str) -> EventCopier:
        return self.store_copier if kind == "store" else self.load_copier

    def worker(self, kind: str):
        return self.store_worker if kind == "store" else self.load_worker


@contextlib.contextmanager
def held(worker):
    """Keep ``worker``'s thread busy (as a worker that cannot get the GIL): only a waiting thread can
    end its transfers meanwhile."""
    holding, release = threading.Event(), threading.Event()

    def block() -> None:
        holding.set()
        release.wait(HANG_S)

    worker.loop.mailbox.post(block)
    assert holding.wait(HANG_S)
    try:
        yield
    finally:
        release.set()


HOST_BLOCKS = 8
BLOCKS = 4  # two chunks of two blocks: a load of several chunks gets a cancel flag


def make_gpu_offloader(make_offloader, driver, completion: str = "poll", **opts):
    from kvoffload._core.base.layout import BlockLayout

    caches = random_caches(16, seed=3)
    slot = BlockLayout.of(caches).slot_bytes
    off = make_offloader(caches, **{"host_blocks": HOST_BLOCKS, "chunk_bytes": 2 * slot, **opts})
    return off, caches, GpuPath(off, driver, completion)


def start(off, kind: str):
    """The transfer under test: a store of keys 0..3, or a load of the stored keys 0..3 into blocks 8..11."""
    if kind == "store":
        return off.store({k: k for k in range(BLOCKS)})
    return off.load({k: 8 + k for k in range(BLOCKS)})


def prepare(off, gpu: GpuPath, kind: str) -> None:
    """A load needs its keys stored (their copies land at once); then the transfer's copies wait for the test."""
    if kind == "load":
        off.store({k: k for k in range(BLOCKS)}).result(HANG_S)
    gpu.copier(kind).complete_at_once = None


def fail_copies(gpu: GpuPath, kind: str) -> None:
    """The device faults: every copy of the transfer ends with CUDA error 700."""
    for event in gpu.copier(kind).events:
        gpu.driver.complete(event, ILLEGAL_ADDRESS)


def check_failed_and_leaked_nothing(off, caches, gpu: GpuPath, kind: str, t) -> None:
    """``t`` failed with TransferError (the CUDA error as cause), nothing of it is left, and the
    offloader works as before once the device does."""
    from kvoffload._core.cuda.driver import CudaError

    assert t.done() and not t.cancelled()
    err = t.exception(0)
    assert isinstance(err, kvoffload.TransferError), repr(err)
    assert isinstance(err.__cause__, CudaError) and err.__cause__.code == ILLEGAL_ADDRESS, repr(err.__cause__)
    with pytest.raises(kvoffload.TransferError):
        t.result(0)
    s = off.stats()
    assert (s.failed, s.pending, s.pinned, s.in_flight) == (1, 0, 0, 0), s
    if kind == "store":
        assert not any(k in off for k in range(BLOCKS)), "a key of the failed store was published"
        assert s.host_free == HOST_BLOCKS, s
        assert s.bytes_stored == 0, s
    else:
        assert all(k in off for k in range(BLOCKS)) and s.host_free == HOST_BLOCKS - BLOCKS, s
        assert all(f.released.is_set() for f in gpu.load_copier.flags), "the load's cancel flag was not given back"
    # the device works again: a store and a load round trip
    gpu.store_copier.complete_at_once = gpu.load_copier.complete_at_once = 0
    want = {k: block_bytes(caches, k) for k in range(BLOCKS)}
    off.store({k: k for k in range(BLOCKS)}).result(HANG_S)
    for t_ in caches.values():
        t_[8:].zero_()
    off.load({k: 8 + k for k in range(BLOCKS)}).result(HANG_S)
    assert all(block_bytes(caches, 8 + k) == want[k] for k in range(BLOCKS))
    s = off.stats()
    assert (s.pending, s.pinned, s.in_flight) == (0, 0, 0), s


KINDS = ["store", "load"]
COMPLETIONS = ["poll", "thread"]


@pytest.mark.parametrize("completion", COMPLETIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_failing_on_the_device_fails_the_transfer_through_the_workers_bridge(make_offloader, standin_driver, kind, completion):
    """Nobody waits in a thread: the worker's bridge learns that the copies failed, and ends the transfer."""
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver, completion)
    prepare(off, gpu, kind)
    t = start(off, kind)
    ended = threading.Event()
    t.add_done_callback(lambda _: ended.set())  # registered on a plain thread: runs where the transfer ends
    fail_copies(gpu, kind)
    assert ended.wait(HANG_S), "the transfer never ended"
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


@pytest.mark.parametrize("completion", COMPLETIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_awaited_transfer_whose_copy_fails_on_the_device_raises_transfer_error(make_offloader, standin_driver, kind, completion):
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver, completion)
    prepare(off, gpu, kind)

    async def run():
        t = start(off, kind)
        waiting = asyncio.ensure_future(asyncio.wait_for(t, HANG_S))
        while not t._callbacks:  # until the task waits: the failure then reaches it through the worker
            await asyncio.sleep(0)
        fail_copies(gpu, kind)
        with pytest.raises(kvoffload.TransferError):
            await waiting
        return t

    check_failed_and_leaked_nothing(off, caches, gpu, kind, asyncio.run(run()))


@pytest.mark.parametrize("kind", KINDS)
def test_result_asleep_until_the_copies_land_learns_that_they_failed(make_offloader, standin_driver, kind):
    """The worker is held: ``result()`` ends the transfer itself. A store sleeps in the driver on its last
    copy's event; a load of several chunks (a cancel flag) sleeps on an alarm the last copy rings."""
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)
    asleep = standin_driver.synchronizing if kind == "store" else standin_driver.alarmed
    t = start(off, kind)
    if kind == "load":
        assert gpu.load_copier.flags, "the load has no cancel flag: the alarm path is not exercised"
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            t.result()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    with held(gpu.worker(kind)):
        waiter = threading.Thread(target=wait)
        waiter.start()
        assert asleep.wait(HANG_S), "result() did not sleep until the copies land"
        fail_copies(gpu, kind)
        waiter.join(HANG_S)
        assert not waiter.is_alive(), "result() hangs"
        assert len(outcome) == 1 and isinstance(outcome[0], kvoffload.TransferError), outcome
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


@pytest.mark.parametrize("kind", KINDS)
def test_done_notices_a_failed_copy_without_the_worker(make_offloader, standin_driver, kind):
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)
    t = start(off, kind)
    with held(gpu.worker(kind)):
        assert not t.done()
        fail_copies(gpu, kind)
        assert t.done()  # ended here, in the asking thread
        assert isinstance(t.exception(0), kvoffload.TransferError)
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


def test_a_store_keeps_the_chunks_that_landed_before_its_copy_failed(make_offloader, standin_driver):
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    gpu.store_copier.complete_at_once = None
    t = off.store({k: k for k in range(BLOCKS)})
    first, second = gpu.store_copier.events
    t.add_done_callback(lambda _: None)  # somebody waits: the bridge follows the copies closely
    standin_driver.complete(first)
    spin_until(lambda: 0 in off and 1 in off, what="the first chunk published")
    standin_driver.complete(second, ILLEGAL_ADDRESS)
    assert isinstance(t.exception(HANG_S), kvoffload.TransferError)
    assert 0 in off and 1 in off and 2 not in off and 3 not in off
    s = off.stats()
    assert s.failed == 1 and s.host_free == HOST_BLOCKS - 2 and s.pending == 0, s
    assert s.bytes_stored_partially == 2 * off.layout.block_bytes, s


def test_a_cancelled_load_whose_copies_fail_ends_and_gives_its_pins_back(make_offloader, standin_driver):
    """The cancel path asks the load's copies whether they completed: a failed one ends it (cancelled:
    the cancel came first), once nothing more is written; no waiter hangs."""
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, "load")
    t = start(off, "load")
    assert t.cancel()
    fail_copies(gpu, "load")
    with pytest.raises(kvoffload.TransferCancelled):
        t.result(HANG_S)
    s = off.stats()
    assert (s.pinned, s.in_flight, s.cancelled) == (0, 0, 1), s
    assert all(f.released.is_set() for f in gpu.load_copier.flags)


# where a transfer runs as a task on its worker -> (offloader options, what to run)
TASKS = {
    "disk store": (dict(host_blocks=0, disk_blocks=8), "store"),
    "spilling store": (dict(host_blocks=2, disk_blocks=8), "store"),
    "disk load": (dict(host_blocks=0, disk_blocks=8), "load"),
}


@pytest.mark.parametrize("completion", COMPLETIONS)
@pytest.mark.parametrize("site", list(TASKS))
def test_a_transfer_run_as_a_task_fails_when_its_copy_fails_on_the_device(make_offloader, standin_driver, tmp_path, site, completion):
    opts, kind = TASKS[site]
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver, completion, disk_path=tmp_path / "kv", **opts)
    if site == "spilling store":
        off.store({"a": 12, "b": 13}).result(HANG_S)  # the host tier is full: the next store spills
        keys = {"c": 14}
    else:
        keys = {k: k for k in range(BLOCKS)}
        if kind == "load":
            off.store(keys).result(HANG_S)
    before = off.stats()
    gpu.copier(kind).complete_at_once = ILLEGAL_ADDRESS  # the device has faulted
    t = off.store(keys) if kind == "store" else off.load({k: 8 + i for i, k in enumerate(keys)})
    with pytest.raises(kvoffload.TransferError) as ei:
        t.result(HANG_S)
    assert getattr(ei.value.__cause__, "code", None) == ILLEGAL_ADDRESS, repr(ei.value.__cause__)
    s = off.stats()
    assert (s.failed, s.pending, s.pinned, s.spilling, s.in_flight) == (1, 0, 0, 0, 0), s
    if kind == "store":
        assert not any(k in off for k in keys), "a key of the failed store was published"
        assert s.host_free + s.disk_free == before.host_free + before.disk_free, s
    else:
        assert all(k in off for k in keys)
    gpu.copier(kind).complete_at_once = 0
    want = {k: block_bytes(caches, b) for k, b in keys.items()}
    off.store(keys).result(HANG_S)
    for t_ in caches.values():
        t_[8:12].zero_()
    off.load({k: 8 + i for i, k in enumerate(keys)}).result(HANG_S)
    assert all(block_bytes(caches, 8 + i) == want[k] for i, k in enumerate(keys))
