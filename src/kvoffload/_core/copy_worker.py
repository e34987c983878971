"""A *copy worker*: one direction's worker loop, its block copier and its completion bridge.

The offloader has a store worker and a load worker. A transfer reaches its
worker one of two ways:

* **Quick** (:meth:`CopyWorker.start_quick`): a transfer between the cache
  and host slots that needs nothing else (no spill, no disk). Its copies are
  either enqueued whole in the caller's thread (GPU caches, :meth:`enqueue`)
  or made by the worker in one step (CPU caches, one chunk). The worker runs
  no task for it: every quick transfer handed over during one loop turn is
  taken in one batch callback, their copies submitted together (coalesced into
  one copier call per host buffer and chunk), and each is finished from the
  completion of its last copy. Waiters are woken last, once the batch is done.
  A GPU quick transfer can also be finished by the thread that waits for it
  (:meth:`CopyWorker.finish_landed`): awaited once its copies have completed,
  it ends there and then, with no hop through the worker's thread, which may
  not get the GIL for milliseconds while the caller's thread runs Python.
* **Task** (:meth:`CopyWorker.start_task`): everything else (spills, the disk
  tier, multi-chunk CPU copies) runs as a coroutine on the loop, copying
  through :meth:`copy` (coalesced the same way) and :meth:`pipeline`.

Either way, what a transfer's foreign calls raise is turned into
:class:`TransferError` at one place (:func:`as_transfer_error`). So is a copy that fails on
the device (an asynchronous CUDA error, which its completion event reports): every path that
learns that a copy completed (the bridge, a waiting thread, the cancel path, a task) asks
through :func:`~.cuda.events.completed` / :func:`~.cuda.events.wait_completed`, which raise
instead. What had not landed then is never reported (a store publishes only the chunks that
landed before), and the transfer is cleaned up at once: a failed event is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import torch

from .block_copy import BlockCopier
from .cross_thread import Alarm, give_back_alarm, take_alarm
from .cuda.events import completed, wait_completed
from .errors import OffloadError, TransferError
from .foreign import ForeignCallError, call_foreign
from .transfer import TransferControl, TransferResult
from .worker_loop import WorkerLoop

__all__ = [
    "CopyWorker", "CopyWorkers", "CopyRequest", "CopyCalls", "EndHook", "Enqueued", "HandOver", "JobSteps", "QuickJob", "as_transfer_error",
    "end_transfer",
]

log = logging.getLogger("kvoffload")

C = TypeVar("C")

EndHook = Callable[[TransferResult | None, BaseException | None, bool], Any]
"""``on_end(result, exc, cancelled)``: sees a transfer's outcome just before it ends (its plan counts it)."""


@dataclass(eq=False)
class CopyRequest:
    """Copy cache blocks ``block_ids`` to (``to_host``) or from rows ``rows`` of ``host``."""

    to_host: bool
    host: torch.Tensor
    block_ids: Sequence[int]
    rows: Sequence[int]
    future: asyncio.Future[Any] = field(init=False)
    submitted: bool = False
    event: Any = None


def _to_host(copier: BlockCopier, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> Any:
    return copier.to_host(block_ids, host, rows)


def _to_device(copier: BlockCopier, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> Any:
    return copier.to_device(host, rows, block_ids)


@dataclass
class CopyCalls:
    """How workers call their copier: ``to_host(copier, block_ids, host, rows)`` and
    ``to_device(copier, host, rows, block_ids)``, looked up at every call.

    One per offloader, shared by both workers; ``kvoffload._testing.copy_calls``
    hands it to tests, which replace an attribute to gate or break copies.
    """

    to_host: Callable[[BlockCopier, Sequence[int], torch.Tensor, Sequence[int]], Any] = _to_host
    to_device: Callable[[BlockCopier, torch.Tensor, Sequence[int], Sequence[int]], Any] = _to_device


@dataclass(eq=False)
class Enqueued:
    """Copies submitted together: one completion event per request, in order (None: the copy
    already happened), and the error that stopped the submission (the requests after it were
    not submitted)."""

    events: list[Any]
    error: Exception | None
    cancel_flag: Any = None
    """A GPU load's :class:`~.cuda.cancel_flags.CancelFlag`: raised on cancel, its kernels skip the rest."""

    def settle(self) -> None:
        """Block until every submitted copy has completed or failed: nothing more is written (a
        cleanup path: never raises for a failed copy, whose event counts as settled)."""
        for event in reversed(self.events):  # in stream order: the last one covers all
            if event is not None:
                try:
                    wait_completed(event)
                except ForeignCallError:  # a failed device: nothing more will be written
                    pass
                return

    def release(self) -> None:
        """:meth:`settle`, then give the cancel flag back (no kernel reads it any more). Idempotent."""
        self.settle()
        if self.cancel_flag is not None:
            self.cancel_flag.release()


def as_transfer_error(kind: str, e: BaseException) -> BaseException:
    """What a transfer reports for ``e``: the library's own errors and cancellation as they are,
    anything else (the user's, the driver's, ``SystemExit``) as :class:`TransferError` with it as
    the cause. The one place where foreign exceptions become kvoffload's."""
    if isinstance(e, ForeignCallError):  # the original exception becomes the cause
        err = TransferError(f"{kind} failed: {e}")
        err.__cause__ = e.__cause__
        return err
    if isinstance(e, (asyncio.CancelledError, OffloadError, GeneratorExit)):
        return e
    err = TransferError(f"{kind} failed: {e if isinstance(e, Exception) else repr(e)}")
    err.__cause__ = e
    return err


class JobSteps(Protocol):
    """A transfer's own bookkeeping, which its worker calls back (the tiers' store and load plans)."""

    reports_landings: bool
    """True: call :meth:`landed` as each copy completes (stores publish chunk by chunk)."""
    taken: float | None
    """When a worker took the transfer (``time.perf_counter()``); the worker sets it."""

    def landed(self, i: int) -> None:
        """Copy ``i`` (and every copy before it) has completed."""
        ...

    def result(self) -> TransferResult:
        """The finished transfer's result."""
        ...

    def cleanup(self) -> None:
        """Undo what did not finish; runs however the transfer ends, once its copies have completed. Idempotent."""
        ...


class QuickJob:
    """A transfer between the cache and host slots, run by the worker without a task.

    Exactly one of ``requests`` (copies the worker makes) and ``enqueued`` (copies
    submitted at call time) is given. ``on_end`` sees the outcome before the
    transfer is finished.
    """

    __slots__ = ("control", "hand_over", "steps", "on_end", "requests", "enqueued", "next_landing", "ended", "sleepers")

    def __init__(
        self, control: TransferControl, hand_over: HandOver, steps: JobSteps, on_end: EndHook, *,
        requests: list[CopyRequest] | None = None, enqueued: Enqueued | None = None,
    ) -> None:
        self.control = control
        self.hand_over = hand_over
        self.steps = steps
        self.on_end = on_end
        self.requests = requests
        self.enqueued = enqueued
        self.next_landing = 0
        self.ended = False
        self.sleepers: list[Alarm] = []
        """Alarms of threads asleep until the job's copies land (:meth:`CopyWorker.finish_landed`): rung at its end."""


class CopyWorker:
    """One direction's worker: loop thread + block copier + completion bridge."""

    RECHECK_ASLEEP_S = 0.1
    """A thread asleep until a job's copies land looks again this often, should a ring never come."""

    def __init__(
        self, kind: Literal["store", "load"], loop: WorkerLoop, copier: BlockCopier, bridge: Any, calls: CopyCalls, depth: int = 3
    ) -> None:
        self.kind = kind
        self.loop = loop
        self.copier = copier
        self.calls = calls
        self.bridge = bridge
        self.depth = depth
        self._pending: list[CopyRequest] = []
        self._flush_scheduled = False
        self._submit_lock = threading.Lock()
        """Held while the copier enqueues: callers' threads (:meth:`enqueue`) and the loop share it."""
        self._arrived: list[QuickJob] = []
        self._batch_scheduled = False
        self._live: set[QuickJob] = set()
        self._job_lock = threading.Lock()
        """Held to report a quick job's landings and to claim its end: the worker and a thread that
        waits for the job (:meth:`finish_landed`) may both get there."""
        self._finishing: list[tuple[QuickJob, TransferResult | None, BaseException | None, bool]] | None = None
        loop.add_stop_hook(self._end_quick_jobs)

    def _submit(self, to_host: bool, host: torch.Tensor, rows: Sequence[int], ids: Sequence[int]) -> Any:
        if to_host:
            return call_foreign("copy to host", self.calls.to_host, self.copier, ids, host, rows)
        return call_foreign("copy to device", self.calls.to_device, self.copier, host, rows, ids)

    # -- submission at call time (callers' threads) ------------------------------------------

    def enqueue(self, requests: Sequence[CopyRequest], after: Any, hand_over: HandOver) -> Enqueued:
        """Submit every request now, in the calling thread, after ``after`` (an event, or None).

        For GPU caches this only enqueues work on the copier's streams, so the
        copies run with no Python step between them, whatever the calling
        thread or the worker loop do meanwhile. Stops at the first error
        (``Enqueued.error``: it fails the transfer, as anything the copier raises does).
        A load of several chunks gets a cancel flag (:meth:`_stop_early`).

        The copies are recorded in ``hand_over`` as they are submitted. On a ``BaseException``
        raised around the copier's calls (a signal handler's ``KeyboardInterrupt``, say): waits until
        the copies submitted by then have completed and gives the cancel flag back, then re-raises;
        the caller may then free the slots.
        """
        enqueued = hand_over.enqueued = Enqueued([], None)
        if self.kind == "load" and len(requests) > 1:
            enqueued.cancel_flag = self.copier.take_cancel_flag()

        def submit() -> None:
            for r in requests:
                enqueued.events.append(self._submit(r.to_host, r.host, r.rows, r.block_ids))

        self._enqueue(enqueued, after, submit)
        return enqueued

    def enqueue_by_tensor(
        self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int], after: Any, hand_over: HandOver,
    ) -> Enqueued:
        """Like :meth:`enqueue` (``BaseException`` included) for a load with per-tensor completion (GPU
        copier only): one event per tensor, in ``kv_caches`` order."""
        enqueued = hand_over.enqueued = Enqueued([], None)
        enqueued.cancel_flag = self.copier.take_cancel_flag()

        def submit() -> None:
            enqueued.events.extend(call_foreign("copy to device", self.copier.to_device_by_tensor, host, rows, block_ids))  # type: ignore[attr-defined]

        self._enqueue(enqueued, after, submit)
        return enqueued

    def _enqueue(self, enqueued: Enqueued, after: Any, submit: Callable[[], None]) -> None:
        """Run ``submit`` under the submit lock, after ``after``, its kernels reading ``enqueued``'s cancel
        flag; what it raised becomes ``enqueued.error``, but a ``BaseException``, which propagates once
        what was submitted has completed and the flag is back."""
        flag = enqueued.cancel_flag
        try:
            with self._submit_lock:
                try:
                    if after is not None:
                        self.copier.wait_for(after)
                    with self.copier.stops_on(flag) if flag is not None else contextlib.nullcontext():
                        submit()
                except Exception as e:  # OSError, ForeignCallError, a driver error: fails this transfer only
                    enqueued.error = e
        except BaseException:
            enqueued.release()
            raise

    # -- quick transfers ------------------------------------------------------------------------

    def start_quick(self, job: QuickJob) -> None:
        """Hand ``job`` to the worker (from any thread); it is taken with the others of its loop turn,
        unless its :class:`HandOver` was withdrawn meanwhile (:meth:`abandon`)."""
        if job.enqueued is not None:
            job.control.set_finisher(functools.partial(self.finish_landed, job), self._hurry)
            if job.enqueued.cancel_flag is not None:
                job.control.set_canceller(functools.partial(self._stop_early, job))
        self.loop.mailbox.post(self._arrive, job)  # the hand-over: last

    def abandon(self, hand_over: HandOver, control: TransferControl, steps: JobSteps, on_end: EndHook) -> None:
        """After an exception (a signal handler's ``KeyboardInterrupt``, say) cut short the hand-over of
        a transfer (``control``) anywhere between the making of ``hand_over`` and the worker's taking it: if the
        worker took it, cancel it (the worker ends it, once its copies have landed); else withdraw it
        (no worker touches it) and end it cancelled here: its copies waited for, ``steps.cleanup()``
        (slots and pins go back), ``on_end``, the end. Call from the interrupted thread, then re-raise."""
        if not hand_over.withdraw():
            control.transfer.cancel()
            return
        if hand_over.enqueued is not None:
            hand_over.enqueued.release()
        end_transfer(self.loop.name, control, steps.cleanup, on_end, None, None, True)

    def _hurry(self) -> None:
        """(Any thread.) Somebody waits for a quick job: have the bridge follow its copies closely."""
        if self.bridge is None or self.bridge.hurried:  # CPU copies: nothing to follow; or hurried already
            return
        try:
            self.loop.mailbox.post(self.bridge.hurry)
        except RuntimeError:  # the worker has stopped: the job has ended or ends with it
            pass

    def finish_landed(self, job: QuickJob, wait: bool = False) -> bool:
        """From any thread: if every copy of ``job`` (enqueued at call time) has completed, report its
        landings and end it here, unless it ended or was cancelled; True if it ended here.

        ``wait``: first sleep until its last copy completes (the GIL released): one take of the GIL
        when it lands, where a waiter woken by the worker needs two (the worker's, then its own), each
        up to the interpreter's switch interval behind a thread busy in Python. In the driver when
        nothing can end the job sooner; a load with a cancel flag sleeps on an alarm instead
        (:meth:`_sleep_until_landed`), which its end rings too."""
        enqueued = job.enqueued
        if job.ended or enqueued is None or enqueued.error is not None or job.control.cancel_requested:
            return False
        events = enqueued.events
        last = events[-1] if events else None
        if last is not None:
            try:
                if wait and enqueued.cancel_flag is None:
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

    def _sleep_until_landed(self, job: QuickJob, last: Any) -> bool:
        """Sleep on an alarm, the GIL released, until ``last`` (``job``'s last copy event) completes,
        rung by the driver, or ``job`` ends, rung by :meth:`_finish` (a cancel ends it within a
        chunk); True if ``last`` completed, ForeignCallError if it failed. Without alarms (no POSIX
        semaphores): only asks."""
        try:
            alarm = take_alarm()
        except OSError:
            return completed(last)
        job.sleepers.append(alarm)
        try:
            try:
                self.copier.ring_when_complete(last, alarm)
            except Exception:  # a failed device: the worker ends the job, and rings
                log.debug("%s: could not enqueue a ring for a waiting thread", self.loop.name, exc_info=True)
            while not completed(last):
                if job.ended or job.control.cancel_requested:
                    return False
                alarm.sleep(self.RECHECK_ASLEEP_S)
            return True
        finally:
            job.sleepers.remove(alarm)
            give_back_alarm(alarm)

    def _stop_early(self, job: QuickJob) -> None:
        """The transfer's canceller (any thread): raise its cancel flag, so that its kernels skip
        what they have not started, and have the worker end it once the copy running now is done."""
        assert job.enqueued is not None
        try:
            job.enqueued.cancel_flag.raise_flag()
            self.loop.mailbox.post(self._end_early, job)
        except Exception:  # a failed device, a stopping worker: the job ends with its last copy
            log.debug("%s: could not stop a transfer early", self.loop.name, exc_info=True)

    def _end_early(self, job: QuickJob) -> None:
        """(On the loop.) Once the flag is raised on the device, every copy not complete by then reads it
        before it starts, except the first of them: end ``job`` cancelled once that one completes."""
        assert job.enqueued is not None
        raised = job.enqueued.cancel_flag.raised
        if raised is None:  # raising failed (a failed device): the job ends with its last copy
            return
        self._when_complete(raised, job, functools.partial(self._end_at_first_incomplete, job))

    def _end_at_first_incomplete(self, job: QuickJob) -> None:
        assert job.enqueued is not None
        for event in job.enqueued.events:
            try:
                if event is None or completed(event):
                    continue
            except ForeignCallError as e:
                self._fail(job, e)
                return
            self._when_complete(event, job, functools.partial(self._end, job, cancelled=True))
            return

    def _when_complete(self, event: Any, job: QuickJob, then: Callable[[], Any]) -> None:
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

    def _arrive(self, job: QuickJob) -> None:
        if not job.hand_over.take():  # withdrawn by its interrupted caller, who ends it
            return
        with self._job_lock:
            if job.ended:  # finished by a thread that waited for it
                return
            self._live.add(job)
        self._arrived.append(job)
        if not self._batch_scheduled:
            self._batch_scheduled = True
            self.loop.loop.call_soon(self._run_batch)

    def _run_batch(self) -> None:
        """Take every quick job that arrived this turn: submit their copies, follow their completion."""
        self._batch_scheduled = False
        jobs, self._arrived = self._arrived, []
        self._finishing = []
        now = time.perf_counter()
        for job in jobs:
            job.steps.taken = now
        try:
            to_copy: list[QuickJob] = []
            for job in jobs:
                if job.enqueued is not None:
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

    def _copy_coalesced(self, jobs: list[QuickJob]) -> None:
        """Submit the jobs' copies, one copier call per run of jobs into the same host buffer."""
        requests = []
        for job in jobs:
            assert job.requests is not None and len(job.requests) == 1
            requests.append(job.requests[0])
        for start, end, event, error in self._submit_runs(requests):
            for job in jobs[start:end]:
                if error is not None:  # OSError or ForeignCallError: fails the jobs of this call only
                    self._end(job, exc=error)
                else:
                    job.enqueued = Enqueued([event], None)
                    self._follow_guarded(job)

    def _submit_runs(self, requests: Sequence[CopyRequest]) -> Iterator[tuple[int, int, Any, Exception | None]]:
        """Submit ``requests`` in runs of consecutive ones that share a direction and a host buffer, at
        most ``chunk_blocks`` blocks per copier call; yields ``(start, end, event, error)`` per run,
        ``error`` being what the call raised (the run was then not submitted)."""
        limit = self.copier.chunk_blocks
        i = 0
        while i < len(requests):
            first = requests[i]
            n, j = len(first.block_ids), i + 1
            while (j < len(requests) and requests[j].to_host == first.to_host and requests[j].host is first.host
                   and n + len(requests[j].block_ids) <= limit):
                n += len(requests[j].block_ids)
                j += 1
            run = requests[i:j]
            ids = [b for r in run for b in r.block_ids] if len(run) > 1 else first.block_ids
            rows = [x for r in run for x in r.rows] if len(run) > 1 else first.rows
            try:
                with self._submit_lock:
                    event = self._submit(first.to_host, first.host, rows, ids)
            except Exception as e:  # OSError or ForeignCallError
                yield i, j, None, e
            else:
                yield i, j, event, None
            i = j

    def _follow_guarded(self, job: QuickJob) -> None:
        """:meth:`_follow`; should that fail (a bug of ours, a failed device), end the job once its copies are done."""
        try:
            self._follow(job)
        except BaseException as e:
            assert job.enqueued is not None
            job.enqueued.release()
            if not job.ended:
                self._end(job, exc=e)

    def _follow(self, job: QuickJob) -> None:
        """Report each copy of ``job`` as it completes (only the last when nothing reports landings)."""
        assert job.enqueued is not None
        events = job.enqueued.events
        if not events:  # nothing was submitted: nothing landed
            self._release_flag(job)
            self._copies_done(job)
            return
        first = 0 if job.steps.reports_landings else len(events) - 1
        for i in range(first, len(events)):
            if events[i] is None:
                self._land(job, i, None)
            else:  # nobody waits yet: a waiter hurries the bridge (Transfer._wait)
                self.bridge.watch(events[i], eager=False).add_done_callback(functools.partial(self._land, job, i))

    def _land(self, job: QuickJob, i: int, watched: asyncio.Future[None] | None) -> None:
        """Copy ``i`` of ``job`` completed (so did those before it), or failed (``watched``, its bridge
        future, holds the error)."""
        assert job.enqueued is not None
        events = job.enqueued.events
        failure = watched.exception() if watched is not None and not watched.cancelled() else None
        if failure is not None:
            self._fail(job, failure)
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
            job.enqueued.release()
            self._end(job, exc=error)
        elif i == len(events) - 1:
            self._copies_done(job)

    def _fail(self, job: QuickJob, error: BaseException, *, here: bool = False) -> bool:
        """A copy of ``job`` failed on the device: once nothing more is written (a failed event counts
        as settled), end it failed, or cancelled if a cancel came first; what had not landed is never
        reported. ``here``: as :meth:`_end`. True if it ended it."""
        if job.ended:
            return False
        assert job.enqueued is not None
        job.enqueued.release()
        if job.control.cancel_requested:
            return self._end(job, cancelled=True, here=here)
        return self._end(job, exc=error, here=here)

    @staticmethod
    def _report_landings(job: QuickJob, i: int) -> None:
        """Tell ``job``'s steps that copies up to ``i`` landed (those that want to know). Under the job lock."""
        if job.steps.reports_landings and not job.control.cancel_requested:
            while job.next_landing <= i:
                job.next_landing += 1
                job.steps.landed(job.next_landing - 1)

    @staticmethod
    def _release_flag(job: QuickJob) -> None:
        assert job.enqueued is not None
        if job.enqueued.cancel_flag is not None:
            job.enqueued.cancel_flag.release()

    def _copies_done(self, job: QuickJob) -> None:
        """Every submitted copy of ``job`` has completed: end it cancelled, failed or done."""
        assert job.enqueued is not None
        if job.control.cancel_requested:
            self._end(job, cancelled=True)
        elif job.enqueued.error is not None:
            self._end(job, exc=job.enqueued.error)
        else:
            self._end(job)

    def _end(
        self, job: QuickJob, exc: BaseException | None = None, cancelled: bool = False, *, claimed: bool = False, here: bool = False,
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

    def _finish(self, job: QuickJob, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        end_transfer(self.loop.name, job.control, None, job.on_end, result, exc, cancelled)
        for alarm in tuple(job.sleepers):
            alarm.ring()

    def _end_quick_jobs(self) -> None:
        """At shutdown (on the loop): let the copies of every quick job land, then end it cancelled."""
        for job in list(self._live):
            if job.enqueued is not None:
                job.enqueued.release()
            if not job.ended:
                self._end(job, cancelled=True)
        self._arrived = []

    # -- transfers run as tasks -------------------------------------------------------------------

    def start_task(
        self, control: TransferControl, hand_over: HandOver, run: Callable[[], Coroutine[Any, Any, TransferResult]],
        cleanup: Callable[[], Any], on_end: EndHook,
    ) -> None:
        """Run ``run()`` as a task on the loop for the transfer of ``control``, unless ``hand_over`` was
        withdrawn before the worker made the task (:meth:`abandon`): then no task runs it, and
        neither ``cleanup`` nor ``on_end`` runs on the worker. However the task ends (also cancelled
        before its first step, when the coroutine's own ``finally`` never runs), ``cleanup`` runs on
        the loop, then ``on_end`` sees the outcome, and only then does the transfer end, so what
        ``on_end`` records is visible to every waiter that wakes. A cancel goes to the task itself
        (``task.cancel()`` on its loop; the future of ``run_coroutine_threadsafe`` did not always
        pass it on, CPython gh-105836)."""
        kind, loop = self.kind, self.loop

        async def guarded() -> TransferResult:
            try:
                return await run()
            except BaseException as e:  # SystemExit & co. too: out of a task they would stop the worker loop
                mapped = as_transfer_error(kind, e)
                if mapped is e:
                    raise
                raise mapped from mapped.__cause__

        async def withdrawn() -> TransferResult:
            raise asyncio.CancelledError

        def ended(task: asyncio.Task[TransferResult]) -> None:
            cancelled = task.cancelled()
            exc = None if cancelled else task.exception()
            result = None if cancelled or exc is not None else task.result()
            if hand_over.taken:
                end_transfer(loop.name, control, cleanup, on_end, result, exc, cancelled)
            else:
                control.finish(result, exc, cancelled)

        def cancel(task: asyncio.Task[TransferResult]) -> None:
            if loop.in_thread():  # at once: a task cancelled before its first step copies nothing
                task.cancel()
                return
            with contextlib.suppress(RuntimeError):  # the loop has stopped: its stop cancelled every task
                loop.mailbox.post(task.cancel)

        def create() -> None:
            task = loop.loop.create_task(guarded() if hand_over.take() else withdrawn())
            loop.track(task)
            task.add_done_callback(ended)
            control.set_canceller(functools.partial(cancel, task))

        loop.mailbox.post(create)

    async def copy(self, req: CopyRequest) -> Any:
        """Submit ``req`` with whatever else is requested this loop turn; returns its completion event.

        If cancelled, a request not yet submitted is withdrawn; one already
        submitted is waited for before the ``CancelledError`` propagates.
        """
        loop = self.loop.loop
        req.future = loop.create_future()
        self._pending.append(req)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        try:
            return await req.future
        except BaseException:
            if not req.submitted:
                if req in self._pending:
                    self._pending.remove(req)
            else:
                await self.settle(req.event)
            raise

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        pending = [r for r in pending if not r.future.cancelled()]
        for start, end, event, error in self._submit_runs(pending):
            for r in pending[start:end]:
                if error is not None:  # fails the transfers of this call only
                    if not r.future.done():
                        r.future.set_exception(error)
                    continue
                r.submitted, r.event = True, event
                if not r.future.done():
                    r.future.set_result(event)

    async def wait(self, event: Any) -> None:
        """Wait until ``event`` completed (None: already complete). Raises ForeignCallError if its
        copies failed on the device (what it covers did not land)."""
        if event is not None:
            await self.bridge.watch(event)

    async def settle(self, event: Any) -> None:
        """Wait until ``event`` completed or failed, even if cancelled meanwhile (cleanup path: never
        raises for a failed copy, whose event counts as settled)."""
        if event is None:
            return
        fut = self.bridge.watch(event)
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except ForeignCallError:  # a failed device: nothing more will be written
                break
        if not fut.cancelled():
            fut.exception()  # retrieved: a failure here is the cleanup's to ignore

    async def pipeline(self, chunks: Iterable[C], request: Callable[[C], CopyRequest], completed: Callable[[C], Any]) -> None:
        """Copy each chunk (``request(chunk)``) in order, up to ``depth`` in flight; ``completed(chunk)`` as each lands.

        On cancellation or error nothing more is submitted, every copy already
        submitted is waited for, and the exception propagates; chunks that
        landed stay reported.
        """
        inflight: deque[tuple[Any, C]] = deque()
        try:
            for chunk in chunks:
                event = await self.copy(request(chunk))
                inflight.append((event, chunk))
                while inflight and (inflight[0][0] is None or len(inflight) >= self.depth):
                    await self.wait(inflight[0][0])
                    completed(inflight.popleft()[1])
            while inflight:
                await self.wait(inflight[0][0])
                completed(inflight.popleft()[1])
        except BaseException:
            if inflight:
                await self.settle(inflight[-1][0])  # in stream order: the last one covers all
            raise


_HAND_OVER_LOCK = threading.Lock()


def end_transfer(
    where: str, control: TransferControl, cleanup: Callable[[], Any] | None, on_end: EndHook,
    result: TransferResult | None, exc: BaseException | None, cancelled: bool,
) -> None:
    """How a worker ends a transfer, whichever way it ran: ``cleanup()`` (what it holds goes back; its
    copies have completed), ``on_end`` sees the outcome, then the transfer ends (its waiters wake).
    Nothing raised here escapes (a ``SystemExit`` would stop the worker's loop for good)."""
    if cleanup is not None:
        try:
            cleanup()
        except BaseException:
            log.exception("%s: transfer cleanup raised", where)
    try:
        on_end(result, exc, cancelled)
    except BaseException:
        log.exception("%s: transfer end hook raised", where)
    control.finish(result, exc, cancelled)


class HandOver:
    """A transfer's way to its worker, which an interrupt (a signal handler's ``KeyboardInterrupt``)
    may cut short anywhere. Made by the caller before it reserves anything; who owns the transfer is
    decided once: the worker, when it :meth:`take` s it, or the interrupted caller, when it
    :meth:`withdraw` s it (then :meth:`CopyWorker.abandon` ends it). Copies enqueued at call time are
    recorded here (:attr:`enqueued`) as they are submitted, so that the owner can wait for them."""

    __slots__ = ("taken", "withdrawn", "enqueued")

    def __init__(self) -> None:
        self.taken = False
        self.withdrawn = False
        self.enqueued: Enqueued | None = None

    def take(self) -> bool:
        """(The worker.) True: the transfer is the worker's; False: it was withdrawn."""
        with _HAND_OVER_LOCK:
            self.taken = not self.withdrawn
            return self.taken

    def withdraw(self) -> bool:
        """(The interrupted caller.) True: the transfer is back; False: the worker has it."""
        with _HAND_OVER_LOCK:
            self.withdrawn = not self.taken
            return self.withdrawn


@dataclass(frozen=True)
class CopyWorkers:
    """The offloader's workers: stores and loads never wait behind each other, and expedited
    loads (host memory to the cache, on higher-priority streams) never wait behind loads."""

    store: CopyWorker
    load: CopyWorker
    expedited: CopyWorker | None = None
    """Only with ``Options.expedited_loads``."""
