"""The :class:`Transfer` handle that ``store()`` and ``load()`` return.

A transfer runs as a task on one of the offloader's worker loops. The handle
bridges its outcome to whoever waits: any asyncio loop in any thread (``await``),
a plain thread (``result()``), or a callback. At most one cross-thread wake-up
per waiting loop is spent when the transfer ends, shared with every other
transfer that ends before that loop runs (see ``wakeup.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generator, Literal

from .cross_thread import mailbox_of, resolve

__all__ = ["Transfer", "TransferResult"]

log = logging.getLogger("kvoffload")


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer did."""

    kind: Literal["store", "load"]
    keys: tuple[Hashable, ...]
    """Keys whose blocks were moved."""
    skipped: tuple[Hashable, ...]
    """Store only: keys that were already stored (or being stored) and were left alone."""
    nbytes: int
    """Bytes moved (block bytes, without slot padding)."""
    seconds: float
    """From the call to the end of the transfer."""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


class Transfer:
    """A running store or load: await it, cancel it, or wait on it from a thread.

    Cancelling the task that awaits a transfer cancels the transfer
    (``asyncio.shield(transfer)`` opts out). ``CancelledError`` reaches the
    awaiting task only once the transfer no longer writes to its destination.
    """

    __slots__ = ("kind", "_lock", "_state", "_result", "_exc", "_finished", "_callbacks", "_cancel_requested", "_canceller")

    def __init__(self, kind: Literal["store", "load"]) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._state = _PENDING
        self._result: TransferResult | None = None
        self._exc: BaseException | None = None
        self._finished: threading.Event | None = None  # made when a thread first blocks on the transfer
        self._callbacks: list[Callable[[Transfer], Any]] = []
        self._cancel_requested = False
        self._canceller: Callable[[], Any] | None = None

    def __repr__(self) -> str:
        state = ("running", "done", "failed", "cancelled")[self._state]
        return f"<Transfer {self.kind} {state}>"

    # -- public -----------------------------------------------------------------

    def done(self) -> bool:
        """True once the transfer finished: done, failed or cancelled."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        """True if the transfer ended cancelled."""
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Ask the transfer to stop; returns False if it had already finished.

        Returns at once; the transfer ends cancelled after the copies already
        queued on a stream or an IO thread have finished, unless it completes first.
        """
        with self._lock:
            if self._state != _PENDING:
                return False
            self._cancel_requested = True
            canceller = self._canceller
        if canceller is not None:
            canceller()
        return True

    def result(self, timeout: float | None = None) -> TransferResult:
        """Block the calling thread until the transfer ends and return its result.

        Raises ``TimeoutError`` if it has not ended within ``timeout`` seconds,
        ``asyncio.CancelledError`` if it was cancelled, or the transfer's error.
        Do not call this on a running event loop: await the transfer instead.
        """
        if not self._block(timeout):
            raise TimeoutError(f"transfer did not finish within {timeout} s")
        return self._outcome()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Like :meth:`result` but returns the error (None on success)."""
        if not self._block(timeout):
            raise TimeoutError(f"transfer did not finish within {timeout} s")
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        return self._exc

    def _block(self, timeout: float | None) -> bool:
        with self._lock:
            if self._state != _PENDING:
                return True
            if self._finished is None:
                self._finished = threading.Event()
            finished = self._finished
        return finished.wait(timeout)

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Call ``fn(transfer)`` when the transfer ends.

        It runs on the worker thread that finished the transfer, or at once in
        the calling thread if it has already ended; keep it short and thread-safe
        (``loop.call_soon_threadsafe`` to reach a loop). Whatever it raises,
        ``SystemExit`` and ``KeyboardInterrupt`` included, is logged and ignored.
        """
        with self._lock:
            if self._state == _PENDING:
                self._callbacks.append(fn)
                return
        _call_quietly(fn, self)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._wait().__await__()

    # -- waiting from an event loop ---------------------------------------------

    async def _wait(self) -> TransferResult:
        loop = asyncio.get_running_loop()
        try:
            await self._finished_on(loop)
        except asyncio.CancelledError:
            # Our awaiting task was cancelled: cancel the transfer, then hold the
            # CancelledError back until nothing more is written.
            self.cancel()
            while True:
                try:
                    await asyncio.shield(self._finished_on(loop))
                    break
                except asyncio.CancelledError:
                    continue
            raise
        return self._outcome()

    def _finished_on(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = loop.create_future()
        box = mailbox_of(loop)

        def wake(_: Transfer) -> None:
            try:
                box.post(resolve, fut)
            except RuntimeError:  # the waiting loop was closed meanwhile: nobody to wake
                pass

        with self._lock:
            if self._state == _PENDING:
                self._callbacks.append(wake)
                return fut
        fut.set_result(None)
        return fut

    def _outcome(self) -> TransferResult:
        if self._state == _DONE:
            assert self._result is not None
            return self._result
        if self._state == _CANCELLED:
            raise asyncio.CancelledError()
        assert self._exc is not None
        raise self._exc

    # -- worker side ------------------------------------------------------------

    def _set_canceller(self, canceller: Callable[[], Any]) -> None:
        """Install how to stop the worker task; runs it now if a cancel came first."""
        with self._lock:
            self._canceller = canceller
            fire = self._cancel_requested and self._state == _PENDING
        if fire:
            canceller()

    def _finish(self, result: TransferResult | None = None, exc: BaseException | None = None, cancelled: bool = False) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            if cancelled:
                self._state = _CANCELLED
            elif exc is not None:
                self._state, self._exc = _FAILED, exc
            else:
                self._state, self._result = _DONE, result
            callbacks, self._callbacks = self._callbacks, []
            self._canceller = None
            finished = self._finished
        if finished is not None:
            finished.set()
        for fn in callbacks:
            _call_quietly(fn, self)



def _call_quietly(fn: Callable[[Transfer], Any], transfer: Transfer) -> None:
    try:
        fn(transfer)
    except BaseException:  # a user's callback must not stop the worker loop, not even with SystemExit
        log.exception("done callback %r raised", fn)
