"""Bridges that turn CUDA event completion into awaitable futures on a worker loop.

Each worker loop owns one bridge, and every event it watches was recorded on
that loop's copy stream, so events complete in the order they are watched.

Two bridges, chosen by measurement (see ``docs/design.md`` for the numbers):

* :class:`ThreadBridge` - a waiter thread blocks on blocking-sync events
  (``cudaEventBlockingSync``: the thread sleeps in the driver, no spinning),
  and wakes the loop once for every run of completions it finds. Costs one
  cross-thread wake-up per completion batch and no CPU while waiting.
* :class:`PollBridge` - the loop polls ``event.query()``: it spins
  (``sleep(0)``) for ``spin_s`` (1 ms) after an eager watch or a :meth:`~PollBridge.follow_closely`
  (somebody waits), and after each completion while somebody waits, so a transfer
  whose chunks keep landing is followed closely; otherwise (nobody waits, or nothing
  has completed for ``spin_s``: the GPU is stalled behind compute) it ticks every
  millisecond. No thread hop, the lowest latency; a core is busy only while copies
  that somebody waits for are landing. Nothing runs while no event is pending.
  Spinning takes the GIL thousands of times a second, which the threads running
  the model's Python pay for: hence only while somebody waits.

A copy that fails on the device (its event's ``query()`` or ``synchronize()`` raises a CUDA
error, such as an illegal address) completes its future with :class:`ForeignCallError` (the
CUDA error as ``__cause__``) instead of a result: the event is settled, nothing more is written,
and what it covers did not land. Every reader of copy events asks through :func:`completed` and
:func:`wait_completed`, which say so the same way.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Any, Protocol

from ..base.helper_threads import mark_own_thread
from ..base.cross_thread import resolve
from ..base.foreign import ForeignCallError

__all__ = ["CompletionBridge", "CopyEvent", "ThreadBridge", "PollBridge", "make_bridge", "completed", "wait_completed"]


class CopyEvent(Protocol):
    """What copies complete with: a :class:`~.driver.DriverEvent`, a ``torch.cuda.Event``, a test's
    stand-in. Both calls raise (the copy failed on the device) as the driver reports it."""

    def query(self) -> bool:
        """True once the work recorded before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block until it has completed."""
        ...


def completed(event: CopyEvent) -> bool:
    """``event.query()``: True once the copies recorded before ``event`` have completed.

    Raises :class:`ForeignCallError` (what the event raised as ``__cause__``: a CUDA error) if they
    failed on the device: the event is settled, and what it covers did not land. Only ``Exception``
    is taken for the copy's: a ``KeyboardInterrupt`` in a waiting thread is its own and propagates."""
    try:
        return bool(event.query())
    except Exception as e:
        raise _copy_failed(e) from e


def wait_completed(event: CopyEvent) -> None:
    """``event.synchronize()``: block until the copies recorded before ``event`` have completed.
    Raises as :func:`completed` does if they failed."""
    try:
        event.synchronize()
    except Exception as e:
        raise _copy_failed(e) from e


def _copy_failed(e: Exception) -> ForeignCallError:
    try:
        text = str(e)  # foreign: its __str__ may raise
    except Exception:
        text = ""
    return ForeignCallError(f"a copy failed on the device: {type(e).__name__}" + (f": {text}" if text else ""))


def _settle(fut: asyncio.Future[None], failure: ForeignCallError | None) -> None:
    """Complete ``fut``: with ``failure`` if its copies failed, else with None; nothing if it is done
    already (cancelled, say). Call on its loop."""
    if fut.done():
        return
    if failure is not None:
        fut.set_exception(failure)
    else:
        fut.set_result(None)


class CompletionBridge(Protocol):
    """Turns an event into a future of the loop the bridge serves."""

    def watch(self, event: CopyEvent, eager: bool = True) -> asyncio.Future[None]:
        """A future that completes when ``event`` has completed, with :class:`ForeignCallError` if its
        copies failed on the device. Call on the bridge's loop. ``eager``: somebody waits for it now
        (a polling bridge follows it closely)."""
        ...

    def follow_closely(self) -> None:
        """Somebody now waits for what is watched: follow it closely. Call on the bridge's loop."""
        ...

    @property
    def following_closely(self) -> bool:
        """True while a :meth:`follow_closely` holds (readable from any thread: then a hint, not a promise)."""
        ...

    def close(self) -> None:
        """Stop any helper thread; pending futures are left as they are."""
        ...


def _settle_all(batch: list[tuple[asyncio.Future[None], ForeignCallError | None]]) -> None:
    for fut, failure in batch:
        _settle(fut, failure)


class ThreadBridge:
    """A waiter thread sleeping on blocking-sync events in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "kvoffload-events") -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[Any, asyncio.Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, event: CopyEvent, eager: bool = True) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._queue.put((event, fut))
        return fut

    def follow_closely(self) -> None:
        pass  # the waiter thread wakes at each completion anyway

    @property
    def following_closely(self) -> bool:
        return True

    def _run(self) -> None:
        mark_own_thread()
        held: list[tuple[Any, asyncio.Future[None]] | None] = []  # an item taken but not yet complete
        while True:
            item = held.pop() if held else self._queue.get()
            if item is None:
                return
            event, fut = item
            failure: ForeignCallError | None = None
            try:
                wait_completed(event)  # sleeps in the driver; releases the GIL
            except ForeignCallError as e:
                failure = e
            batch = [(fut, failure)]
            while True:  # gather every completion (or failure) already there: one wake-up for all
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    held.append(nxt)
                    break
                failure = None
                try:
                    if not completed(nxt[0]):
                        held.append(nxt)
                        break
                except ForeignCallError as e:
                    failure = e
                batch.append((nxt[1], failure))
            try:
                self._loop.call_soon_threadsafe(_settle_all, batch)
            except RuntimeError:  # loop closed during shutdown
                return

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class PollBridge:
    """The loop polls ``event.query()``: spin briefly, then tick every millisecond."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spin_s: float = 1e-3, tick_s: float = 1e-3) -> None:
        self._loop = loop
        self._spin_s = spin_s
        self._tick_s = tick_s
        self._pending: deque[tuple[Any, asyncio.Future[None]]] = deque()
        self._poller: asyncio.Task[None] | None = None
        self._last_progress = 0.0
        self._eager = False
        """Somebody waits for what is pending (cleared when nothing is)."""
        self._tick: asyncio.Future[None] | None = None
        """What the poller awaits between two ticks: following closely resolves it early."""

    def watch(self, event: CopyEvent, eager: bool = True) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._pending.append((event, fut))
        if eager:
            self.follow_closely()
        elif self._poller is None:
            self._poller = self._loop.create_task(self._poll())
        return fut

    @property
    def following_closely(self) -> bool:
        return self._eager

    def follow_closely(self) -> None:
        # Also before the awaited events are watched (the waiter's call may overtake the worker's watch):
        # what is watched next is followed closely, until nothing is pending.
        self._eager = True
        self._last_progress = time.perf_counter()
        if self._tick is not None:  # the poller waits for its next tick: poll now
            resolve(self._tick)
        elif self._pending and self._poller is None:
            self._poller = self._loop.create_task(self._poll())

    async def _poll(self) -> None:
        try:
            while self._pending:
                while self._pending:
                    failure: ForeignCallError | None = None
                    try:
                        if not completed(self._pending[0][0]):
                            break
                    except ForeignCallError as e:  # settled too: the next one's turn
                        failure = e
                    _settle(self._pending.popleft()[1], failure)
                    if self._eager:
                        self._last_progress = time.perf_counter()
                if not self._pending:
                    self._eager = False
                    break
                if time.perf_counter() - self._last_progress < self._spin_s:
                    await asyncio.sleep(0)
                else:
                    await self._next_tick()
        finally:
            self._poller = None

    async def _next_tick(self) -> None:
        tick = self._tick = self._loop.create_future()
        timer = self._loop.call_later(self._tick_s, resolve, tick)
        try:
            await tick
        finally:
            timer.cancel()
            self._tick = None

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


def make_bridge(kind: str, loop: asyncio.AbstractEventLoop, name: str) -> CompletionBridge:
    """Build the bridge named ``kind`` ("thread" or "poll") for ``loop``."""
    if kind == "thread":
        return ThreadBridge(loop, name)
    if kind == "poll":
        return PollBridge(loop)
    raise ValueError(f"unknown completion bridge {kind!r}: use 'thread' or 'poll'")
