"""Which async library runs the caller, and the one thing kvoffload does differently under each:
sleeping in the current task until another thread wakes it.

The library is asked of sniffio (which trio keeps up to date, and requires: where sniffio is not
installed, only asyncio can run), never guessed from whether an
asyncio loop runs in this thread: under trio's guest mode one does, yet trio's tasks cannot await its
futures. Everything in kvoffload that waits from an event loop goes through :func:`wakeup` (or
:func:`running_asyncio_loop` for where a callback belongs); nothing else asks which library runs.

* asyncio: a future of the running loop, resolved through the loop's mailbox (``cross_thread.py``):
  at most one cross-thread wake-up per loop turn, however many waits end meanwhile.
* anything else anyio runs (trio, also in guest mode): an anyio ``Event`` set through the backend's
  own thread-safe call (``TrioToken.run_sync_soon``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from .cross_thread import MAILBOX_ATTRIBUTE, Mailbox, mailbox_of

try:
    import sniffio
except ImportError:  # trio requires sniffio: without it, no library but asyncio can be running
    sniffio = None  # type: ignore[assignment]

__all__ = ["running_asyncio_loop", "settled", "Wakeup", "wakeup"]


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop running the caller (a task, or a callback of the loop), or None: on a plain
    thread, and under any other library, trio's guest mode on an asyncio loop included."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    # What sniffio.current_async_library() reads first: where a library that runs on asyncio's
    # thread (trio in guest mode) or inside its tasks (trio-asyncio) says who runs now. Neither set,
    # asyncio runs: a task, or a callback of the loop outside any task.
    if sniffio is None:
        return loop
    library = sniffio.thread_local.name or sniffio.current_async_library_cvar.get()
    return loop if library is None or library == "asyncio" else None


class Wakeup(Protocol):
    """A wait for the current task that any thread ends with :meth:`wake`."""

    def wake(self, *_: object) -> None:
        """End the wait (from any thread, any number of times; arguments are ignored, so that it can be
        a done callback). Nothing happens once the waiting loop or run has gone."""

    async def wait(self) -> None:
        """Sleep until woken. A cancellation of the waiting task ends the wait at once."""

    async def wait_through_cancel(self, on_cancel: Callable[[], object]) -> BaseException | None:
        """Sleep until woken, even if the waiting task is cancelled meanwhile: then call ``on_cancel()``
        once and go on sleeping (shielded, and without spinning under anyio's cancel scopes, which
        deliver their cancellation again at every await). Returns the cancellation held back, for the
        caller to raise (once it has cleaned up), or None."""


def wakeup() -> Wakeup:
    """A new :class:`Wakeup` for the task running here, whichever library runs it (asyncio, or any
    backend anyio runs); anyio's ``NoEventLoopError`` when no event loop runs here."""
    loop = running_asyncio_loop()
    return _AsyncioWakeup(loop) if loop is not None else _AnyioWakeup()


class _AsyncioWakeup:
    __slots__ = ("_loop", "_box", "_fut", "_woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._box: Mailbox = getattr(loop, MAILBOX_ATTRIBUTE, None) or mailbox_of(loop)  # the usual case without a call
        self._fut: asyncio.Future[None] = loop.create_future()
        self._woken = False

    def wake(self, *_: object) -> None:
        try:
            self._box.post(self._woken_on_loop)
        except RuntimeError:  # the waiting loop has closed: nobody to wake
            pass

    def _woken_on_loop(self) -> None:
        self._woken = True
        if not self._fut.done():  # not cancelled with its task
            self._fut.set_result(None)

    async def wait(self) -> None:
        await self._fut

    async def wait_through_cancel(self, on_cancel: Callable[[], object]) -> BaseException | None:
        try:
            await self._fut
            return None
        except asyncio.CancelledError as e:
            held = e
        on_cancel()
        import anyio

        with anyio.CancelScope(shield=True):  # under anyio's scopes on asyncio
            while not self._woken:
                self._fut = self._loop.create_future()  # the last one was cancelled with the task
                try:
                    await self._fut
                except asyncio.CancelledError:  # asyncio's cancellations may come again
                    continue
        return held


class _AnyioWakeup:
    __slots__ = ("_call_soon", "_event")

    def __init__(self) -> None:
        import anyio
        import anyio.lowlevel

        native = anyio.lowlevel.current_token().native_token
        self._call_soon: Callable[[Callable[[], Any]], Any] = getattr(native, "run_sync_soon")
        self._event = anyio.Event()

    def wake(self, *_: object) -> None:
        try:
            self._call_soon(self._event.set)
        except RuntimeError:  # the waiting run has ended (trio's RunFinishedError): nobody to wake
            pass

    async def wait(self) -> None:
        await self._event.wait()

    async def wait_through_cancel(self, on_cancel: Callable[[], object]) -> BaseException | None:
        import anyio

        try:
            await self._event.wait()
            return None
        except anyio.get_cancelled_exc_class() as e:
            held = e
        on_cancel()
        with anyio.CancelScope(shield=True):
            await self._event.wait()
        return held


async def settled(fut: asyncio.Future[Any]) -> None:
    """On an asyncio loop: return once ``fut`` is done, however it ends, even if the waiting task is
    cancelled meanwhile (each cancellation is absorbed while waiting; ``fut`` itself is never
    cancelled here). For clean-up that must not go on while IO or a copy still uses a buffer: the
    caller then raises what it was handling. Never raises what ``fut`` ended with (it is retrieved)."""
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            continue
    if not fut.cancelled():
        fut.exception()
