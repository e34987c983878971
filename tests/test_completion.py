"""Who ends a GPU transfer enqueued at call time: the worker's landing watcher, which the driver rings
once a copy completes, or the thread that waits for it (``done()``, ``result()``, ``await``) once its
copies have landed, with no hop through another thread that may not get the GIL for milliseconds.
Either way it ends exactly once, with every landing reported once and in order, and cleaned up once.
Driven on the CPU by a stand-in copier whose copy events the test completes by hand."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import kvoffload
from kvoffload._core.base.cross_thread import WakeSemaphore
from kvoffload._core.workers import job as job_module
from kvoffload._core.workers import landings as landings_module
from kvoffload._core.workers.copy_submission import CopyCalls, CopyRequest
from kvoffload._core.workers.copy_worker import CopyWorker
from kvoffload._core.workers.job import Job
from kvoffload._core.workers.landings import LandingWatcher
from support.standins import StandInCopier, StandInEvent, StandInFlag
from support.waiting import blocked, HANG_S, spin_until

WORKER = "kvoffload-test-worker"
WATCHER = f"{WORKER}-landings"


class Steps(Job):
    """A transfer's job as the tiers' plans make it: records each landing (as a store publishes
    chunk by chunk), each cleanup and each end, with the name of the thread that ended it."""

    def __init__(self, reports_landings: bool = True) -> None:
        super().__init__("store")
        self.reports_landings = reports_landings
        self.landings: list[int] = []
        self.cleanups = 0
        self.ends: list[tuple[object, BaseException | None, bool]] = []
        self.end_threads: list[str] = []
        self.finished = threading.Event()
        """Set once it ended (waiting on it ends nothing, as ``result()`` or ``done()`` may)."""

    def landed(self, i: int) -> None:
        self.landings.append(i)

    def result(self):
        return kvoffload.TransferResult("store", (), (), 0, 0.0)

    def cleanup(self) -> None:
        self.cleanups += 1

    def count_end(self, result, exc, cancelled) -> None:
        self.ends.append((result, exc, cancelled))
        self.end_threads.append(threading.current_thread().name)
        self.finished.set()


class HeldRingsCopier(StandInCopier):
    """A stand-in copier whose rings the driver holds back until :meth:`let_rings_through` (never,
    unless the test says): the landing watcher then looks only when the test rings it itself."""

    def __init__(self, flag: StandInFlag) -> None:
        super().__init__(flag)
        self._lock = threading.Lock()
        self._through = False
        self._held: list = []

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        with self._lock:
            if not self._through:
                self._held.append((event, alarm))
                return
        super().ring_when_complete(event, alarm, in_order, for_thread)

    def let_rings_through(self) -> None:
        with self._lock:
            self._through = True
            held, self._held = self._held, []
        for event, alarm in held:
            super().ring_when_complete(event, alarm)


class _Rig:
    """A GPU load worker over a stand-in copier; :meth:`hold` keeps its loop's thread busy until released."""

    def __init__(self, copier: StandInCopier | None = None) -> None:
        self.copier = copier if copier is not None else StandInCopier(StandInFlag(raise_lands_at_once=True))
        self.worker = CopyWorker("load", WORKER, self.copier, CopyCalls(), gpu=True)
        self.loop = self.worker.loop
        self.watcher = self.worker._watcher
        assert self.watcher is not None
        self._release = threading.Event()

    def hold(self) -> None:
        """Block the loop's thread (as a worker that cannot get the GIL) until :meth:`let_go`; once let
        go, returns when the loop ran everything posted before."""
        held = threading.Event()

        def block() -> None:
            held.set()
            self._release.wait(HANG_S)

        self.loop.mailbox.post(block)
        assert held.wait(HANG_S)

    def let_go(self) -> None:
        self._release.set()

    def look(self) -> None:
        """Wake the landing watcher as a ring would."""
        self.watcher._semaphore.ring()

    def dropped(self, job: Job) -> None:
        """Wait until the watcher follows ``job`` no more."""
        spin_until(lambda: job not in self.watcher.jobs(), what="the watcher dropped the job")

    @staticmethod
    def requests(chunks: int) -> list:
        """Copies of ``chunks`` chunks of 4 blocks into the cache."""
        import torch

        host = torch.zeros((4 * chunks, 16), dtype=torch.uint8)
        return [CopyRequest(False, host, [4 * c + i for i in range(4)], [4 * c + i for i in range(4)]) for c in range(chunks)]

    def start(self, chunks: int = 3, reports_landings: bool = True):
        """Start a transfer of ``chunks`` copies as the tiers do; returns (its transfer, its job, its copies' events)."""
        first = len(self.copier.events)
        job = Steps(reports_landings)
        self.worker.start(job, None, self.requests(chunks))
        return job.transfer, job, self.copier.events[first:]

    def close(self) -> None:
        self.let_go()
        if isinstance(self.copier, HeldRingsCopier):
            self.copier.let_rings_through()
        for e in self.copier.events:
            e.complete()
        assert self.worker.stop(5)
        self.worker.close()


def fresh_wake_semaphores(monkeypatch) -> None:
    """Watchers made from now on sleep on a semaphore of their own, not one from the pool, which a
    ring meant for an earlier sleeper may still wake (harmless: a watcher woken early looks again,
    but a test that must know when it looks cannot have it)."""
    monkeypatch.setattr(landings_module, "take_wake_semaphore", WakeSemaphore)


def no_watcher_rechecks(monkeypatch) -> None:
    """Watchers made from now on look again only when rung (their rechecks a minute apart)."""
    monkeypatch.setattr(LandingWatcher, "RECHECK_S", 60.0)
    monkeypatch.setattr(LandingWatcher, "IDLE_RECHECK_S", 60.0)


@pytest.fixture
def rig(monkeypatch):
    fresh_wake_semaphores(monkeypatch)
    r = _Rig()
    yield r
    r.close()


@pytest.fixture
def quiet_rig(monkeypatch):
    """A rig whose landing watcher looks only when the test rings it (:meth:`_Rig.look`): the driver
    holds its rings back and the watcher's rechecks are a minute apart."""
    fresh_wake_semaphores(monkeypatch)
    no_watcher_rechecks(monkeypatch)
    r = _Rig(HeldRingsCopier(StandInFlag(raise_lands_at_once=True)))
    yield r
    r.close()


def fail_on_device(event) -> None:
    """``event`` completes with an asynchronous CUDA error: asking about it raises."""

    def illegal_address(*_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    event.query = illegal_address
    event.synchronize = illegal_address
    event.complete()


def wait_in_thread(transfer) -> tuple[threading.Thread, list[object]]:
    """A started thread ("blocked-waiter") blocked in ``transfer.result()``, and the list that gets
    what it returned, or what it raised."""
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(transfer.result())
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait, name="blocked-waiter")
    waiter.start()
    return waiter, outcome


# -- who ends it ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["done", "result", "await"])
def test_a_transfer_waited_for_after_its_copies_landed_ends_in_the_waiting_thread(quiet_rig, how):
    """The watcher cannot look (no ring comes): the waiter that finds the copies landed ends the
    transfer itself, reporting every landing once and in order; the watcher, looking later, drops it
    without reporting anything again."""
    rig = quiet_rig
    transfer, steps, events = rig.start()
    if how == "done":
        assert not transfer.done()
        for e in events[:2]:
            e.complete()
        assert not transfer.done(), "ended before its last copy completed"
        events[2].complete()
        assert transfer.done(), "done() did not end the landed transfer"
        assert transfer.result(0).kind == "store"
    elif how == "result":
        with pytest.raises(TimeoutError):  # copies still running: nobody ends it
            transfer.result(timeout=0.05)
        for e in events:
            e.complete()
        assert transfer.result(timeout=0.05).kind == "store"
    else:
        for e in events:
            e.complete()

        async def wait():
            return await asyncio.wait_for(transfer, 1)

        assert asyncio.run(wait()).kind == "store"
    assert steps.landings == [0, 1, 2] and steps.cleanups == 1
    assert steps.end_threads == [threading.current_thread().name]
    assert rig.copier.flag.released.is_set()
    rig.look()
    rig.dropped(steps)
    assert steps.landings == [0, 1, 2] and steps.cleanups == 1 and len(steps.ends) == 1


class LandsOnQuery(StandInEvent):
    """A copy that lands while its waiter looks again: complete at its ``n``-th query (never if 0)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.queries = n, 0

    def query(self) -> bool:
        self.queries += 1
        if self.queries == self.n:
            self.complete()
        return super().query()


def start_one_copy(rig: _Rig, event: StandInEvent, lands_soon: bool) -> Steps:
    """Start a transfer of one copy that completes with ``event``, as the tiers do; its job."""
    rig.copier.to_device = lambda host, rows, block_ids: rig.copier.events.append(event) or event  # type: ignore[method-assign]
    job = Steps(reports_landings=False)
    job.lands_soon = lands_soon
    rig.worker.start(job, None, rig.requests(1))
    return job


@pytest.mark.parametrize("how", ["await", "result"])
@pytest.mark.parametrize("lands_soon", [True, False], ids=["lands soon", "large"])
def test_a_waiter_looks_again_for_a_copy_that_lands_soon_before_it_asks_for_a_ring(quiet_rig, how, lands_soon):
    """A transfer of one small copy (``Job.lands_soon``) still in flight when a caller awaits it or
    blocks in ``result()`` is looked at again for a while: if it lands meanwhile, the caller ends it
    with no ring asked for and no other thread on the way. Any other transfer gets its ring at once."""
    rig = quiet_rig
    event = LandsOnQuery(3)
    job = start_one_copy(rig, event, lands_soon)
    transfer = job.transfer

    async def wait():
        return await asyncio.wait_for(transfer, 0.2)

    if lands_soon:
        assert (asyncio.run(wait()) if how == "await" else transfer.result(timeout=0.2)).kind == "store"
        assert event.queries == 3 and not event.alarmed.is_set() and not rig.copier._held, "a ring asked for"
        assert job.end_threads == [threading.current_thread().name]
    else:
        loop = asyncio.new_event_loop()
        if how == "await":
            task = loop.create_task(_await(transfer))
            loop.run_until_complete(asyncio.sleep(0))  # the task runs up to its await
        else:
            with pytest.raises(TimeoutError):  # the held ring never comes, the watcher never looks
                transfer.result(timeout=0.05)
        assert event.queries == 1 and rig.copier._held, "no ring asked for at the first look"
        assert not job.finished.is_set()
        rig.copier.let_rings_through()
        event.complete()
        assert job.finished.wait(HANG_S) and job.end_threads == [WATCHER]
        if how == "await":
            assert loop.run_until_complete(task).kind == "store"
        loop.close()


def test_a_waiter_asks_for_a_ring_once_a_copy_that_lands_soon_has_not_landed_after_its_looks(quiet_rig):
    """The looks again are bounded (``LOOK_AGAIN_S``): a small copy that does not land meanwhile (it
    waits behind the caller's stream, say) gets its ring, and ends as any other once it lands. A
    ``result(timeout=0)`` looks once."""
    rig = quiet_rig
    event = LandsOnQuery(0)
    job = start_one_copy(rig, event, lands_soon=True)
    with pytest.raises(TimeoutError):  # a timeout of 0 asks without waiting: one look
        job.transfer.result(timeout=0)
    assert event.queries == 1
    with pytest.raises(TimeoutError):
        job.transfer.result(timeout=0.05)
    assert event.queries > 2 and rig.copier._held, "no ring asked for after the looks"
    rig.copier.let_rings_through()
    event.complete()
    assert job.finished.wait(HANG_S) and job.end_threads == [WATCHER]


def test_a_one_copy_transfer_ends_when_it_lands_on_the_watchers_thread(rig):
    """A GPU transfer of one copy enqueued at call time (the serving engine's small store or load)
    is followed by the landing watcher, which the driver rings: it ends, published, with its done
    callback run, while the worker's loop is held and nobody waits in a thread; nothing is reported
    twice once the loop runs again."""
    rig.hold()  # the worker's loop cannot run
    transfer, steps, events = rig.start(chunks=1)
    ended = threading.Event()
    transfer.add_done_callback(lambda t: ended.set())  # from a plain thread: runs where it ends
    assert not ended.wait(0.05), "ended before its copy landed"
    assert events[0].alarmed.is_set(), "no ring was enqueued for the copy's completion"
    events[0].complete()
    assert ended.wait(HANG_S), "the transfer did not end while the worker's loop was held"
    assert transfer.result(0).kind == "store"
    assert steps.landings == [0] and steps.cleanups == 1 and steps.end_threads == [WATCHER]
    rig.let_go()
    rig.hold()  # the loop ran its turn: nothing more happened
    rig.dropped(steps)
    assert steps.landings == [0] and steps.cleanups == 1 and len(steps.ends) == 1


def test_a_store_of_several_chunks_publishes_chunk_by_chunk_as_the_watcher_is_rung(rig):
    rig.hold()
    transfer, steps, events = rig.start()
    for i, e in enumerate(events):
        assert steps.landings == list(range(i)), "a chunk was reported before it landed"
        e.complete()
        spin_until(lambda: steps.landings == list(range(i + 1)), what=f"chunk {i} reported")
        if i < len(events) - 1:
            assert not steps.finished.is_set(), "ended before its last copy completed"
    assert steps.finished.wait(HANG_S)
    assert transfer.result(0).kind == "store"
    assert steps.landings == [0, 1, 2] and steps.cleanups == 1 and steps.end_threads == [WATCHER]


def test_one_copy_transfers_nobody_waits_for_cost_no_ring_and_end_at_the_watchers_next_look(rig):
    """A transfer of one copy is followed lazily: handed over, it asks the driver for no ring (a ring
    costs the caller more than the rest of its call); nobody waiting, it ends at the watcher's next
    look after it landed, published, on the watcher's thread."""
    rig.hold()
    started = [rig.start(chunks=1) for _ in range(3)]
    events = [e for _, _, evs in started for e in evs]
    assert not any(e.alarmed.is_set() for e in events), "a ring was enqueued though nobody waits"
    for e in events[:2]:
        e.complete()
    rig.look()
    for _, steps, _ in started[:2]:
        assert steps.finished.wait(HANG_S), "a transfer that landed did not end at the watcher's look"
    assert not started[2][1].finished.is_set()
    events[2].complete()
    rig.look()
    assert started[2][1].finished.wait(HANG_S)
    for t, steps, _ in started:
        assert t.exception(0) is None
        assert steps.landings == [0] and steps.cleanups == 1 and steps.end_threads == [WATCHER]


@pytest.mark.parametrize("how", ["callback", "await", "result with a timeout", "cancel"])
def test_whoever_waits_for_one_copy_transfers_gets_them_one_ring_and_each_ends_as_it_lands(rig, how):
    """Waiters that find one-copy transfers still in flight (a done callback, an awaiting task, a
    thread in ``result(timeout)``, a cancel) have the driver ring the watcher for the oldest copy only
    (a burst costs one ring); each look rings again for the next one waited for, so each transfer
    ends as it lands, in stream order, on the watcher's thread."""
    rig.hold()
    started = [rig.start(chunks=1) for _ in range(3)]
    events = [e for _, _, evs in started for e in evs]
    waiters: list = []
    loop = asyncio.new_event_loop()
    for t, _, evs in started:
        if how == "callback":
            t.add_done_callback(lambda _t: None)
        elif how == "await":
            waiters.append(loop.create_task(_await(t)))
            loop.run_until_complete(asyncio.sleep(0))  # each task runs up to its await
        elif how == "cancel":
            assert t.cancel()
        else:
            with pytest.raises(TimeoutError):
                t.result(timeout=0.001)
    assert [e.alarmed.is_set() for e in events] == [True, False, False], "not one ring, for the oldest"
    for i, e in enumerate(events):
        assert e.alarmed.wait(HANG_S), "no ring for a copy somebody waits for"
        e.complete()
        assert started[i][1].finished.wait(HANG_S), "a transfer that landed did not end"
        assert all(not s.finished.is_set() for _, s, _ in started[i + 1 :]), "ended before its copy landed"
    if waiters:
        assert [r.kind for r in loop.run_until_complete(asyncio.gather(*waiters))] == ["store"] * 3
    loop.close()
    for t, steps, _ in started:
        assert t.cancelled() if how == "cancel" else t.exception(0) is None
        assert steps.cleanups == 1 and steps.end_threads == [WATCHER]


async def _await(transfer):
    return await transfer


@pytest.mark.parametrize("chunks", [1, 3], ids=["one copy", "three copies, a cancel flag"])
def test_a_blocked_result_returns_once_the_watcher_ends_the_transfer(rig, chunks):
    """A thread blocked in result() (its copies had not landed when it looked) sleeps until whoever
    ends the transfer wakes it: the watcher, with the worker's loop held."""
    rig.hold()
    transfer, steps, events = rig.start(chunks)
    assert (transfer._job.cancel_flag is not None) == (chunks > 1)

    def land() -> None:
        spin_until(lambda: blocked(transfer), what="result() blocked")
        for e in events:
            e.complete()

    lander = threading.Thread(target=land)
    lander.start()
    try:
        assert transfer.result(HANG_S).kind == "store"
    finally:
        lander.join()
    assert steps.end_threads == [WATCHER] and steps.landings == list(range(chunks)) and steps.cleanups == 1
    assert rig.copier.flag.released.is_set() or chunks == 1


class WaiterRingsOnlyCopier(StandInCopier):
    """A stand-in copier whose driver rings threads blocked in ``result()`` but never the landing
    watcher (set :attr:`watcher_semaphore`): only the blocked thread can end a transfer."""

    watcher_semaphore: object = None

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        if alarm is not self.watcher_semaphore:
            super().ring_when_complete(event, alarm, in_order, for_thread)


@pytest.mark.parametrize("chunks", [1, 3], ids=["one copy", "three copies, a cancel flag"])
def test_a_thread_blocked_in_result_is_rung_by_the_driver_and_ends_the_transfer_itself(monkeypatch, chunks):
    """Behind a thread busy in Python, a wake-up from the watcher costs two takes of the GIL in a row
    (the watcher's, then the waiter's): a thread blocked in result() without a timeout has the driver
    ring it once the last copy landed, and ends the transfer itself (its landings reported once)."""
    fresh_wake_semaphores(monkeypatch)
    no_watcher_rechecks(monkeypatch)
    copier = WaiterRingsOnlyCopier(StandInFlag(raise_lands_at_once=True))
    rig = _Rig(copier)
    try:
        copier.watcher_semaphore = rig.watcher._semaphore
        transfer, steps, events = rig.start(chunks)
        waiter, outcome = wait_in_thread(transfer)
        first_ring = events[-2 if chunks > 1 else -1]  # several copies: rung once the last but one landed
        spin_until(lambda: bool(transfer._job is not None and transfer._job.sleepers and first_ring.alarmed.is_set()),
                   what="the waiter asleep, its ring enqueued")
        for e in events:
            e.complete()
        waiter.join(HANG_S)
        assert not waiter.is_alive(), "the blocked thread was not rung"
        assert len(outcome) == 1 and outcome[0].kind == "store"
        assert steps.end_threads == ["blocked-waiter"] and steps.landings == list(range(chunks)) and steps.cleanups == 1
        rig.look()
        rig.dropped(steps)
        assert len(steps.ends) == 1
    finally:
        rig.close()


class CountedSleeps(WakeSemaphore):
    """A watcher's wake semaphore that counts the watcher's returns to sleep: each one follows a
    finished look (or the first sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    def sleep(self, timeout: float, *, keep_gil: bool = False) -> float | None:
        self.sleeps += 1
        return super().sleep(timeout, keep_gil=keep_gil)


class RecordedRings(StandInCopier):
    """A stand-in copier that records every ring asked of the driver, as (event, semaphore)."""

    def __init__(self, flag: StandInFlag) -> None:
        super().__init__(flag)
        self.rings: list = []
        self.out_of_order: list = []
        """Events rung for with ``in_order=False``."""

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        self.rings.append((event, alarm))
        if not in_order:
            self.out_of_order.append(event)
        super().ring_when_complete(event, alarm, in_order, for_thread)


@pytest.mark.parametrize("reports_landings", [True, False], ids=["store, chunk by chunk", "load"])
def test_the_watcher_leaves_the_last_copy_of_a_job_to_the_thread_asleep_on_it(monkeypatch, reports_landings):
    """Behind a thread busy in Python, a transfer's end waits for each thread that wakes for it to take
    the GIL in turn: for a job a thread sleeps on in result(), the watcher follows the copies before
    the last (a store publishes them as they land) and asks no ring for the last one; the sleeper,
    rung by the driver, ends the job alone."""
    monkeypatch.setattr(landings_module, "take_wake_semaphore", CountedSleeps)
    no_watcher_rechecks(monkeypatch)
    copier = RecordedRings(StandInFlag(raise_lands_at_once=True))
    rig = _Rig(copier)
    watcher_semaphore = rig.watcher._semaphore
    try:
        transfer, steps, events = rig.start(3, reports_landings)
        waiter, outcome = wait_in_thread(transfer)
        spin_until(lambda: any(e is events[-2] and a is not watcher_semaphore for e, a in copier.rings),
                   what="the waiter asleep, its ring (for the last copy but one) enqueued")
        for i in range(2):  # a store's watcher looks after each copy but the last; a load's after its first only
            looks = watcher_semaphore.sleeps
            events[i].complete()
            if reports_landings or i == 0:
                spin_until(lambda: watcher_semaphore.sleeps > looks, what=f"the watcher's look after copy {i}")
        assert steps.landings == ([0, 1] if reports_landings else []), "landings before the last not reported as they landed"
        assert not [e for e, a in copier.rings if a is watcher_semaphore and e is events[-1]], "the watcher asked a ring for the last copy"
        events[-1].complete()
        waiter.join(HANG_S)
        assert not waiter.is_alive() and len(outcome) == 1
        assert steps.end_threads == ["blocked-waiter"] and steps.cleanups == 1
        assert steps.landings == ([0, 1, 2] if reports_landings else [])
        rig.look()
        rig.dropped(steps)
        assert len(steps.ends) == 1
    finally:
        rig.close()


def test_a_thread_asleep_on_several_copies_is_rung_a_copy_early_then_for_the_last(monkeypatch):
    """Behind a thread busy in Python, taking the GIL back after a ring waits up to the switch
    interval: a thread blocked in result() on several copies is rung once the last but one landed
    (it takes the GIL back while the last moves), asks a ring for the last only then, and ends the
    job itself once that landed."""
    fresh_wake_semaphores(monkeypatch)
    no_watcher_rechecks(monkeypatch)
    copier = RecordedRings(StandInFlag(raise_lands_at_once=True))
    rig = _Rig(copier)
    watcher_semaphore = rig.watcher._semaphore
    try:
        transfer, steps, events = rig.start(3)
        waiter, outcome = wait_in_thread(transfer)

        def waiters_rings() -> list:
            return [e for e, a in copier.rings if a is not watcher_semaphore]

        spin_until(lambda: waiters_rings() == [events[1]], what="the waiter's ring for the last copy but one")
        events[0].complete()
        events[1].complete()
        spin_until(lambda: waiters_rings() == [events[1], events[2]], what="the waiter's ring for the last copy, once the one before landed")
        assert waiter.is_alive() and not steps.finished.is_set()
        events[2].complete()
        waiter.join(HANG_S)
        assert not waiter.is_alive() and len(outcome) == 1 and outcome[0].kind == "store"
        assert steps.end_threads == ["blocked-waiter"] and steps.cleanups == 1
        rig.look()
        rig.dropped(steps)
        assert len(steps.ends) == 1
    finally:
        rig.close()


class RecordedSleeps(WakeSemaphore):
    """A sleeper's wake semaphore that records each sleep: (keep_gil, what it returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[tuple[bool, float | None]] = []

    def sleep(self, timeout: float, *, keep_gil: bool = False) -> float | None:
        took = super().sleep(timeout, keep_gil=keep_gil)
        self.sleeps.append((keep_gil, took))
        return took


def test_a_sleeper_that_took_the_gil_back_behind_python_sleeps_on_the_last_copy_keeping_it(monkeypatch):
    """Rung a copy early while this thread runs Python without a pause, the sleeper waits a switch
    interval for the GIL; the last copy has not landed, so it sleeps on its ring keeping the GIL (no
    longer than a switch interval: nobody could ring it meanwhile here), then sleeps as before and
    ends the job itself once the last copy lands."""
    fresh_wake_semaphores(monkeypatch)
    no_watcher_rechecks(monkeypatch)
    made: list[RecordedSleeps] = []
    monkeypatch.setattr(job_module, "take_wake_semaphore", lambda: made.append(RecordedSleeps()) or made[-1])
    monkeypatch.setattr(job_module, "give_back_wake_semaphore", lambda semaphore: None)
    copier = WaiterRingsOnlyCopier(StandInFlag(raise_lands_at_once=True))  # the watcher, never rung, takes no GIL meanwhile
    rig = _Rig(copier)
    try:
        copier.watcher_semaphore = rig.watcher._semaphore
        transfer, steps, events = rig.start(3)
        waiter, outcome = wait_in_thread(transfer)
        spin_until(lambda: bool(made and made[0].sleeps == [] and events[1].alarmed.is_set()), what="the waiter's early ring")
        events[0].complete()
        events[1].complete()  # rings the sleeper; this thread keeps the GIL and runs on
        deadline = time.monotonic() + HANG_S
        while not any(keep for keep, _ in made[0].sleeps) and time.monotonic() < deadline:
            pass  # pure Python: the sleeper gets the GIL only once this thread is made to drop it
        held = [(keep, took) for keep, took in made[0].sleeps if keep]
        assert held == [(True, None)], f"the sleeper did not sleep on the last copy keeping the GIL: {made[0].sleeps[:3]}"
        took_early = made[0].sleeps[0][1]
        assert took_early is not None and took_early > job_module.GIL_TAKEN_AT_ONCE_S
        assert not steps.finished.is_set()
        events[2].complete()
        waiter.join(HANG_S)
        assert not waiter.is_alive() and len(outcome) == 1 and outcome[0].kind == "store"
        assert steps.end_threads == ["blocked-waiter"] and steps.cleanups == 1
    finally:
        rig.close()


def test_a_job_left_by_its_sleeper_before_its_end_is_taken_back_by_the_watcher(monkeypatch):
    """The watcher asked no ring for the last copy of a job a thread slept on; when that thread leaves
    before the end (a cancel here, of a job without a cancel flag: nothing else rings the watcher),
    the watcher takes the job back and ends it once its copies landed."""
    monkeypatch.setattr(landings_module, "take_wake_semaphore", CountedSleeps)
    no_watcher_rechecks(monkeypatch)
    copier = RecordedRings(StandInFlag(raise_lands_at_once=True))
    copier.take_cancel_flag = lambda: None  # as without the copy kernel
    rig = _Rig(copier)
    watcher_semaphore = rig.watcher._semaphore
    try:
        transfer, steps, events = rig.start(2)
        waiter, outcome = wait_in_thread(transfer)
        spin_until(lambda: any(e is events[0] and a is not watcher_semaphore for e, a in copier.rings),
                   what="the waiter asleep, its ring (for the last copy but one) enqueued")
        looks = watcher_semaphore.sleeps
        events[0].complete()
        spin_until(lambda: watcher_semaphore.sleeps > looks, what="the watcher's look after copy 0")
        assert not [e for e, a in copier.rings if a is watcher_semaphore and e is events[-1]]
        assert transfer.cancel()
        events[-1].complete()
        waiter.join(HANG_S)
        assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], kvoffload.TransferCancelled)
        spin_until(lambda: steps.finished.is_set(), what="the job ended")
        assert len(steps.ends) == 1 and steps.ends[0][2] and steps.cleanups == 1
    finally:
        rig.close()


def test_a_cancels_rings_never_wait_behind_the_ring_for_a_later_copy(monkeypatch):
    """The driver runs a stream's rings in order: a ring for the cancel flag's raise, or for the copy a
    cancelled load ends with, queued behind the watcher's ring for the load's last copy would come
    only once the whole load landed. The watcher asks both out of order (the copier gives them a
    stream of their own), and the load ends cancelled once the copy running at the cancel landed."""
    fresh_wake_semaphores(monkeypatch)
    monkeypatch.setattr(LandingWatcher, "RECHECK_S", 60.0)
    copier = RecordedRings(StandInFlag(raise_lands_at_once=True))
    rig = _Rig(copier)
    try:
        transfer, steps, events = rig.start(3, reports_landings=False)
        events[0].complete()
        spin_until(lambda: any(e is events[-1] for e, _ in copier.rings), what="the watcher's ring for the last copy")
        assert transfer.cancel()
        spin_until(lambda: len(copier.out_of_order) == 2, what="the rings of the raise and of the running copy")
        assert copier.out_of_order[0] is copier.flag.raised and copier.out_of_order[1] is events[1]
        assert not any(e is events[1] for e, _ in copier.rings[:-1]), "the running copy was rung for in order"
        events[1].complete()
        assert steps.finished.wait(HANG_S), "the cancelled load did not end once its running copy landed"
        assert steps.ends[0][2] and not events[2].query(), "it waited for its last copy"
        with pytest.raises(kvoffload.TransferCancelled):
            transfer.result(0)
    finally:
        rig.close()


# -- cancelled -----------------------------------------------------------------------------------


def test_a_cancelled_transfer_is_not_ended_done_by_its_waiter(quiet_rig):
    rig = quiet_rig
    transfer, steps, events = rig.start()
    assert transfer.cancel()
    for e in events:
        e.complete()
    assert not transfer.done(), "its waiter ended a cancelled transfer"
    with pytest.raises(TimeoutError):
        transfer.result(timeout=0.05)
    rig.look()  # the watcher ends it cancelled
    with pytest.raises(kvoffload.TransferCancelled):
        transfer.result(timeout=HANG_S)
    assert steps.ends == [(None, None, True)] and steps.cleanups == 1 and steps.landings == []
    assert steps.end_threads == [WATCHER] and rig.copier.flag.released.is_set()


def test_a_cancel_ends_a_thread_blocked_on_a_load_once_the_running_chunk_lands(rig):
    """A thread blocked in result() on a load of several chunks learns of a cancel within the chunk
    copying now: it raises TransferCancelled though the later copies (their DMAs) have not completed;
    the cancel flag goes back only once they have."""
    transfer, steps, events = rig.start()
    waiter, outcome = wait_in_thread(transfer)
    spin_until(lambda: blocked(transfer), what="result() blocked")
    assert transfer.cancel()
    spin_until(lambda: steps.stop_at == 0, what="the watcher chose the copy the cancelled load ends with")
    events[0].complete()  # the copy running at the cancel; the later ones' DMAs still run
    waiter.join(HANG_S)
    assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], kvoffload.TransferCancelled)
    assert steps.ends == [(None, None, True)] and steps.landings == [] and steps.cleanups == 1
    assert not rig.copier.flag.released.is_set(), "the flag went back while chunks reading it were queued"
    for e in events[1:]:
        e.complete()
    assert rig.copier.flag.released.wait(HANG_S)
    rig.dropped(steps)
    assert len(steps.ends) == 1


# -- races ---------------------------------------------------------------------------------------


def test_waiters_and_the_watcher_racing_end_each_transfer_once(quiet_rig):
    """Many transfers whose copies complete while two plain threads poll done(): the first half lands
    while only the pollers can end them (the watcher gets no ring), the rest races the watcher. Each
    ends once, its landings reported once, in order."""
    rig = quiet_rig
    started = [rig.start() for _ in range(300)]
    half = len(started) // 2
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for t, _, _ in started:
                t.done()

    pollers = [threading.Thread(target=poll, name=f"poller-{i}") for i in range(2)]
    for th in pollers:
        th.start()
    try:
        for _, _, events in started[:half]:
            for e in events:
                e.complete()
        spin_until(lambda: all(s.finished.is_set() for _, s, _ in started[:half]), what="the pollers ended the first half")
        rig.copier.let_rings_through()
        for _, _, events in started[half:]:
            for e in events:
                e.complete()
        for t, _, _ in started:
            t.result(timeout=HANG_S)
    finally:
        stop.set()
        for th in pollers:
            th.join()
    for t, steps, _ in started:
        assert steps.landings == [0, 1, 2] and steps.cleanups == 1 and len(steps.ends) == 1, (steps.landings, steps.ends)
    assert {name for _, s, _ in started[:half] for name in s.end_threads} <= {"poller-0", "poller-1"}
    spin_until(lambda: not rig.watcher.jobs(), what="the watcher dropped every transfer")
    assert all(len(s.ends) == 1 and s.landings == [0, 1, 2] for _, s, _ in started)


# -- a copy that fails on the device ----------------------------------------------------------------


@pytest.mark.parametrize("who", ["watcher", "waiter"])
def test_a_copy_failing_on_the_device_fails_the_job_once(request, who):
    """A copy whose completion event reports a CUDA error fails its job with TransferError (the error as
    cause), once, cleaned up, whoever learns of it: the watcher (the chunk that landed before stays
    reported, the later ones never are) or a waiter that finds the last copy failed."""
    rig = request.getfixturevalue("rig" if who == "watcher" else "quiet_rig")
    transfer, steps, events = rig.start()
    if who == "watcher":
        events[0].complete()
        spin_until(lambda: steps.landings == [0], what="the first chunk reported")
        fail_on_device(events[1])
        assert steps.finished.wait(HANG_S), "the failed transfer never ended"
        assert steps.end_threads == [WATCHER] and steps.landings == [0]
    else:
        for e in events:
            fail_on_device(e)
        with pytest.raises(kvoffload.TransferError):
            transfer.result(0.05)
        assert steps.end_threads == [threading.current_thread().name] and steps.landings == []
    err = transfer.exception(0)
    assert isinstance(err, kvoffload.TransferError) and isinstance(err.__cause__, RuntimeError), repr(err)
    assert "illegal memory access" in str(err.__cause__)
    assert len(steps.ends) == 1 and steps.ends[0][1] is err and not steps.ends[0][2]
    assert steps.cleanups == 1 and rig.copier.flag.released.is_set()
    rig.look()
    rig.dropped(steps)
    assert len(steps.ends) == 1 and steps.cleanups == 1


# -- a hand-over interrupted by an asynchronous exception (a signal handler's KeyboardInterrupt) --


class _InterruptedAfter(list):
    """Copy requests whose submission an interrupt stops once ``n`` are submitted: raised between two
    copier calls, as a signal handler raises it (one raised inside a copier's call fails the
    transfer instead, as anything a copy raises does)."""

    def __init__(self, requests: list, n: int) -> None:
        super().__init__(requests)
        self.n = n

    def __iter__(self):
        for i, r in enumerate(list.__iter__(self)):
            if i == self.n:
                raise KeyboardInterrupt
            yield r


def _land_once_settled(copier: StandInCopier, submitted: int) -> threading.Thread:
    """A thread that completes every copy once somebody sleeps on the last of ``submitted`` copies (or
    gives up after a while: then the test fails on what it finds, instead of hanging)."""

    def land() -> None:
        spin_until(lambda: len(copier.events) >= submitted, what="the copies submitted")
        copier.events[submitted - 1].waited.wait(2.0)
        for e in copier.events:
            e.complete()

    lander = threading.Thread(target=land)
    lander.start()
    return lander


@pytest.mark.parametrize("where", ["between two copies", "ordering after the caller"])
def test_an_interrupt_while_copies_are_enqueued_propagates_once_they_completed_and_abandon_gives_the_flag_back(rig, where):
    """What the caller may then free (slots, pins) no copy still writes or reads. The enqueue takes no
    lock of the jobs' (a caller may hold the index's): the cancel flag goes back with ``abandon``."""
    if where == "between two copies":
        requests, submitted, after = _InterruptedAfter(rig.requests(3), 2), 2, None
    else:
        def interrupted(event: object) -> None:
            raise KeyboardInterrupt

        rig.copier.wait_for = interrupted
        requests, submitted, after = rig.requests(3), 0, object()
    lander = _land_once_settled(rig.copier, submitted) if submitted else None
    job = Steps()
    with pytest.raises(KeyboardInterrupt):
        rig.worker._submitter.enqueue(job, requests, after)
    complete_when_raised = [e.query() for e in rig.copier.events]
    if lander is not None:
        lander.join()
    assert complete_when_raised == [True] * submitted, "the interrupt propagated with copies still running"
    assert len(job.events) == submitted
    rig.worker.abandon(job)
    assert rig.copier.flag.released.is_set(), "abandoned with the load's cancel flag still taken"
    assert job.transfer.cancelled()


@pytest.mark.parametrize("worker_took_it", [False, True], ids=["before-the-worker-took-it", "after"])
@pytest.mark.parametrize("path", ["call-time", "task"])
def test_an_interrupted_hand_over_ends_the_transfer_cancelled_exactly_once(quiet_rig, monkeypatch, path, worker_took_it):
    """An interrupt in ``CopyWorker.start`` once the job was handed over (to the landing watcher, or
    posted to the loop as a task): ``abandon`` either takes the transfer back (its copies completed,
    its flag back) and ends it, or leaves it to the worker, which ends it cancelled. Either way it
    ends cancelled, cleaned up and counted once."""
    rig = quiet_rig
    job = Steps()
    transfer = job.transfer

    def taken() -> bool:
        """The worker has the job: the watcher took it, or the loop made its task."""
        return job.owner == job_module._TAKEN and (path == "call-time" or job.task is not None)

    lander = None
    if path == "call-time":
        real_follow = rig.watcher.follow

        def follow(j: Job) -> None:
            """Hands over for real, then raises KeyboardInterrupt."""
            real_follow(j)
            if worker_took_it:
                rig.look()  # the watcher takes the job at its first look
                spin_until(taken, what="the watcher took the job")
            raise KeyboardInterrupt

        rig.watcher.follow = follow
        if not worker_took_it:
            lander = _land_once_settled(rig.copier, 2)
        try:
            with pytest.raises(KeyboardInterrupt):
                rig.worker.start(job, None, rig.requests(2))
        finally:
            del rig.watcher.follow
    else:
        real_box = rig.loop.mailbox

        class InterruptedPost:
            """Posts for real, then raises KeyboardInterrupt, once."""

            interrupted = False

            def post(self, fn, *args) -> None:
                real_box.post(fn, *args)
                if not InterruptedPost.interrupted:
                    InterruptedPost.interrupted = True
                    if worker_took_it:
                        spin_until(taken, what="the worker took the job")
                    raise KeyboardInterrupt

        async def run(job, after):
            await asyncio.Event().wait()

        if not worker_took_it:
            rig.hold()  # the loop cannot take the job before the interrupt
        monkeypatch.setattr(rig.loop, "mailbox", InterruptedPost())
        try:
            with pytest.raises(KeyboardInterrupt):
                rig.worker.start(job, object(), run=run)
        finally:
            monkeypatch.setattr(rig.loop, "mailbox", real_box)
    rig.worker.abandon(job)
    if not worker_took_it:
        assert transfer.cancelled(), "abandon did not end the transfer it took back"
        assert job.end_threads == [threading.current_thread().name]
        if path == "call-time":
            assert all(e.query() for e in rig.copier.events), "abandon returned with copies still running"
            assert rig.copier.flag.released.is_set()
    if lander is not None:
        lander.join()
    for e in rig.copier.events:
        e.complete()
    rig.copier.let_rings_through()
    rig.look()
    with pytest.raises(kvoffload.TransferCancelled):
        transfer.result(HANG_S)
    rig.let_go()
    rig.hold()  # the loop has run what was posted
    rig.dropped(job)
    spin_until(lambda: not rig.loop._tasks, what="the worker's task for the transfer ended")
    rig.hold()  # and whatever the worker does at a job's or task's end is over
    assert job.ends == [(None, None, True)] and job.cleanups == 1 and job.landings == []
    if path == "call-time":
        assert rig.copier.flag.released.is_set()
