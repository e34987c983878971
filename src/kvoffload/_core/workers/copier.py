"""Block copiers: copy blocks between the KV cache and rows of host memory.

A copier serves one direction's worker loop. ``to_host`` / ``to_device`` copy a
chunk of at most ``chunk_blocks`` blocks and return a completion event, or
None when the copy already happened (CPU caches). Host memory is given as a
``uint8[rows, slot_bytes]`` tensor and a row number per block, so the same
copier fills host-tier slots and disk bounce buffers alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ..base.cross_thread import WakeSemaphore
from ..base.layout import BlockLayout
from ..base.options import Options
from ..base.piece_copies import memcpy_pieces
from ..cuda.events import CopyEvent

__all__ = ["BlockCopier", "CpuBlockCopier", "make_block_copier"]


class BlockCopier(Protocol):
    """Copies chunks of blocks between the cache and host rows, in submission order."""

    chunk_blocks: int

    def caller_event(self) -> CopyEvent | None:
        """An event recorded now on the calling thread's current stream, or None (CPU caches)."""
        ...

    def wait_for(self, event: CopyEvent | None) -> None:
        """Make every later copy wait until ``event`` (caller's compute) has completed; None: the work
        enqueued so far on the calling thread's current stream (GPU caches)."""
        ...

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> CopyEvent | None:
        """Copy cache blocks into host rows; returns a completion event or None."""
        ...

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> CopyEvent | None:
        """Copy host rows into cache blocks; returns a completion event or None."""
        ...

    def take_cancel_flag(self) -> Any:
        """A cancel flag for one load's copies (see :meth:`stops_on`), or None: no early cancellation."""
        ...

    def stops_on(self, flag: Any) -> AbstractContextManager[None]:
        """Loads enqueued inside stop writing the cache once ``flag`` (from :meth:`take_cancel_flag`) is raised."""
        ...

    def ring_when_complete(self, event: CopyEvent, semaphore: WakeSemaphore, in_order: bool = True, for_thread: bool = False) -> None:
        """Have ``semaphore`` rung once ``event`` (one of this copier's completion events) completes,
        without Python running meanwhile. ``in_order=False``: ``event`` may complete before events
        already rung for (a cancel flag's raise; an earlier copy than one rung for): its ring must not
        wait behind theirs. ``for_thread``: the ring of a thread asleep until ``event`` completes (it
        may be for a later copy than the landing watcher's next ring, which must not wait behind it)."""
        ...

    def close(self) -> None:
        """Free device resources (staging memory)."""
        ...


class CpuBlockCopier:
    """Synchronous copies between CPU-tensor caches and host rows.

    One call of :func:`~..base.piece_copies.memcpy_pieces` per chunk walks its (block, piece)
    pairs in C, one ``memcpy`` each. A chunk of at least :attr:`RELEASE_GIL_BYTES` is copied with
    the GIL released, so that the caller's event loop and other threads run meanwhile; smaller
    ones keep it: with another thread of the process busy in Python, taking the GIL back can wait
    a whole switch interval (5 ms), which only a copy much longer than that is worth.
    """

    RELEASE_GIL_BYTES = 8 << 20
    """Copies of this many bytes or more release the GIL (about 1-3 ms of ``memcpy``)."""

    def __init__(self, layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], chunk_bytes: int) -> None:
        self._rows = layout.block_rows(kv_caches)  # keeps the views (and the addresses below) alive
        self._pieces = layout.piece_table(self._rows)
        self.chunk_blocks = layout.blocks_per_chunk(chunk_bytes)

    def caller_event(self) -> None:
        return None  # CPU work is complete when the caller's call returns

    def wait_for(self, event: Any) -> None:
        pass

    def take_cancel_flag(self) -> None:
        """None: CPU copies are made one chunk at a time by the worker, which stops between chunks."""
        return None

    def stops_on(self, flag: Any) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def ring_when_complete(self, event: Any, semaphore: WakeSemaphore, in_order: bool = True, for_thread: bool = False) -> None:
        semaphore.ring()  # CPU copies are complete when they return

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> None:
        memcpy_pieces(True, host.data_ptr(), host.stride(0), block_ids, rows, self._pieces, self.RELEASE_GIL_BYTES)

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        memcpy_pieces(False, host.data_ptr(), host.stride(0), block_ids, rows, self._pieces, self.RELEASE_GIL_BYTES)

    def close(self) -> None:
        self._rows = []


def make_block_copier(
    layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], options: Options, *, expedited: bool = False,
) -> BlockCopier:
    """A :class:`CpuBlockCopier` for CPU caches, a CUDA copier (own streams, staging, copy kernel) for GPU
    caches; ``expedited``: its streams have a higher priority than the others' (and than compute)."""
    if not layout.is_cuda:
        return CpuBlockCopier(layout, kv_caches, options.chunk_bytes)
    from ..cuda.cuda_copier import CudaBlockCopier

    return CudaBlockCopier(
        layout, kv_caches, chunk_bytes=options.chunk_bytes, use_batch_copy=options.use_batch_copy, gather_ctas=options.gather_ctas,
        priority=-1 if expedited else 0,
        copy_engine=options.copy_engine, loads_by_sm=expedited,
    )
