"""What ``Offloader.stats()`` reports, and the transfer counters behind it."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .transfer import Transfer, TransferResult

__all__ = ["OffloaderStats", "TransferCounters"]


@dataclass(frozen=True)
class OffloaderStats:
    """A snapshot of the offloader's state (``Offloader.stats()``)."""

    host_slots: int
    host_free: int
    """Host slots neither holding an entry nor reserved by a running store."""
    disk_slots: int
    disk_free: int
    ready: int
    """Stored keys visible to ``lookup`` (both tiers)."""
    host_ready: int
    disk_ready: int
    pending: int
    """Keys being written by running stores (not visible)."""
    pinned: int
    """Stored keys in use by running loads (never evicted)."""
    spilling: int
    """Host entries being written to disk to make room (still visible)."""
    evicted: int
    """Entries dropped to make room, since start."""
    spilled: int
    """Entries moved from host memory to disk, since start."""
    in_flight: int
    """Transfers started and not yet finished."""
    stores: int
    loads: int
    failed: int
    cancelled: int
    bytes_stored: int
    bytes_loaded: int


class TransferCounters:
    """Transfers started and ended, by outcome; thread-safe."""


    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.stores = self.loads = self.failed = self.cancelled = 0
        self.bytes_stored = self.bytes_loaded = 0

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def ended(self, t: Transfer, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        """Count a transfer's end; runs before the transfer is finished (``WorkerLoop.start_transfer``'s
        ``on_end``), so a waiter that wakes already sees it counted."""
        with self.lock:
            self.in_flight -= 1
            if cancelled:
                self.cancelled += 1
            elif exc is not None or result is None:
                self.failed += 1
            elif result.kind == "store":
                self.stores += 1
                self.bytes_stored += result.nbytes
            else:
                self.loads += 1
                self.bytes_loaded += result.nbytes
