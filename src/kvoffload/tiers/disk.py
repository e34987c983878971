"""The disk tier: block slots in one file, IO on a thread pool, pipelined with the copies.

Each slot is ``slot_bytes`` (a multiple of 4096) at offset ``slot * slot_bytes``,
so every O_DIRECT call is aligned whatever the tensors' bytes per block. Runs
of consecutive slots become one ``pwritev``/``preadv`` (cut into jobs of
``job_bytes`` so that ``io_threads`` threads share large runs).

Stores straight to disk (no host tier) copy a chunk of blocks into one half of
a pinned, page-aligned bounce buffer while the IO threads write the previous
chunk from the other half; loads read chunk N+1 into one half while chunk N is
copied to the cache from the other. Spills write host slots directly from the
(pinned, aligned) host slab: no extra copy.

The event loops never block on IO: they await futures of the IO pool.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..diskfile import DiskFile, IoBatch, io_jobs
from ..hostmem import HostBuffer
from ..lane import Lane
from ..layout import BlockLayout
from .host import chunked

__all__ = ["DiskTier"]

log = logging.getLogger("kvoffload")


class DiskTier:
    """Block slots in a private file on local disk."""

    def __init__(
        self,
        layout: BlockLayout,
        path: str,
        slots: int,
        *,
        chunk_blocks: int,
        io_threads: int,
        use_page_cache: bool,
        store_bounce: bool,
        job_bytes: int = 8 << 20,
    ) -> None:
        self.layout = layout
        self.slots = slots
        self.chunk_blocks = chunk_blocks
        self.job_bytes = job_bytes
        self._bounce: list[HostBuffer] = []
        self.file = DiskFile(path, slots * layout.slot_bytes, use_page_cache=use_page_cache)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoffload-io")
        try:
            # two halves of chunk_blocks slots each, per direction that needs one
            for _ in range(2 if store_bounce else 1):
                self._bounce.append(HostBuffer(2 * chunk_blocks * layout.slot_bytes, pin=layout.is_cuda))
        except BaseException:
            self.close()
            raise
        self._load_bounce = self._bounce[0]
        self._store_bounce = self._bounce[1] if store_bounce else None

    # -- raw IO between host rows and disk slots ------------------------------------

    def write_rows(self, host: np.ndarray, rows: Sequence[int], slots: Sequence[int]) -> IoBatch:
        """Start writing host rows to disk slots (pairwise) on the IO pool."""
        jobs = io_jobs(host, rows, slots, self.job_bytes)
        return IoBatch(self.pool, [functools.partial(self.file.write, bufs, off) for off, bufs in jobs])

    def read_rows(self, host: np.ndarray, rows: Sequence[int], slots: Sequence[int]) -> IoBatch:
        """Start reading disk slots into host rows (pairwise) on the IO pool."""
        jobs = io_jobs(host, rows, slots, self.job_bytes)
        return IoBatch(self.pool, [functools.partial(self.file.read, bufs, off) for off, bufs in jobs])

    # -- cache <-> disk through the bounce buffer -------------------------------------

    async def store(self, lane: Lane, pairs: Sequence[tuple[int, int]], landed: Callable[[int], None]) -> None:
        """Copy cache blocks to disk slots (``(block id, slot)``); ``landed(n)`` after each chunk is on disk."""
        assert self._store_bounce is not None, "disk-only stores need the store bounce buffer"
        bounce = self._store_bounce.tensor.view(-1, self.layout.slot_bytes)
        host = bounce.numpy()
        c = self.chunk_blocks
        writes: deque[tuple[IoBatch, int]] = deque()
        event: Any = None
        try:
            for i, chunk in enumerate(chunked(pairs, c)):
                if len(writes) == 2:  # this half's previous write must be done
                    await writes[0][0].wait()
                    landed(writes.popleft()[1])
                rows = list(range((i % 2) * c, (i % 2) * c + len(chunk)))
                event = lane.mover.to_host([b for b, _ in chunk], bounce, rows)
                await lane.wait(event)
                event = None
                writes.append((self.write_rows(host, rows, [s for _, s in chunk]), len(chunk)))
            while writes:
                await writes[0][0].wait()
                landed(writes.popleft()[1])
        except BaseException:
            await lane.settle(event)
            for w, _ in writes:
                await w.settle()
            raise

    async def load(self, lane: Lane, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy disk slots to cache blocks (``(slot, block id)``), reading ahead one chunk."""
        bounce = self._load_bounce.tensor.view(-1, self.layout.slot_bytes)
        host = bounce.numpy()
        c = self.chunk_blocks
        chunks = chunked(pairs, c)
        rows_of = [list(range((i % 2) * c, (i % 2) * c + len(ch))) for i, ch in enumerate(chunks)]

        def read(i: int) -> IoBatch:
            return self.read_rows(host, rows_of[i], [s for s, _ in chunks[i]])

        copies: deque[Any] = deque()  # completion events of copies out of the bounce buffer
        reading: IoBatch | None = read(0) if chunks else None
        try:
            for i, chunk in enumerate(chunks):
                assert reading is not None
                await reading.wait()
                reading = None
                if i + 1 < len(chunks):
                    if copies:  # the next read's half was last copied out by chunk i-1
                        await lane.wait(copies.popleft())
                    reading = read(i + 1)
                copies.append(lane.mover.to_device(bounce, rows_of[i], [b for _, b in chunk]))
            while copies:
                await lane.wait(copies.popleft())
        except BaseException:
            if reading is not None:
                await reading.settle()
            if copies:
                await lane.settle(copies[-1])
            raise

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the IO threads, then close and unlink the file; False if a thread is stuck (fd leaked)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for t in list(getattr(self.pool, "_threads", ())):
            t.join(timeout)
        if any(t.is_alive() for t in getattr(self.pool, "_threads", ())):
            log.warning("disk tier: an IO thread is still running; leaving fd %d open", self.file.fd)
            return False
        self.file.close()
        for b in self._bounce:
            b.close()
        self._bounce = []
        return True
