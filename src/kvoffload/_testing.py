"""Seams for tests: inject faults into an offloader's disk IO and copies. Not for production use.

Both functions return a live object whose attributes the offloader looks up at
every call, so a test replaces an attribute to intercept every later call::

    io = kvoffload._testing.disk_io(off)
    real = io.pwritev
    io.pwritev = lambda fd, buffers, offset: real(fd, buffers, offset) - 4096  # a short write

These names are kept stable for tests; everything else under ``kvoffload._core``
may change without notice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from ._core.workers.copier import BlockCopier
from ._core.base.diskfile import IoCalls
from ._core.tiers.hostmem import HostBuffer
from ._core.workers.copy_submission import CopyCalls
from ._core.offloader import Offloader

__all__ = ["disk_io", "copy_calls", "uses_o_direct", "disk_file_stat", "disk_file_location", "pinned_buffers", "check_index",
           "take_gpu_path", "IoCalls", "CopyCalls", "BlockCopier"]


def disk_io(off: Offloader) -> IoCalls | None:
    """The system calls of ``off``'s disk tier, or None without one.

    The disk tier calls ``io.pwritev(fd, buffers, offset)`` and
    ``io.preadv(fd, buffers, offset)``, positionally, as ``os.pwritev`` /
    ``os.preadv`` are called. Anything but the requested byte count returned
    (short, zero, longer, ``None``) and any exception raised fail that transfer
    with :class:`kvoffload.TransferError`. The offloader must be started.
    """
    return off._running_storage().disk_io()


def copy_calls(off: Offloader) -> CopyCalls:
    """How ``off``'s worker loops call their block copiers (both directions).

    ``calls.to_host(copier, block_ids, host, rows)`` and
    ``calls.to_device(copier, host, rows, block_ids)``; replace either to gate
    or break copies. GPU transfers between the cache and host memory make these
    calls in the thread that calls ``store()``/``load()`` (they are enqueued
    whole there): a gate on them holds that thread. Any exception raised fails the transfer with
    :class:`kvoffload.TransferError`. The offloader must be started.
    """
    return off._running_runtime().copy_calls


def uses_o_direct(off: Offloader) -> bool:
    """True when ``off``'s disk tier does O_DIRECT IO (False: buffered, or no disk tier)."""
    disk = off._running_storage().disk
    return disk is not None and disk.file.direct


def disk_file_stat(off: Offloader) -> os.stat_result:
    """``os.fstat`` of ``off``'s disk file (which has no name unless it is persistent)."""
    disk = off._running_storage().disk
    assert disk is not None, "no disk tier"
    return os.fstat(disk.file.fd)


def disk_file_location(off: Offloader) -> str:
    """Where the kernel says ``off``'s disk file is (``/proc/self/fd``): its path, or for a file with
    no name the directory it was made in, then ``/#<inode> (deleted)`` or the like."""
    disk = off._running_storage().disk
    assert disk is not None, "no disk tier"
    return os.readlink(f"/proc/self/fd/{disk.file.fd}")


def pinned_buffers(off: Offloader) -> list[HostBuffer]:
    """Every host buffer ``off`` allocated: the host slab and the disk tier's bounce buffers."""
    return off._running_storage().host_buffers()


def check_index(off: Offloader) -> None:
    """Assert every invariant of ``off``'s index: each slot free or owned once, states consistent."""
    off._running_storage().index.check()


def take_gpu_path(off: Offloader, wrap: Callable[[str, BlockCopier], BlockCopier]) -> None:
    """Make ``off`` (started, over CPU caches) take its GPU path, to drive that path on any machine
    (over GPU caches: copy through ``wrap`` of the real copiers, to watch their calls):
    each worker (``kind`` "store" or "load") copies through ``wrap(kind, its copier)``, a stand-in whose
    copies complete with events the test completes (``query``, ``synchronize``; ``ring_when_complete``
    rings the given semaphore once the event completes), followed by a landing watcher; transfers
    between the cache and host memory are enqueued at call time, as on a GPU."""
    rt = off._running_runtime()
    storage = off._running_storage()
    for worker in rt.workers:
        worker._follow_with(wrap(worker.kind, worker._copier))
    storage.layout = dataclasses.replace(storage.layout, device=torch.device("cuda", 0))
