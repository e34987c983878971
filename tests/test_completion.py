"""Who ends a GPU transfer enqueued at call time: its worker, or the thread that waits for it once its
copies have landed (with no hop through a worker that may not get the GIL for milliseconds).
Either way it ends exactly once, with every landing reported once and in order. Driven on the CPU
by a stand-in copier whose copy events the test completes by hand."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvoffload
import kvoffload._core.workers.copy_submission
from support.standins import StandInCopier, StandInEvent, StandInFlag
from support.waiting import HANG_S, spin_until


class _PublishingSteps:
    """A store's steps: records each landing (as a store publishes chunk by chunk) and each end."""

    reports_landings = True
    taken = None

    def __init__(self) -> None:
        self.landings: list[int] = []
        self.cleanups = 0
        self.ends: list[tuple[object, bool]] = []
        self.end_threads: list[str] = []

    def landed(self, i: int) -> None:
        self.landings.append(i)

    def result(self):
        return kvoffload.TransferResult("store", (), (), 0, 0.0)

    def cleanup(self) -> None:
        self.cleanups += 1

    def ended(self, result, exc, cancelled) -> None:
        self.ends.append((result, cancelled))
        self.end_threads.append(threading.current_thread().name)


class _Rig:
    """A worker loop with the stand-in copier; :meth:`hold` keeps its thread busy until released."""

    def __init__(self) -> None:
        from kvoffload._core.workers.copy_submission import CopyCalls
        from kvoffload._core.runtime import start_copy_worker

        self.copier = StandInCopier(StandInFlag(raise_lands_at_once=True))
        self.worker = start_copy_worker("load", "kvoffload-test-worker", self.copier, CopyCalls(), completion="poll")
        self.loop = self.worker.loop
        self._release = threading.Event()

    def hold(self) -> None:
        """Block the worker's thread (as a worker that cannot get the GIL) until :meth:`let_go`."""
        held = threading.Event()

        def block() -> None:
            held.set()
            self._release.wait(10)

        self.loop.mailbox.post(block)
        assert held.wait(10)

    def let_go(self) -> None:
        self._release.set()

    @staticmethod
    def requests(chunks: int) -> list:
        """Copies of ``chunks`` chunks of 4 blocks into the cache."""
        import torch

        from kvoffload._core.workers.copy_submission import CopyRequest

        host = torch.zeros((4 * chunks, 16), dtype=torch.uint8)
        return [CopyRequest(False, host, [4 * c + i for i in range(4)], [4 * c + i for i in range(4)]) for c in range(chunks)]

    def start(self, chunks: int = 3):
        from kvoffload._core.workers.copy_submission import HandOver
        from kvoffload._core.workers.host_copy_jobs import HostCopyJob
        from kvoffload._core.workers.transfer import TransferControl

        requests = self.requests(chunks)
        steps = _PublishingSteps()
        control = TransferControl("store")
        transfer = control.transfer
        first = len(self.copier.events)
        hand_over = HandOver()
        enqueued = self.worker.submitter.enqueue(requests, None, hand_over)
        self.worker.host_jobs.start(HostCopyJob(control, hand_over, steps, steps.ended, copies=enqueued))
        return transfer, steps, self.copier.events[first:]

    def result_landing_once_asleep(self, transfer, events, asleep: threading.Event):
        """``transfer.result()`` in this thread with the worker held, while another thread completes
        ``events`` once ``asleep`` says the waiter sleeps; returns (the result, whether it slept).
        Should the waiter never sleep, the worker is let go to end the transfer: the test then fails
        on the returned flag instead of hanging."""
        self.hold()
        slept: list[bool] = []

        def land() -> None:
            slept.append(asleep.wait(10))
            for e in events:
                e.complete()
            if not slept[0]:
                self.let_go()

        lander = threading.Thread(target=land)
        lander.start()
        result = transfer.result()
        lander.join()
        return result, slept[0]

    def close(self) -> None:
        self.let_go()
        for e in self.copier.events:
            e.complete()
        self.loop.stop(5)


@pytest.fixture
def rig():
    r = _Rig()
    yield r
    r.close()


def test_a_transfer_waited_for_after_its_copies_landed_ends_in_the_waiting_thread(rig):
    transfer, steps, events = rig.start()
    rig.hold()  # the worker cannot run: only the waiting thread can end the transfer
    with pytest.raises(TimeoutError):  # copies still running: nobody ends it
        transfer.result(timeout=0.05)
    for e in events:
        e.complete()
    assert transfer.result(timeout=0.05).kind == "store"
    assert steps.landings == [0, 1, 2] and steps.cleanups == 1
    assert steps.end_threads == [threading.current_thread().name]
    assert rig.copier.flag.released.is_set()
    rig.let_go()  # the worker then finds it ended: nothing is reported twice
    rig.hold()
    assert steps.landings == [0, 1, 2] and steps.cleanups == 1 and len(steps.ends) == 1


def test_a_one_copy_transfer_ends_when_it_lands_without_waking_the_worker(rig):
    """A GPU transfer of one copy enqueued at call time (the serving engine's small store or load)
    is followed by the landing watcher, which the driver rings: it ends, published, with its done
    callback run, while the worker's thread is held and nobody waits in a thread; the worker
    never sees it (nothing is reported twice once it runs again)."""
    rig.copier.flag = None
    rig.hold()  # the worker cannot run
    transfer, steps, events = rig.start(chunks=1)
    ended = threading.Event()
    transfer.add_done_callback(lambda t: ended.set())  # from a plain thread: runs where it ends
    assert not ended.wait(0.05), "ended before its copy landed"
    assert events[0].alarmed.is_set(), "no ring was enqueued for the copy's completion"
    events[0].complete()
    assert ended.wait(10), "the transfer did not end while the worker was held"
    assert transfer.result(0).kind == "store"
    assert steps.landings == [0] and steps.cleanups == 1 and steps.end_threads == ["kvoffload-test-worker-landings"]
    rig.let_go()
    rig.hold()  # the worker ran its turn: nothing more happened
    assert steps.landings == [0] and steps.cleanups == 1 and len(steps.ends) == 1


def test_a_burst_of_one_copy_transfers_costs_one_ring_and_each_ends_as_it_lands(rig):
    """Transfers handed over while a ring is on its way enqueue none of their own; woken, the watcher
    ends those that landed and rings again for the oldest still in flight, so each ends."""
    rig.copier.flag = None
    rig.hold()
    started = [rig.start(chunks=1) for _ in range(3)]
    events = [e for _, _, evs in started for e in evs]
    assert [e.alarmed.is_set() for e in events] == [True, False, False]
    events[0].complete()
    events[1].complete()  # lands before the watcher looks: ended in the same sweep
    assert started[0][0].exception(10) is None and started[1][0].exception(10) is None
    assert not started[2][0].done() and events[2].alarmed.wait(10), "no ring for the transfer still in flight"
    events[2].complete()
    assert started[2][0].exception(10) is None
    assert all(steps.cleanups == 1 for _, steps, _ in started)


def test_result_sleeps_until_the_copies_land_and_ends_the_transfer_itself(rig):
    """A thread blocked in result() on a transfer that cannot end early (no cancel flag) sleeps until
    its last copy completes, then ends it: no wake-up from the worker needed (the worker is held)."""
    rig.copier.flag = None
    transfer, steps, events = rig.start()
    result, slept = rig.result_landing_once_asleep(transfer, events, events[-1].waited)
    assert result.kind == "store"
    assert slept, "result() did not sleep on the last copy's event"
    assert steps.end_threads == [threading.current_thread().name] and steps.landings == [0, 1, 2]


def test_result_on_a_load_that_can_stop_early_sleeps_until_it_lands_and_ends_it_itself(rig):
    """A load of several chunks has a cancel flag, so its waiter cannot sleep in the driver on the
    last copy (a cancel ends it sooner). It sleeps on a wake semaphore the last copy's completion rings, and
    ends the transfer itself: no wake-up from the worker needed (the worker is held)."""
    assert rig.copier.flag is not None
    transfer, steps, events = rig.start()
    result, slept = rig.result_landing_once_asleep(transfer, events, events[-1].alarmed)
    assert result.kind == "store"
    assert slept, "result() did not sleep until the last copy rang"
    assert steps.end_threads == [threading.current_thread().name] and steps.landings == [0, 1, 2]
    assert rig.copier.flag.released.is_set()


def test_a_cancel_ends_a_thread_asleep_until_a_load_lands(rig, monkeypatch):
    """The waiter sleeping until the last copy lands learns of a cancel within the chunk copying
    now: it raises TransferCancelled though the later copies (their DMAs) have not completed.
    The worker's end of the transfer rings it."""
    monkeypatch.setattr(rig.worker.host_jobs, "RECHECK_ASLEEP_S", 60.0)  # only a ring wakes the waiter
    chose = threading.Event()  # the worker chose the copy the cancelled transfer ends with
    choose = rig.worker.host_jobs._end_at_first_incomplete

    def choose_and_tell(job) -> None:
        choose(job)
        chose.set()

    monkeypatch.setattr(rig.worker.host_jobs, "_end_at_first_incomplete", choose_and_tell)
    transfer, steps, events = rig.start()
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            transfer.result()
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert events[-1].alarmed.wait(10), "result() did not sleep until the last copy rang"
    assert transfer.cancel()
    assert chose.wait(10)
    events[0].complete()  # the copy running at the cancel; the later ones' DMAs still run
    waiter.join(10)
    assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], kvoffload.TransferCancelled)
    assert steps.ends == [(None, True)] and steps.landings == []


@pytest.mark.asyncio
async def test_await_and_done_end_a_landed_transfer_without_its_worker(rig):
    transfer, steps, events = rig.start()
    rig.hold()
    assert not transfer.done()
    for e in events[:2]:
        e.complete()
    assert not transfer.done(), "ended before its last copy completed"
    events[2].complete()
    assert transfer.done()  # done() notices the landed copies itself
    result = await asyncio.wait_for(transfer, 1)
    assert result.kind == "store" and steps.landings == [0, 1, 2] and len(steps.ends) == 1

    second, steps2, events2 = rig.start()
    for e in events2:
        e.complete()
    await asyncio.wait_for(second, 1)  # the worker is still held: the await ended it
    assert steps2.landings == [0, 1, 2] and len(steps2.ends) == 1


def test_a_cancelled_transfer_is_not_ended_done_by_its_waiter(rig):
    transfer, steps, events = rig.start()
    transfer.cancel()
    for e in events:
        e.complete()
    with pytest.raises(kvoffload.TransferCancelled):
        transfer.result(timeout=10)
    assert steps.ends == [(None, True)] and steps.cleanups == 1


def test_waiters_and_the_worker_racing_end_each_transfer_once():
    """Many transfers whose copies complete while a plain thread polls done() and the worker follows
    them: each ends once, its landings reported once, in order."""
    rig = _Rig()
    try:
        started = [rig.start() for _ in range(300)]
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                for t, _, _ in started:
                    t.done()

        pollers = [threading.Thread(target=poll) for _ in range(2)]
        for th in pollers:
            th.start()
        rig.hold()  # the first half lands while only the pollers can end them; the rest races the worker
        for i, (_, _, events) in enumerate(started):
            if i == len(started) // 2:
                rig.let_go()
            for e in events:
                e.complete()
        for t, _, _ in started:
            t.result(timeout=10)
        stop.set()
        for th in pollers:
            th.join()
        for t, steps, _ in started:
            assert steps.landings == [0, 1, 2] and steps.cleanups == 1 and len(steps.ends) == 1
        enders = {name for _, s, _ in started for name in s.end_threads}
        assert enders - {"kvoffload-test-worker"}, "no transfer was ended by a waiting thread"
    finally:
        rig.close()


def test_the_poll_bridge_follows_closely_only_what_somebody_waits_for():
    """A worker watches its copies without following closely (nobody waits yet); a waiter's call to follow closely, even one that
    arrives before the watch, makes the bridge follow them closely until nothing is pending."""
    from kvoffload._core.cuda.events import PollBridge

    async def run() -> None:
        bridge = PollBridge(asyncio.get_running_loop())
        first = StandInEvent()
        fut = bridge.watch(first, eager=False)
        assert not bridge.following_closely
        bridge.follow_closely()
        assert bridge.following_closely
        first.complete()
        await asyncio.wait_for(fut, 5)
        await asyncio.sleep(0)  # the poller notices nothing is pending
        assert not bridge.following_closely, "still following closely with nothing pending"
        bridge.follow_closely()  # a waiter's call overtaking the worker's watch is kept for it
        second = StandInEvent()
        fut = bridge.watch(second, eager=False)
        assert bridge.following_closely
        second.complete()
        await asyncio.wait_for(fut, 5)
        bridge.close()

    asyncio.run(run())


def test_following_closely_wakes_a_poller_waiting_for_its_next_tick():
    """Following closely does not wait for the bridge's next tick: with ticks a minute apart, the
    landed copy is still noticed at once."""
    from kvoffload._core.cuda.events import PollBridge

    async def run() -> None:
        bridge = PollBridge(asyncio.get_running_loop(), tick_s=60.0)
        event = StandInEvent()
        fut = bridge.watch(event, eager=False)
        while bridge._tick is None:  # the poller is between two ticks
            await asyncio.sleep(0)
        event.complete()
        bridge.follow_closely()
        await asyncio.wait_for(fut, 5)
        bridge.close()

    asyncio.run(run())


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
def test_an_interrupt_while_copies_are_enqueued_propagates_once_they_completed_and_the_flag_is_back(rig, where):
    """What the caller may then free (slots, pins) no copy still writes or reads."""
    if where == "between two copies":
        requests, submitted, after = _InterruptedAfter(rig.requests(3), 2), 2, None
    else:
        def interrupted(event: object) -> None:
            raise KeyboardInterrupt

        rig.copier.wait_for = interrupted
        requests, submitted, after = rig.requests(3), 0, object()
    lander = _land_once_settled(rig.copier, submitted) if submitted else None
    with pytest.raises(KeyboardInterrupt):
        rig.worker.submitter.enqueue(requests, after, kvoffload._core.workers.copy_submission.HandOver())
    complete_when_raised = [e.query() for e in rig.copier.events]
    flag_back_when_raised = rig.copier.flag.released.is_set()
    if lander is not None:
        lander.join()
    assert complete_when_raised == [True] * submitted, "the interrupt propagated with copies still running"
    assert flag_back_when_raised, "the interrupt propagated with the load's cancel flag still taken"


@pytest.mark.parametrize("worker_took_it", [False, True], ids=["before-the-worker-took-it", "after"])
@pytest.mark.parametrize("path", ["quick", "task"])
def test_an_interrupted_hand_over_ends_the_transfer_cancelled_exactly_once(rig, monkeypatch, path, worker_took_it):
    """An interrupt in ``host_jobs.start``/``tasks.start`` after the job was posted: ``abandon`` either takes
    the transfer back (its copies completed, its flag back) and ends it, or leaves it to the worker,
    which ends it cancelled. Either way it ends cancelled, cleaned up and counted once."""
    from kvoffload._core.workers.copy_submission import HandOver
    from kvoffload._core.workers.host_copy_jobs import HostCopyJob
    from kvoffload._core.workers.transfer import TransferControl

    steps = _PublishingSteps()
    control = TransferControl("load")
    transfer = control.transfer
    hand_over = HandOver()
    job = HostCopyJob(control, hand_over, steps, steps.ended, copies=rig.worker.submitter.enqueue(rig.requests(2), None, hand_over)) if path == "quick" else None

    def taken() -> bool:
        """The worker has the job (it arrived), or made the task (which installs a canceller)."""
        return job in rig.worker.host_jobs._live if job is not None else transfer._canceller is not None

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

    async def run_forever():
        await asyncio.Event().wait()

    lander = _land_once_settled(rig.copier, 2) if path == "quick" and not worker_took_it else None
    if not worker_took_it:
        rig.hold()  # the worker cannot take the job before the interrupt
    monkeypatch.setattr(rig.loop, "mailbox", InterruptedPost())
    try:
        with pytest.raises(KeyboardInterrupt):
            if job is not None:
                rig.worker.host_jobs.start(job)
            else:
                rig.worker.tasks.start(control, hand_over, run_forever, steps.cleanup, steps.ended)
    finally:
        monkeypatch.setattr(rig.loop, "mailbox", real_box)
    rig.worker.abandon(hand_over, control, steps, steps.ended)
    if path == "quick" and not worker_took_it:
        assert all(e.query() for e in rig.copier.events), "abandon returned with copies still running"
        assert rig.copier.flag.released.is_set()
    if lander is not None:
        lander.join()
    for e in rig.copier.events:
        e.complete()
    with pytest.raises(kvoffload.TransferCancelled):
        transfer.result(HANG_S)
    rig.let_go()
    rig.hold()  # the worker has taken what was posted
    if job is not None:
        spin_until(lambda: job.ended or hand_over.withdrawn, what="the job ended or came back")
    else:
        spin_until(lambda: not rig.loop._tasks, what="the worker's task for the transfer ended")
    rig.hold()  # and whatever the worker does at a job's or task's end is over
    assert steps.ends == [(None, True)] and steps.cleanups == 1 and steps.landings == []
