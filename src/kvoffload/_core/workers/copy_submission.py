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
from typing import TYPE_CHECKING, Any, Literal

import torch

from .copier import BlockCopier
from ..cuda.events import CopyEvent
from ..base.foreign import call_foreign, foreign_error

if TYPE_CHECKING:
    from .job import Job

__all__ = ["CopyCalls", "CopyRequest", "CopySubmitter"]


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


_NOTHING_TO_STOP = contextlib.nullcontext()
"""What a transfer without a cancel flag submits its copies in (one for all: it holds nothing)."""


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

    def enqueue(
        self, job: Job, requests: Sequence[CopyRequest], after: Any,
        by_tensor: tuple[torch.Tensor, Sequence[int], Sequence[int]] | None = None,
    ) -> None:
        """Submit every request now, in the calling thread, after ``after`` (an event, or None: the work
        enqueued so far on the calling thread's current stream).

        For GPU caches this only enqueues work on the copier's streams, so the
        copies run with no Python step between them, whatever the calling
        thread or the worker loop do meanwhile. Stops at the first error
        (``job.error``: it fails the transfer, as anything the copier raises does).
        A load of several chunks gets a cancel flag. ``by_tensor`` (GPU copier only): instead, a load
        of ``(host rows, slots, block ids)`` copied tensor by tensor, one event per tensor in
        ``kv_caches`` order.

        The copies are recorded in ``job.events`` as they are submitted. On a ``BaseException``
        raised around the copier's calls (a signal handler's ``KeyboardInterrupt``, say): waits until
        the copies submitted by then have completed, then re-raises; the caller may then free the
        slots (and gives the cancel flag back: :meth:`~.job.Job.settle`). Takes no lock of the jobs':
        the index's lock may be held (:meth:`~.copy_worker.CopyWorker.submit_now`).
        """
        events: list[CopyEvent | None] = []
        job.events = events
        copier = self.copier
        flag = job.cancel_flag = copier.take_cancel_flag() if self.kind == "load" and (len(requests) > 1 or by_tensor) else None
        calls = self.calls
        own = calls.to_host is _to_host and calls.to_device is _to_device  # no test seam: the copier's own calls, a call fewer
        try:
            with self._lock:
                try:
                    copier.wait_for(after)  # None: the caller's current stream (this is the caller's thread)
                    with copier.stops_on(flag) if flag is not None else _NOTHING_TO_STOP:
                        if by_tensor is not None:
                            events.extend(call_foreign("copy to device", copier.to_device_by_tensor, *by_tensor))  # type: ignore[attr-defined]
                        for r in requests if by_tensor is None else ():  # :meth:`submit`, inlined: two calls fewer per copy
                            try:
                                if r.to_host:
                                    event = copier.to_host(r.block_ids, r.host, r.rows) if own else calls.to_host(copier, r.block_ids, r.host, r.rows)
                                else:
                                    event = copier.to_device(r.host, r.rows, r.block_ids) if own else calls.to_device(copier, r.host, r.rows, r.block_ids)
                            except OSError:
                                raise
                            except BaseException as e:  # as call_foreign maps it
                                raise foreign_error("copy to host" if r.to_host else "copy to device", e) from e
                            events.append(event)
                except Exception as e:  # OSError, ForeignCallError, a driver error: fails this transfer only
                    job.error = e
        except BaseException:
            job.wait_copies()
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
