"""The offloader's options: one frozen, validated value instead of loose keyword arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["Options"]


@dataclass(frozen=True)
class Options:
    """Everything about an :class:`Offloader` except its caches; validated on construction.

    ``Offloader(kv_caches, host_blocks=1024, ...)`` builds one from its keyword
    arguments; ``off.options`` returns it.
    """

    host_blocks: int = 4096
    """Block slots in (pinned) host memory; 0 for a disk-only offloader."""
    disk_path: str | None = None
    """File of the disk tier (created fresh, mode 0600, removed on close), or None."""
    disk_blocks: int = 0
    """Block slots on disk; needs ``disk_path``."""
    chunk_bytes: int = 128 << 20
    """Bytes per copy chunk: the unit of pipelining and of cancellation. A GPU cache gets two
    staging buffers of this size per direction (512 MiB of GPU memory in all at the default)."""
    completion: Literal["poll", "thread"] = "poll"
    """How CUDA completion reaches the worker loops (see docs/design.md)."""
    gather_ctas: int = 0
    """GPU caches: CTAs per gather/scatter launch; 0 (the default) runs one per piece, the fastest on
    an idle GPU. A small number (8-32) leaves more SMs to the model's kernels and moves less per
    second: ``kvoffload bench`` measures both beside a matmul loop."""
    gather_priority: Literal["low", "high"] = "low"
    """GPU caches: the priority of the streams that gather and scatter pieces. ``"low"`` (the
    default): the model's kernels go first. ``"high"``: the copy kernels go first, which can keep
    the copy engines busier when both directions run at once with small pieces, at the cost of
    delaying the model's kernels for the (brief) gathers. ``kvoffload bench`` measures both."""
    copy_engine: Literal["kernel", "dma"] = "kernel"
    """GPU caches: who copies the pieces of a chunk. ``"kernel"`` (the default): a copy kernel
    gathers them into a staging buffer that one DMA moves (loads: the reverse), the fastest on an
    idle GPU for every piece size, and loads stop early when cancelled. ``"dma"``: the copy
    engines move each piece with a descriptor of its own, using no SMs; the driver takes about
    a microsecond per piece to enqueue them (in the calling thread), and small pieces copy
    slowly (16 KiB: a few GB/s). ``kvoffload bench`` measures both beside a matmul loop."""
    use_batch_copy: bool = True
    """False forces one ``cuMemcpyAsync`` per copy instead of ``cuMemcpyBatchAsync``."""
    io_threads: int = 4
    """Disk IO threads."""
    use_page_cache: bool = False
    """Buffered disk IO instead of O_DIRECT."""
    expedited_loads: bool = False
    """Start a third worker for ``load(..., expedited=True)``: small loads the caller waits for then
    queue behind no other load. Its copies are made by a kernel on high-priority streams that reads
    host memory directly, so they overtake a bulk load whose DMAs fill the copy engines' queue.
    Costs one thread. Without it expedited loads run as others. GPU caches only: on CPU caches the
    copies hold the GIL, so a third thread would wait for it behind the load worker's (7 ms
    measured, where a one-block load run between the chunks of a bulk load on the load worker
    takes 0.4 ms); expedited loads there take the load worker."""

    def __post_init__(self) -> None:
        _check_count("host_blocks", self.host_blocks, minimum=0)
        _check_count("disk_blocks", self.disk_blocks, minimum=0)
        _check_count("chunk_bytes", self.chunk_bytes, minimum=1)
        _check_count("io_threads", self.io_threads, minimum=1)
        _check_count("gather_ctas", self.gather_ctas, minimum=0)
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)):
                raise TypeError(f"disk_path must be a path or None, got {type(self.disk_path).__name__}")
            path = os.fspath(self.disk_path)
            if not isinstance(path, str):
                raise TypeError(f"disk_path must be a str path, got {type(path).__name__}")
            if not path or "\0" in path:
                raise ValueError(f"disk_path is not a valid path: {path!r}")
            object.__setattr__(self, "disk_path", path)
        if self.disk_blocks and self.disk_path is None:
            raise ValueError("disk_blocks > 0 needs a disk_path")
        if self.disk_path is not None and not self.disk_blocks:
            raise ValueError("disk_path given with disk_blocks=0: give the number of disk slots")
        if not self.host_blocks and not self.disk_blocks:
            raise ValueError("no room: host_blocks and disk_blocks are both 0")
        if self.gather_priority not in ("low", "high"):
            raise ValueError(f"gather_priority must be 'low' or 'high', got {self.gather_priority!r}")
        if self.copy_engine not in ("kernel", "dma"):
            raise ValueError(f"copy_engine must be 'kernel' or 'dma', got {self.copy_engine!r}")
        if self.completion not in ("thread", "poll"):
            raise ValueError(f"completion must be 'thread' or 'poll', got {self.completion!r}")
        for name in ("use_batch_copy", "use_page_cache", "expedited_loads"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
