"""The :class:`Transfer` handle that ``store()`` and ``load()`` return.

A transfer runs on one of the offloader's worker loops. The handle bridges its
outcome to whoever waits: any asyncio loop in any thread, a trio run (also in guest
mode on an asyncio loop), or anyio on either (``await``); a plain thread (``result()``);
or a callback. How a task sleeps until the transfer ends depends on the library that
runs it: ``base/async_backends.py`` owns that (on asyncio, at most one cross-thread wake-up
per waiting loop, shared with every other transfer that ends before that loop runs).

The handle is all a caller sees. The workers hold its :class:`~.job.Job`, the transfer's one
record, which ends it (:meth:`Transfer._end`, the one place a transfer ends) and reports per-tensor
landings.

A ``Transfer`` is not an ``asyncio.Future``, but it has what asyncio's combinators
use: ``asyncio.wait`` registers done callbacks (run on the registering loop, as a
future's are) and removes them; ``gather``, ``wait_for``, ``as_completed``,
``shield`` and ``ensure_future`` wrap it in a task that awaits it, so cancelling
that task cancels the transfer.
"""

from __future__ import annotations

import asyncio  # noqa: F401  (named in a type alias as a string)
import contextvars
import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generator, Literal

from ..base.async_backends import running_asyncio_loop, wakeup
from ..base.cross_thread import mailbox_of
from ..base.errors import ClosedError, TransferCancelled
from ..base.helper_threads import PROCESS

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


_Callback = tuple[Callable[["Transfer"], Any], "asyncio.AbstractEventLoop | None", "contextvars.Context | None"]
"""A done callback, the loop it runs on (None: where the transfer ends) and its context."""


class Transfer:
    """A running store or load: await it, cancel it, or wait on it from a thread.

    Cancelling the task that awaits a transfer cancels the transfer (``asyncio.shield``
    opts out); the task's cancellation reaches it only once the transfer no longer writes
    to its destination. A transfer cancelled by anything else ends with
    :class:`TransferCancelled`. In a child forked while it ran, waiting for it raises
    :class:`ClosedError` at once: it goes on in the parent only.

    ``tensor_names``: the names of the caches' tensors, the only names :meth:`tensor_done`
    and :meth:`wait_tensor` accept.
    """

    __slots__ = (
        "kind", "_lock", "_state", "_result", "_exc", "_exc_tb", "_finished", "_callbacks", "_cancel_requested", "_job",
        "_tensors", "_tensor_names", "_generation",
    )

    def __init__(self, kind: Literal["store", "load"], tensor_names: Sequence[str] = (), job: Any = None) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._state = _PENDING
        self._result: TransferResult | None = None
        self._exc: BaseException | None = None
        self._exc_tb: TracebackType | None = None
        """Where the error was raised: every raise of it starts from there again (as a future's do)."""
        self._generation = PROCESS.generation
        self._finished: threading.Event | None = None  # made when a thread first blocks on the transfer
        self._callbacks: list[_Callback] = []
        self._cancel_requested = False
        self._job = job
        """The workers' record of it (:class:`~.job.Job`; None once it ended)."""
        self._tensors: dict[str, _TensorCopy] | None = None
        """Loads with per-tensor completion: each tensor's copy event and waiters."""
        self._tensor_names: tuple[str, ...] = tuple(tensor_names)

    def __repr__(self) -> str:
        state = ("running", "done", "failed", "cancelled")[self._state]
        return f"<Transfer {self.kind} {state}>"

    # -- public -----------------------------------------------------------------

    def done(self) -> bool:
        """True once the transfer finished: done, failed or cancelled. A GPU transfer whose copies
        have landed is ended here if its worker has not done so yet."""
        return self._state != _PENDING or self._finish_if_landed()

    def cancelled(self) -> bool:
        """True if the transfer ended cancelled."""
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Ask the transfer to stop; returns False if it had already finished.

        Returns at once; the transfer ends cancelled after the copies already
        queued on a stream or an IO thread have finished, unless it completes first.
        A GPU load of several chunks ends once the chunk copying now has finished:
        its later copy kernels skip their work. Never raises: a transfer whose offloader
        is closing ends cancelled by the close. In a forked child, nothing runs to
        cancel: returns False.
        """
        if self._state != _PENDING or self._in_parent_only():
            return False
        with self._lock:
            if self._state != _PENDING:
                return False
            self._cancel_requested = True
            job = self._job
        if job is not None:
            job.cancel()
        return True

    def result(self, timeout: float | None = None) -> TransferResult:
        """Block the calling thread until the transfer ends; returns its :class:`TransferResult`.

        Raises ``TimeoutError`` if it has not ended within ``timeout`` seconds (None: no limit),
        :class:`TransferCancelled` if it was cancelled, or the transfer's error (each time with the
        traceback of where it was raised); :class:`ClosedError` in a child forked while it ran.
        Do not call this on a running event loop: await the transfer instead. The thread sleeps
        with the GIL released until the transfer ends (a GPU transfer of one small copy still in
        flight is first looked at again for up to 20 us, unless ``timeout`` is 0: it lands sooner
        than a sleep's wake-up).
        """
        if not self._block(timeout):
            raise TimeoutError(f"transfer did not finish within {timeout} s")
        if self._state == _DONE:  # :meth:`_outcome`'s first case, inlined: the hot path of every result()
            return self._result  # type: ignore[return-value]  # set with _DONE
        return self._outcome()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Like :meth:`result` but returns the error (None on success); raises :class:`TransferCancelled`
        if the transfer was cancelled."""
        if not self._block(timeout):
            raise TimeoutError(f"transfer did not finish within {timeout} s")
        if self._state == _CANCELLED:
            raise self._cancelled_error()
        return self._exc.with_traceback(self._exc_tb) if self._exc is not None else None

    def _block(self, timeout: float | None) -> bool:
        if self._state != _PENDING:
            return True
        if self._generation != PROCESS.generation:
            self._check_process()
        job = self._job
        # :meth:`_finish_if_landed`, inlined (the hot path of every result()); a look again for a copy that
        # lands soon, unless the caller asked not to wait (a timeout of 0)
        if job is not None and job.end_if_landed(timeout is None or timeout > 0):
            return True
        if job is not None:
            if timeout is None:  # copies at call time: the driver rings this thread, which ends it
                job.sleep_until_landed()
            else:
                job.want_end()
        with self._lock:
            if self._state != _PENDING:
                return True
            if self._finished is None:
                self._finished = threading.Event()
            finished = self._finished
        return finished.wait(timeout)

    def add_done_callback(
        self, fn: Callable[[Transfer], Any], *, context: contextvars.Context | None = None, on_ending_thread: bool = False,
    ) -> None:
        """Call ``fn(transfer)`` when the transfer ends (soon, if it has ended).

        Registered by an asyncio task or callback, it runs on that loop, as an
        ``asyncio.Future``'s callbacks do (``context`` as there), or where the transfer
        ends if that loop has closed meanwhile. Registered anywhere else (a plain thread, a
        trio task), or with ``on_ending_thread=True`` (bookkeeping of an integration that must
        not depend on the caller's loop), it runs on the thread that ends the transfer (its
        worker, or a thread that awaits it, waits in :meth:`result` or asks :meth:`done` once
        its copies landed), or at once if it has ended; keep it short and thread-safe, and never
        let it wait for another transfer (``result()``): on a worker's thread, a wait for a
        transfer of the same worker never ends. To wait there, register from an event loop, or
        hand the wait to a thread of your own. Whatever it raises, ``SystemExit`` and
        ``KeyboardInterrupt`` included, is logged and ignored.
        :class:`ClosedError` in a child forked while the transfer ran (it never ends there).
        """
        self._check_process()
        cb: _Callback = (fn, None if on_ending_thread else running_asyncio_loop(), context)
        with self._lock:
            pending = self._state == _PENDING
            if pending:
                self._callbacks.append(cb)
            job = self._job
        if not pending:
            self._dispatch(cb)
        elif job is not None:
            job.want_end()

    def remove_done_callback(self, fn: Callable[[Transfer], Any]) -> int:
        """Remove every registration of ``fn``; returns how many there were."""
        with self._lock:
            kept = [cb for cb in self._callbacks if cb[0] != fn]
            removed = len(self._callbacks) - len(kept)
            self._callbacks = kept
        return removed

    def __await__(self) -> Generator[Any, None, TransferResult]:
        if self._state == _PENDING:
            job = self._job  # _finish_if_landed, inlined: the hot path of every await
            if job is None or self._generation != PROCESS.generation or not job.end_if_landed(True):
                # Sleep until the transfer ends (not a coroutine of its own: a frame fewer to enter and resume).
                if self._generation != PROCESS.generation:
                    self._check_process()
                woken = wakeup()
                if self._on_end_registered(woken.wake):
                    # If the awaiting task is cancelled, so is the transfer; its cancellation is held back
                    # until nothing more is written.
                    cancellation = yield from woken.wait_through_cancel(self.cancel).__await__()
                    if cancellation is not None:
                        raise cancellation
        if self._state == _DONE:  # :meth:`_outcome`'s first case, inlined
            return self._result  # type: ignore[return-value]  # set with _DONE
        return self._outcome()

    # -- per-tensor completion (loads) ------------------------------------------

    def tensor_done(self, name: str) -> bool:
        """True once tensor ``name``'s blocks of this load are in place (a store: once it has ended).
        ``ValueError`` if ``name`` is not one of the caches' tensors."""
        state = self._tensor_state(name)
        return self._state == _DONE or (state is not None and state.done)

    async def wait_tensor(self, name: str) -> None:
        """Return once tensor ``name``'s blocks of this load are in place, so layer ``name`` can be used
        while later tensors still load (``load(..., per_tensor=True)`` on a GPU cache with every key in
        host memory; otherwise once the whole transfer is done). Raises what ``await transfer`` raises
        if the transfer ends first without it; ``ValueError`` if ``name`` is not one of the caches'
        tensors. Cancelling the waiting task stops the wait, not the transfer. Works under asyncio,
        trio and anyio."""
        state = self._tensor_state(name)
        self._check_process()
        woken = wakeup()
        if state is None:
            pending = self._on_end_registered(woken.wake)
        else:
            with self._lock:
                pending = self._state == _PENDING and not state.done
                if pending:
                    state.waiters.append(woken.wake)
        if pending:
            await woken.wait()
        if state is not None and state.done:
            return
        self._outcome()

    def stream_wait(self, name: str, stream: Any = None) -> None:
        """Make ``stream`` (a ``torch.cuda.Stream``; default: the current one) wait for tensor ``name``'s
        copy, without the host waiting: the next kernels there see that tensor's blocks in place.
        Needs ``load(..., per_tensor=True)`` on a GPU cache with every key in host memory
        (``ValueError`` otherwise). A failed or cancelled copy leaves the blocks unspecified: check the transfer."""
        state = self._tensor_state(name)
        if state is None or state.event is None:
            raise ValueError("stream_wait needs a GPU load made with per_tensor=True whose keys are all in host memory")
        import torch

        raw = stream.cuda_stream if stream is not None else torch.cuda.current_stream().cuda_stream
        state.event.wait_on(raw)

    def _tensor_state(self, name: str) -> _TensorCopy | None:
        """Tensor ``name``'s copy (None: it is done with the transfer); ValueError if there is no such tensor."""
        if self._tensors is not None:
            state = self._tensors.get(name)
            if state is not None:
                return state
        elif name in self._tensor_names:
            return None
        raise ValueError(f"no tensor {name!r} in this transfer; its tensors are {list(self._tensor_names)}")

    # -- waiting from an event loop ---------------------------------------------

    def _on_end_registered(self, wake: Callable[[Transfer], Any]) -> bool:
        """Register ``wake`` to run where the transfer ends; False (nothing registered) if it has ended."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._callbacks.append((wake, None, None))
            job = self._job
        if job is not None:
            job.want_end()
        return True

    def _cancelled_error(self) -> TransferCancelled:
        return TransferCancelled(f"the {self.kind} was cancelled (Transfer.cancel(), close(), or its offloader was collected)")

    def _outcome(self) -> TransferResult:
        if self._state == _DONE:
            assert self._result is not None
            return self._result
        if self._state == _CANCELLED:
            raise self._cancelled_error()
        assert self._exc is not None
        raise self._exc.with_traceback(self._exc_tb)  # from where it was raised, not from every raise since

    def _finish_if_landed(self) -> bool:
        """End the transfer here if its copies have completed and nobody ended it yet (GPU transfers
        enqueued at call time): a waiter then needs no hop through another thread."""
        job = self._job
        return job is not None and self._generation == PROCESS.generation and job.end_if_landed()

    def _in_parent_only(self) -> bool:
        """True in a child forked while the transfer ran: it goes on in the parent, never here."""
        return self._generation != PROCESS.generation and self._state == _PENDING

    def _check_process(self) -> None:
        if self._in_parent_only():
            raise ClosedError(
                f"this {self.kind} was started before a fork() and runs on in the parent process only; it never ends here"
            )

    def _dispatch(self, cb: _Callback) -> None:
        """Run a done callback where it belongs: on its loop, else (or if that loop has closed) here."""
        fn, loop, context = cb
        if loop is not None and not loop.is_closed():
            try:
                mailbox_of(loop).post(_call_quietly, fn, self, context)
                return
            except RuntimeError:  # closed meanwhile
                pass
        _call_quietly(fn, self, context)

    # -- the workers' side (called by its job) -------------------------------------------

    def _end(self, result: TransferResult | None = None, exc: BaseException | None = None, cancelled: bool = False) -> None:
        """End the transfer (the first call wins): wake every waiter and run the done callbacks. Only
        its job calls this (:meth:`~.job.Job.end`)."""
        with self._lock:
            if self._state != _PENDING:
                return
            if cancelled:
                self._state = _CANCELLED
            elif exc is not None:
                self._state, self._exc, self._exc_tb = _FAILED, exc, exc.__traceback__
            else:
                self._state, self._result = _DONE, result
            callbacks, self._callbacks = self._callbacks, []
            self._job = None
            finished = self._finished
            tensor_waiters = []
            for state in (self._tensors or {}).values():
                tensor_waiters += state.waiters
                state.waiters = []
        if finished is not None:
            finished.set()
        for cb in callbacks:
            if cb[1] is None and cb[2] is None:  # a waiter's wake-up (:meth:`_on_end_registered`): run here, a hop fewer
                try:
                    cb[0](self)
                except BaseException:
                    log.exception("done callback %r raised", cb[0])
            else:
                self._dispatch(cb)
        for wake in tensor_waiters:  # those whose tensor never landed: they raise the outcome
            _call_quietly(wake, self)

    def _track_tensors(self, events: list[Any]) -> None:
        """Before the transfer is returned, for a per-tensor GPU load: the event each tensor's copy ends
        with, in copy order; tensors after a failed submission get none (they never land: their waiters
        get the transfer's error)."""
        self._tensors = {n: _TensorCopy(events[i] if i < len(events) else None) for i, n in enumerate(self._tensor_names)}

    def _tensor_landed(self, index: int) -> None:
        """Tensor ``index`` (in copy order) is in place: wake its waiters."""
        assert self._tensors is not None
        state = self._tensors[self._tensor_names[index]]
        with self._lock:
            state.done = True
            waiters, state.waiters = state.waiters, []
        for wake in waiters:
            _call_quietly(wake, self)



class _TensorCopy:
    """One tensor of a per-tensor load: the event its copy ends with, and who waits for it."""

    __slots__ = ("event", "done", "waiters")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.done = False
        self.waiters: list[Callable[[Transfer], Any]] = []


def _call_quietly(fn: Callable[[Transfer], Any], transfer: Transfer, context: contextvars.Context | None = None) -> None:
    try:
        if context is not None:
            context.run(fn, transfer)
        else:
            fn(transfer)
    except BaseException:  # a user's callback must not stop the worker loop, not even with SystemExit
        log.exception("done callback %r raised", fn)
