"""Block copiers: copy blocks between the KV cache and rows of host memory.

A copier serves one direction's worker loop. ``to_host`` / ``to_device`` copy a
chunk of at most ``chunk_blocks`` blocks and return a completion event, or
None when the copy already happened (CPU caches). Host memory is given as a
``uint8[rows, slot_bytes]`` tensor and a row number per block, so the same
copier fills host-tier slots and disk bounce buffers alike.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ..base.cross_thread import WakeSemaphore
from ..base.layout import BlockLayout, runs
from ..base.options import Options
from ..cuda.events import CopyEvent

__all__ = ["BlockCopier", "CpuBlockCopier", "make_block_copier"]


class BlockCopier(Protocol):
    """Copies chunks of blocks between the cache and host rows, in submission order."""

    chunk_blocks: int

    def caller_event(self) -> CopyEvent | None:
        """An event recorded now on the calling thread's current stream, or None (CPU caches)."""
        ...

    def wait_for(self, event: CopyEvent | None) -> None:
        """Make every later copy wait until ``event`` (caller's compute) has completed."""
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

    def ring_when_complete(self, event: CopyEvent, semaphore: WakeSemaphore) -> None:
        """Have ``semaphore`` rung once ``event`` (one of this copier's completion events) completes,
        without Python running meanwhile."""
        ...

    def close(self) -> None:
        """Free device resources (staging memory)."""
        ...


class CpuBlockCopier:
    """Synchronous copies between CPU-tensor caches and host rows.

    Each (block, piece) is one libc ``memcpy`` called through ``ctypes.PYFUNCTYPE``, which keeps
    the GIL: with another thread of the process busy in Python, a copy that released it (torch's
    do) could wait the whole 5 ms switch interval to take it back, once per piece. Where libc's
    ``memcpy`` cannot be found, runs of consecutive blocks and rows become one torch slice copy per
    piece, or one gather/scatter per piece when runs are short and pieces small (measured on 2
    cores: slice copies of 64 KiB pieces 6 GB/s, index_select/index_copy_ 1.5 GB/s).
    """

    SLICE_MIN_BYTES = 16 << 10

    def __init__(self, layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], chunk_bytes: int) -> None:
        self._pieces = layout.pieces
        self._rows = layout.block_rows(kv_caches)
        self._piece_addresses = layout.piece_addresses(self._rows)
        self._avg_piece = layout.block_bytes / len(layout.pieces)
        self._memcpy = _libc_memcpy()
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

    def ring_when_complete(self, event: Any, semaphore: WakeSemaphore) -> None:
        semaphore.ring()  # CPU copies are complete when they return

    def _copy(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int], to_host: bool) -> None:
        if self._memcpy is not None:
            memcpy, hbase, hstride = self._memcpy, host.data_ptr(), host.stride(0)
            for b, r in zip(block_ids, rows):
                row = hbase + r * hstride
                for cbase, stride, offset, nbytes in self._piece_addresses:
                    if to_host:
                        memcpy(row + offset, cbase + b * stride, nbytes)
                    else:
                        memcpy(cbase + b * stride, row + offset, nbytes)
            return
        starts, lengths = runs(block_ids, rows)
        if len(block_ids) * self._avg_piece / len(starts) >= self.SLICE_MIN_BYTES:
            for s, n in zip(starts.tolist(), lengths.tolist()):
                b, r = block_ids[s], rows[s]
                for p, cache_rows in zip(self._pieces, self._rows):
                    h = host[r : r + n, p.offset : p.offset + p.nbytes]
                    c = cache_rows[b : b + n]
                    (h.copy_(c) if to_host else c.copy_(h))
            return
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        hrows = torch.as_tensor(rows, dtype=torch.int64)
        for p, cache_rows in zip(self._pieces, self._rows):
            h = host[:, p.offset : p.offset + p.nbytes]
            if to_host:
                h.index_copy_(0, hrows, cache_rows.index_select(0, ids))
            else:
                cache_rows.index_copy_(0, ids, h.index_select(0, hrows))

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> None:
        self._copy(block_ids, host, rows, to_host=True)

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        self._copy(block_ids, host, rows, to_host=False)

    def close(self) -> None:
        self._rows = []


def _libc_memcpy() -> Any:
    """libc's ``memcpy(dst, src, n)`` as a ctypes function that keeps the GIL, or None."""
    try:
        address = ctypes.cast(ctypes.CDLL(None).memcpy, ctypes.c_void_p).value
    except (OSError, AttributeError):  # no libc to load (not a POSIX system)
        return None
    if not address:
        return None
    return ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(address)


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
        priority=-1 if expedited else 0, kernel_priority=-1 if expedited or options.gather_priority == "high" else 0,
        copy_engine=options.copy_engine, loads_by_sm=expedited,
    )
