"""Block movers: copy blocks between the KV cache and rows of host memory.

A mover serves one direction's worker loop. ``to_host`` / ``to_device`` copy a
chunk of at most ``chunk_blocks`` blocks and return a completion event, or
None when the copy already happened (CPU caches). Host memory is given as a
``uint8[rows, slot_bytes]`` tensor and a row number per block, so the same
mover fills host-tier slots and disk bounce buffers alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from .layout import BlockLayout

__all__ = ["BlockMover", "CpuMover", "make_mover"]


class BlockMover(Protocol):
    """Copies chunks of blocks between the cache and host rows, in submission order."""

    chunk_blocks: int

    def wait_for(self, event: Any) -> None:
        """Make every later copy wait until ``event`` (caller's compute) has completed."""
        ...

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> Any:
        """Copy cache blocks into host rows; returns a completion event or None."""
        ...

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> Any:
        """Copy host rows into cache blocks; returns a completion event or None."""
        ...

    def close(self) -> None:
        """Free device resources (staging memory)."""
        ...


class CpuMover:
    """Synchronous copies between CPU-tensor caches and host rows."""

    def __init__(self, layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], chunk_bytes: int) -> None:
        self._pieces = layout.pieces
        self._rows = layout.block_rows(kv_caches)
        self.chunk_blocks = max(1, chunk_bytes // layout.slot_bytes)

    def wait_for(self, event: Any) -> None:
        pass  # CPU work is complete when the caller's call returns

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> None:
        src = torch.as_tensor(block_ids, dtype=torch.int64)
        dst = torch.as_tensor(rows, dtype=torch.int64)
        for p, cache_rows in zip(self._pieces, self._rows):
            host[:, p.offset : p.offset + p.nbytes].index_copy_(0, dst, cache_rows.index_select(0, src))

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> None:
        src = torch.as_tensor(rows, dtype=torch.int64)
        dst = torch.as_tensor(block_ids, dtype=torch.int64)
        for p, cache_rows in zip(self._pieces, self._rows):
            cache_rows.index_copy_(0, dst, host[:, p.offset : p.offset + p.nbytes].index_select(0, src))

    def close(self) -> None:
        self._rows = []


def make_mover(
    layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], *, chunk_bytes: int, use_batch_copy: bool = True
) -> BlockMover:
    """A :class:`CpuMover` for CPU caches, a CUDA mover (own stream, staging) for GPU caches."""
    if not layout.is_cuda:
        return CpuMover(layout, kv_caches, chunk_bytes)
    from .cuda.mover import CudaMover

    return CudaMover(layout, kv_caches, chunk_bytes=chunk_bytes, use_batch_copy=use_batch_copy)
