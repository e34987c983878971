"""GPU <-> host block copies through double-buffered GPU staging and batched DMA.

Host slots hold each block's pieces of every tensor back to back, so one
(layer, block) piece is often only 16-64 KiB. Copying such pieces one
descriptor each is slow host->GPU (3-5 GB/s measured at 16 KiB on an H200).
So a chunk of blocks is gathered on the GPU into a staging buffer laid out
exactly like host slots (``index_select`` per tensor, at HBM speed), and moved
with ``cuMemcpyBatchAsync``, one descriptor per run of consecutive host slots.
Loads run the same way backwards and scatter with ``index_copy_``.

Two streams per direction overlap the two halves: a kernel stream gathers or
scatters chunk N while the copy stream DMAs chunk N-1, through two staging
buffers used in turn. Events order each buffer's reuse.

Staging costs one kernel launch per tensor per chunk (20-40 us of CPU each
on an H200, so about a millisecond for a 32-layer cache), which
only pays off for large chunks. Small chunks (at most ``direct_max_copies`` pieces, e.g. one or a few
blocks) are copied directly, one batched descriptor per (tensor, block).

Completion events: a store chunk completes on the copy stream, a load chunk on
the kernel stream, so each direction's completions arrive in submission order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..layout import BlockLayout, runs
from .driver import BatchCopy

__all__ = ["CudaMover"]


class CudaMover:
    """One direction's streams, staging buffers and batched copy."""

    def __init__(
        self, layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], *, chunk_bytes: int, use_batch_copy: bool = True
    ) -> None:
        self._layout = layout
        self._pieces = layout.pieces
        self._rows = layout.block_rows(kv_caches)
        self.chunk_blocks = max(1, chunk_bytes // layout.slot_bytes)
        # Priority 0 is the lowest: compute kernels go first.
        self.kernel_stream = torch.cuda.Stream(device=layout.device, priority=0)
        self.copy_stream = torch.cuda.Stream(device=layout.device, priority=0)
        shape = (self.chunk_blocks, layout.slot_bytes)
        self._staging = [torch.empty(shape, dtype=torch.uint8, device=layout.device) for _ in range(2)]
        self._staging_free: list[torch.cuda.Event | None] = [None, None]  # last use of each buffer
        self._turn = 0
        self._copy = BatchCopy(use_batch=use_batch_copy)
        self.direct_max_copies = 128
        # Per tensor: base address and bytes per block, for direct descriptors.
        self._bases = np.array([r.data_ptr() for r in self._rows], dtype=np.uint64)
        self._piece_bytes = np.array([p.nbytes for p in self._pieces], dtype=np.uint64)
        self._piece_offsets = np.array([p.offset for p in self._pieces], dtype=np.uint64)

    def wait_for(self, event: Any) -> None:
        """Every later copy waits for ``event``. Called with the lane's submit lock held."""
        # Both streams touch cache blocks: kernels when staged, DMA when direct.
        self.kernel_stream.wait_event(event)
        self.copy_stream.wait_event(event)

    def _direct(self, nblocks: int) -> bool:
        return nblocks * len(self._pieces) <= self.direct_max_copies

    def _direct_dma(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int], to_host: bool) -> None:
        """One descriptor per (tensor, block) between cache and host slots, no staging."""
        ids = np.asarray(block_ids, dtype=np.uint64)
        hr = np.asarray(rows, dtype=np.uint64)
        cache_addrs = (self._bases[:, None] + ids[None, :] * self._piece_bytes[:, None]).ravel()
        host_addrs = (host.data_ptr() + hr[None, :] * np.uint64(self._layout.slot_bytes) + self._piece_offsets[:, None]).ravel()
        sizes = np.repeat(self._piece_bytes, len(ids))
        if to_host:
            self._copy(host_addrs, cache_addrs, sizes, self.copy_stream.cuda_stream)
        else:
            self._copy(cache_addrs, host_addrs, sizes, self.copy_stream.cuda_stream)

    def _take_staging(self, stream: torch.cuda.Stream) -> tuple[int, torch.Tensor]:
        b = self._turn
        self._turn ^= 1
        free = self._staging_free[b]
        if free is not None:
            stream.wait_event(free)
        return b, self._staging[b]

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        host = torch.tensor(ids, dtype=torch.int64).pin_memory()
        return host.to(self._layout.device, non_blocking=True)

    def _dma(self, staging: torch.Tensor, host: torch.Tensor, rows: Sequence[int], to_host: bool) -> None:
        slot = self._layout.slot_bytes
        starts, lengths = runs(rows)
        host_addrs = host.data_ptr() + np.asarray(rows, dtype=np.uint64)[starts] * np.uint64(slot)
        stage_addrs = staging.data_ptr() + starts.astype(np.uint64) * np.uint64(slot)
        sizes = lengths.astype(np.uint64) * np.uint64(slot)
        if to_host:
            self._copy(host_addrs, stage_addrs, sizes, self.copy_stream.cuda_stream)
        else:
            self._copy(stage_addrs, host_addrs, sizes, self.copy_stream.cuda_stream)

    @staticmethod
    def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> torch.cuda.Event:
        with torch.cuda.device(self._layout.device):  # any calling thread: a caller's, or a worker loop
            return self._to_host(block_ids, host, rows)

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> torch.cuda.Event:
        with torch.cuda.device(self._layout.device):
            return self._to_device(host, rows, block_ids)

    def _to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> torch.cuda.Event:
        n = len(block_ids)
        assert n <= self.chunk_blocks
        if self._direct(n):
            self._direct_dma(block_ids, host, rows, to_host=True)
            return self._record(self.copy_stream)
        b, staging = self._take_staging(self.kernel_stream)
        with torch.cuda.stream(self.kernel_stream):
            idx = self._index(block_ids)
            stage = staging[:n]
            for p, cache_rows in zip(self._pieces, self._rows):
                # one kernel per tensor, written straight into the strided slot columns
                torch.index_select(cache_rows, 0, idx, out=stage[:, p.offset : p.offset + p.nbytes])
            gathered = self._record(self.kernel_stream)
        self.copy_stream.wait_event(gathered)
        self._dma(staging, host, rows, to_host=True)
        done = self._staging_free[b] = self._record(self.copy_stream)
        return done

    def _to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> torch.cuda.Event:
        n = len(block_ids)
        assert n <= self.chunk_blocks
        if self._direct(n):
            self._direct_dma(block_ids, host, rows, to_host=False)
            self.kernel_stream.wait_event(self._record(self.copy_stream))
            return self._record(self.kernel_stream)
        b, staging = self._take_staging(self.copy_stream)
        self._dma(staging, host, rows, to_host=False)
        landed = self._record(self.copy_stream)
        self.kernel_stream.wait_event(landed)
        with torch.cuda.stream(self.kernel_stream):
            idx = self._index(block_ids)
            stage = staging[:n]
            for p, cache_rows in zip(self._pieces, self._rows):
                cache_rows.index_copy_(0, idx, stage[:, p.offset : p.offset + p.nbytes])
            done = self._staging_free[b] = self._record(self.kernel_stream)
        return done

    def close(self) -> None:
        self.kernel_stream.synchronize()
        self.copy_stream.synchronize()
        self._staging = []
        self._rows = []
