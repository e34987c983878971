"""The host tier: one slab of (pinned) host memory holding ``slots`` block slots.

Slot ``i`` is row ``i`` of a ``uint8[slots, slot_bytes]`` view of the slab. A
store reserves slots in the index at call time (evicting least-recently-used
entries that no transfer uses), copies blocks in chunks, and publishes each
chunk's keys only when its copy has completed. A load pins its entries at call
time so that nothing evicts them while they are read.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..hostmem import HostBuffer
from ..index import BlockIndex, Entry
from ..lane import Lane
from ..layout import BlockLayout
from ..transfer import TransferResult

__all__ = ["HostTier", "StorePlan", "LoadPlan"]


def chunked(items: Sequence, size: int) -> list[Sequence]:
    """``items`` cut into consecutive pieces of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass
class StorePlan:
    """A store's reserved entries and GPU source blocks; tracks what is published."""

    pairs: list[tuple[int, Entry]]  # (cache block id, reserved entry)
    skipped: tuple[Hashable, ...]
    started: float = field(default_factory=time.perf_counter)
    published: int = 0
    finished: bool = False


@dataclass
class LoadPlan:
    """A load's pinned entries and GPU destination blocks."""

    pairs: list[tuple[Entry, int]]  # (pinned entry, cache block id)
    started: float = field(default_factory=time.perf_counter)
    released: bool = False


class HostTier:
    """Block slots in host memory, with their index."""

    def __init__(self, layout: BlockLayout, slots: int) -> None:
        self.layout = layout
        self.slots = slots
        self.buffer = HostBuffer(slots * layout.slot_bytes, pin=layout.is_cuda)
        self.rows = self.buffer.tensor.view(slots, layout.slot_bytes)
        self.index = BlockIndex(slots)

    # -- store ------------------------------------------------------------------

    def plan_store(self, blocks: dict[Hashable, int]) -> StorePlan:
        """Reserve slots for the keys not yet present (may raise CapacityError)."""
        entries, skipped = self.index.reserve(blocks)
        return StorePlan([(blocks[e.key], e) for e in entries], tuple(skipped))

    async def run_store(self, lane: Lane, plan: StorePlan, after: object) -> TransferResult:
        """Copy the plan's blocks into their slots, publishing each chunk as it lands."""
        if after is not None:
            lane.mover.wait_for(after)

        def submit(chunk: Sequence[tuple[int, Entry]]) -> object:
            return lane.mover.to_host([b for b, _ in chunk], self.rows, [e.slot for _, e in chunk])

        def completed(chunk: Sequence[tuple[int, Entry]]) -> None:
            self.index.publish(e for _, e in chunk)
            plan.published += len(chunk)

        await lane.pipeline(chunked(plan.pairs, lane.mover.chunk_blocks), submit, completed)
        keys = tuple(e.key for _, e in plan.pairs)
        return TransferResult("store", keys, plan.skipped, len(keys) * self.layout.block_bytes, time.perf_counter() - plan.started)

    def end_store(self, plan: StorePlan) -> None:
        """Abort every entry the store did not publish (idempotent)."""
        if not plan.finished:
            plan.finished = True
            self.index.abort(e for _, e in plan.pairs[plan.published :])

    # -- load -------------------------------------------------------------------

    def plan_load(self, blocks: dict[Hashable, int]) -> LoadPlan:
        """Pin the entries of ``blocks`` (may raise MissingKeysError)."""
        keys = list(blocks)
        return LoadPlan(list(zip(self.index.pin(keys), (blocks[k] for k in keys))))

    async def run_load(self, lane: Lane, plan: LoadPlan, after: object) -> TransferResult:
        """Copy the pinned slots into the cache blocks."""
        if after is not None:
            lane.mover.wait_for(after)

        def submit(chunk: Sequence[tuple[Entry, int]]) -> object:
            return lane.mover.to_device(self.rows, [e.slot for e, _ in chunk], [b for _, b in chunk])

        await lane.pipeline(chunked(plan.pairs, lane.mover.chunk_blocks), submit, lambda chunk: None)
        keys = tuple(e.key for e, _ in plan.pairs)
        return TransferResult("load", keys, (), len(keys) * self.layout.block_bytes, time.perf_counter() - plan.started)

    def end_load(self, plan: LoadPlan) -> None:
        """Release the load's pins (idempotent)."""
        if not plan.released:
            plan.released = True
            self.index.unpin(e for e, _ in plan.pairs)

    def close(self) -> None:
        """Free the slab (no copy may be running)."""
        self.rows = self.rows.new_empty((0, self.layout.slot_bytes))
        self.buffer.close()
