"""Bridges that turn CUDA event completion into awaitable futures on a worker loop.

Each worker loop owns one bridge, and every event it watches was recorded on
that loop's copy stream, so events complete in the order they are watched.

Two bridges, chosen by measurement (see ``docs/design.md`` for the numbers):

* :class:`ThreadBridge` - a waiter thread blocks on blocking-sync events
  (``cudaEventBlockingSync``: the thread sleeps in the driver, no spinning),
  and wakes the loop once for every run of completions it finds. Costs one
  cross-thread wake-up per completion batch and no CPU while waiting.
* :class:`PollBridge` - the loop polls ``event.query()``: it spins
  (``sleep(0)``) for ``spin_s`` (1 ms) after an eager watch or a :meth:`~PollBridge.hurry`
  (somebody waits), and after each completion while somebody waits, so a transfer
  whose chunks keep landing is followed closely; otherwise (nobody waits, or nothing
  has completed for ``spin_s``: the GPU is stalled behind compute) it ticks every
  millisecond. No thread hop, the lowest latency; a core is busy only while copies
  that somebody waits for are landing. Nothing runs while no event is pending.
  Spinning takes the GIL thousands of times a second, which the threads running
  the model's Python pay for: hence only while somebody waits.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from typing import Any, Protocol

from ..cross_thread import resolve

__all__ = ["CompletionBridge", "ThreadBridge", "PollBridge", "make_bridge"]


class CompletionBridge(Protocol):
    """Turns an event into a future of the loop the bridge serves."""

    def watch(self, event: Any, eager: bool = True) -> asyncio.Future[None]:
        """A future that completes when ``event`` has completed. Call on the bridge's loop. ``eager``:
        somebody waits for it now (a polling bridge follows it closely)."""
        ...

    def hurry(self) -> None:
        """Somebody now waits for what is watched: follow it closely. Call on the bridge's loop."""
        ...

    @property
    def hurried(self) -> bool:
        """True while a :meth:`hurry` holds (readable from any thread: then a hint, not a promise)."""
        ...

    def close(self) -> None:
        """Stop any helper thread; pending futures are left as they are."""
        ...


def _resolve_all(futs: list[asyncio.Future[None]]) -> None:
    for fut in futs:
        resolve(fut)


class ThreadBridge:
    """A waiter thread sleeping on blocking-sync events in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "kvoffload-events") -> None:
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[Any, asyncio.Future[None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, event: Any, eager: bool = True) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._queue.put((event, fut))
        return fut

    def hurry(self) -> None:
        pass  # the waiter thread wakes at each completion anyway

    @property
    def hurried(self) -> bool:
        return True

    def _run(self) -> None:
        held: list[tuple[Any, asyncio.Future[None]] | None] = []  # an item taken but not yet complete
        while True:
            item = held.pop() if held else self._queue.get()
            if item is None:
                return
            event, fut = item
            event.synchronize()  # sleeps in the driver; releases the GIL
            batch = [fut]
            while True:  # gather every completion already there: one wake-up for all
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or not nxt[0].query():
                    held.append(nxt)
                    break
                batch.append(nxt[1])
            try:
                self._loop.call_soon_threadsafe(_resolve_all, batch)
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
        """What the poller awaits between two ticks: a hurry resolves it early."""

    def watch(self, event: Any, eager: bool = True) -> asyncio.Future[None]:
        fut = self._loop.create_future()
        self._pending.append((event, fut))
        if eager:
            self.hurry()
        elif self._poller is None:
            self._poller = self._loop.create_task(self._poll())
        return fut

    @property
    def hurried(self) -> bool:
        return self._eager

    def hurry(self) -> None:
        # Also before the awaited events are watched (the waiter's hurry may overtake the worker's watch):
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
                while self._pending and self._pending[0][0].query():
                    resolve(self._pending.popleft()[1])
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
