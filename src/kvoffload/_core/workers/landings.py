"""How kvoffload learns that a GPU copy landed: :class:`LandingWatcher`, one per GPU copy worker.

The watcher is a thread asleep on a semaphore (:class:`~..base.cross_thread.WakeSemaphore`) that the
driver rings once a copy's completion event completes: the copier enqueues, on a stream of its own,
a wait for that event and then libc's ``sem_post`` as a host function (``ring_when_complete``), so
no Python runs and no thread of kvoffload's is awake while copies are in flight. Rung, the watcher
takes the GIL once, asks every copy it follows whether it completed (``cuEventQuery``, about a
microsecond), reports what landed, and has the driver ring again for the oldest copy still in
flight: a burst of transfers costs one ring, however many land meanwhile.

It follows two things, in the order they were handed to it:

* jobs whose copies were submitted outside a task (:meth:`follow`): it reports their landings (a
  store publishes chunk by chunk) and ends them (:meth:`~.job.Job.copies_done`) once their last copy
  completed; a cancelled load with a cancel flag ends once the copy running when the flag was raised
  completed;
* single events with a callback (:meth:`when_complete`): a task's chunk, awaited on the worker's
  loop, and the raising of a cancel flag.

Events of one worker complete in the order they were recorded (its copies run on its streams in
submission order), so one ring, for the oldest, is enough, and a look stops at the first job whose
copy is still in flight; an event off those streams (a cancel flag's) asks for a ring of its own. A copy that failed on the device counts as completed, with the
error (:func:`~..cuda.events.completed` raises it): its job fails, its callback gets it.

A thread blocked in ``result()`` has the driver ring it for its job's last copy and ends the job
itself (:meth:`~.job.Job.sleep_until_landed`); the watcher then asks no ring for that copy (it rings
for a job of several copies at its first, so that it looks before the last), so that behind a thread
busy in Python the end waits for one take of the GIL, not for the watcher's and then the sleeper's.
A sleeper that leaves before the end has the watcher look again.

Whoever else notices a landing first may end a job through the same path (a caller awaiting it,
:meth:`~.job.Job.end_if_landed`); the watcher then drops it.

A job of one copy (a serving engine's small store or load) is followed *lazily*: it asks no ring
when it is handed over, since its caller usually awaits it later and then finds it landed (an engine
awaits a step's loads and stores in the next step), so no ring is paid for and no kvoffload thread
takes the GIL. Whoever waits for it while it is in flight (an awaiting task, ``result(timeout)``, a
done callback, a cancel) asks for one (:meth:`want`): for the oldest job waited for, the ring on its
way covers the rest (each look rings for the next one waited for). A job nobody waits for ends at
the watcher's next look: a ring for another job, or its recheck (:attr:`RECHECK_S`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..base.cross_thread import give_back_wake_semaphore, take_wake_semaphore
from ..base.foreign import ForeignCallError
from ..base.helper_threads import mark_own_thread
from ..cuda.events import CopyEvent, completed, copy_failed
from .copier import BlockCopier
from .job import WATCH_CLOSELY, WATCH_LAZILY, WATCH_RUNG, Job

__all__ = ["LandingWatcher"]

log = logging.getLogger("kvoffload")

Landed = Callable[[ForeignCallError | None], Any]
"""Called on the watcher's thread once an event completed (None) or failed (the error)."""


class LandingWatcher:
    """Follows one worker's GPU copies on a thread of its own (see the module docstring)."""

    IDLE_RECHECK_S = 1.0
    """How often it looks with nothing to follow (only whether to stop)."""
    RECHECK_S = 0.05
    """How often it looks while it follows copies: should a ring never come (a failed device), and for
    jobs followed lazily that nobody waits for."""

    def __init__(self, copier: BlockCopier, name: str) -> None:
        self._copier = copier
        self._semaphore = take_wake_semaphore()  # OSError without POSIX semaphores
        self._jobs: collections.deque[Job] = collections.deque()
        self._waits: list[tuple[CopyEvent, Landed]] = []
        self._lock = threading.Lock()
        self._ring_pending = False
        """A ring is on its way for the oldest copy followed: copies handed over meanwhile need none."""
        self._ring_target: Job | None = None
        """The job that ring is for (None: a single event's, or none)."""
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- handing copies over (any thread) ---------------------------------------------------

    def follow(self, job: Job) -> None:
        """Follow ``job``'s copies (``job.events``, enqueued in this thread) until it ended. RuntimeError
        once stopping (as a stopped worker's mailbox raises): the caller ends the job.

        A job of one copy is followed lazily: no ring is asked for it now (the driver's ring costs the
        caller about 15 us), since whoever waits for it either finds it landed and ends it, or asks for
        a ring then (:meth:`want`); one nobody waits for ends at the watcher's next look."""
        events = job.events
        closely = events is not None and len(events) != 1 or job.transfer._tensors is not None
        with self._lock:
            if self._stopping:
                raise RuntimeError("the worker has stopped")
            followed = self._jobs
            while followed and followed[0].ended and followed[0].cancel_flag is None:  # ended by their waiters
                followed.popleft()
            followed.append(job)
            ring = closely and not self._ring_pending
            if closely:
                job.watch = WATCH_CLOSELY
                self._ring_pending = True
                if ring:
                    self._ring_target = job
        if ring:
            event = _next_event(job)
            try:
                self._copier.ring_when_complete(event, self._semaphore, True)  # type: ignore[arg-type]  # None raises: :meth:`_ring_after`, inlined
            except Exception:
                self._ring_after(event)  # None (look now), or a failed device: as it handles them

    def want(self, job: Job) -> None:
        """Somebody waits for ``job`` to end (a task awaits it, a thread waits with a timeout, a done
        callback, a cancel): if it is followed lazily, have the driver ring the watcher once its last
        copy landed (a job followed closely has its rings already)."""
        with self._lock:
            if job.ended or self._stopping or job.watch != WATCH_LAZILY:
                return
            job.watch = WATCH_RUNG
            target = self._ring_target
            if self._ring_pending and target is not None and _older(target, job, self._jobs):
                return  # the ring on its way comes first, and the look it brings rings for this job: a burst costs one
            in_order = not self._ring_pending
            self._ring_pending = True
            if in_order:
                self._ring_target = job
        events = job.events
        self._ring_after(events[-1] if events else None, in_order)  # out of order: it may land before the ring on its way

    def when_complete(self, event: CopyEvent, landed: Landed, *, in_order: bool = True) -> None:
        """Call ``landed(failure)`` on the watcher's thread once ``event`` completed. ``in_order=False``:
        ``event`` is not on the worker's copy streams (it may complete before older ones): it gets a
        ring of its own. RuntimeError once stopping."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("the worker has stopped")
            self._waits.append((event, landed))
            ring = not self._ring_pending or not in_order
            self._ring_pending = True
            if ring and in_order:
                self._ring_target = None
        if ring:
            self._ring_after(event, in_order)

    def _ring_after(self, event: CopyEvent | None, in_order: bool = True) -> None:
        """Have the driver ring the watcher once ``event`` completes (None: look now); ``in_order=False``:
        ``event`` may complete before the copy a ring is on its way for."""
        if event is None:
            self._semaphore.ring()
            return
        try:
            self._copier.ring_when_complete(event, self._semaphore, in_order)
        except Exception:  # a failed device: the next look finds the copy failed
            log.debug("%s: could not enqueue a landing ring", self._thread.name, exc_info=True)
            self._semaphore.ring()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        mark_own_thread()
        while not self._stopping:
            self._semaphore.sleep(self.RECHECK_S if self._jobs or self._waits else self.IDLE_RECHECK_S)
            if self._jobs or self._waits:
                try:
                    self._sweep()
                except BaseException:  # a bug of ours must not stop the watcher: the jobs end at shutdown
                    log.exception("%s: following copies raised", self._thread.name)

    def _sweep(self) -> None:
        """Report what landed; keep the rest, and have the driver ring again for the oldest of it."""
        with self._lock:
            jobs, waits = list(self._jobs), list(self._waits)
            self._ring_pending = False  # the ring came (or this is a recheck): a hand-over may ring again
        done_jobs = set()
        for job in jobs:
            if _advance(job):
                done_jobs.add(id(job))
            elif job.stop_at < 0:  # its copy in flight: those handed over later land after it (stream order)
                break
        done_waits = set()
        for item in waits:
            event, landed = item
            failure: ForeignCallError | None = None
            try:
                if not completed(event):
                    continue
            except ForeignCallError as e:
                failure = e
            done_waits.add(id(item))
            try:
                landed(failure)
            except BaseException:
                log.exception("%s: a landing callback raised", self._thread.name)
        with self._lock:
            if done_jobs:
                followed, k = self._jobs, 0
                while followed and id(followed[0]) in done_jobs:  # usually the oldest: a prefix
                    followed.popleft()
                    k += 1
                if k < len(done_jobs):
                    self._jobs = collections.deque(j for j in followed if id(j) not in done_jobs)
            if done_waits:
                self._waits = [w for w in self._waits if id(w) not in done_waits]
            ring = False
            if not self._ring_pending and (self._jobs or self._waits):
                ring, oldest, self._ring_target = _ring_for(self._jobs, self._waits)
                self._ring_pending = ring
        if ring:
            self._ring_after(oldest)

    def look_again(self) -> None:
        """Sweep now (a thread that slept on a job's last copy left before ending it: the watcher,
        which skipped that copy's ring, takes the job back)."""
        self._semaphore.ring()

    def jobs(self) -> list[Job]:
        """The jobs it follows now."""
        with self._lock:
            return list(self._jobs)

    def stop(self) -> None:
        """Follow nothing more (hand-overs raise RuntimeError), stop the thread, give the semaphore back."""
        with self._lock:
            self._stopping = True
        self._semaphore.ring()
        self._thread.join(5.0)
        if not self._thread.is_alive():
            give_back_wake_semaphore(self._semaphore)


def _older(a: Job, b: Job, jobs: collections.deque[Job]) -> bool:
    """True if ``a`` was handed over before ``b`` (or is ``b``); both are in ``jobs``, oldest first."""
    for job in jobs:
        if job is a:
            return True
        if job is b:
            return False
    return False


def _ring_for(jobs: collections.deque[Job], waits: list[tuple[CopyEvent, Landed]]) -> tuple[bool, CopyEvent | None, Job | None]:
    """What the watcher has the driver ring it for next, and for which job: the next copy of the
    oldest job it follows closely or somebody waits for, passing over a job's last copy while a thread sleeps on it (:meth:`~.job.Job.sleep_until_landed`:
    rung by the driver itself, that thread ends the job; behind a thread busy in Python, the end then
    waits for one take of the GIL, not for the watcher's and then the sleeper's); else the oldest
    single event. ``(False, None, None)``: nothing to ring for (the jobs passed over end by their sleepers,
    or come back with :meth:`LandingWatcher.look_again`; a job followed lazily has a ring of its own once
    somebody waits for it)."""
    for job in jobs:
        if job.watch == WATCH_LAZILY:
            continue
        event = _next_event(job)
        events = job.events
        if event is not None and job.sleepers and events and event is events[-1] and not job.ended:
            continue
        return True, event, job
    if waits:
        return True, waits[0][0], None
    return False, None, None


def _next_event(job: Job) -> CopyEvent | None:
    """The copy of ``job`` to be rung for: its next one to land when it reports landings or on the
    first look at a job of several copies (so that a look comes before the last one, which
    :func:`_ring_for` may pass over), else its last."""
    events = job.events or []
    several_unseen = job.next_landing == 0 and len(events) > 1
    candidates = events[job.next_landing:] if job.reports_landings or several_unseen else events[-1:]
    if job.next_landing <= job.stop_at:  # cancelled, and the copy it ends with has not been seen complete
        candidates = events[job.stop_at : job.stop_at + 1] + candidates
    for event in candidates:
        if event is not None:
            return event
    return None


def _advance(job: Job) -> bool:
    """Report what of ``job`` landed, end it when it is done; True once the watcher is done with it."""
    if (job.ended and job.cancel_flag is None) or not job.take():  # ended by a waiter that found it landed (a
        return True  # cancelled load's flag goes back with its last copy); or withdrawn by its interrupted caller, who ends it
    events = job.events or []
    i, n = job.next_landing, len(events)
    while i < n:
        event = events[i]
        try:
            if event is not None and not event.query():  # :func:`completed`, inlined: a call fewer per look
                break
        except Exception as e:  # settled: nothing more is written
            job.failed(copy_failed(e))
            return True
        i += 1
    if i > job.next_landing:
        job.report(i - 1)
    if i == n:
        job.copies_done()
        return True
    if 0 <= job.stop_at < i:  # cancelled: later copies skip their work; the flag goes back with the last
        job.end(cancelled=True)
    return False
