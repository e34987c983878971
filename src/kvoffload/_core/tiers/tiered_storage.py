"""Where blocks go: the index over both tiers, and the store/load plans that use them.

A store reserves slots in the store tier (host memory if it has slots, else
disk). If that takes spilling least-recently-used host entries to disk, the
store first writes them out (they stay loadable from host memory meanwhile),
then copies its own blocks, publishing each chunk as it lands. A load pins each
key's current copy and reads host-resident keys and disk-resident keys in turn.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ..diskfile import IoCalls
from ..hostmem import HostBuffer
from ..index import DISK, HOST, BlockIndex, Pin, Reservation
from ..copy_worker import Enqueued, CopyWorker
from ..layout import BlockLayout
from ..transfer import TransferResult
from ..cross_thread import resolve_from_any_thread
from .disk import DiskTier
from .host import HostTier, chunked

__all__ = ["TieredStorage", "StorePlan", "LoadPlan"]


@dataclass
class StorePlan:
    """A store's reservation and source blocks; tracks what is published."""

    reservation: Reservation
    block_ids: list[int]
    started: float = field(default_factory=time.perf_counter)
    published: int = 0
    finished: bool = False
    enqueued: Enqueued | None = None
    """Copies submitted at call time (see :meth:`TieredStorage.enqueue_store`); None: the worker copies."""


@dataclass
class LoadPlan:
    """A load's pinned copies and destination blocks."""

    pins: list[Pin]
    block_ids: list[int]
    started: float = field(default_factory=time.perf_counter)
    released: bool = False
    enqueued: Enqueued | None = None
    """Copies submitted at call time (see :meth:`TieredStorage.enqueue_load`); None: the worker copies."""


class TieredStorage:
    """The host and disk tiers with their common index."""

    def __init__(
        self,
        layout: BlockLayout,
        host_blocks: int,
        disk_path: str | None,
        disk_blocks: int,
        *,
        chunk_blocks: int,
        io_threads: int,
        use_page_cache: bool,
    ) -> None:
        self.layout = layout
        self.index = BlockIndex(host_blocks, disk_blocks)
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        try:
            if host_blocks:
                self.host = HostTier(layout, host_blocks)
            if disk_blocks:
                assert disk_path is not None
                self.disk = DiskTier(
                    layout, disk_path, disk_blocks, chunk_blocks=chunk_blocks, io_threads=io_threads,
                    use_page_cache=use_page_cache, store_bounce=not host_blocks,
                )
        except BaseException:
            self.close()
            raise

    # -- store ------------------------------------------------------------------------

    def plan_store(self, blocks: dict[Hashable, int]) -> StorePlan:
        """Reserve slots for the keys not yet present (may raise CapacityError)."""
        r = self.index.reserve(blocks)
        return StorePlan(r, [blocks[e.key] for e in r.entries])

    def enqueue_store(self, worker: CopyWorker, plan: StorePlan, after: Any) -> bool:
        """Submit the whole store now, in the caller's thread, if it can be: a GPU cache into host
        slots that need no spill. Its copies then run on the GPU with no Python step between chunks,
        however busy the caller's or the worker's thread; the worker only follows completion."""
        if not self.layout.is_cuda or self.index.store_tier != HOST or plan.reservation.spills:
            return False
        assert self.host is not None
        pairs = [(b, e.slot) for b, e in zip(plan.block_ids, plan.reservation.entries)]
        plan.enqueued = worker.enqueue(self.host.requests_in(pairs, worker.copier.chunk_blocks), after)
        return True

    async def run_store(self, worker: CopyWorker, plan: StorePlan, after: Any) -> TransferResult:
        """Spill what must make room, then copy the blocks, publishing chunk by chunk."""
        entries = plan.reservation.entries
        if plan.enqueued is not None:
            chunk = worker.copier.chunk_blocks
            await worker.completed(plan.enqueued, lambda i: self._publish(plan, min(chunk, len(entries) - i * chunk)))
            return self._store_result(plan)
        if after is not None:
            worker.copier.wait_for(after)
        if plan.reservation.spills:
            await self._spill(plan)

        pairs = [(b, e.slot) for b, e in zip(plan.block_ids, entries)]
        if self.index.store_tier == HOST:
            assert self.host is not None
            await self.host.copy_in(worker, pairs, lambda n: self._publish(plan, n))
        else:
            assert self.disk is not None
            await self.disk.store(worker, pairs, lambda n: self._publish(plan, n))
        return self._store_result(plan)

    def _publish(self, plan: StorePlan, n: int) -> None:
        """The store's next ``n`` entries have landed: make them visible."""
        self.index.publish(plan.reservation.entries[plan.published : plan.published + n])
        plan.published += n

    def _store_result(self, plan: StorePlan) -> TransferResult:
        keys = tuple(e.key for e in plan.reservation.entries)
        return TransferResult(
            "store", keys, tuple(plan.reservation.skipped), len(keys) * self.layout.block_bytes,
            time.perf_counter() - plan.started,
        )

    async def _spill(self, plan: StorePlan) -> None:
        """Write the victims to disk, then wait until no load reads the host slots their heirs take."""
        assert self.host is not None and self.disk is not None
        host = self.host.array
        spills = plan.reservation.spills
        for group in chunked(spills, self.disk.chunk_blocks):
            try:
                await self.disk.write_rows(host, [s.host_slot for s in group], [s.disk_slot for s in group]).wait()
            except BaseException:
                for s in group:
                    self.index.spill_failed(s)
                raise
            for s in group:
                self.index.spill_done(s)
        # A load that pinned a victim's host copy before it moved may still be reading it.
        loop = asyncio.get_running_loop()
        for s in spills:
            unread: asyncio.Future[None] = loop.create_future()
            self.index.when_unread(s.host_slot, functools.partial(resolve_from_any_thread, loop, unread))
            await unread

    def end_store(self, plan: StorePlan) -> None:
        """Undo what the store did not finish (idempotent): unwritten spills, unpublished entries."""
        if plan.finished:
            return
        plan.finished = True
        if plan.enqueued is not None:  # cancelled before the worker followed it: let the GPU finish first
            plan.enqueued.settle()
        for s in plan.reservation.spills:
            self.index.spill_failed(s)  # no-op for spills that ended
        self.index.abort(plan.reservation.entries[plan.published :])

    # -- load -------------------------------------------------------------------------

    def plan_load(self, blocks: dict[Hashable, int]) -> LoadPlan:
        """Pin the current copy of every key (may raise MissingKeysError)."""
        keys = list(blocks)
        return LoadPlan(self.index.pin(keys), [blocks[k] for k in keys])

    def enqueue_load(self, worker: CopyWorker, plan: LoadPlan, after: Any) -> bool:
        """Submit the whole load now, in the caller's thread, if it can be: a GPU cache and every key
        in host memory (see :meth:`enqueue_store`)."""
        if not self.layout.is_cuda or any(p.tier != HOST for p in plan.pins):
            return False
        assert self.host is not None
        pairs = [(p.slot, b) for p, b in zip(plan.pins, plan.block_ids)]
        plan.enqueued = worker.enqueue(self.host.requests_out(pairs, worker.copier.chunk_blocks), after)
        return True

    async def run_load(self, worker: CopyWorker, plan: LoadPlan, after: Any) -> TransferResult:
        """Copy host-resident keys, then disk-resident keys, into their cache blocks."""
        if plan.enqueued is not None:
            await worker.completed(plan.enqueued)
            return self._load_result(plan)
        if after is not None:
            worker.copier.wait_for(after)
        from_host = [(p.slot, b) for p, b in zip(plan.pins, plan.block_ids) if p.tier == HOST]
        from_disk = [(p.slot, b) for p, b in zip(plan.pins, plan.block_ids) if p.tier == DISK]
        if from_host:
            assert self.host is not None
            await self.host.copy_out(worker, from_host)
        if from_disk:
            assert self.disk is not None
            await self.disk.load(worker, from_disk)
        return self._load_result(plan)

    def _load_result(self, plan: LoadPlan) -> TransferResult:
        keys = tuple(p.entry.key for p in plan.pins)
        return TransferResult("load", keys, (), len(keys) * self.layout.block_bytes, time.perf_counter() - plan.started)

    def end_load(self, plan: LoadPlan) -> None:
        """Release the load's pins (idempotent)."""
        if not plan.released:
            plan.released = True
            if plan.enqueued is not None:  # cancelled before the worker followed it: let the GPU finish first
                plan.enqueued.settle()
            self.index.unpin(plan.pins)

    def disk_io(self) -> IoCalls | None:
        """The disk tier's system calls (the test seam), or None without a disk tier."""
        return self.disk.file.io if self.disk is not None else None

    def host_buffers(self) -> list[HostBuffer]:
        """The host slab and the disk tier's bounce buffers."""
        return ([self.host.buffer] if self.host is not None else []) + (self.disk.bounce_buffers() if self.disk is not None else [])

    def close(self, timeout: float = 30.0) -> bool:
        """Free both tiers (no copy may be running); False if the disk's IO threads are stuck."""
        ok = True
        if self.disk is not None:
            ok = self.disk.close(timeout)
            self.disk = None
        if self.host is not None:
            self.host.close()
            self.host = None
        return ok

