"""Where blocks go: the index over both tiers, and the store/load plans that use them.

A store reserves slots in the store tier (host memory if it has slots, else
disk). If that takes spilling least-recently-used host entries to disk, the
store first writes them out (they stay loadable from host memory meanwhile),
then copies its own blocks, publishing each chunk as it lands. A store larger
than the host slots it can have sends its first blocks to disk slots, staged
in the host slots its last blocks then take. A load pins each key's current
copy and reads host-resident keys and disk-resident keys in turn.

Promotion (``promote=True``): a load's disk-resident keys that got free host
slots when it was called (:meth:`BlockIndex.pin`) are read by the IO threads
straight into those slots (the host slab is pinned and page-aligned: no bounce
buffer), become host-resident as each chunk lands, and are copied to the cache
from there by the host tier's copy: no extra copy. Their disk slots stay theirs,
as clean copies. A store that needs host room before a chunk's read started
takes its slots back; those keys are then read like the others on disk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from ..base.cache_identity import CacheIdentity, encode_key
from ..base.deadline import Deadline
from ..base.diskfile import DiskIoCounts, IoBatch, IoCalls
from .hostmem import HostBuffer
from .index import DISK, HOST, BlockIndex, Pin, Reservation
from ..workers.copy_worker import CopyWorker, CopyWorkers
from ..workers.job import LANDS_SOON_BYTES, Job
from ..base.layout import BlockLayout
from ..base.sealing import Sealer
from ..workers.transfer import Transfer, TransferResult
from .stats import PersistentCounts, TierCounts, TransferCounters
from ..base.cross_thread import resolve_from_any_thread
from ..base.errors import MissingKeysError
from .remote_tier import RemoteTier
from .disk import BouncePool, DiskTier
from .host import HostTier, chunked

log = logging.getLogger("kvoffload")

__all__ = ["TieredStorage", "StorePlan", "LoadPlan"]


class StorePlan(Job):
    """A store's job: its reservation and source blocks; publishes its entries as their copies land."""

    __slots__ = ("index", "metrics", "reservation", "block_ids", "block_bytes", "chunk_blocks", "published", "finished", "counted", "on_stored")

    def __init__(
        self, index: BlockIndex, metrics: TransferCounters, block_bytes: int, chunk_blocks: int, tensor_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__("store", tensor_names)
        self.reports_landings = True
        self.index = index
        self.metrics = metrics
        self.reservation = Reservation([], [], [])
        """Filled by :meth:`BlockIndex.reserve` in one step with the index's changes."""
        self.block_ids: list[int] = []
        self.block_bytes = block_bytes
        self.chunk_blocks = chunk_blocks
        self.published = 0
        self.finished = False
        self.counted = False
        """True once ``metrics`` counts the store in flight (:meth:`TransferCounters.started`)."""
        self.on_stored: Callable[[tuple[Hashable, ...]], None] | None = None
        """Told the keys of a store that completed (the remote tier's write-through)."""

    def publish(self, n: int) -> None:
        """The store's next ``n`` entries have landed: make them visible."""
        self.index.publish(self.reservation.entries[self.published : self.published + n])
        self.published += n

    def landed(self, i: int) -> None:
        """Chunk ``i`` (of ``chunk_blocks`` blocks) has landed: its entries are visible (:meth:`publish`,
        inlined: a call fewer per landing)."""
        n = min(self.chunk_blocks, len(self.block_ids) - i * self.chunk_blocks)
        self.index.publish(self.reservation.entries[self.published : self.published + n])
        self.published += n

    def result(self) -> TransferResult:
        keys = tuple([e.key for e in self.reservation.entries])
        return TransferResult("store", keys, tuple(self.reservation.skipped), len(keys) * self.block_bytes, time.perf_counter() - self.started)

    def count_end(self, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        """Count the store's end (keys it published before failing or being cancelled included), if it
        was counted started (a store refused at the call, ``CapacityError``, or cut short before, never
        ran) or had nothing to copy (done at the call, never in flight)."""
        if result is not None and self.on_stored is not None:
            self.on_stored(result.keys)
        if not self.counted and result is None:
            return
        partial = 0 if result is not None else self.published * self.block_bytes
        self.metrics.ended(("store", result, exc is not None, cancelled, self.started, self.taken, time.perf_counter(), partial, 0, self.counted))

    def cleanup(self) -> None:
        """Undo what the store did not finish (idempotent): unwritten spills, unpublished entries.
        Its copies have completed (the workers wait for them before cleaning up)."""
        if not self.finished:
            self.finished = True
            _give_back_unfinished(self.index, self.reservation, self.published)


def _give_back_unfinished(index: BlockIndex, reservation: Reservation, published: int) -> None:
    """What a reservation's holder did not finish goes back: its unwritten spills, its entries after
    the first ``published``."""
    for s in reservation.spills:
        index.spill_failed(s)  # no-op for spills that ended
    if published < len(reservation.entries):  # the usual store published them all: no lock to take
        index.abort(reservation.entries[published:])


class FetchedSlots:
    """A remote load's slots for the keys it fetches from the remote tier: reserved as a store's
    (never counted as one), published once their blocks are in the cache; what it did not publish
    goes back with the load's cleanup."""

    __slots__ = ("index", "reservation", "block_ids", "published", "finished")

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.reservation = Reservation([], [], [])
        """Filled by :meth:`BlockIndex.reserve` in one step with the index's changes."""
        self.block_ids: list[int] = []
        """The cache blocks the fetched keys are loaded into, in the reservation's order."""
        self.published = 0
        self.finished = False

    def publish_all(self) -> None:
        """Every fetched block is in the cache: its entry is visible."""
        entries = self.reservation.entries
        self.index.publish(entries[self.published :])
        self.published = len(entries)

    def cleanup(self) -> None:
        """Give back what was not published (idempotent)."""
        if not self.finished:
            self.finished = True
            _give_back_unfinished(self.index, self.reservation, self.published)


class LoadPlan(Job):
    """A load's job: its pinned copies and destination blocks; unpins them when it ends."""

    __slots__ = ("index", "metrics", "keys", "pins", "block_ids", "block_bytes", "released", "per_tensor", "counted")

    def __init__(
        self, index: BlockIndex, metrics: TransferCounters, keys: tuple[Hashable, ...], block_ids: list[int], block_bytes: int,
        tensor_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__("load", tensor_names)
        self.index = index
        self.metrics = metrics
        self.keys = keys
        """The keys the call named, in its order (what the result reports)."""
        self.per_tensor = False
        """Per-tensor loads: copy ``i`` is tensor ``i``, reported as it lands."""
        self.pins: list[Pin] = []
        """Filled by :meth:`BlockIndex.pin` pin by pin."""
        self.block_ids = block_ids
        self.block_bytes = block_bytes
        self.released = False
        self.counted = False
        """True once ``metrics`` counts the load in flight (:meth:`TransferCounters.started`)."""

    def landed(self, i: int) -> None:
        if self.per_tensor:
            self.transfer._tensor_landed(i)

    def result(self) -> TransferResult:
        keys = self.keys
        return TransferResult("load", keys, (), len(keys) * self.block_bytes, time.perf_counter() - self.started)

    def count_end(self, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        """Count the load's end, with how many of its keys came from disk, if it was counted started or
        had nothing to copy (as a store's)."""
        if not self.counted and result is None:
            return
        from_disk = [p.tier for p in self.pins].count(DISK) if result is not None and self.index.has_disk else 0
        self.metrics.ended(("load", result, exc is not None, cancelled, self.started, self.taken, time.perf_counter(), 0, from_disk, self.counted))

    def cleanup(self) -> None:
        """Release the load's pins (idempotent); its copies have completed."""
        if not self.released:
            self.released = True
            self.index.unpin(self.pins)


class RemoteLoadPlan(LoadPlan):
    """A load some of whose keys come from the remote tier: the local keys' pins (as any load) and
    the remote keys' host slots, reserved like a store's (:attr:`fetched`), published once their
    blocks are in the cache. Its cleanup gives back both."""

    __slots__ = ("fetched", "remote_keys")

    def __init__(
        self, index: BlockIndex, metrics: TransferCounters, blocks: dict[Hashable, int], remote_keys: list[Hashable], block_bytes: int,
        tensor_names: tuple[str, ...],
    ) -> None:
        super().__init__(index, metrics, tuple(blocks), [], block_bytes, tensor_names)
        self.fetched = FetchedSlots(index)
        """The remote keys' reservation."""
        self.remote_keys = remote_keys

    def cleanup(self) -> None:
        self.fetched.cleanup()
        super().cleanup()


class TieredStorage:
    """The host and disk tiers with their common index; starts transfers on their workers.

    A transfer between the cache and host slots alone (a store that needs no
    spill, a load of host-resident keys) needs no task on its worker: a GPU
    cache's copies are enqueued whole in the caller's thread, before ``store()``
    or ``load()`` returns, so they run with no Python step between chunks
    however busy the caller's or the worker's thread. The rest (spills, the
    disk tier, a store larger than the host slots it can have) runs as a task
    on the worker's loop.
    """

    def __init__(
        self,
        layout: BlockLayout,
        host_blocks: int,
        disk_path: str | None,
        disk_blocks: int,
        workers: CopyWorkers,
        metrics: TransferCounters,
        *,
        chunk_blocks: int,
        io_threads: int,
        use_page_cache: bool,
        promote: bool = False,
        bounce_blocks: int | None = None,
        identity: CacheIdentity | None = None,
        verify: bool = False,
        sealer: Sealer | None = None,
    ) -> None:
        """``identity``: the disk tier is persistent, for caches of this identity (its entries found
        again at start, checkpointed, kept at close; keys must be bytes, str or int); ``verify``: check
        every disk slot's CRC32C when read; ``sealer``: how the disk tier signs and encrypts its slots
        (:class:`~..base.sealing.Sealer`)."""
        self.layout = layout
        self.workers = workers
        self.metrics = metrics
        self.chunk_blocks = chunk_blocks
        self.bounce_blocks = bounce_blocks or chunk_blocks
        self.tensor_names = tuple(dict.fromkeys(p.name for p in layout.pieces))
        """The caches' tensors in copy order (a per-tensor load reports them in this order)."""
        self.index = BlockIndex(host_blocks, disk_blocks, promote=promote)
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self._disk_io_left = DiskIoCounts()
        """The disk file's IO counts once the disk tier is closed."""
        self._persistent_left = PersistentCounts()
        """The persistent disk tier's counts once it is closed."""
        self.remote: RemoteTier | None = None
        """The remote tier, set by :meth:`attach_remote`."""
        try:
            if host_blocks:
                self.host = HostTier(layout, host_blocks, workers)
            if disk_blocks:
                assert disk_path is not None
                self.disk = DiskTier(
                    layout, disk_path, disk_blocks, workers, chunk_blocks=bounce_blocks or chunk_blocks, io_threads=io_threads,
                    use_page_cache=use_page_cache, store_bounce=not host_blocks, identity=identity, verify=verify, sealer=sealer,
                )
                if self.disk.persistent is not None:
                    self.index.restore(self.disk.recovered.entries)
                    self.index.on_disk_slot_freed = self.disk.forget
                    self.disk.persistent.on_bad_slot = self.index.drop_disk_slot
                    self.disk.start_checkpoints(self.index.disk_copies)
        except BaseException:
            self.close(failed_start=True)
            raise

    def attach_remote(self, remote: RemoteTier) -> None:
        """Add the remote tier: loads may name keys it reported; blocks are written to it as their
        stores complete or as they are evicted (its ``write`` mode). Its staging buffer, where the
        writes of disk copies and evicted blocks wait, has as many slots as a bounce half."""
        remote.attach(self.host.array if self.host is not None else None, self.disk, self.bounce_blocks)
        self.index.report_evictions = remote.write == "evict"
        self.remote = remote

    def _capture_evicted_on_host(self, reservation: Reservation) -> None:
        """Write on eviction: the host slots a reservation evicted, copied for the remote before anything
        writes them (at the call: copies at call time are enqueued before it returns)."""
        if reservation.evicted and self.remote is not None:
            self.remote.capture_host([v for v in reservation.evicted if v.tier == HOST])

    async def _capture_evicted_on_disk(self, reservation: Reservation) -> None:
        """Write on eviction: the disk slots a reservation evicted, read for the remote before its task
        writes them (only a task's reservation evicts disk entries: its spills or disk-bound blocks)."""
        if reservation.evicted and self.remote is not None:
            await self.remote.capture_disk([v for v in reservation.evicted if v.tier == DISK])

    # -- store ------------------------------------------------------------------------

    def store(self, blocks: dict[Hashable, int], after: Any) -> Transfer:
        """Reserve slots for ``blocks`` (key -> cache block id) and start copying them in; the running transfer.

        Raises CapacityError with nothing reserved. A store with nothing to copy (every key
        stored already) is done at once, and counted. An interrupt anywhere in here (a signal
        handler's ``KeyboardInterrupt``) leaks nothing: the worker's :meth:`~CopyWorker.abandon`."""
        remote = self.remote
        if remote is not None or (self.disk is not None and self.disk.persistent is not None):
            for key in blocks:
                encode_key(key)  # TypeError / ValueError for a key a persistent or remote tier cannot keep, before anything
        plan = StorePlan(self.index, self.metrics, self.layout.block_bytes, self.chunk_blocks, self.tensor_names)
        if remote is not None and remote.write == "through":
            plan.on_stored = remote.write_through
        worker = self.workers.store
        try:
            early = None
            if len(blocks) > self.chunk_blocks and self._early():  # a small store: no call
                early = functools.partial(self._store_early, plan, blocks, after)
            reservation = self.index.reserve(blocks, plan.reservation, start_copies=early)
            if reservation.evicted and self.remote is not None:
                self._capture_evicted_on_host(reservation)
            if not reservation.entries:  # done at the call: counted, never in flight
                plan.end(TransferResult("store", (), tuple(reservation.skipped), 0, 0.0))
                return plan.transfer
            self.metrics.started(plan)
            requests = None
            if plan.events is None:  # not submitted by _store_early
                plan.block_ids = [blocks[e.key] for e in reservation.entries]
                if not reservation.to_disk and not reservation.spills:
                    assert self.host is not None
                    requests = self.host.requests(True, plan.block_ids, [e.slot for e in reservation.entries])
                    plan.lands_soon = len(plan.block_ids) * self.layout.block_bytes <= LANDS_SOON_BYTES
            worker.start(plan, after, requests, self._run_store)
        except BaseException:
            worker.abandon(plan)
            raise
        return plan.transfer

    def _early(self) -> bool:
        """Whether a transfer of more than one chunk between the cache and host slots alone has its
        copies submitted under the index's lock, as soon as its slots are known (:meth:`_store_early`,
        :meth:`_load_early`): GPU copies, whose per-block bookkeeping (about a microsecond a block)
        then runs while they do."""
        return self.host is not None and self.layout.is_cuda

    def _store_early(self, plan: StorePlan, blocks: dict[Hashable, int], after: Any, slots: list[int]) -> Callable[[], None]:
        """(:meth:`BlockIndex.reserve`'s ``start_copies``: every key of ``blocks`` is new, in ``slots``.)"""
        assert self.host is not None
        plan.block_ids = list(blocks.values())
        return self.workers.store.submit_now(plan, self.host.requests(True, plan.block_ids, slots), after)

    def _load_early(self, plan: LoadPlan, after: Any, slots: list[int]) -> Callable[[], None]:
        """(:meth:`BlockIndex.pin`'s ``start_copies``: every key is in host memory, in ``slots``.)"""
        assert self.host is not None
        return self.workers.load.submit_now(plan, self.host.requests(False, plan.block_ids, slots), after)

    async def _run_store(self, plan: StorePlan, after: Any) -> TransferResult:
        """Spill what must make room, then copy the blocks, publishing chunk by chunk: first those
        with disk slots, then those with host slots."""
        self.workers.store.wait_for(after)
        await self._capture_evicted_on_disk(plan.reservation)
        if plan.reservation.spills:
            await self._spill(plan.reservation)
        pairs = [(b, e.slot) for b, e in zip(plan.block_ids, plan.reservation.entries)]
        to_disk = plan.reservation.to_disk
        if to_disk:
            assert self.disk is not None
            keys = [e.key for e in plan.reservation.entries[:to_disk]]
            await self.disk.store(pairs[:to_disk], plan.publish, self._staging(pairs[to_disk:]), keys)
        if to_disk < len(pairs):
            assert self.host is not None
            await self.host.copy_in(pairs[to_disk:], plan.publish)
        return plan.result()

    def _staging(self, host_pairs: list[tuple[int, int]]) -> BouncePool | None:
        """Where a store's disk-bound blocks are staged: with a host tier, the host slots of its last
        blocks (``(block id, slot)`` pairs), which it owns and no load reads once its spills are done
        and which it writes only after its disk-bound blocks are on disk; else the disk tier's bounce
        buffer (None)."""
        if self.host is None:
            return None
        return BouncePool.of_rows(self.host.rows, [slot for _, slot in host_pairs], self.chunk_blocks)

    async def _spill(self, reservation: Reservation) -> None:
        """Write a reservation's victims to disk, then wait until no load reads the host slots their heirs take."""
        assert self.host is not None and self.disk is not None
        host = self.host.array
        spills = reservation.spills
        for group in chunked(spills, self.disk.chunk_blocks):
            try:
                await self.disk.write_rows(
                    host, [s.host_slot for s in group], [s.disk_slot for s in group], [s.victim.key for s in group],
                ).wait()
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

    # -- load -------------------------------------------------------------------------

    def load(
        self, blocks: dict[Hashable, int], after: Any, per_tensor: bool, expedited: bool, taking: list[Pin | None] | None = None,
    ) -> Transfer:
        """Pin the stored copy of every key of ``blocks`` (key -> destination block id) and start copying
        them out; the running transfer. ``taking``: a lease's pins to take over, by position in
        ``blocks`` (:meth:`BlockIndex.pin`). Raises MissingKeysError with nothing pinned or taken. An
        interrupt anywhere in here leaks nothing (the worker's :meth:`~CopyWorker.abandon`)."""
        remote_keys = self._remote_keys(blocks, taking) if blocks and self.remote is not None else []
        plan: LoadPlan
        if remote_keys:
            plan = RemoteLoadPlan(self.index, self.metrics, blocks, remote_keys, self.layout.block_bytes, self.tensor_names)
        else:
            plan = LoadPlan(self.index, self.metrics, tuple(blocks), list(blocks.values()), self.layout.block_bytes, self.tensor_names)
        worker = self.workers.load
        try:
            if not blocks:  # done at the call: counted, never in flight
                plan.end(TransferResult("load", (), (), 0, 0.0))
                return plan.transfer
            if isinstance(plan, RemoteLoadPlan):
                self._plan_remote_load(plan, blocks, taking)
                self.metrics.started(plan)
                worker.start(plan, after, run=self._run_remote_load)
                return plan.transfer
            early = None
            if len(blocks) > self.chunk_blocks and not per_tensor and not expedited and taking is None and self._early():
                early = functools.partial(self._load_early, plan, after)
            self.index.pin(list(blocks), plan.pins, taking, early)
            self.metrics.started(plan)
            worker = self.start_load(plan, after, per_tensor, expedited)
        except BaseException:
            worker.abandon(plan)
            raise
        return plan.transfer

    def _remote_keys(self, blocks: dict[Hashable, int], taking: list[Pin | None] | None) -> list[Hashable]:
        """The keys of ``blocks`` not stored here that the remote tier reported (:meth:`RemoteTier.lookup`)."""
        remote = self.remote
        if remote is None:
            return []
        held = taking if taking is not None else [None] * len(blocks)
        return [k for k, t in zip(blocks, held) if (t is None or not t.held) and k not in self.index and remote.reported(k)]

    def _plan_remote_load(self, plan: RemoteLoadPlan, blocks: dict[Hashable, int], taking: list[Pin | None] | None) -> None:
        """Pin the local keys of ``blocks`` (first: no reservation below evicts them), then reserve
        host slots for the remote ones, filling ``plan``. ``MissingKeysError`` / ``CapacityError``
        with what it holds in ``plan`` (the caller's :meth:`~CopyWorker.abandon` gives it back)."""
        remote = set(plan.remote_keys)
        local = [k for k in blocks if k not in remote]
        plan.block_ids = [blocks[k] for k in local]
        local_taking = [t for k, t in zip(blocks, taking) if k not in remote] if taking is not None else None
        self.index.pin(local, plan.pins, local_taking)
        reservation = self.index.reserve(plan.remote_keys, plan.fetched.reservation, staged_in_host=False)
        self._capture_evicted_on_host(reservation)
        if reservation.skipped:  # stored here meanwhile, by a store still running: not loadable now
            raise MissingKeysError(reservation.skipped)
        plan.fetched.block_ids = [blocks[e.key] for e in reservation.entries]

    async def _run_remote_load(self, plan: RemoteLoadPlan, after: Any) -> TransferResult:
        """Read the remote keys into the slots reserved for them (after the spills that make room), copy
        them to the cache and publish them as local entries: those with disk slots (no host slot to be
        had) through the disk tier's load bounce buffer, the others straight into their host slots.
        Every remote block is fetched and checked before any reaches the cache (the host slots' first,
        then :meth:`DiskTier.load_fetched`'s), so a failed fetch writes no cache block. Then load the
        local keys as any load."""
        self.workers.load.wait_for(after)
        fetched = plan.fetched
        remote = self.remote
        assert remote is not None
        await self._capture_evicted_on_disk(fetched.reservation)
        if fetched.reservation.spills:
            await self._spill(fetched.reservation)
        entries, to_disk = fetched.reservation.entries, fetched.reservation.to_disk
        in_host = entries[to_disk:]
        host = self.host
        if in_host:
            assert host is not None
            await remote.fetch([e.key for e in in_host], [host.array[e.slot] for e in in_host])
        if to_disk:
            assert self.disk is not None
            pairs = [(e.slot, b) for e, b in zip(entries[:to_disk], fetched.block_ids)]
            await self.disk.load_fetched(pairs, [e.key for e in entries[:to_disk]], remote.fetch)
        if in_host:
            assert host is not None
            await host.copy_out([(e.slot, b) for e, b in zip(in_host, fetched.block_ids[to_disk:])])
        fetched.publish_all()
        if plan.pins:
            await self._run_load(plan, None)
        return plan.result()

    def start_load(self, plan: LoadPlan, after: Any, per_tensor: bool = False, expedited: bool = False) -> CopyWorker:
        """Start copying the pinned keys out (not before ``after``, else the caller's stream, has
        completed); returns the worker it runs on.

        ``per_tensor`` (a GPU cache, every key in host memory): copy tensor by tensor and report each
        one's completion to the transfer; elsewhere every tensor is done with the transfer.
        ``expedited`` (every key in host memory): on the expedited worker, behind no other load."""
        if plan.events is not None:  # submitted by _load_early: followed
            self.workers.load.start(plan, after)
            return self.workers.load
        all_host = not self.index.has_disk or DISK not in [p.tier for p in plan.pins]
        requests = None
        if all_host:
            assert self.host is not None
            requests = self.host.requests(False, plan.block_ids, [p.slot for p in plan.pins])
            plan.lands_soon = len(plan.block_ids) * self.layout.block_bytes <= LANDS_SOON_BYTES
        # The expedited worker takes copies at call time (GPU) or one chunk (CPU) only (its loop runs
        # no task); anything else goes the regular way.
        host_job = requests is not None and (self.layout.is_cuda or len(requests) == 1)
        worker = self.workers.expedited if expedited and host_job and self.workers.expedited is not None else self.workers.load
        by_tensor = None
        if per_tensor and self.layout.is_cuda and all_host:
            assert self.host is not None
            by_tensor = (self.host.rows, [p.slot for p in plan.pins], plan.block_ids)
            plan.per_tensor = plan.reports_landings = True
        worker.start(plan, after, requests, self._run_load, by_tensor)
        return worker

    async def _run_load(self, plan: LoadPlan, after: Any) -> TransferResult:
        """Copy host-resident keys, then disk-resident keys being promoted, then the other disk-resident
        keys into their cache blocks."""
        self.workers.load.wait_for(after)
        from_host = [(p.slot, b) for p, b in zip(plan.pins, plan.block_ids) if p.tier == HOST]
        promoting = [(p, b) for p, b in zip(plan.pins, plan.block_ids) if p.tier == DISK and p.promote_slot >= 0]
        from_disk = [(p.slot, b) for p, b in zip(plan.pins, plan.block_ids) if p.tier == DISK and p.promote_slot < 0]
        if from_host:
            assert self.host is not None
            await self.host.copy_out(from_host)
        if promoting:
            from_disk += await self._load_promoting(promoting)
        if from_disk:
            assert self.disk is not None
            await self.disk.load(from_disk)
        return plan.result()

    async def _load_promoting(self, pairs: list[tuple[Pin, int]]) -> list[tuple[int, int]]:
        """Load ``(pin, block id)`` pairs through their pins' promotion host slots, chunk by chunk: the IO
        threads read a chunk's disk slots straight into its host slots (the next chunk's read already
        running), its entries become host-resident (:meth:`BlockIndex.promotion_done`), and the host
        tier's copy takes it to the cache. Returns ``(disk slot, block id)`` of the keys whose host slot a
        store took back before their read started, for the plain disk load. On error or cancellation,
        every read started is waited for before the exception propagates: nothing writes the host slots
        once the load lets them go."""
        host, disk, worker = self.host, self.disk, self.workers.load
        assert host is not None and disk is not None
        chunks = chunked(pairs, self.chunk_blocks)
        reads: deque[tuple[list[tuple[Pin, int]], IoBatch | None]] = deque()  # chunks read: pairs still promoting, their read
        taken_back: list[tuple[int, int]] = []
        last: Any = None  # completion event of the last copy out of the host slots

        def start_read(i: int) -> None:
            started = {id(p) for p in self.index.start_promotion([p for p, _ in chunks[i]])}
            mine = [(p, b) for p, b in chunks[i] if id(p) in started]
            taken_back.extend((p.slot, b) for p, b in chunks[i] if id(p) not in started)
            batch = disk.read_rows(host.array, [p.promote_slot for p, _ in mine], [p.slot for p, _ in mine]) if mine else None
            reads.append((mine, batch))

        try:
            for i in range(len(chunks)):
                while len(reads) < 2 and i + len(reads) < len(chunks):  # this chunk and the next one
                    start_read(i + len(reads))
                mine, batch = reads[0]
                if batch is not None:
                    await batch.wait()
                reads.popleft()
                if mine:
                    self.index.promotion_done([p for p, _ in mine])
                    last = await worker.copy(host.request_out([(p.promote_slot, b) for p, b in mine]))
            await worker.wait(last)
        except BaseException:
            for _, batch in reads:
                if batch is not None:
                    await batch.settle()
            await worker.settle(last)
            raise
        return taken_back

    def counts(self) -> TierCounts:
        """Slot use, entry states and the tiers' counters (readable from any thread, also while or after closing)."""
        disk = self.disk
        return TierCounts(
            index=self.index.counts(),
            disk_io=disk.file.io_counts() if disk is not None else self._disk_io_left,
            persistent=self._persistent_counts(disk),
        )

    def _persistent_counts(self, disk: DiskTier | None) -> PersistentCounts:
        """The counts of a persistent disk tier (all 0 for another), as it closed when ``disk`` is None."""
        if disk is None:
            return self._persistent_left
        p = disk.persistent
        if p is None:
            return PersistentCounts()
        return PersistentCounts(len(disk.recovered.entries), disk.recovered.dropped, p.checksum_failures)

    def _copy_host_entries_to_disk(self, deadline: Deadline) -> None:
        """A persistent tier's close: write entries only in host memory to disk, the most recently used
        first, within ``deadline``, so that they are found again after a restart: to free slots, then
        to the slots of the disk's least recently used entries, which are evicted
        (:meth:`BlockIndex.copy_host_entries_to_disk`). The final checkpoint, written next, lists
        what is then on disk; an entry whose write failed is not kept."""
        disk, host = self.disk, self.host
        if disk is None or host is None or disk.persistent is None:
            return
        moves = self.index.copy_host_entries_to_disk()
        if not moves:
            return
        try:
            disk.write_rows(host.array, [h for _, h, _ in moves], [d for _, _, d in moves], [e.key for e, _, _ in moves]).result(
                deadline.left()
            )
        except (OSError, TimeoutError):
            log.warning("kvoffload: writing host entries to the persistent disk tier at close failed; they are not kept", exc_info=True)
            for _, _, d in moves:
                self.index.drop_disk_slot(d)

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget ``keys`` (:meth:`BlockIndex.discard`); returns how many were present. With a
        persistent disk tier, returns once the headers of the disk slots they freed are voided on disk."""
        n = self.index.discard(keys)
        disk = self.disk
        if n and disk is not None and disk.persistent is not None:
            disk.persistent.void_forgotten()
        return n

    def disk_io(self) -> IoCalls | None:
        """The disk tier's system calls (the test seam), or None without a disk tier."""
        return self.disk.file.io if self.disk is not None else None

    def host_buffers(self) -> list[HostBuffer]:
        """The host slab and the disk tier's bounce buffers."""
        return ([self.host.buffer] if self.host is not None else []) + (self.disk.bounce_buffers() if self.disk is not None else [])

    def close(self, timeout: float | None = 30.0, *, failed_start: bool = False) -> bool:
        """Free both tiers (no copy may be running); False if the disk's IO threads are stuck. After a
        ``failed_start`` a persistent disk file this start created is removed (:meth:`DiskTier.close`)."""
        ok = True
        disk = self.disk
        if disk is not None:
            deadline = Deadline(timeout)
            if not failed_start:
                self._copy_host_entries_to_disk(deadline)
            ok = disk.close(deadline.left(), failed_start=failed_start)
            self._disk_io_left = disk.file.io_counts()
            self._persistent_left = self._persistent_counts(disk)
            self.disk = None
        if self.host is not None:
            self.host.close()
            self.host = None
        return ok

