"""Transfers run as tasks: everything that is not a host-copy job (spills, the disk tier, the
remote tier, CPU copies of several chunks) runs as a coroutine on the worker's loop, copying
through :meth:`TransferTasks.copy` (the copies of one loop turn coalesced, as host-copy jobs' are)
and :meth:`TransferTasks.pipeline`, and waiting through the completion bridge."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Literal, TypeVar

from .copy_submission import CopyRequest, CopySubmitter, HandOver
from ..cuda.events import CompletionBridge, CopyEvent
from ..base.async_backends import settled
from .transfer import TransferControl, TransferResult
from ..base.foreign import as_transfer_error
from .transfer_end import EndHook, end_transfer
from .worker_loop import WorkerLoop

__all__ = ["TransferTasks"]

C = TypeVar("C")


class TransferTasks:
    """One worker's task pipeline (see the module docstring)."""

    def __init__(
        self, kind: Literal["store", "load"], loop: WorkerLoop, submitter: CopySubmitter, bridge: CompletionBridge | None, depth: int = 3,
    ) -> None:
        self.kind = kind
        self.loop = loop
        self.submitter = submitter
        self.bridge = bridge
        self.depth = depth
        self._pending: list[CopyRequest] = []
        self._flush_scheduled = False

    # -- ----------------------------------------------------------------

    def start(
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
        for start, end, event, error in self.submitter.submit_runs(pending):
            for r in pending[start:end]:
                if error is not None:  # fails the transfers of this call only
                    if not r.future.done():
                        r.future.set_exception(error)
                    continue
                r.submitted, r.event = True, event
                if not r.future.done():
                    r.future.set_result(event)

    async def wait(self, event: CopyEvent | None) -> None:
        """Wait until ``event`` completed (None: already complete). Raises ForeignCallError if its
        copies failed on the device (what it covers did not land)."""
        if event is not None:
            assert self.bridge is not None  # events come from a GPU copier, which has a bridge
            await self.bridge.watch(event)

    async def settle(self, event: CopyEvent | None) -> None:
        """Wait until ``event`` completed or failed, even if cancelled meanwhile (cleanup path: never
        raises for a failed copy, whose event counts as settled)."""
        if event is None:
            return
        assert self.bridge is not None
        await settled(self.bridge.watch(event))  # a failed copy (ForeignCallError) counts as settled

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
