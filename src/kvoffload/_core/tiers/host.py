"""The host tier: one slab of (pinned) host memory holding ``slots`` block slots.

Slot ``i`` is row ``i`` of a ``uint8[slots, slot_bytes]`` view of the slab. The
tier moves blocks between the cache and its slots in chunks on a worker; which
key lives in which slot is the index's business, not the tier's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from ..hostmem import HostBuffer
from ..copy_worker import CopyRequest, CopyWorker
from ..layout import BlockLayout

__all__ = ["HostTier", "chunked"]

T = TypeVar("T")


def chunked(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """``items`` cut into consecutive pieces of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


class HostTier:
    """Block slots in host memory."""

    def __init__(self, layout: BlockLayout, slots: int) -> None:
        self.layout = layout
        self.slots = slots
        self.buffer = HostBuffer(slots * layout.slot_bytes, pin=layout.device if layout.is_cuda else None)
        self.rows = self.buffer.tensor.view(slots, layout.slot_bytes)

    @property
    def array(self) -> np.ndarray:
        """The slots as a numpy ``uint8[slots, slot_bytes]`` view (for disk IO)."""
        return self.rows.numpy()

    def requests_in(self, pairs: Sequence[tuple[int, int]], chunk_blocks: int) -> list[CopyRequest]:
        """Copies of cache blocks into slots (``(block id, slot)`` pairs), one per chunk of ``chunk_blocks``."""
        return [CopyRequest(True, self.rows, [b for b, _ in c], [s for _, s in c]) for c in chunked(pairs, chunk_blocks)]

    def requests_out(self, pairs: Sequence[tuple[int, int]], chunk_blocks: int) -> list[CopyRequest]:
        """Copies of slots into cache blocks (``(slot, block id)`` pairs), one per chunk of ``chunk_blocks``."""
        return [CopyRequest(False, self.rows, [b for _, b in c], [s for s, _ in c]) for c in chunked(pairs, chunk_blocks)]

    async def copy_in(self, worker: CopyWorker, pairs: Sequence[tuple[int, int]], landed: Callable[[int], None]) -> None:
        """Copy cache blocks into slots (``(block id, slot)`` pairs) on the worker's loop; ``landed(n)`` after each chunk of n."""
        await worker.pipeline(self.requests_in(pairs, worker.copier.chunk_blocks), lambda r: r, lambda r: landed(len(r.block_ids)))

    async def copy_out(self, worker: CopyWorker, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy slots into cache blocks (``(slot, block id)`` pairs) on the worker's loop."""
        await worker.pipeline(self.requests_out(pairs, worker.copier.chunk_blocks), lambda r: r, lambda r: None)

    def close(self) -> None:
        """Free the slab (no copy may be running)."""
        self.rows = self.rows.new_empty((0, self.layout.slot_bytes))
        self.buffer.close()
