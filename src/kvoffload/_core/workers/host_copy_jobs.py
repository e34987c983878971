"""Host-copy jobs: transfers whose copies all run between the cache and host slots (a store
that needs no spill and no disk, a load of host-resident keys), run by the worker without a task.

Their copies are either enqueued whole in the caller's thread (GPU caches,
:meth:`~.copy_submission.CopySubmitter.enqueue`) or made by the worker in one step (CPU caches,
one chunk). Every job handed over during one loop turn is taken in one batch callback, their
copies submitted together (coalesced into one copier call per host buffer and chunk), and each
is ended from the completion of its last copy; waiters are woken last, once the batch is done.
A GPU job can also be ended by the thread that waits for it (:meth:`HostCopyJobs.finish_landed`):
awaited once its copies have completed, it ends there and then, with no hop through the worker's
thread, which may not get the GIL for milliseconds while the caller's thread runs Python.

A copy that fails on the device (an asynchronous CUDA error, which its completion event reports)
is learnt through :func:`~.cuda.events.completed` / :func:`~.cuda.events.wait_completed` on every
path (the bridge, a waiting thread, the cancel path): what had not landed is never reported (a
store publishes only the chunks that landed before), and the job is cleaned up at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from .copy_submission import CopyRequest, CopySubmitter, HandOver, SubmittedCopies
from ..base.cross_thread import WakeSemaphore, give_back_wake_semaphore, take_wake_semaphore
from ..base.helper_threads import mark_own_thread
from ..cuda.events import CompletionBridge, CopyEvent, completed, wait_completed
from ..base.foreign import ForeignCallError
from .transfer import TransferControl, TransferResult
from ..base.foreign import as_transfer_error
from .transfer_end import EndHook, JobSteps, end_transfer
from .worker_loop import WorkerLoop

__all__ = ["HostCopyJob", "HostCopyJobs"]

log = logging.getLogger("kvoffload")


class HostCopyJob:
    """A transfer between the cache and host slots, run by the worker without a task.

    Exactly one of ``requests`` (copies the worker makes) and ``copies`` (copies
    submitted at call time) is given. ``on_end`` sees the outcome before the
    transfer is finished.
    """

    __slots__ = ("control", "hand_over", "steps", "on_end", "requests", "copies", "next_landing", "ended", "sleepers")

    def __init__(
        self, control: TransferControl, hand_over: HandOver, steps: JobSteps, on_end: EndHook, *,
        requests: list[CopyRequest] | None = None, copies: SubmittedCopies | None = None,
    ) -> None:
        self.control = control
        self.hand_over = hand_over
        self.steps = steps
        self.on_end = on_end
        self.requests = requests
        self.copies = copies
        self.next_landing = 0
        self.ended = False
        self.sleepers: list[WakeSemaphore] = []
        """Wake semaphores of threads asleep until the job's copies land (:meth:`HostCopyJobs.finish_landed`): rung at its end."""


class HostCopyJobs:
    """One worker's host-copy jobs: handed over from any thread, taken in batches on its loop."""

    RECHECK_ASLEEP_S = 0.1
    """A thread asleep until a job's copies land looks again this often, should a ring never come."""

    def __init__(self, kind: Literal["store", "load"], loop: WorkerLoop, submitter: CopySubmitter, bridge: CompletionBridge | None) -> None:
        self.kind = kind
        self.loop = loop
        self.submitter = submitter
        self.bridge = bridge
        self._arrived: list[HostCopyJob] = []
        self._batch_scheduled = False
        self._live: set[HostCopyJob] = set()
        self._job_lock = threading.Lock()
        """Held to report a job's landings and to claim its end: the worker and a thread that waits
        for the job (:meth:`finish_landed`) may both get there."""
        self._finishing: list[tuple[HostCopyJob, TransferResult | None, BaseException | None, bool]] | None = None
        self._watcher: LandingWatcher | None = None
        self._watcher_unavailable = False
        loop.add_stop_hook(self.end_all)

    # -- ---------------------------------------------------------------------

    def start(self, job: HostCopyJob) -> None:
        """Hand ``job`` to the worker (from any thread); it is taken with the others of its loop turn,
        unless its :class:`HandOver` was withdrawn meanwhile (:meth:`~.copy_worker.CopyWorker.abandon`).
        A GPU job of one copy enqueued at call time goes to the :class:`LandingWatcher` instead, in
        this thread: the worker's thread never wakes for it."""
        copies = job.copies
        if copies is not None:
            watcher = self._landing_watcher(copies)
            if watcher is not None:
                job.control.set_finisher(functools.partial(self.finish_landed, job), _nothing)
                job.steps.taken = time.perf_counter()
                watcher.watch(job)  # the hand-over: last (the watcher takes it)
                return
            job.control.set_finisher(functools.partial(self.finish_landed, job), self._follow_closely)
            if copies.cancel_flag is not None:
                job.control.set_canceller(functools.partial(self._stop_early, job))
        self.loop.mailbox.post(self._arrive, job)  # the hand-over: last

    def _landing_watcher(self, copies: SubmittedCopies) -> LandingWatcher | None:
        """The watcher for a job with these ``copies`` (made at the first one), or None when the job
        takes the worker's way: CPU copies, several copies (landings to report chunk by chunk, a
        cancel flag), none, a failed submission, or no semaphores here."""
        if (self.bridge is None or len(copies.events) != 1 or copies.events[0] is None or copies.error is not None
                or copies.cancel_flag is not None or self._watcher_unavailable):
            return None
        watcher = self._watcher
        if watcher is None:
            with self._job_lock:
                if self._watcher is None and not self._watcher_unavailable:
                    try:
                        self._watcher = LandingWatcher(self, f"{self.loop.name}-landings")
                    except OSError:  # no POSIX semaphores: the worker follows every job
                        self._watcher_unavailable = True
                watcher = self._watcher
        return watcher

    def _follow_closely(self) -> None:
        """(Any thread.) Somebody waits for a host-copy job: have the bridge follow its copies closely."""
        if self.bridge is None or self.bridge.following_closely:  # CPU copies: nothing to follow; or hurried already
            return
        try:
            self.loop.mailbox.post(self.bridge.follow_closely)
        except RuntimeError:  # the worker has stopped: the job has ended or ends with it
            pass

    def finish_landed(self, job: HostCopyJob, wait: bool = False) -> bool:
        """From any thread: if every copy of ``job`` (copies at call time) has completed, report its
        landings and end it here, unless it ended or was cancelled; True if it ended here.

        ``wait``: first sleep until its last copy completes (the GIL released): one take of the GIL
        when it lands, where a waiter woken by the worker needs two (the worker's, then its own), each
        up to the interpreter's switch interval behind a thread busy in Python. In the driver when
        nothing can end the job sooner; a load with a cancel flag sleeps on a wake semaphore instead
        (:meth:`_sleep_until_landed`), which its end rings too."""
        copies = job.copies
        if job.ended or copies is None or copies.error is not None or job.control.cancel_requested:
            return False
        events = copies.events
        last = events[-1] if events else None
        if last is not None:
            try:
                if wait and copies.cancel_flag is None:
                    wait_completed(last)
                    if job.ended or job.control.cancel_requested:
                        return False
                elif not (self._sleep_until_landed(job, last) if wait else completed(last)):
                    return False
            except ForeignCallError as e:  # its copies failed: they are settled, it ends failed here
                if job.steps.taken is None:
                    job.steps.taken = time.perf_counter()
                return self._fail(job, e, here=True)
        with self._job_lock:
            if job.ended:
                return False
            try:
                self._report_landings(job, len(events) - 1)
            except BaseException:  # a bug of ours: leave the job to its worker, which ends it with the error
                return False
            job.ended = True
        if job.steps.taken is None:
            job.steps.taken = time.perf_counter()
        self._release_flag(job)
        self._end(job, claimed=True, here=True)
        return True

    def _sleep_until_landed(self, job: HostCopyJob, last: Any) -> bool:
        """Sleep on a wake semaphore, the GIL released, until ``last`` (``job``'s last copy event) completes,
        rung by the driver, or ``job`` ends, rung by :meth:`_finish` (a cancel ends it within a
        chunk); True if ``last`` completed, ForeignCallError if it failed. Without wake semaphores (no POSIX
        semaphores): only asks."""
        try:
            semaphore = take_wake_semaphore()
        except OSError:
            return completed(last)
        job.sleepers.append(semaphore)
        try:
            try:
                self.submitter.copier.ring_when_complete(last, semaphore)
            except Exception:  # a failed device: the worker ends the job, and rings
                log.debug("%s: could not enqueue a ring for a waiting thread", self.loop.name, exc_info=True)
            while not completed(last):
                if job.ended or job.control.cancel_requested:
                    return False
                semaphore.sleep(self.RECHECK_ASLEEP_S)
            return True
        finally:
            job.sleepers.remove(semaphore)
            give_back_wake_semaphore(semaphore)

    def _stop_early(self, job: HostCopyJob) -> None:
        """The transfer's canceller (any thread): raise its cancel flag, so that its kernels skip
        what they have not started, and have the worker end it once the copy running now is done."""
        assert job.copies is not None
        try:
            job.copies.cancel_flag.raise_flag()
            self.loop.mailbox.post(self._end_early, job)
        except Exception:  # a failed device, a stopping worker: the job ends with its last copy
            log.debug("%s: could not stop a transfer early", self.loop.name, exc_info=True)

    def _end_early(self, job: HostCopyJob) -> None:
        """(On the loop.) Once the flag is raised on the device, every copy not complete by then reads it
        before it starts, except the first of them: end ``job`` cancelled once that one completes."""
        assert job.copies is not None
        raised = job.copies.cancel_flag.raised
        if raised is None:  # raising failed (a failed device): the job ends with its last copy
            return
        self._when_complete(raised, job, functools.partial(self._end_at_first_incomplete, job))

    def _end_at_first_incomplete(self, job: HostCopyJob) -> None:
        assert job.copies is not None
        for event in job.copies.events:
            try:
                if event is None or completed(event):
                    continue
            except ForeignCallError as e:
                self._fail(job, e)
                return
            self._when_complete(event, job, functools.partial(self._end, job, cancelled=True))
            return

    def _when_complete(self, event: CopyEvent, job: HostCopyJob, then: Callable[[], Any]) -> None:
        """Poll ``event`` every 0.1 ms, then call ``then()``, unless ``job`` ended meanwhile; should the
        event fail, :meth:`_fail` ``job`` instead. (The bridge cannot watch these events: it follows
        events in the order they were watched, and the job's last one came first.)"""
        if job.ended:
            return
        try:
            complete = completed(event)
        except ForeignCallError as e:
            self._fail(job, e)
            return
        if complete:
            then()
        else:
            self.loop.loop.call_later(1e-4, self._when_complete, event, job, then)

    def _take(self, job: HostCopyJob) -> bool:
        """Take a job handed over (the worker or the landing watcher): True if it is now live here;
        False if its interrupted caller withdrew it (and ends it) or a waiting thread ended it."""
        if not job.hand_over.take():
            return False
        with self._job_lock:
            if job.ended:
                return False
            self._live.add(job)
        return True

    def _arrive(self, job: HostCopyJob) -> None:
        if not self._take(job):
            return
        self._arrived.append(job)
        if not self._batch_scheduled:
            self._batch_scheduled = True
            self.loop.loop.call_soon(self._run_batch)

    def _run_batch(self) -> None:
        """Take every host-copy job that arrived this turn: submit their copies, follow their completion."""
        self._batch_scheduled = False
        jobs, self._arrived = self._arrived, []
        self._finishing = []
        now = time.perf_counter()
        for job in jobs:
            job.steps.taken = now
        try:
            to_copy: list[HostCopyJob] = []
            for job in jobs:
                if job.copies is not None:
                    self._follow_guarded(job)
                elif job.control.cancel_requested:  # nothing copied yet: nothing to wait for
                    self._end(job, cancelled=True)
                else:
                    to_copy.append(job)
            self._copy_coalesced(to_copy)
        finally:
            finishing, self._finishing = self._finishing, None
            for args in finishing:  # wake-ups last: each may hand the GIL to a woken thread
                self._finish(*args)

    def _copy_coalesced(self, jobs: list[HostCopyJob]) -> None:
        """Submit the jobs' copies, one copier call per run of jobs into the same host buffer."""
        requests = []
        for job in jobs:
            assert job.requests is not None and len(job.requests) == 1
            requests.append(job.requests[0])
        for start, end, event, error in self.submitter.submit_runs(requests):
            for job in jobs[start:end]:
                if error is not None:  # OSError or ForeignCallError: fails the jobs of this call only
                    self._end(job, exc=error)
                else:
                    job.copies = SubmittedCopies([event], None)
                    self._follow_guarded(job)

    def _follow_guarded(self, job: HostCopyJob) -> None:
        """:meth:`_follow`; should that fail (a bug of ours, a failed device), end the job once its copies are done."""
        try:
            self._follow(job)
        except BaseException as e:
            assert job.copies is not None
            job.copies.release()
            if not job.ended:
                self._end(job, exc=e)

    def _follow(self, job: HostCopyJob) -> None:
        """Report each copy of ``job`` as it completes (only the last when nothing reports landings)."""
        assert job.copies is not None
        events = job.copies.events
        if not events:  # nothing was submitted: nothing landed
            self._release_flag(job)
            self._copies_done(job)
            return
        first = 0 if job.steps.reports_landings else len(events) - 1
        for i in range(first, len(events)):
            event = events[i]
            if event is None:
                self._land(job, i, None)
            else:  # nobody waits yet: a waiter has the bridge follow closely (Transfer._wait)
                assert self.bridge is not None  # events come from a GPU copier, which has a bridge
                self.bridge.watch(event, eager=False).add_done_callback(functools.partial(self._land, job, i))

    def _land(self, job: HostCopyJob, i: int, watched: asyncio.Future[None] | None, *, here: bool = False) -> None:
        """Copy ``i`` of ``job`` completed (so did those before it), or failed (``watched``, its bridge
        future, holds the error). ``here``: as :meth:`_end`."""
        assert job.copies is not None
        events = job.copies.events
        failure = watched.exception() if watched is not None and not watched.cancelled() else None
        if failure is not None:
            self._fail(job, failure, here=here)
            return
        if i == len(events) - 1:  # no kernel reads the flag any more (even if the job ended early)
            self._release_flag(job)
        with self._job_lock:
            if job.ended:
                return
            try:
                self._report_landings(job, i)
            except BaseException as e:  # a bug of ours: end the job only once nothing more is written
                error: BaseException | None = e
            else:
                error = None
        if error is not None:
            job.copies.release()
            self._end(job, exc=error, here=here)
        elif i == len(events) - 1:
            self._copies_done(job, here=here)

    def _fail(self, job: HostCopyJob, error: BaseException, *, here: bool = False) -> bool:
        """A copy of ``job`` failed on the device: once nothing more is written (a failed event counts
        as settled), end it failed, or cancelled if a cancel came first; what had not landed is never
        reported. ``here``: as :meth:`_end`. True if it ended it."""
        if job.ended:
            return False
        assert job.copies is not None
        job.copies.release()
        if job.control.cancel_requested:
            return self._end(job, cancelled=True, here=here)
        return self._end(job, exc=error, here=here)

    @staticmethod
    def _report_landings(job: HostCopyJob, i: int) -> None:
        """Tell ``job``'s steps that copies up to ``i`` landed (those that want to know). Under the job lock."""
        if job.steps.reports_landings and not job.control.cancel_requested:
            while job.next_landing <= i:
                job.next_landing += 1
                job.steps.landed(job.next_landing - 1)

    @staticmethod
    def _release_flag(job: HostCopyJob) -> None:
        assert job.copies is not None
        if job.copies.cancel_flag is not None:
            job.copies.cancel_flag.release()

    def _copies_done(self, job: HostCopyJob, *, here: bool = False) -> None:
        """Every submitted copy of ``job`` has completed: end it cancelled, failed or done."""
        assert job.copies is not None
        if job.control.cancel_requested:
            self._end(job, cancelled=True, here=here)
        elif job.copies.error is not None:
            self._end(job, exc=job.copies.error, here=here)
        else:
            self._end(job, here=here)

    def _end(
        self, job: HostCopyJob, exc: BaseException | None = None, cancelled: bool = False, *, claimed: bool = False, here: bool = False,
    ) -> bool:
        """Clean up after ``job`` (its copies have completed) and finish its transfer: batched when the
        worker is in a batch, unless ``here``. Nothing if the job ended already, unless the caller
        ``claimed`` its end (set ``job.ended`` under the job lock). True if it ended it."""
        if not claimed:
            with self._job_lock:
                if job.ended:
                    return False
                job.ended = True
        self._live.discard(job)
        try:
            job.steps.cleanup()
        except BaseException:
            log.exception("%s: transfer cleanup raised", self.loop.name)
        result = None
        if not cancelled and exc is None:
            try:
                result = job.steps.result()
            except BaseException as e:
                exc = e
        if exc is not None:
            exc = as_transfer_error(self.kind, exc)
        if self._finishing is not None and not here:
            self._finishing.append((job, result, exc, cancelled))
        else:
            self._finish(job, result, exc, cancelled)
        return True

    def _finish(self, job: HostCopyJob, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        end_transfer(self.loop.name, job.control, None, job.on_end, result, exc, cancelled)
        for semaphore in tuple(job.sleepers):
            semaphore.ring()

    def end_all(self) -> None:
        """At shutdown (on the loop): stop the landing watcher, let the copies of every host-copy job
        land, then end it cancelled."""
        watcher, self._watcher = self._watcher, None
        self._watcher_unavailable = True  # none after shutdown
        if watcher is not None:
            for job in watcher.stop():  # handed over, not taken yet: the worker's now
                self._take(job)
        for job in list(self._live):
            if job.copies is not None:
                job.copies.release()
            if not job.ended:
                self._end(job, cancelled=True)
        self._arrived = []


def _nothing() -> None:
    """A waiter's call to follow its job closely, for jobs the landing watcher follows: it is woken
    by the driver, not by polling, so there is nothing to hurry."""


class LandingWatcher:
    """Ends GPU host-copy jobs of one copy as their copy lands, on a thread of its own that sleeps on
    a semaphore (a :class:`~..base.cross_thread.WakeSemaphore`) which the copier has the driver ring once the
    copy's event completes (``ring_when_complete``, a host function on a stream of its own).

    The caller's thread hands a job over without waking anybody (the watcher takes the
    :class:`HandOver` when it first looks, as the worker would); while copies are in flight no
    thread of kvoffload's runs; when one lands the watcher takes the GIL once, ends every job whose
    copy has landed by then (publishing, giving back, waking waiters where they wait), and sleeps
    again. A job a waiting thread ends first (:meth:`HostCopyJobs.finish_landed`), or its
    interrupted caller withdrew, is dropped.
    """

    IDLE_RECHECK_S = 1.0
    """How often the watcher looks with nothing to watch (it only checks whether to stop)."""
    RECHECK_S = 0.05
    """How often it looks while jobs are watched, should a ring never come (a failed device)."""

    def __init__(self, jobs: HostCopyJobs, name: str) -> None:
        self._jobs = jobs
        self._semaphore = take_wake_semaphore()  # OSError without semaphores: the caller falls back
        self._watched: list[HostCopyJob] = []
        self._lock = threading.Lock()
        self._ring_pending = False
        """A ring is on its way for the oldest watched job: jobs handed over meanwhile need none."""
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, job: HostCopyJob) -> None:
        """(The caller's thread.) Follow ``job``, its one copy enqueued. Unless a ring is already on its
        way (for an older job: the watcher, woken, rings again for the oldest job still in flight),
        have the driver ring the watcher once this copy lands: a burst of transfers costs one ring."""
        assert job.copies is not None
        with self._lock:
            if self._stopping:  # as a stopped worker's mailbox does: the caller's clean-up ends the job
                raise RuntimeError("the worker has stopped")
            self._watched.append(job)
            ring = not self._ring_pending
            self._ring_pending = True
        if ring:
            self._ring_after(job)

    def _ring_after(self, job: HostCopyJob) -> None:
        """Have the driver ring the watcher once ``job``'s copy completes."""
        event = job.copies.events[0] if job.copies is not None else None
        assert event is not None  # a watched job has one copy
        try:
            self._jobs.submitter.copier.ring_when_complete(event, self._semaphore)
        except Exception:  # a failed device: the watcher's next look finds the copy failed
            log.debug("%s: could not enqueue a landing ring", self._thread.name, exc_info=True)
            self._semaphore.ring()

    def _run(self) -> None:
        mark_own_thread()
        while not self._stopping:
            self._semaphore.sleep(self.RECHECK_S if self._watched else self.IDLE_RECHECK_S)
            if self._watched:
                try:
                    self._sweep()
                except BaseException:  # a bug of ours must not stop the watcher: the jobs end at shutdown
                    log.exception("%s: ending landed jobs raised", self._thread.name)

    def _sweep(self) -> None:
        """End every watched job whose copy has landed (or failed); keep the others, and have the
        driver ring again once the oldest of them lands."""
        with self._lock:
            watched = list(self._watched)
            self._ring_pending = False  # the ring came (or the look is a recheck): watch() may ring again
        gone: set[int] = set()
        jobs = self._jobs
        for job in watched:
            if not job.ended and (job.hand_over.taken or jobs._take(job)):  # else: ended by a waiter, or withdrawn
                event = job.copies.events[0] if job.copies is not None else None
                assert event is not None  # a watched job has one copy (HostCopyJobs._landing_watcher)
                try:
                    if not completed(event):
                        continue
                except ForeignCallError as e:  # the copy failed on the device: it is settled
                    jobs._fail(job, e, here=True)
                else:
                    jobs._land(job, 0, None, here=True)
            gone.add(id(job))
        with self._lock:
            if gone:
                self._watched = [j for j in self._watched if id(j) not in gone]
            oldest = self._watched[0] if self._watched and not self._ring_pending else None
            if oldest is not None:
                self._ring_pending = True
        if oldest is not None:
            self._ring_after(oldest)

    def stop(self) -> list[HostCopyJob]:
        """Stop the thread and give the semaphore back; the jobs still watched, not yet taken, are
        returned for the worker to end."""
        with self._lock:
            self._stopping = True  # nothing is handed over from here on (watch() refuses)
        self._semaphore.ring()
        self._thread.join(5.0)
        if not self._thread.is_alive():
            give_back_wake_semaphore(self._semaphore)
        with self._lock:
            left, self._watched = self._watched, []
        return [job for job in left if not job.hand_over.taken]
