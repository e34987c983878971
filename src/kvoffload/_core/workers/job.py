"""A transfer's one record on the workers' side: :class:`Job`.

The caller holds the :class:`~.transfer.Transfer`; everything else a running transfer has is one
job: its copies (their completion events, the error that stopped their submission, a load's cancel
flag), who owns it (the worker once it takes it, or the caller that was interrupted before), the
task that runs it, and the tiers' own bookkeeping, which a tier's store or load plan adds by
subclassing it (:meth:`landed`, :meth:`result`, :meth:`cleanup`, :meth:`count_end`).

A job ends in one place, :meth:`Job.end`, exactly once, whoever gets there first: its worker, the
thread that follows its copies (:class:`~.landings.LandingWatcher`), a caller that awaits it once its
copies have landed (:meth:`Job.end_if_landed`), or the caller an interrupt cut short
(:meth:`~.copy_worker.CopyWorker.abandon`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from ..base.cross_thread import give_back_wake_semaphore, take_wake_semaphore
from ..base.foreign import ForeignCallError, as_transfer_error
from ..cuda.events import CopyEvent, completed, copy_failed, wait_completed
from .transfer import Transfer, TransferResult

if TYPE_CHECKING:
    from .copy_submission import CopyRequest
    from .copy_worker import CopyWorker

__all__ = ["Job"]

log = logging.getLogger("kvoffload")

_LOCK = threading.Lock()
"""Held to claim a job (its worker takes it, or its interrupted caller withdraws it), to report its
landings and to claim its end: brief, and never around a copy or a wait."""

_WAITING, _TAKEN, _WITHDRAWN = range(3)

WATCH_LAZILY, WATCH_CLOSELY, WATCH_RUNG = range(3)
"""How the landing watcher follows a job's copies submitted at call time: *lazily* (no ring: whoever
waits for the job finds it landed and ends it, or asks for a ring, :meth:`Job.want_end`), *closely*
(its in-order rings follow each copy: several copies, landings reported), or *rung* (a ring of its
own is on its way)."""

RECHECK_ASLEEP_S = 0.1
"""A thread asleep until a job's copies land looks again this often, should a ring never come."""
LANDS_SOON_BYTES = 1 << 20
"""A transfer of at most this many bytes (one chunk, one copy unless per tensor) lands within about a
hop through another thread (two wakes of 10-30 us each) once enqueued: a caller that waits for it
looks again for a while first (:data:`LOOK_AGAIN_S`, :meth:`Job.end_if_landed`)."""
LOOK_AGAIN_S = 20e-6
"""How long a caller waiting for a transfer that lands soon looks again, keeping the GIL (an event loop
blocks meanwhile), before it asks for a ring: less than the hop the ring costs."""
GIL_TAKEN_AT_ONCE_S = 20e-6
"""A woken thread that waited longer than this to take the GIL back found it held: a free GIL is
taken in about a microsecond, one held by a thread running Python up to the switch interval later."""


class Job:
    """One store's or load's record (see the module docstring). The tiers' plans subclass it."""

    __slots__ = (
        "transfer", "worker", "events", "error", "cancel_flag", "requests", "reports_landings", "next_landing", "stop_at",
        "ended", "owner", "task", "started", "taken", "sleepers", "watch", "lands_soon",
    )

    def __init__(self, kind: Literal["store", "load"], tensor_names: Sequence[str] = ()) -> None:
        self.transfer = Transfer(kind, tensor_names, self)
        self.worker: CopyWorker | None = None
        """The worker that runs it (set by :meth:`CopyWorker.start`)."""
        self.events: list[CopyEvent | None] | None = None
        """Copies submitted for it outside a task, in stream order: one completion event each (None: it
        happened already). None: it runs as a task, or has not started."""
        self.error: Exception | None = None
        """What stopped the submission of its copies (the later ones were not submitted)."""
        self.cancel_flag: Any = None
        """A GPU load's :class:`~..cuda.cancel_flags.CancelFlag`: raised on cancel, its kernels skip the rest."""
        self.requests: list[CopyRequest] | None = None
        """A CPU job's one chunk, copied by its worker."""
        self.reports_landings = False
        """True: :meth:`landed` is called as each copy completes (stores publish chunk by chunk)."""
        self.next_landing = 0
        """Copies before this one have completed (and were reported)."""
        self.stop_at = -1
        """Cancelled: the job ends once copy ``stop_at`` has completed (later ones skip their work)."""
        self.ended = False
        self.owner = _WAITING
        self.task: asyncio.Task[TransferResult] | None = None
        self.started = time.perf_counter()
        """When the call began."""
        self.taken: float | None = None
        """When a worker took it (None: it never started)."""
        self.sleepers: list[Any] = []
        """Wake semaphores of threads blocked in ``result()`` until its copies land: rung at its end too."""
        self.watch = WATCH_LAZILY
        """How the landing watcher follows its copies (``WATCH_*``; set under the watcher's lock)."""
        self.lands_soon = False
        """At most :data:`LANDS_SOON_BYTES` between the cache and host slots: a caller waiting for it looks
        again for a while (:meth:`end_if_landed`) before it asks for a ring (set by the plan that makes
        its copies)."""

    # -- the tiers' bookkeeping (their plans override these) -------------------------------

    def landed(self, i: int) -> None:
        """Copy ``i`` (and every copy before it) has completed. Called under the job lock."""

    def result(self) -> TransferResult:
        """The finished transfer's result."""
        raise NotImplementedError

    def cleanup(self) -> None:
        """Undo what did not finish; runs however the job ends, once its copies have completed. Idempotent."""

    def count_end(self, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        """See the outcome just before the transfer ends (the plans count it)."""

    # -- ownership ----------------------------------------------------------------------------

    def take(self) -> bool:
        """(The worker.) True: the job is the worker's now; False: its interrupted caller withdrew it."""
        with _LOCK:
            if self.owner == _WAITING:
                self.owner = _TAKEN
            return self.owner == _TAKEN

    def withdraw(self) -> bool:
        """(The interrupted caller.) True: the job is the caller's to end; False: a worker has it."""
        with _LOCK:
            if self.owner == _WAITING:
                self.owner = _WITHDRAWN
            return self.owner == _WITHDRAWN

    # -- its copies ---------------------------------------------------------------------------

    def settle(self) -> None:
        """:meth:`wait_copies`, then give the cancel flag back."""
        self.wait_copies()
        self.release_flag()

    def wait_copies(self) -> None:
        """Block until every copy submitted outside a task has completed or failed: nothing more is
        written (a cleanup path: a failed copy counts as settled)."""
        for event in reversed(self.events or ()):  # in stream order: the last one covers all
            if event is not None:
                try:
                    wait_completed(event)
                except ForeignCallError:
                    pass
                break

    def release_flag(self) -> None:
        """No kernel reads the cancel flag any more: give it back (once)."""
        with _LOCK:
            flag, self.cancel_flag = self.cancel_flag, None
        if flag is not None:
            flag.release()

    def report(self, upto: int) -> None:
        """Copies up to ``upto`` have completed: report them (those that want to know), unless the job
        ended or a cancel came."""
        with _LOCK:
            if self.reports_landings and not self.ended and not self.transfer._cancel_requested:
                while self.next_landing <= upto:
                    self.next_landing += 1
                    self.landed(self.next_landing - 1)
            elif self.next_landing <= upto:
                self.next_landing = upto + 1

    def copies_done(self, failure: BaseException | None = None) -> bool:
        """Every submitted copy has completed, or ``failure``: one failed on the device (it is settled:
        nothing more is written, and what had not landed is never reported). End cancelled if a cancel
        came, else failed (``failure``, or what stopped the submission) or done. True if it ended here."""
        if self.cancel_flag is not None:
            self.release_flag()
        if self.transfer._cancel_requested:
            return self.end(cancelled=True)
        return self.end(exc=failure if failure is not None else self.error)

    def failed(self, error: BaseException) -> bool:
        """A copy failed on the device: :meth:`copies_done` with ``error``."""
        return self.copies_done(error)

    def end_if_landed(self, look_again: bool = False) -> bool:
        """From a thread that waits for the job: if it runs on copies submitted at call time and all of
        them have completed, report them and end it here, with no hop through another thread (which may
        not get the GIL for milliseconds while this one runs Python). True if it ended here.

        ``look_again`` (a caller about to sleep until the job ends: ``await``, ``result()``): a job that
        lands soon (:attr:`lands_soon`) is looked at again for up to :data:`LOOK_AGAIN_S` first, since
        the ring and the wake-ups a sleep costs take longer than its copy."""
        events = self.events
        if self.ended or not events or self.task is not None or self.error is not None or self.transfer._cancel_requested:
            return False
        last = events[-1]
        try:
            if last is not None and not last.query():  # :func:`completed`, inlined: the hot path of every await
                if not (look_again and self.lands_soon):
                    return False
                give_up = time.perf_counter() + LOOK_AGAIN_S
                while not last.query():
                    if time.perf_counter() > give_up:
                        return False
        except Exception as e:
            return self.failed(copy_failed(e))
        if self.reports_landings:  # else nothing to report: the job ends now
            self.report(len(events) - 1)
        if self.cancel_flag is not None:  # :meth:`copies_done`, inlined: no cancel came, nothing failed
            self.release_flag()
        return self.end()

    # -- the end --------------------------------------------------------------------------------

    def end(self, result: TransferResult | None = None, exc: BaseException | None = None, cancelled: bool = False) -> bool:
        """End the transfer, once (the first call wins; True if this one did): :meth:`cleanup` (what
        it holds goes back: its copies have completed), its result, :meth:`count_end`, then the
        :class:`Transfer` ends and its waiters wake. What a hook raises is logged and the end goes on
        (a ``SystemExit`` would stop a worker's loop for good), except a Ctrl-C in the main thread:
        it is raised once the end is whole, so the user's interrupt is not lost."""
        with _LOCK:
            if self.ended:
                return False
            self.ended = True
        if self.taken is None:
            self.taken = time.perf_counter()
        interrupt: BaseException | None = None
        try:
            self.cleanup()
        except BaseException as e:
            interrupt = _kept_or_logged(e, "cleanup")
        if not cancelled and exc is None and result is None:
            try:
                result = self.result()
            except BaseException as e:
                if _is_ctrl_c(e) and interrupt is None:  # the copies landed: the result is made again, the Ctrl-C kept
                    interrupt = e
                    try:
                        result = self.result()
                    except BaseException as again:
                        exc = again
                else:
                    exc = e
        if exc is not None:
            exc = as_transfer_error(self.transfer.kind, exc)
        try:
            self.count_end(result, exc, cancelled)
        except BaseException as e:
            interrupt = _kept_or_logged(e, "end hook") or interrupt
        self.transfer._end(result, exc, cancelled)
        for semaphore in tuple(self.sleepers):  # a thread asleep until the copies land: it ended sooner (a cancel)
            semaphore.ring()
        if interrupt is not None:
            raise interrupt
        return True

    def want_end(self) -> None:
        """Somebody waits for the job to end (a task awaits it, a thread waits in ``result()`` with a
        timeout, a done callback, a cancel): copies at call time followed lazily get a ring now (see
        :meth:`~.landings.LandingWatcher.follow`)."""
        worker = self.worker
        if worker is not None and not self.ended and self.events is not None:
            worker.want(self)

    def sleep_until_landed(self) -> None:
        """(A thread blocked in ``result()`` without a timeout on copies submitted at call time.) Sleep,
        the GIL released, until the driver rings this thread once the last copy landed, then end the job
        here (:meth:`end_if_landed`): behind a thread busy in Python, one take of the GIL where a
        wake-up from the landing watcher costs two in a row. Returns early if the job ends otherwise
        (its end rings the sleepers: a cancel, an error), or where the driver cannot ring this thread
        (no wake semaphores, a failed device): the landing watcher then ends it (:meth:`want_end`).

        A job of several chunks rings this thread once its last chunk but one has landed: behind a
        thread running Python, taking the GIL back waits up to the switch interval, and it waits while
        the last chunk moves. If taking the GIL back waited at all (longer than
        :data:`GIL_TAKEN_AT_ONCE_S`: a thread running Python holds it, and would take it again before
        the last copy lands) and the last has not landed yet, the thread sleeps on it keeping the GIL,
        for at most one switch interval (as long as a thread running Python keeps it), rather than
        wait up to as long again."""
        events, worker = self.events, self.worker
        if not events or events[-1] is None or worker is None or self.error is not None:
            self.want_end()
            return
        try:
            semaphore = take_wake_semaphore()
        except OSError:
            self.want_end()
            return
        last = events[-1]
        early = events[-2] if len(events) > 1 else None  # several chunks: rung one chunk early, see below
        self.sleepers.append(semaphore)
        try:
            if not worker.ring_when_landed(early if early is not None else last, semaphore):
                return
            while not self.ended and not self.transfer._cancel_requested:
                try:
                    if completed(last):
                        break
                except ForeignCallError:
                    break  # end_if_landed below fails the job
                took = semaphore.sleep(RECHECK_ASLEEP_S)
                if early is None or took is None or self.ended or self.transfer._cancel_requested:
                    continue  # (the loop's test leaves on an end or a cancel)
                early = None  # the last chunk moves: a ring for it
                try:
                    if completed(last):
                        break
                except ForeignCallError:
                    break
                if not worker.ring_when_landed(last, semaphore):
                    return
                if took > GIL_TAKEN_AT_ONCE_S:  # the GIL came back behind a thread running Python: another take would cost as much
                    semaphore.sleep(sys.getswitchinterval(), keep_gil=True)  # no longer than that thread keeps it
            self.end_if_landed()
        finally:
            self.sleepers.remove(semaphore)
            give_back_wake_semaphore(semaphore)
            if not self.ended:
                if self.watch == WATCH_CLOSELY:  # the watcher passed over the last copy's ring for this thread
                    worker.look_again()
                else:  # a cancel, a failed ring
                    self.want_end()

    def cancel(self) -> None:
        """(Any thread, once :meth:`Transfer.cancel` recorded the request.) Stop what can be stopped: a
        task is cancelled on its loop; a load with a cancel flag raises it, so its kernels skip what
        they have not started. Other jobs end cancelled once their copies have completed."""
        worker = self.worker
        if worker is not None:
            worker.cancel(self)


def _is_ctrl_c(e: BaseException) -> bool:
    """A ``KeyboardInterrupt`` in the main thread, where a signal handler raises it wherever it lands."""
    return isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()


def _kept_or_logged(e: BaseException, what: str) -> BaseException | None:
    """(Called in an ``except`` block of :meth:`Job.end`.) A Ctrl-C (:func:`_is_ctrl_c`) is returned, to
    be raised once the end is whole; anything else is logged (the end goes on) and None returned."""
    if _is_ctrl_c(e):
        return e
    log.exception("kvoffload: transfer %s raised", what)
    return None
