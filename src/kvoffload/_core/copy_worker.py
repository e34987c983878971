"""A *worker*: one direction's worker loop with its block copier and completion bridge.

The offloader has a store worker and a load worker. Tiers copy blocks through
:meth:`CopyWorker.copy`, which *coalesces*: every copy requested during one turn of
the loop is submitted together in the next, as one copier call per host buffer
(up to ``chunk_blocks`` blocks), sharing one completion event. A thousand
one-block transfers in flight thus cost a few dozen driver calls and events,
not a thousand.

:meth:`CopyWorker.pipeline` keeps a few chunks of one transfer in flight, reports each
chunk as it completes, and on cancellation or error waits for every copy
already submitted before the exception propagates.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .foreign import call_foreign
from .worker_loop import WorkerLoop
from .block_copy import BlockCopier

__all__ = ["CopyWorker", "CopyRequest", "CopyCalls", "Enqueued"]

C = TypeVar("C")


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
    """Copies submitted by :meth:`CopyWorker.enqueue`: one completion event per request, in order, and
    the error that stopped the submission (the requests after it were not submitted)."""

    events: list[Any]
    error: Exception | None

    def settle(self) -> None:
        """Block until every submitted copy has completed (a cleanup path: never raises)."""
        for event in reversed(self.events):  # in stream order: the last one covers all
            if event is not None:
                try:
                    event.synchronize()
                except Exception:  # a failed device: nothing more will be written
                    pass
                return


class CopyWorker:
    """Loop thread + copier + bridge for one direction."""

    def __init__(self, loop_thread: WorkerLoop, copier: BlockCopier, bridge: Any, calls: CopyCalls, depth: int = 3) -> None:
        self.thread = loop_thread
        self.copier = copier
        self.calls = calls
        self.bridge = bridge
        self.depth = depth
        self._pending: list[CopyRequest] = []
        self._flush_scheduled = False
        self._submit_lock = threading.Lock()
        """Held while the copier enqueues: callers' threads (:meth:`enqueue`) and the loop (:meth:`copy`) share it."""

    def _submit(self, to_host: bool, host: torch.Tensor, rows: Sequence[int], ids: Sequence[int]) -> Any:
        if to_host:
            return call_foreign("copy to host", self.calls.to_host, self.copier, ids, host, rows)
        return call_foreign("copy to device", self.calls.to_device, self.copier, host, rows, ids)

    # -- submission at call time ---------------------------------------------------------

    def enqueue(self, requests: Sequence[CopyRequest], after: Any) -> Enqueued:
        """Submit every request now, in the calling thread, after ``after`` (an event, or None).

        For GPU caches this only enqueues work on the copier's streams, so the
        copies run with no Python step between them, whatever the calling
        thread or the worker loop do meanwhile. Stops at the first error.
        """
        events: list[Any] = []
        with self._submit_lock:
            try:
                if after is not None:
                    self.copier.wait_for(after)
                for r in requests:
                    events.append(self._submit(r.to_host, r.host, r.rows, r.block_ids))
            except Exception as e:  # OSError, ForeignCallError, a driver error: fails this transfer only
                return Enqueued(events, e)
        return Enqueued(events, None)

    async def completed(self, enqueued: Enqueued, landed: Callable[[int], Any] | None = None) -> None:
        """Wait for the copies of ``enqueued`` in order, ``landed(i)`` as request ``i``'s completes
        (without ``landed``, only for the last: one wake-up for the whole transfer); then raise
        the submission's error, if any. On cancellation, waits for every submitted copy before
        ``CancelledError`` propagates."""
        try:
            if landed is None:
                await self.wait(enqueued.events[-1] if enqueued.events else None)
            else:
                for i, event in enumerate(enqueued.events):
                    await self.wait(event)
                    landed(i)
        except BaseException:
            if enqueued.events:
                await self.settle(enqueued.events[-1])
            raise
        if enqueued.error is not None:
            raise enqueued.error

    # -- coalesced submission ---------------------------------------------------------

    async def copy(self, req: CopyRequest) -> Any:
        """Submit ``req`` with whatever else is requested this loop turn; returns its completion event.

        If cancelled, a request not yet submitted is withdrawn; one already
        submitted is waited for before the ``CancelledError`` propagates.
        """
        loop = self.thread.loop
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
        limit = self.copier.chunk_blocks
        i = 0
        while i < len(pending):
            first = pending[i]
            batch = [first]
            n = len(first.block_ids)
            j = i + 1
            while (j < len(pending) and pending[j].to_host == first.to_host and pending[j].host is first.host
                   and n + len(pending[j].block_ids) <= limit):
                n += len(pending[j].block_ids)
                batch.append(pending[j])
                j += 1
            i = j
            ids = [b for r in batch for b in r.block_ids] if len(batch) > 1 else first.block_ids
            rows = [x for r in batch for x in r.rows] if len(batch) > 1 else first.rows
            try:
                with self._submit_lock:
                    event = self._submit(first.to_host, first.host, rows, ids)
            except Exception as e:  # OSError or ForeignCallError: fails the transfers of this batch only
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r in batch:
                r.submitted, r.event = True, event
                if not r.future.done():
                    r.future.set_result(event)

    # -- completion -------------------------------------------------------------------

    async def wait(self, event: Any) -> None:
        """Wait until ``event`` completed (None: already complete)."""
        if event is not None:
            await self.bridge.watch(event)

    async def settle(self, event: Any) -> None:
        """Wait until ``event`` completed, even if cancelled meanwhile (cleanup path)."""
        if event is None:
            return
        fut = self.bridge.watch(event)
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue

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
