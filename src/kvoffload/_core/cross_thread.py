"""Coalesced cross-thread calls into an event loop.

``loop.call_soon_threadsafe`` costs a write to the loop's self-pipe (and a
wake-up) per call. Under load, thousands of transfers start and finish per
second, so calls into one loop are queued in a :class:`Mailbox` and the loop is
woken once per batch: the first call after the loop drained the mailbox pays
for the wake-up, the calls that arrive before it runs ride along.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Mailbox", "mailbox_of", "resolve", "resolve_from_any_thread", "caller_of_current_loop", "event_settable_from_any_thread"]


class Mailbox:
    """Thread-safe queue of callbacks for one loop, drained in one loop callback per batch."""

    __slots__ = ("_loop", "_lock", "_calls", "_scheduled", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon. Raises RuntimeError if the loop is closed."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except BaseException as e:  # one bad callback must not drop the rest, nor stop the loop (SystemExit)
                self._loop.call_exception_handler({"message": "kvoffload mailbox callback failed", "exception": e})


_boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_boxes_lock = threading.Lock()


def mailbox_of(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The mailbox of ``loop`` (created on first use, dropped with the loop)."""
    box = _boxes.get(loop)
    if box is None:
        with _boxes_lock:
            box = _boxes.get(loop)
            if box is None:
                box = _boxes[loop] = Mailbox(loop)
    return box


def resolve(fut: asyncio.Future[None]) -> None:
    """Complete ``fut`` with None unless it is done already (cancelled, say). Call on its loop."""
    if not fut.done():
        fut.set_result(None)


def resolve_from_any_thread(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """:func:`resolve` ``fut`` on ``loop`` from any thread; nothing if the loop has closed (nobody waits)."""
    try:
        loop.call_soon_threadsafe(resolve, fut)
    except RuntimeError:
        pass


def caller_of_current_loop() -> Callable[[Callable[[], Any]], Any]:
    """A non-blocking, thread-safe ``call(fn)`` that runs ``fn()`` on the event loop running in this
    thread, whatever the backend anyio knows it by: the loop's mailbox on asyncio,
    ``TrioToken.run_sync_soon`` on trio. The call raises ``RuntimeError`` once that loop is gone.
    Raises anyio's ``NoEventLoopError`` when no event loop runs here."""
    import anyio.lowlevel

    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        box = mailbox_of(native)
        return box.post
    run_sync_soon: Callable[[Callable[[], Any]], Any] = getattr(native, "run_sync_soon")
    return run_sync_soon


def event_settable_from_any_thread() -> tuple[Callable[..., None], Any]:
    """An ``anyio.Event`` of the event loop running in this thread, and a callable that sets it from
    any thread (its arguments are ignored; nothing happens once that loop is gone)."""
    import anyio

    call_soon = caller_of_current_loop()
    event = anyio.Event()

    def set_soon(*_: object) -> None:
        try:
            call_soon(event.set)
        except RuntimeError:  # the waiting loop or run has ended: nobody to wake
            pass

    return set_soon, event
