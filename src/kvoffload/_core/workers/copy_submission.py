"""Submitting copies to one direction's copier: the requests, and the one lock that serialises
the copier's calls, whether from a caller's thread at call time (:meth:`CopySubmitter.enqueue`: a
GPU transfer's copies are on their streams before ``store()``/``load()`` returns) or from the
worker's loop (:meth:`CopySubmitter.submit_runs`: the copies of one loop turn, coalesced into one
copier call per host buffer and chunk)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .copier import BlockCopier
from ..cuda.events import CopyEvent, wait_completed
from ..base.foreign import ForeignCallError, call_foreign

__all__ = ["CopyCalls", "CopyRequest", "CopySubmitter", "HandOver", "SubmittedCopies"]


@dataclass(eq=False)
class CopyRequest:
    """Copy cache blocks ``block_ids`` to (``to_host``) or from rows ``rows`` of ``host``."""

    to_host: bool
    host: torch.Tensor
    block_ids: Sequence[int]
    rows: Sequence[int]
    future: asyncio.Future[CopyEvent | None] = field(init=False)
    submitted: bool = False
    event: CopyEvent | None = None


def _to_host(copier: BlockCopier, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> CopyEvent | None:
    return copier.to_host(block_ids, host, rows)


def _to_device(copier: BlockCopier, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> CopyEvent | None:
    return copier.to_device(host, rows, block_ids)


@dataclass
class CopyCalls:
    """How workers call their copier: ``to_host(copier, block_ids, host, rows)`` and
    ``to_device(copier, host, rows, block_ids)``, looked up at every call.

    One per offloader, shared by both workers; ``kvoffload._testing.copy_calls``
    hands it to tests, which replace an attribute to gate or break copies.
    """

    to_host: Callable[[BlockCopier, Sequence[int], torch.Tensor, Sequence[int]], CopyEvent | None] = _to_host
    to_device: Callable[[BlockCopier, torch.Tensor, Sequence[int], Sequence[int]], CopyEvent | None] = _to_device


@dataclass(eq=False)
class SubmittedCopies:
    """Copies submitted together: one completion event per request, in order (None: the copy
    already happened), and the error that stopped the submission (the requests after it were
    not submitted)."""

    events: list[CopyEvent | None]
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


class CopySubmitter:
    """Submits copies to one copier (``calls`` says how: tests replace them to gate or break copies)."""

    def __init__(self, kind: Literal["store", "load"], copier: BlockCopier, calls: CopyCalls) -> None:
        self.kind = kind
        self.copier = copier
        self.calls = calls
        self._lock = threading.Lock()
        """Held while the copier enqueues: callers' threads (:meth:`enqueue`) and the loop share it."""

    def submit(self, to_host: bool, host: torch.Tensor, rows: Sequence[int], ids: Sequence[int]) -> CopyEvent | None:
        if to_host:
            return call_foreign("copy to host", self.calls.to_host, self.copier, ids, host, rows)
        return call_foreign("copy to device", self.calls.to_device, self.copier, host, rows, ids)

    # -- submission at call time (callers' threads) ------------------------------------------

    def enqueue(self, requests: Sequence[CopyRequest], after: Any, hand_over: HandOver) -> SubmittedCopies:
        """Submit every request now, in the calling thread, after ``after`` (an event, or None: the work
        enqueued so far on the calling thread's current stream).

        For GPU caches this only enqueues work on the copier's streams, so the
        copies run with no Python step between them, whatever the calling
        thread or the worker loop do meanwhile. Stops at the first error
        (``SubmittedCopies.error``: it fails the transfer, as anything the copier raises does).
        A load of several chunks gets a cancel flag (:meth:`_stop_early`).

        The copies are recorded in ``hand_over`` as they are submitted. On a ``BaseException``
        raised around the copier's calls (a signal handler's ``KeyboardInterrupt``, say): waits until
        the copies submitted by then have completed and gives the cancel flag back, then re-raises;
        the caller may then free the slots.
        """
        copies = hand_over.copies = SubmittedCopies([], None)
        if self.kind == "load" and len(requests) > 1:
            copies.cancel_flag = self.copier.take_cancel_flag()

        def submit() -> None:
            for r in requests:
                copies.events.append(self.submit(r.to_host, r.host, r.rows, r.block_ids))

        self._enqueue(copies, after, submit)
        return copies

    def enqueue_by_tensor(
        self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int], after: Any, hand_over: HandOver,
    ) -> SubmittedCopies:
        """Like :meth:`enqueue` (``BaseException`` included) for a load with per-tensor completion (GPU
        copier only): one event per tensor, in ``kv_caches`` order."""
        copies = hand_over.copies = SubmittedCopies([], None)
        copies.cancel_flag = self.copier.take_cancel_flag()

        def submit() -> None:
            copies.events.extend(call_foreign("copy to device", self.copier.to_device_by_tensor, host, rows, block_ids))  # type: ignore[attr-defined]

        self._enqueue(copies, after, submit)
        return copies

    def _enqueue(self, copies: SubmittedCopies, after: Any, submit: Callable[[], None]) -> None:
        """Run ``submit`` under the submit lock, after ``after``, its kernels reading ``copies``'s cancel
        flag; what it raised becomes ``copies.error``, but a ``BaseException``, which propagates once
        what was submitted has completed and the flag is back."""
        flag = copies.cancel_flag
        try:
            with self._lock:
                try:
                    self.copier.wait_for(after)  # None: the caller's current stream (this is the caller's thread)
                    with self.copier.stops_on(flag) if flag is not None else contextlib.nullcontext():
                        submit()
                except Exception as e:  # OSError, ForeignCallError, a driver error: fails this transfer only
                    copies.error = e
        except BaseException:
            copies.release()
            raise

    def submit_runs(self, requests: Sequence[CopyRequest]) -> Iterator[tuple[int, int, Any, Exception | None]]:
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
                with self._lock:
                    event = self.submit(first.to_host, first.host, rows, ids)
            except Exception as e:  # OSError or ForeignCallError
                yield i, j, None, e
            else:
                yield i, j, event, None
            i = j


_HAND_OVER_LOCK = threading.Lock()


class HandOver:
    """A transfer's way to its worker, which an interrupt (a signal handler's ``KeyboardInterrupt``)
    may cut short anywhere. Made by the caller before it reserves anything; who owns the transfer is
    decided once: the worker, when it :meth:`take` s it, or the interrupted caller, when it
    :meth:`withdraw` s it (then :meth:`~.copy_worker.CopyWorker.abandon` ends it). Copies copies at call time are
    recorded here (:attr:`copies`) as they are submitted, so that the owner can wait for them."""

    __slots__ = ("taken", "withdrawn", "copies")

    def __init__(self) -> None:
        self.taken = False
        self.withdrawn = False
        self.copies: SubmittedCopies | None = None

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
