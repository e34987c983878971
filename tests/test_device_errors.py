"""A copy that fails on the device (an asynchronous CUDA error such as an illegal address, which
only its completion event reports) fails its transfer with TransferError, the CUDA error as
``__cause__``: a store publishes none of the chunks that had not landed, a load gives its pins
back, slots go back, no waiter hangs, and later transfers work once the device does. So for every
path that learns a copy completed: the worker's landing watcher (the one mechanism that follows
copies, rung by the driver), an awaiting task, a thread blocked in ``result()``, ``done()`` (which
ends the transfer itself on finding its copies settled), the cancel path, and transfers run as tasks
(the disk tier, spills).

Driven on the CPU: an offloader over CPU caches takes its GPU path (``kvoffload._testing.take_gpu_path``:
copies enqueued at call time, followed by a landing watcher), each copy returning the real
``DriverEvent`` over a stand-in driver (``standin_driver``) that the test completes, or fails with
CUDA error 700, by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

import kvoffload
import kvoffload._testing
from support.caches import block_bytes, random_caches
from support.standins import StandInDriver, StandInFlag
from support.waiting import blocked, HANG_S, spin_until

ILLEGAL_ADDRESS = StandInDriver.ILLEGAL_ADDRESS


class EventCopier:
    """Stands in for the CUDA copier of an offloader over CPU caches: copies as the CPU copier does,
    and returns a real ``DriverEvent`` (over the stand-in driver) per chunk. Each event completes at
    once with ``complete_at_once`` (0: success, else that CUDA error), or, if None, when the test says.
    After :meth:`hold_rings`, the rings the landing watcher asks for wait until :meth:`let_rings_through`."""

    def __init__(self, real, driver: StandInDriver, *, cancel_flags: bool) -> None:
        self.real = real
        self.driver = driver
        self.chunk_blocks = real.chunk_blocks
        self.cancel_flags = cancel_flags
        self.complete_at_once: int | None = 0
        self.events: list = []
        self.flags: list[StandInFlag] = []
        self._rings_lock = threading.Lock()
        self._held_rings: list | None = None

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

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        with self._rings_lock:
            if self._held_rings is not None:
                self._held_rings.append((event, alarm))
                return
        self.driver.ring_when_complete(event, alarm)

    def hold_rings(self) -> None:
        with self._rings_lock:
            if self._held_rings is None:
                self._held_rings = []

    def let_rings_through(self) -> None:
        with self._rings_lock:
            held, self._held_rings = self._held_rings or [], None
        for event, alarm in held:
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
    through :class:`EventCopier`, their copies followed by a landing watcher."""

    def __init__(self, off: kvoffload.Offloader, driver: StandInDriver) -> None:
        made: dict[str, EventCopier] = {}

        def wrap(kind: str, copier) -> EventCopier:
            assert kind not in made, "one worker per direction"
            made[kind] = EventCopier(copier, driver, cancel_flags=kind == "load")
            return made[kind]

        kvoffload._testing.take_gpu_path(off, wrap)
        rt = off._running_runtime()
        self.store_worker, self.load_worker = rt.workers[0], rt.workers[1]
        self.store_copier, self.load_copier = made["store"], made["load"]
        self.driver = driver

    def copier(self, kind: str) -> EventCopier:
        return self.store_copier if kind == "store" else self.load_copier

    def worker(self, kind: str):
        return self.store_worker if kind == "store" else self.load_worker


@contextlib.contextmanager
def held(worker):
    """Keep ``worker``'s loop thread busy (as a worker that cannot get the GIL): only its landing
    watcher or a waiting thread can end its transfers meanwhile."""
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


def make_gpu_offloader(make_offloader, driver, **opts):
    from kvoffload._core.base.layout import BlockLayout

    caches = random_caches(16, seed=3)
    slot = BlockLayout.of(caches).slot_bytes
    off = make_offloader(caches, **{"host_blocks": HOST_BLOCKS, "chunk_bytes": 2 * slot, **opts})
    return off, caches, GpuPath(off, driver)


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


@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_failing_on_the_device_fails_the_transfer_through_the_landing_watcher(make_offloader, standin_driver, kind):
    """Nobody waits in a thread: the worker's landing watcher, rung by the driver, learns that the
    copies failed, and ends the transfer."""
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)
    t = start(off, kind)
    ended = threading.Event()
    t.add_done_callback(lambda _: ended.set())  # registered on a plain thread: runs where the transfer ends
    fail_copies(gpu, kind)
    assert ended.wait(HANG_S), "the transfer never ended"
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


@pytest.mark.parametrize("kind", KINDS)
def test_an_awaited_transfer_whose_copy_fails_on_the_device_raises_transfer_error(make_offloader, standin_driver, kind):
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)

    async def run():
        t = start(off, kind)
        waiting = asyncio.ensure_future(asyncio.wait_for(t, HANG_S))
        while not t._callbacks:  # until the task waits: the failure then reaches it through the landing watcher
            await asyncio.sleep(0)
        fail_copies(gpu, kind)
        with pytest.raises(kvoffload.TransferError):
            await waiting
        return t

    check_failed_and_leaked_nothing(off, caches, gpu, kind, asyncio.run(run()))


@pytest.mark.parametrize("kind", KINDS)
def test_a_thread_blocked_in_result_learns_that_the_copies_failed(make_offloader, standin_driver, kind):
    """``result()`` blocked on a transfer whose copies had not landed (a store, and a load of several
    chunks, which has a cancel flag) sleeps until the transfer ends: the landing watcher ends it
    failed, with the worker's loop held."""
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)
    t = start(off, kind)
    if kind == "load":
        assert gpu.load_copier.flags, "the load has no cancel flag"
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
        spin_until(lambda: blocked(t), what="result() blocked")
        fail_copies(gpu, kind)
        waiter.join(HANG_S)
        assert not waiter.is_alive(), "result() hangs"
        assert len(outcome) == 1 and isinstance(outcome[0], kvoffload.TransferError), outcome
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


@pytest.mark.parametrize("kind", KINDS)
def test_done_notices_a_failed_copy_without_the_worker(make_offloader, standin_driver, monkeypatch, kind):
    """With the worker's loop held and its landing watcher kept from looking (no ring comes, no
    recheck is due), ``done()`` finds the copies failed and ends the transfer itself, in the asking thread."""
    from kvoffload._core.base.cross_thread import WakeSemaphore
    from kvoffload._core.workers import landings

    # a semaphore of its own: one from the pool may hold a ring meant for an earlier sleeper
    monkeypatch.setattr(landings, "take_wake_semaphore", WakeSemaphore)
    monkeypatch.setattr(landings.LandingWatcher, "RECHECK_S", 60.0)
    monkeypatch.setattr(landings.LandingWatcher, "IDLE_RECHECK_S", 60.0)
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    prepare(off, gpu, kind)
    gpu.copier(kind).hold_rings()
    t = start(off, kind)
    enders: list[str] = []
    t.add_done_callback(lambda _: enders.append(threading.current_thread().name))  # runs where it ends
    with held(gpu.worker(kind)):
        assert not t.done()
        fail_copies(gpu, kind)
        assert t.done()  # ended here, in the asking thread
        assert enders == [threading.current_thread().name], enders
        assert isinstance(t.exception(0), kvoffload.TransferError)
    gpu.copier(kind).let_rings_through()
    check_failed_and_leaked_nothing(off, caches, gpu, kind, t)


def test_a_store_keeps_the_chunks_that_landed_before_its_copy_failed(make_offloader, standin_driver):
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver)
    gpu.store_copier.complete_at_once = None
    t = off.store({k: k for k in range(BLOCKS)})
    first, second = gpu.store_copier.events
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


@pytest.mark.parametrize("site", list(TASKS))
def test_a_transfer_run_as_a_task_fails_when_its_copy_fails_on_the_device(make_offloader, standin_driver, tmp_path, site):
    """A task's copy is awaited on the worker's loop through the landing watcher: its failure fails the task."""
    opts, kind = TASKS[site]
    off, caches, gpu = make_gpu_offloader(make_offloader, standin_driver, disk_path=tmp_path / "kv", **opts)
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
