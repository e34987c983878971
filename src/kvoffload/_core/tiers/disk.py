"""The disk tier: block slots in one file, IO on a thread pool, pipelined with the copies.

Each slot is ``slot_bytes`` (a multiple of 4096) at offset ``slot * slot_bytes``,
so every O_DIRECT call is aligned whatever the tensors' bytes per block. Runs
of consecutive slots become one ``pwritev``/``preadv`` (cut into jobs of
``job_bytes`` so that ``io_threads`` threads share large runs).

Stores straight to disk (no host tier) copy a chunk of blocks into one half of
a pinned, page-aligned bounce buffer while the IO threads write the previous
chunk from the other half (a store larger than the host tier stages its first
blocks so, in the host slots its last blocks take); loads read chunk N+1 into
one half while chunk N is copied to the cache from the other. Spills write host slots directly from the
(pinned, aligned) host slab: no extra copy.

The event loops never block on IO: they await futures of the IO pool.

With persistence (:class:`~.persistent_slots.PersistentSlots`) each slot is a header page
and the payload, written in one ``pwritev`` and checked on every read; the file is reopened
rather than created, and checkpointed in the background and at close.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..base.deadline import Deadline
from ..base.diskfile import DiskFile, IoBatch, io_jobs
from ..base.helper_threads import mark_own_thread
from .hostmem import HostBuffer
from ..base.cache_identity import CacheIdentity
from ..base.sealing import Sealer
from .encrypted_slots import EncryptedSlots
from ..workers.copy_submission import CopyRequest
from ..workers.copy_worker import CopyWorkers
from ..base.layout import BlockLayout
from .host import chunked
from . import persistent_slots
from .persistent_slots import PersistentSlots, Recovered

__all__ = ["DiskTier", "BouncePool"]

log = logging.getLogger("kvoffload")


class BouncePool:
    """Halves of a bounce buffer (rows of pinned host memory), shared by the transfers that use it.

    A half is taken for one chunk and given back when the IO or copy that
    uses it has ended (``release_after``), independently of the transfer that
    took it, so transfers never wait on each other in a cycle.
    """

    def __init__(self, rows: torch.Tensor, halves: Sequence[Sequence[int]]) -> None:
        self.rows = rows
        """The ``uint8[rows, slot_bytes]`` memory the halves are rows of."""
        self.array = rows.numpy()
        self._halves = [list(h) for h in halves]
        self.chunk_blocks = min(len(h) for h in self._halves)
        """Rows per half: the most blocks one chunk through this pool may have."""
        self._free = list(range(len(self._halves)))
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def of_buffer(cls, buffer: HostBuffer, chunk_blocks: int, slot_bytes: int) -> BouncePool:
        """Two halves of ``chunk_blocks`` slots each in ``buffer``."""
        return cls(buffer.tensor.view(2 * chunk_blocks, slot_bytes), [range(chunk_blocks), range(chunk_blocks, 2 * chunk_blocks)])

    @classmethod
    def of_rows(cls, rows: torch.Tensor, free_rows: Sequence[int], chunk_blocks: int) -> BouncePool:
        """Up to two halves of up to ``chunk_blocks`` rows each among ``free_rows`` (at least one) of ``rows``:
        a store's own host slots, used to stage its blocks on their way to disk."""
        free_rows = sorted(free_rows)
        per_half = max(1, min(chunk_blocks, len(free_rows) // 2))
        halves = [free_rows[i : i + per_half] for i in range(0, min(2 * per_half, len(free_rows)), per_half)]
        return cls(rows, halves)

    def rows_of(self, half: int, n: int) -> list[int]:
        """Row numbers of the first ``n`` rows of ``half``."""
        return self._halves[half][:n]

    async def acquire(self) -> int:
        """Take a free half, waiting for one if needed."""
        while not self._free:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif self._free:  # we were woken but leave: pass the wake-up on
                    self._wake()
                raise
        return self._free.pop()

    def try_acquire(self) -> int | None:
        """Take a free half if there is one, without waiting."""
        return self._free.pop() if self._free else None

    def release(self, half: int) -> None:
        """Give ``half`` back now."""
        self._free.append(half)
        self._wake()

    def release_after(self, done: Any, half: int) -> None:
        """Give ``half`` back once the awaitable ``done`` has ended (however it ends)."""

        async def later() -> None:
            try:
                await done
            except BaseException:
                pass
            finally:
                self.release(half)

        task = asyncio.ensure_future(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return


class DiskTier:
    """Block slots in a private file on local disk."""

    def __init__(
        self,
        layout: BlockLayout,
        path: str,
        slots: int,
        workers: CopyWorkers,
        *,
        chunk_blocks: int,
        io_threads: int,
        use_page_cache: bool,
        store_bounce: bool,
        job_bytes: int = 8 << 20,
        identity: CacheIdentity | None = None,
        verify: bool = False,
        sealer: Sealer | None = None,
    ) -> None:
        """``identity``: make the tier persistent, for a cache of this identity (reopening the file
        at ``path`` if it has the same; see :attr:`recovered`); ``verify``: check every slot's CRC32C
        when it is read; ``sealer``: a persistent tier signs and/or encrypts its slots with it, any
        other encrypts them if it has a key (``remote_secret=``, ``encryption_key=``)."""
        self.layout = layout
        self.slots = slots
        self.workers = workers
        self.chunk_blocks = chunk_blocks
        self.job_bytes = job_bytes
        self._bounce: list[HostBuffer] = []
        self._load_pool: BouncePool
        self._store_pool: BouncePool | None = None
        self.persistent: PersistentSlots | None = None
        self.recovered = Recovered([], 0, "")
        """What a reopen of a persistent file found (nothing for a new or non-persistent file)."""
        self._snapshot: Callable[[], list[tuple[Hashable, int]]] | None = None
        self._checkpoints: Any = None
        self.encrypted: EncryptedSlots | None = None
        """A non-persistent tier's encryption (``encryption_key=``)."""
        if identity is None:
            self.file = DiskFile(path, slots * layout.slot_bytes, use_page_cache=use_page_cache)
            if sealer is not None and sealer.key is not None:
                self.encrypted = EncryptedSlots(self.file, slots, layout.slot_bytes, layout.block_bytes, sealer.key)
        else:
            probe = PersistentSlots.file_bytes_of(slots, layout.slot_bytes, identity)
            self.file = DiskFile(path, probe, use_page_cache=use_page_cache, persistent=True)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-io", initializer=mark_own_thread)
        try:
            if identity is not None:
                self.persistent = PersistentSlots(
                    self.file, slots, layout.slot_bytes, layout.block_bytes, identity, verify=verify, sealer=sealer,
                )
                self.recovered = self.persistent.open(self.pool)
            # two halves of chunk_blocks slots each, per direction that needs one
            for _ in range(2 if store_bounce else 1):
                self._bounce.append(HostBuffer(2 * chunk_blocks * layout.slot_bytes, pin=layout.device if layout.is_cuda else None))
        except BaseException:
            self.close(failed_start=True)
            raise
        self._load_pool = BouncePool.of_buffer(self._bounce[0], chunk_blocks, layout.slot_bytes)
        if store_bounce:
            self._store_pool = BouncePool.of_buffer(self._bounce[1], chunk_blocks, layout.slot_bytes)

    # -- raw IO between host rows and disk slots ------------------------------------

    def write_rows(
        self, host: np.ndarray, rows: Sequence[int], slots: Sequence[int], keys: Sequence[Hashable] = (),
    ) -> IoBatch:
        """Start writing host rows to disk slots (pairwise) on the IO pool; a persistent tier writes
        each with its header, which names the key (``keys``, pairwise too)."""
        if self.persistent is not None:
            assert len(keys) == len(slots), "a persistent tier writes each slot with its key"
            return IoBatch(self.pool, self.persistent.write_calls([host[r] for r in rows], slots, keys, self.job_bytes))
        if self.encrypted is not None:
            return IoBatch(self.pool, self.encrypted.write_calls([host[r] for r in rows], slots, self.job_bytes))
        jobs = io_jobs(host, rows, slots, self.job_bytes)
        return IoBatch(self.pool, [functools.partial(self.file.write, bufs, off) for off, bufs in jobs])

    def read_rows(self, host: np.ndarray, rows: Sequence[int], slots: Sequence[int]) -> IoBatch:
        """Start reading disk slots into host rows (pairwise) on the IO pool; a persistent tier checks
        each slot's header (and with ``verify`` its CRC32C): one that fails fails the batch
        (``OSError(EBADMSG)``) and its entry is dropped."""
        if self.persistent is not None:
            return IoBatch(self.pool, self.persistent.read_calls([host[r] for r in rows], slots, self.job_bytes))
        if self.encrypted is not None:
            return IoBatch(self.pool, self.encrypted.read_calls([host[r] for r in rows], slots, self.job_bytes))
        jobs = io_jobs(host, rows, slots, self.job_bytes)
        return IoBatch(self.pool, [functools.partial(self.file.read, bufs, off) for off, bufs in jobs])

    # -- persistence ----------------------------------------------------------------------

    def start_checkpoints(self, snapshot: Callable[[], list[tuple[Hashable, int]]]) -> None:
        """Persistent tier: checkpoint ``snapshot()`` (``(key, disk slot)`` of the entries with a copy
        on disk, least recently used first) in the background every
        :data:`~.persistent_slots.CHECKPOINT_INTERVAL_S` seconds while anything changed, and at close."""
        if self.persistent is None:
            return
        interval = persistent_slots.CHECKPOINT_INTERVAL_S
        self._snapshot = snapshot
        self._checkpoints = self.workers.store.run_coroutine(self.persistent.checkpoint_every(interval, snapshot, self.pool))

    def forget(self, slot: int) -> None:
        """Persistent tier: disk ``slot`` went back to the pool; its old entry must not come back."""
        if self.persistent is not None:
            self.persistent.forget(slot)

    # -- cache <-> disk through the bounce buffer -------------------------------------

    async def store(
        self, pairs: Sequence[tuple[int, int]], landed: Callable[[int], None], through: BouncePool | None = None,
        keys: Sequence[Hashable] = (),
    ) -> None:
        """Copy cache blocks to disk slots (``(block id, slot)``, for ``keys``, pairwise) on the store
        worker's loop; ``landed(n)`` after each chunk is on disk.

        Chunk N is copied into a free bounce half while the IO threads write
        chunk N-1 from another; a half is freed when its write has ended. The
        halves are those of ``through`` (say, host slots the store owns), else
        the disk tier's store bounce buffer.
        """
        pool = through if through is not None else self._store_pool
        assert pool is not None, "disk-only stores need the store bounce buffer"
        worker = self.workers.store
        writes: deque[tuple[IoBatch, int]] = deque()
        half: int | None = None
        event: Any = None
        try:
            for i, chunk in enumerate(chunked(pairs, pool.chunk_blocks)):
                while writes and writes[0][0].done():  # report what landed meanwhile
                    await writes[0][0].wait()
                    landed(writes.popleft()[1])
                half = await pool.acquire()
                rows = pool.rows_of(half, len(chunk))
                event = await worker.copy(CopyRequest(True, pool.rows, [b for b, _ in chunk], rows))
                await worker.wait(event)
                event = None
                first = i * pool.chunk_blocks
                batch = self.write_rows(pool.array, rows, [s for _, s in chunk], keys[first : first + len(chunk)])
                pool.release_after(batch.wait(), half)
                half = None
                writes.append((batch, len(chunk)))
            while writes:
                await writes[0][0].wait()
                landed(writes.popleft()[1])
        except BaseException:
            await worker.settle(event)
            if half is not None:
                pool.release(half)
            for w, _ in writes:
                await w.settle()
            raise

    async def load(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy disk slots to cache blocks (``(slot, block id)``) on the load worker's loop, reading one chunk ahead.

        A bounce half is freed when the copy out of it has completed. The read
        of the next chunk starts before this chunk's copy when a half is free;
        otherwise after it, once this transfer holds no half: a transfer never
        waits for a half while holding one, so concurrent loads cannot deadlock.
        """
        pool = self._load_pool
        worker = self.workers.load
        chunks = chunked(pairs, self.chunk_blocks)
        reading: tuple[IoBatch, int] | None = None  # the read in flight and its half
        last: Any = None  # completion event of the last copy out of the bounce buffer

        def start_read(i: int, half: int) -> tuple[IoBatch, int]:
            return self.read_rows(pool.array, pool.rows_of(half, len(chunks[i])), [s for s, _ in chunks[i]]), half

        try:
            if chunks:
                reading = start_read(0, await pool.acquire())
            for i, chunk in enumerate(chunks):
                assert reading is not None
                batch, half = reading
                reading = None
                try:
                    await batch.wait()  # on error or cancellation it first waits for the read to stop
                except BaseException:
                    pool.release(half)
                    raise
                more = i + 1 < len(chunks)
                if more:
                    free = pool.try_acquire()
                    if free is not None:
                        reading = start_read(i + 1, free)
                try:
                    last = await worker.copy(CopyRequest(False, pool.rows, [b for _, b in chunk], pool.rows_of(half, len(chunk))))
                finally:
                    pool.release_after(worker.settle(last), half)
                if more and reading is None:
                    reading = start_read(i + 1, await pool.acquire())
            await worker.wait(last)
        except BaseException:
            if reading is not None:
                await reading[0].settle()
                pool.release(reading[1])
            await worker.settle(last)
            raise

    async def load_fetched(
        self, pairs: Sequence[tuple[int, int]], keys: Sequence[Hashable],
        fetch: Callable[[Sequence[Hashable], list[np.ndarray]], Awaitable[None]],
    ) -> None:
        """Blocks from elsewhere (the remote tier) to disk slots and cache blocks (``(slot, block id)``,
        for ``keys``, pairwise), on the load worker's loop. Nothing reaches the cache before every
        block has been fetched: first, chunk by chunk, ``fetch(keys, buffers)`` fills a load bounce
        half (checking each value) and the IO threads write it to its slots while the next chunk is
        fetched; then the last chunk, still in its half, is copied to the cache (beside its write)
        and the others are read back from their slots as by :meth:`load`. A failed fetch thus leaves
        every cache block as it was. On error or cancellation every write and copy started is waited
        for before the exception propagates."""
        pool = self._load_pool
        worker = self.workers.load
        chunks = chunked(pairs, pool.chunk_blocks)
        writes: list[IoBatch] = []
        held: tuple[int, list[int]] | None = None  # the last chunk's half and rows, kept for its copy
        last: Any = None  # completion event of the copy out of that half

        async def ended(batch: IoBatch, event: Any) -> None:
            try:
                await batch.wait()  # (not settle(): that would cancel the writes not started)
            finally:
                await worker.settle(event)

        try:
            for i, chunk in enumerate(chunks):
                half = await pool.acquire()
                rows = pool.rows_of(half, len(chunk))
                first = i * pool.chunk_blocks
                chunk_keys = keys[first : first + len(chunk)]
                try:
                    await fetch(chunk_keys, [pool.array[r] for r in rows])
                    batch = self.write_rows(pool.array, rows, [s for s, _ in chunk], chunk_keys)
                except BaseException:
                    pool.release(half)
                    raise
                writes.append(batch)
                if i + 1 < len(chunks):
                    pool.release_after(batch.wait(), half)
                else:
                    held = half, rows
            for batch in writes[:-1]:  # every block fetched and checked: the cache may be written now
                await batch.wait()
            if held is not None:
                (half, rows), held = held, None
                try:
                    last = await worker.copy(CopyRequest(False, pool.rows, [b for _, b in chunks[-1]], rows))
                finally:
                    pool.release_after(ended(writes[-1], last), half)
            if len(chunks) > 1:
                await self.load(pairs[: (len(chunks) - 1) * pool.chunk_blocks])
            if writes:
                await writes[-1].wait()
            await worker.wait(last)
        except BaseException:
            for batch in writes:
                await batch.settle()
            await worker.settle(last)
            if held is not None:
                pool.release(held[0])
            raise

    def bounce_buffers(self) -> list[HostBuffer]:
        """The pinned bounce buffers."""
        return list(self._bounce)

    def close(self, timeout: float | None = 30.0, *, failed_start: bool = False) -> bool:
        """Stop the IO threads within ``timeout`` seconds in all (None: no limit), then close and unlink
        the file (a persistent one is checkpointed and kept; after a ``failed_start``, one this start
        created is removed with its checkpoint); False if a thread is stuck (fd leaked)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        deadline = Deadline(timeout)
        for t in list(getattr(self.pool, "_threads", ())):
            t.join(deadline.left())
        if any(t.is_alive() for t in getattr(self.pool, "_threads", ())):
            log.warning("disk tier: an IO thread is still running; leaving fd %d open", self.file.fd)
            return False
        if failed_start and self.file.persistent and not self.file.existed:
            self.file.persistent = False  # created by this start: it goes with it
            if self.persistent is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.persistent.checkpoint_path)
        elif self.persistent is not None and self._snapshot is not None and self.file.fd >= 0:
            try:
                self.persistent.write_tombstones_now()
                self.persistent.write_checkpoint(self._snapshot(), clean=True)
            except OSError:
                log.warning("kvoffload: %s: the final checkpoint failed; the next start checks every slot", self.file.path, exc_info=True)
        self.file.close()
        for b in self._bounce:
            b.close()
        self._bounce = []
        return True
