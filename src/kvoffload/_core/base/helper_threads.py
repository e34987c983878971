"""kvoffload's own threads: which threads are kvoffload's (:func:`mark_own_thread`), which process
they serve (:data:`PROCESS`: none of them survives a fork), and short-lived helper
threads for work that blocks, such as starting and closing an offloader off the caller's loop."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from .async_backends import wakeup

__all__ = [
    "HelperThread", "mark_own_thread", "on_worker_thread", "PROCESS", "run_in_thread", "run_off_loop",
]

T = TypeVar("T")


# -- whose thread is this ---------------------------------------------------------------------------

_own = threading.local()


def mark_own_thread() -> None:
    """Mark the calling thread as one of kvoffload's that must never wait for a close: call it first
    thing on every worker loop, landing watcher and disk IO thread. (Done callbacks run on worker
    loops; garbage collection, and so an offloader's finalizer, may run on any of them.)"""
    _own.marked = True


def on_worker_thread() -> bool:
    """True on a thread marked with :func:`mark_own_thread`, whatever the names of other threads."""
    return getattr(_own, "marked", False)


class HelperThread(threading.Thread):
    """A short-lived thread of ours that may block on a close: aclose(), __aenter__, a handed-off close
    (never marked with :func:`mark_own_thread`)."""


# -- which process ------------------------------------------------------------------------------------

class _Process:
    """This process as kvoffload sees it."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0
        """How many forks separate this process from the one that imported kvoffload first. An object
        made under another generation belongs to an ancestor process, whose threads did not come
        along. An attribute, not a call: the hot path reads it at every transfer."""


PROCESS = _Process()


def _after_fork_in_child() -> None:
    PROCESS.generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- helper threads -----------------------------------------------------------------------------------


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


def _nothing() -> None:
    pass


async def run_off_loop(fn: Callable[[], T], name: str) -> tuple[concurrent.futures.Future[T], BaseException | None]:
    """Run ``fn()`` on a thread named ``name`` and wait for it to end, even if the awaiting task is
    cancelled meanwhile; under asyncio, trio and anyio. Returns the finished future and the
    cancellation held back, for the caller to raise once it has cleaned up, or None. The thread has
    ended when this returns."""
    thread_fut, thread = run_in_thread(fn, name)
    woken = wakeup()
    thread_fut.add_done_callback(woken.wake)
    held = await woken.wait_through_cancel(_nothing)
    thread.join()  # the result is set just before the thread returns: wait out that instant
    return thread_fut, held
