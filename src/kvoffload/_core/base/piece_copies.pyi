"""Copies of KV-cache pieces between cache tensors and host rows, walked in C (``piece_copies.c``)."""

from collections.abc import Sequence
from typing import Any

CopyFunctions = tuple[int, int, int]
"""(``cuMemcpyBatchAsync`` address or 0, ``cuMemcpyAsync`` address, ``CUmemcpyAttributes`` address)."""

Failure = tuple[int, str, int] | None
"""None, or what failed: the driver's error code, the call, the index of the copy."""

def memcpy_pieces(
    to_host: bool, host_base: int, slot_bytes: int, block_ids: Sequence[int], rows: Sequence[int], pieces: Any,
    release_gil_bytes: int, /,
) -> None: ...
def enqueue_pieces(
    copy_fns: CopyFunctions, stream: int, to_host: bool, host_base: int, slot_bytes: int, block_ids: Sequence[int],
    rows: Sequence[int], pieces: Any, first: int, stop: int, /,
) -> Failure: ...
def enqueue_runs(
    copy_fns: CopyFunctions, stream: int, to_host: bool, host_base: int, staging_base: int, slot_bytes: int, rows: Sequence[int], /,
) -> Failure: ...

def enqueue_ring(wait: int, launch_host_func: int, stream: int, event: int, fn: int, data: int, /) -> Failure: ...
def context_status(ctx_get_current: int, /) -> int: ...

class ChunkCopies:
    def __init__(
        self, copy_fns: CopyFunctions, record: int, wait: int, kernel_stream: int, copy_stream: int, between: int,
        slot_bytes: int, pieces: Any, staging: tuple[int, int], kernel: tuple[int, ...] | None,
    ) -> None: ...
    def copy(
        self, to_host: bool, direct: bool, host_base: int, rows: Sequence[int], block_ids: Sequence[int], staging: int,
        free_event: int, done_event: int, cancel_address: int, generation: int, one_stream: bool, caller_stream: int | None, /,
    ) -> Failure: ...
    def wait(self, event: int, /) -> Failure: ...
    def wait_for_stream(self, stream: int, /) -> Failure: ...
