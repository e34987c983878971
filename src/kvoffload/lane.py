"""A *lane*: one direction's worker loop with its block mover and completion bridge.

The offloader has a store lane and a load lane. A tier runs its copy pipeline
on a lane with :meth:`Lane.pipeline`, which keeps a few chunks queued ahead,
reports each chunk as it completes, and on cancellation or error waits for
every copy already queued before the exception propagates.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .loops import LoopThread
from .movers import BlockMover

__all__ = ["Lane"]

C = TypeVar("C")


class Lane:
    """Loop thread + mover + bridge for one direction."""

    def __init__(self, loop_thread: LoopThread, mover: BlockMover, bridge: Any, depth: int = 3) -> None:
        self.thread = loop_thread
        self.mover = mover
        self.bridge = bridge
        self.depth = depth

    async def wait(self, event: Any) -> None:
        """Wait until ``event`` completed (None: already complete)."""
        if event is not None:
            await self.bridge.watch(event)

    async def settle(self, event: Any) -> None:
        """Wait until ``event`` completed, even if cancelled meanwhile (cleanup path)."""
        if event is None:
            return
        fut = self.bridge.watch(event)
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue

    async def pipeline(self, chunks: Iterable[C], submit: Callable[[C], Any], completed: Callable[[C], Any]) -> None:
        """``submit(chunk)`` each chunk in order, keeping up to ``depth`` in flight; ``completed(chunk)`` as each lands.

        On cancellation or error nothing more is submitted, every copy already
        submitted is waited for, and the exception propagates; chunks that
        landed stay reported.
        """
        inflight: deque[tuple[Any, C]] = deque()
        try:
            for chunk in chunks:
                event = submit(chunk)
                inflight.append((event, chunk))
                if event is None:  # copy done synchronously (CPU): a cancellation point between chunks
                    completed(inflight.popleft()[1])
                    await asyncio.sleep(0)
                    continue
                while len(inflight) >= self.depth:
                    await self.wait(inflight[0][0])
                    completed(inflight.popleft()[1])
            while inflight:
                await self.wait(inflight[0][0])
                completed(inflight.popleft()[1])
        except BaseException:
            if inflight:
                await self.settle(inflight[-1][0])  # in stream order: the last one covers all
            raise
