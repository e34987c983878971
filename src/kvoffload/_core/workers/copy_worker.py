"""A *copy worker*: one direction's loop thread, block copier and landing watcher, behind one face.

The tiers hand it a transfer's :class:`~.job.Job` (:meth:`CopyWorker.start`), and the job's
:class:`~.transfer.Transfer` reaches it to cancel (:meth:`CopyWorker.cancel`); an interrupted caller
gives a job back (:meth:`CopyWorker.abandon`); the runtime stops it (:meth:`CopyWorker.stop`). A
transfer runs one of three ways:

* **copies at call time** (a GPU transfer between the cache and host slots alone): enqueued whole
  in the caller's thread before ``store()``/``load()`` returns; the
  :class:`~.landings.LandingWatcher` follows them and ends the job (or the caller does, awaiting it
  once they landed);
* **one chunk on the worker** (the same on a CPU cache): the jobs handed over during one loop turn
  are copied together, one copier call per run of jobs into the same host buffer;
* **a task** (everything else: spills, the disk and remote tiers, CPU transfers of several chunks):
  a coroutine of the tiers on the worker's loop, copying through :meth:`CopyWorker.copy` and
  :meth:`CopyWorker.pipeline`, waiting through :meth:`CopyWorker.wait`.

However it ran, a job ends through :meth:`~.job.Job.end`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from ..base.async_backends import settled
from ..base.foreign import ForeignCallError, as_transfer_error
from ..cuda.events import CopyEvent, completed
from .copier import BlockCopier
from .copy_submission import CopyCalls, CopyRequest, CopySubmitter
from .job import Job
from .landings import LandingWatcher
from .transfer import TransferResult
from .worker_loop import WorkerLoop

__all__ = ["CopyWorker", "CopyWorkers"]

log = logging.getLogger("kvoffload")

C = TypeVar("C")
R = TypeVar("R")

Run = Callable[[Any, Any], Coroutine[Any, Any, TransferResult]]
"""A task's coroutine: ``run(job, after)``, ``after`` the event its first copy waits for (None: none)
(the tiers' own method, its job passed: no partial made per transfer)."""


class CopyWorker:
    """One direction's worker (see the module docstring). ``gpu``: the copier's copies complete
    with events (a landing watcher follows them); else copies are complete when submitted."""

    def __init__(
        self, kind: Literal["store", "load"], name: str, copier: BlockCopier, calls: CopyCalls, *, gpu: bool,
        depth: int = 3, on_thread_start: Callable[[], Any] | None = None,
    ) -> None:
        """Owns ``copier`` from now on: if a part cannot be made, what was made is stopped and the
        copier closed before the error is raised."""
        self.kind = kind
        self.name = name
        self.depth = depth
        self._copier = copier
        self._submitter = CopySubmitter(kind, copier, calls)
        self._arrived: list[Job] = []
        self._batch_scheduled = False
        self._pending: list[CopyRequest] = []
        self._flush_scheduled = False
        self._watcher: LandingWatcher | None = None
        loop: WorkerLoop | None = None
        try:
            loop = self.loop = WorkerLoop(name, on_thread_start=on_thread_start)
            if gpu:
                self._watcher = LandingWatcher(copier, f"{name}-landings")
            loop.add_stop_hook(self._end_followed)
        except BaseException:
            if loop is not None:
                loop.stop(5.0)
            try:
                copier.close()
            except Exception:  # a failed device: the error that stopped the start is the one to raise
                log.exception("kvoffload: %s: releasing the copier after a failed start failed", name)
            raise

    @property
    def chunk_blocks(self) -> int:
        """The most blocks one copy takes."""
        return self._copier.chunk_blocks

    # -- the face ----------------------------------------------------------------------------

    def start(
        self, job: Job, after: Any, requests: list[CopyRequest] | None = None, run: Run | None = None,
        by_tensor: tuple[torch.Tensor, Sequence[int], Sequence[int]] | None = None,
    ) -> None:
        """Run ``job``: its ``requests`` (copies between the cache and host slots alone) at call time
        (GPU; ``by_tensor``: as ``(host rows, slots, block ids)`` of a per-tensor load instead; none if
        :meth:`submit_now` submitted them, then they are followed) or as one
        chunk on the worker (CPU, one request); otherwise ``run(job, after)`` as a task. ``after`` None:
        after the work enqueued so far on the caller's current stream. The hand-over is last: an
        exception before it leaves the job to :meth:`abandon`."""
        job.worker = self
        if self._watcher is not None and (requests is not None or job.events is not None):
            if job.events is None:  # else submitted already (:meth:`submit_now`)
                self._submitter.enqueue(job, requests or (), after, by_tensor)
            if by_tensor is not None:
                job.transfer._track_tensors(job.events or [])
            job.taken = time.perf_counter()
            if not job.events and job.take():  # nothing was submitted: it failed
                job.copies_done()
                return
            self._watcher.follow(job)
            return
        if after is None:
            try:
                after = self._copier.caller_event()
            except Exception as e:  # a failed device: this transfer fails, its slots and pins go back
                if job.take():
                    job.end(exc=e)
                return
        if requests is not None and len(requests) == 1:
            job.requests = requests
            self.loop.mailbox.post(self._arrive, job)
            return
        assert run is not None
        self.loop.mailbox.post(self._create_task, job, run, after)

    def submit_now(self, job: Job, requests: list[CopyRequest], after: Any) -> Callable[[], None]:
        """(A GPU worker.) Submit ``job``'s copies between the cache and host slots in the calling
        thread now, while the index is still being changed under its lock, so that a large transfer's
        copies run during its bookkeeping; :meth:`start` then follows them. Returns what waits until
        they completed (:meth:`~.job.Job.wait_copies`: it takes no lock of the jobs')."""
        job.worker = self
        self._submitter.enqueue(job, requests, after)
        return job.wait_copies

    def cancel(self, job: Job) -> None:
        """(Any thread, the transfer's cancel recorded.) A task is cancelled on its loop; a load with a
        cancel flag raises it (its kernels skip what they have not started) and ends once the copy
        running then completed; anything else ends cancelled once its copies completed."""
        task = job.task
        if task is not None:
            if self.loop.in_thread():  # at once: a task cancelled before its first step copies nothing
                task.cancel()
            else:
                with contextlib.suppress(RuntimeError):  # the loop has stopped: its stop cancelled every task
                    self.loop.mailbox.post(task.cancel)
        elif job.cancel_flag is not None and self._watcher is not None:
            self._stop_early(job)
        elif job.events is not None:  # it ends once its copies landed
            self.want(job)

    def abandon(self, job: Job) -> None:
        """After an exception (a signal handler's ``KeyboardInterrupt``, say) cut a call short anywhere
        before its job was handed over: if this worker took it, cancel it (it ends once its copies
        landed); else end it cancelled here, once the copies enqueued so far completed (slots and pins
        go back). Call from the interrupted thread, then re-raise."""
        if not job.withdraw():
            job.transfer.cancel()
            return
        job.settle()
        job.end(cancelled=True)

    def stop(self, timeout: float | None) -> bool:
        """Stop the loop (its tasks cancelled, every followed job ended cancelled once its copies
        landed), then the landing watcher; False if the loop's thread did not end in ``timeout``."""
        if not self.loop.stop(timeout):
            return False
        watcher = self._watcher
        if watcher is not None:
            watcher.stop()
            self._end_followed()  # handed over while the loop stopped
        return True

    def ring_when_landed(self, event: CopyEvent, semaphore: Any) -> bool:
        """Have the driver ring ``semaphore`` (a thread's :class:`~..base.cross_thread.WakeSemaphore`)
        once ``event`` completed, as it rings the landing watcher's; False if that cannot be enqueued
        (a failed device: the watcher ends the job)."""
        try:
            self._copier.ring_when_complete(event, semaphore, for_thread=True)  # on a ring stream of its own
            return True
        except Exception:
            log.debug("%s: could not enqueue a ring for a waiting thread", self.name, exc_info=True)
            return False

    def want(self, job: Job) -> None:
        """Somebody waits for ``job``, whose copies were submitted at call time: have the landing
        watcher end it once they landed (:meth:`~.landings.LandingWatcher.want`)."""
        if self._watcher is not None:
            self._watcher.want(job)

    def look_again(self) -> None:
        """Have the landing watcher look at the copies it follows now (a thread that slept on a job's
        last copy left before ending it)."""
        if self._watcher is not None:
            self._watcher.look_again()

    def close(self) -> None:
        """Free the copier's device resources (the worker has stopped)."""
        self._copier.close()

    def _follow_with(self, copier: BlockCopier) -> None:
        """(Tests, through ``kvoffload._testing.take_gpu_path``.) Copy through ``copier``, whose copies
        complete with events, followed by a landing watcher, as a GPU worker's are."""
        self._copier = self._submitter.copier = copier
        if self._watcher is None:
            self._watcher = LandingWatcher(copier, f"{self.name}-landings")
        else:
            self._watcher._copier = copier

    # -- copies at call time: ends at shutdown, cancels ---------------------------------------

    def _end_followed(self) -> None:
        """Let the copies of every job the watcher follows land, then end it cancelled."""
        if self._watcher is not None:
            for job in self._watcher.jobs():
                if not job.ended and job.take():
                    job.settle()
                    job.end(cancelled=True)
        arrived, self._arrived = self._arrived, []
        for job in arrived:
            job.end(cancelled=True)

    def _stop_early(self, job: Job) -> None:
        """Raise ``job``'s cancel flag; once it is raised on the device, every copy not complete by then
        reads it before it starts but the first of them: the job ends cancelled once that one lands."""
        flag = job.cancel_flag
        assert self._watcher is not None
        try:
            flag.raise_flag()
            if flag.raised is not None:  # None: raising failed (a failed device): the job ends with its last copy
                self._watcher.when_complete(flag.raised, functools.partial(self._flag_raised, job), in_order=False)
        except Exception:  # a failed device, a stopping worker: the job ends with its last copy
            log.debug("%s: could not stop a transfer early", self.name, exc_info=True)

    def _flag_raised(self, job: Job, failure: ForeignCallError | None) -> None:
        """(The watcher's thread.) Find the first copy of ``job`` not complete: it ends once that one lands."""
        if job.ended:
            return
        if failure is not None:
            job.failed(failure)
            return
        for i, event in enumerate(job.events or ()):
            try:
                if event is None or completed(event):
                    continue
            except ForeignCallError as e:  # settled: the job fails (or ends cancelled, the cancel first)
                job.failed(e)
                return
            job.stop_at = i
            assert self._watcher is not None
            self._watcher.when_complete(event, _nothing, in_order=False)  # a ring of its own
            return

    # -- one chunk on the worker (CPU) --------------------------------------------------------

    def _arrive(self, job: Job) -> None:
        if not job.take() or job.ended:  # withdrawn by its interrupted caller, who ends it
            return
        self._arrived.append(job)
        if not self._batch_scheduled:
            self._batch_scheduled = True
            self.loop.loop.call_soon(self._run_batch)

    def _run_batch(self) -> None:
        """Copy every job that arrived this loop turn, one copier call per run into the same host buffer."""
        self._batch_scheduled = False
        jobs, self._arrived = self._arrived, []
        now = time.perf_counter()
        to_copy: list[Job] = []
        for job in jobs:
            job.taken = now
            if job.transfer._cancel_requested:  # nothing copied yet: nothing to wait for
                job.end(cancelled=True)
            else:
                to_copy.append(job)
        requests = []
        for job in to_copy:
            assert job.requests is not None
            requests.append(job.requests[0])
        for start, end, event, error in self._submitter.submit_runs(requests):
            for job in to_copy[start:end]:
                if error is not None:  # fails the jobs of this call only
                    job.end(exc=error)
                else:
                    job.events = [event]
                    job.report(0)
                    job.copies_done()

    # -- tasks ------------------------------------------------------------------------------------

    def _create_task(self, job: Job, run: Run, after: Any) -> None:
        if not job.take():  # withdrawn by its interrupted caller, who ends it
            return
        job.taken = time.perf_counter()
        task = self.loop.loop.create_task(self._guarded(run, job, after))
        job.task = task
        self.loop.track(task)
        task.add_done_callback(functools.partial(_task_ended, job))
        if job.transfer._cancel_requested:  # a task cancelled before its first step never runs its coroutine
            task.cancel()

    async def _guarded(self, run: Run, job: Job, after: Any) -> TransferResult:
        try:
            return await run(job, after)
        except BaseException as e:  # SystemExit & co. too: out of a task they would stop the worker loop
            mapped = as_transfer_error(self.kind, e)
            if mapped is e:
                raise
            raise mapped from mapped.__cause__

    # -- for the tiers' coroutines, on the worker's loop ------------------------------------------

    def wait_for(self, after: Any) -> None:
        """Make this worker's later copies wait for ``after`` (an event; None: nothing)."""
        if after is not None:
            self._copier.wait_for(after)

    async def copy(self, req: CopyRequest) -> CopyEvent | None:
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
        for start, end, event, error in self._submitter.submit_runs(pending):
            for r in pending[start:end]:
                if error is not None:  # fails the transfers of this call only
                    if not r.future.done():
                        r.future.set_exception(error)
                    continue
                r.submitted, r.event = True, event
                if not r.future.done():
                    r.future.set_result(event)

    def _landing(self, event: CopyEvent) -> asyncio.Future[None]:
        """A future of the loop that completes once ``event`` completed (with ForeignCallError if its
        copies failed), resolved from the landing watcher."""
        fut: asyncio.Future[None] = self.loop.loop.create_future()
        assert self._watcher is not None  # events come from a GPU copier
        self._watcher.when_complete(event, functools.partial(self._resolve_landing, fut))
        return fut

    def _resolve_landing(self, fut: asyncio.Future[None], failure: ForeignCallError | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            self.loop.mailbox.post(_settle_future, fut, failure)

    async def wait(self, event: CopyEvent | None) -> None:
        """Wait until ``event`` completed (None: already complete). Raises ForeignCallError if its
        copies failed on the device (what it covers did not land)."""
        if event is not None:
            await self._landing(event)

    async def settle(self, event: CopyEvent | None) -> None:
        """Wait until ``event`` completed or failed, even if cancelled meanwhile (cleanup path: never
        raises for a failed copy, whose event counts as settled)."""
        if event is not None:
            await settled(self._landing(event))

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

    def run_coroutine(self, coro: Coroutine[Any, Any, R]) -> concurrent.futures.Future[R]:
        """Run ``coro`` on the worker's loop beside its transfers (housekeeping: checkpoints)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop.loop)


def _task_ended(job: Job, task: asyncio.Task[TransferResult]) -> None:
    cancelled = task.cancelled()
    exc = None if cancelled else task.exception()
    job.end(None if cancelled or exc is not None else task.result(), exc, cancelled)


def _settle_future(fut: asyncio.Future[None], failure: ForeignCallError | None) -> None:
    if fut.done():
        return
    if failure is not None:
        fut.set_exception(failure)
    else:
        fut.set_result(None)


def _nothing(failure: ForeignCallError | None) -> None:
    """A ring's callback when the ring alone is wanted (the job it is for is followed anyway)."""


@dataclass(frozen=True)
class CopyWorkers:
    """The offloader's workers: stores and loads never wait behind each other, and expedited
    loads (host memory to the cache, on higher-priority streams) never wait behind loads."""

    store: CopyWorker
    load: CopyWorker
    expedited: CopyWorker | None = None
    """Only with ``Options.expedited_loads``."""
