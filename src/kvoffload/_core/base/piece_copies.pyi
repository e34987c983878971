"""Copies of KV-cache pieces between cache tensors and host rows, walked in C (``piece_copies.c``)."""

from collections.abc import Sequence
from typing import Any

CopyFunctions = tuple[int, int, int]
"""(``cuMemcpyBatchAsync`` address or 0, ``cuMemcpyAsync`` address, ``CUmemcpyAttributes`` address)."""

def memcpy_pieces(
    to_host: bool, host_base: int, slot_bytes: int, block_ids: Sequence[int], rows: Sequence[int], pieces: Any,
    release_gil_bytes: int, /,
) -> None: ...
def enqueue_pieces(
    copy_fns: CopyFunctions, stream: int, to_host: bool, host_base: int, slot_bytes: int, block_ids: Sequence[int],
    rows: Sequence[int], pieces: Any, first: int, stop: int, /,
) -> tuple[int, int]: ...
def enqueue_runs(
    copy_fns: CopyFunctions, stream: int, to_host: bool, host_base: int, staging_base: int, slot_bytes: int, rows: Sequence[int], /,
) -> tuple[int, int]: ...
def launch_pieces(
    launch_fn: int, function: int, stream: int, params: int, blocks: int, max_blocks: int, tensors: int, threads: int,
    max_ctas: int, block_ids: Sequence[int], /,
) -> int: ...
