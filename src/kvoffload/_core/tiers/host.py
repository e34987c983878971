"""The host tier: one slab of (pinned) host memory holding ``slots`` block slots.

Slot ``i`` is row ``i`` of a ``uint8[slots, slot_bytes]`` view of the slab. The
tier moves blocks between the cache and its slots in chunks, stores on the store
worker and loads on the load worker; which key lives in which slot is the
index's business, not the tier's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from .hostmem import HostBuffer
from ..workers.copy_submission import CopyRequest
from ..workers.copy_worker import CopyWorkers
from ..base.layout import BlockLayout

__all__ = ["HostTier", "chunked"]

T = TypeVar("T")


def chunked(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """``items`` cut into consecutive pieces of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


class HostTier:
    """Block slots in host memory."""

    def __init__(self, layout: BlockLayout, slots: int, workers: CopyWorkers) -> None:
        self.layout = layout
        self.slots = slots
        self.workers = workers
        self.chunk_blocks = workers.store.chunk_blocks
        self.buffer = HostBuffer(slots * layout.slot_bytes, pin=layout.device if layout.is_cuda else None)
        self.rows = self.buffer.tensor.view(slots, layout.slot_bytes)

    @property
    def array(self) -> np.ndarray:
        """The slots as a numpy ``uint8[slots, slot_bytes]`` view (for disk IO)."""
        return self.rows.numpy()

    def requests(self, to_host: bool, block_ids: Sequence[int], slots: Sequence[int]) -> list[CopyRequest]:
        """Copies of cache blocks ``block_ids`` into ``slots`` (``to_host``) or back, one per chunk."""
        c = self.chunk_blocks
        if len(block_ids) <= c:
            return [CopyRequest(to_host, self.rows, block_ids, slots)]
        return [CopyRequest(to_host, self.rows, block_ids[i : i + c], slots[i : i + c]) for i in range(0, len(block_ids), c)]

    def request_out(self, pairs: Sequence[tuple[int, int]]) -> CopyRequest:
        """One copy of slots into cache blocks (``(slot, block id)`` pairs), however many."""
        return CopyRequest(False, self.rows, [b for _, b in pairs], [s for s, _ in pairs])

    async def copy_in(self, pairs: Sequence[tuple[int, int]], landed: Callable[[int], None]) -> None:
        """Copy cache blocks into slots (``(block id, slot)`` pairs) on the store worker's loop;
        ``landed(n)`` after each chunk of n."""
        requests = self.requests(True, [b for b, _ in pairs], [s for _, s in pairs])
        await self.workers.store.pipeline(requests, lambda r: r, lambda r: landed(len(r.block_ids)))

    async def copy_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slots into cache blocks (``(slot, block id)`` pairs) on the load worker's loop."""
        await self.workers.load.pipeline(self.requests(False, [b for _, b in pairs], [s for s, _ in pairs]), lambda r: r, lambda r: None)

    def close(self) -> None:
        """Free the slab (no copy may be running)."""
        self.rows = self.rows.new_empty((0, self.layout.slot_bytes))
        self.buffer.close()
