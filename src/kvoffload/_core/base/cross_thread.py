"""Coalesced cross-thread calls into an event loop.

``loop.call_soon_threadsafe`` costs a write to the loop's self-pipe (and a
wake-up) per call. Under load, thousands of transfers start and finish per
second, so calls into one loop are queued in a :class:`Mailbox` and the loop is
woken once per batch: the first call after the loop drained the mailbox pays
for the wake-up, the calls that arrive before it runs ride along.

The offloader's own worker loops are woken *quietly*: through a pipe of their own,
written by libc's ``write`` called without releasing the GIL. ``call_soon_threadsafe``
sends on a socket, which releases the GIL; the woken worker takes it at once and the
caller of ``store()`` or ``load()`` then waits for the worker's whole turn in the middle of
its call (measured: a 4-block GPU store call of 215 us, where its copies took 87 us to
enqueue). Woken quietly, the worker runs when the caller next lets go of the GIL (its
``await``, a blocking call) or after the interpreter's switch interval.

A :class:`WakeSemaphore` wakes a plain thread instead: one that sleeps in a blocking call (the GIL
released) until something rings it. C code can ring it too: the driver, through a host function on
a stream (libc's ``sem_post`` itself, :data:`WakeSemaphore.RING_FUNCTION`), so that a thread waiting for a
GPU copy behind a thread busy in Python is woken with no Python run on its behalf.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import wake_semaphores

__all__ = ["WakeSemaphore", "take_wake_semaphore", "give_back_wake_semaphore", "Mailbox", "mailbox_of", "resolve", "resolve_from_any_thread"]


def _gil_keeping(name: str) -> Callable[[int, Any, int], int] | None:
    """libc's ``read`` or ``write``, called without releasing the GIL; None where ctypes cannot load it."""
    try:
        proto = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
        fn: Callable[[int, Any, int], int] = proto((name, ctypes.CDLL(None)))
        return fn
    except (OSError, AttributeError, TypeError):
        return None


_write_keeping_gil = _gil_keeping("write")
_read_keeping_gil = _gil_keeping("read")
_WAKE_BYTE = ctypes.create_string_buffer(b"w", 1)
_DRAINED = ctypes.create_string_buffer(64)
"""Where woken loops read their wake-up bytes, to throw them away (shared: nobody reads it)."""


class WakeSemaphore:
    """A POSIX semaphore that a thread sleeps on (:meth:`sleep`) until it is rung: by :meth:`ring`
    from another thread, or by C code calling :data:`RING_FUNCTION` with :attr:`address`.
    Making one raises ``OSError`` where the system has no POSIX semaphores.

    Take wake semaphores from the pool (:func:`take_wake_semaphore`): a wake semaphore handed to C code may be rung after its
    sleeper has gone, so its memory must outlive every ring enqueued for it; the pool never frees
    one. Rings that came after its last sleeper left (a ring for a copy it found landed without
    sleeping, its job's end ringing every sleeper) are thrown away when it is taken again: each
    would wake the next sleeper at once, and a thread woken behind a thread running Python waits up
    to a switch interval for the GIL. A ring still on its way then (for a copy that had not landed
    when its sleeper left: a cancel) may wake a later sleeper early: sleepers re-check what they
    wait for.
    """

    __slots__ = ("_sem", "address")

    RING_FUNCTION: int = wake_semaphores.RING_FUNCTION
    """Address of a C function ``void (*)(void *)`` that rings the semaphore at its argument (libc's ``sem_post``)."""

    def __init__(self) -> None:
        self._sem = (ctypes.c_uint64 * -(-wake_semaphores.SEMAPHORE_BYTES // 8))()  # 8-byte aligned
        self.address: int = ctypes.addressof(self._sem)
        wake_semaphores.init(self.address)

    def ring(self) -> None:
        """Wake the sleeper (the next one, if nobody sleeps now). Keeps the GIL."""
        wake_semaphores.ring(self.address)

    def drain(self) -> int:
        """Take back the rings nobody slept through (how many), without sleeping. Keeps the GIL."""
        return wake_semaphores.drain(self.address)

    def sleep(self, timeout: float, *, keep_gil: bool = False) -> float | None:
        """Sleep until rung or ``timeout`` seconds pass: None if not rung, else the seconds the thread
        then waited to take the GIL back (behind a thread running Python, up to the switch interval).
        The GIL is released meanwhile, unless ``keep_gil`` (then every other thread's Python waits:
        only for a short sleep, and the wait is 0.0)."""
        return wake_semaphores.sleep(self.address, timeout, keep_gil)


_idle_wake_semaphores: list[WakeSemaphore] = []
_every_wake_semaphore: list[WakeSemaphore] = []  # never freed: see WakeSemaphore
_wake_semaphores_lock = threading.Lock()


def take_wake_semaphore() -> WakeSemaphore:
    """A wake semaphore from the process's pool (a new one when every semaphore is taken), with no
    ring left from its earlier use; ``OSError`` where wake semaphores cannot be made."""
    with _wake_semaphores_lock:
        if _idle_wake_semaphores:
            semaphore = _idle_wake_semaphores.pop()
            semaphore.drain()
            return semaphore
        semaphore = WakeSemaphore()
        _every_wake_semaphore.append(semaphore)
        return semaphore


def give_back_wake_semaphore(semaphore: WakeSemaphore) -> None:
    """Return ``semaphore`` to the pool (its rings that came meanwhile are thrown away when it is
    taken; one still on its way then only wakes a later sleeper early)."""
    with _wake_semaphores_lock:
        _idle_wake_semaphores.append(semaphore)


class Mailbox:
    """Thread-safe queue of callbacks for one loop, drained in one loop callback per batch.

    ``quiet=True`` (the offloader's worker loops; make it before the loop runs, :meth:`close` it
    after): posting wakes the loop without releasing the GIL (see the module's docstring).
    """

    __slots__ = ("_loop", "_lock", "_calls", "_scheduled", "_pipe", "_closed", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop, *, quiet: bool = False) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._scheduled = False
        self._pipe: tuple[int, int] | None = None
        """Quiet wake-ups: (read end, write end), the read end watched by the loop."""
        self._closed = False
        if quiet and _write_keeping_gil is not None and _read_keeping_gil is not None:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            loop.add_reader(r, self._woken)
            self._pipe = (r, w)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon. Raises RuntimeError if the loop is closed (and drops
        the calls it will never run)."""
        with self._lock:
            if self._closed or self._loop.is_closed():
                self._closed = True
                self._calls = []
                raise RuntimeError("the mailbox's loop is closed")
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
            if self._pipe is not None:
                assert _write_keeping_gil is not None
                _write_keeping_gil(self._pipe[1], _WAKE_BYTE, 1)  # a full pipe is already a wake-up
                return
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile: nothing posted here will run
            with self._lock:
                self._closed = True
                self._calls = []
            raise
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def _woken(self) -> None:
        assert _read_keeping_gil is not None
        with self._lock:
            if self._pipe is not None:
                while _read_keeping_gil(self._pipe[0], _DRAINED, 64) > 0:
                    pass
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except BaseException as e:  # one bad callback must not drop the rest, nor stop the loop (SystemExit)
                self._loop.call_exception_handler({"message": "kvoffload mailbox callback failed", "exception": e})

    def close(self) -> None:
        """With the loop stopped: release the wake-up pipe; later posts raise RuntimeError, as on a closed loop."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
            self._closed = True
            self._calls = []
            if pipe is not None:
                self._loop.remove_reader(pipe[0])
                os.close(pipe[0])
                os.close(pipe[1])


_boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[Mailbox]] = weakref.WeakKeyDictionary()
"""Each loop's mailbox, weakly at both ends: a mailbox lives as long as someone may post to it (a
waiter holds it) or its loop holds its drain callback; then it goes, with whatever a loop that closed
never ran, and never keeps its loop alive (the loop of each ``asyncio.run`` that awaited a transfer)."""
_boxes_lock = threading.Lock()


MAILBOX_ATTRIBUTE = "_kvoffload_mailbox"
"""Where a loop that takes attributes (asyncio's own) keeps its mailbox, for as long as it lives (a
loop and its mailbox refer to each other: they go together); other loops (uvloop's) have theirs in
``_boxes``, made anew when nobody held it."""


def mailbox_of(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The mailbox of ``loop``: the one in use, or a new one. Hold it while you may post to it."""
    box: Mailbox | None = getattr(loop, MAILBOX_ATTRIBUTE, None)
    if box is not None:
        return box
    ref = _boxes.get(loop)
    box = ref() if ref is not None else None
    if box is None:
        with _boxes_lock:
            ref = _boxes.get(loop)
            box = ref() if ref is not None else None
            if box is None:
                box = Mailbox(loop)
                try:
                    setattr(loop, MAILBOX_ATTRIBUTE, box)
                except AttributeError:  # a loop without attributes of its own
                    _boxes[loop] = weakref.ref(box)
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
