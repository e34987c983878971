"""Short-lived threads for work that blocks: starting and closing an offloader off the caller's loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

from .cross_thread import event_settable_from_any_thread

__all__ = ["HelperThread", "on_worker_thread", "run_in_thread", "off_loop", "off_any_loop"]

T = TypeVar("T")


class HelperThread(threading.Thread):
    """A short-lived thread of ours that may block on a close: aclose(), __aenter__, a handed-off close."""


def on_worker_thread() -> bool:
    """True on a thread of kvoffload's that must never wait for a close: a worker loop (done
    callbacks run there), a completion bridge or a disk IO thread (garbage collection may run there)."""
    t = threading.current_thread()
    return t.name.startswith("kvoffload") and not isinstance(t, HelperThread)


def run_in_thread(fn: Callable[[], T], name: str) -> tuple[concurrent.futures.Future[T], threading.Thread]:
    """Run ``fn()`` on a new non-daemon thread named ``name`` (interpreter exit waits for it)."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)

    thread = HelperThread(target=run, name=name)
    thread.start()
    return fut, thread


async def off_loop(fn: Callable[[], T], name: str) -> tuple[asyncio.Future[T], asyncio.CancelledError | None]:
    """Run ``fn()`` on a thread named ``name`` and wait for it to end, even if the awaiting task is
    cancelled meanwhile. Returns the finished future and the ``CancelledError`` held back (to be
    raised by the caller), or None. The thread has ended when this returns."""
    thread_fut, thread = run_in_thread(fn, name)
    fut = asyncio.wrap_future(thread_fut)
    held: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait([fut])  # unlike await or shield, never cancels fut
        except asyncio.CancelledError as e:
            held = e
    thread.join()  # the result is set just before the thread returns: wait out that instant
    return fut, held


async def off_any_loop(fn: Callable[[], T], name: str) -> tuple[concurrent.futures.Future[T], bool]:
    """:func:`off_loop` for any backend anyio runs (trio): returns the finished future and whether
    the awaiting task was cancelled meanwhile (the caller then raises its cancellation with
    ``anyio.lowlevel.checkpoint_if_cancelled()``)."""
    import anyio

    thread_fut, thread = run_in_thread(fn, name)
    wake, ended = event_settable_from_any_thread()
    thread_fut.add_done_callback(wake)
    with anyio.CancelScope(shield=True):
        await ended.wait()
    thread.join()
    cancelled = False
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except anyio.get_cancelled_exc_class():
        cancelled = True
    return thread_fut, cancelled
