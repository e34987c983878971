"""What ``Offloader.stats()`` reports, and the transfer counters behind it."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..base.diskfile import DiskIoCounts
from .index import IndexCounts
from ..workers.transfer import TransferResult

__all__ = ["OffloaderStats", "LatencyHistogram", "PersistentCounts", "TierCounts", "TransferCounters", "LATENCY_BOUNDS"]

LATENCY_BOUNDS: tuple[float, ...] = tuple(1e-5 * 2**i for i in range(24))
"""Upper bounds (seconds) of the latency buckets: 10 us doubling up to about 84 s, then +Inf."""


@dataclass(frozen=True)
class LatencyHistogram:
    """Latencies in buckets: ``counts[i]`` observations fell in ``(bounds[i-1], bounds[i]]``, the
    last count above ``bounds[-1]``."""

    bounds: tuple[float, ...] = field(repr=False)
    counts: tuple[int, ...] = field(repr=False)
    sum: float
    """Seconds, all observations together."""
    count: int

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q`` quantile (``inf`` past the last bound; 0.0 if empty).

        ``q`` is a number in ``[0, 1]`` (``ValueError`` otherwise)."""
        if isinstance(q, bool) or not isinstance(q, (int, float)):
            raise TypeError(f"q must be a number in [0, 1], got {type(q).__name__}")
        if not 0.0 <= q <= 1.0:  # also refuses nan
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            seen += n
            if seen >= rank:
                return bound
        return float("inf")


@dataclass(frozen=True)
class OffloaderStats:
    """A snapshot of the offloader's state (``Offloader.stats()``). Counts run since ``start()``."""

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
    """Entries dropped to make room."""
    spilled: int
    """Entries moved from host memory to disk."""
    in_flight: int
    """Transfers started and not yet finished."""
    stores: int
    loads: int
    failed: int
    cancelled: int
    bytes_stored: int
    bytes_loaded: int
    lookups: int = 0
    """``lookup()`` calls."""
    lookup_hits: int = 0
    """Leading keys found, summed over ``lookup()`` calls."""
    keys_loaded_from_host: int = 0
    keys_loaded_from_disk: int = 0
    """Keys of completed loads, by the tier their bytes came from."""
    evicted_host: int = 0
    evicted_disk: int = 0
    """``evicted``, by the tier the entry was dropped from."""
    disk_bytes_written: int = 0
    """Bytes written to the disk file (stores to disk and spills)."""
    disk_bytes_read: int = 0
    disk_io_errors: int = 0
    """Disk IO calls that raised or moved fewer bytes than asked."""
    bytes_stored_partially: int = 0
    """Bytes of keys published by stores that then failed or were cancelled (chunks that landed stay stored)."""
    host_pending: int = 0
    disk_pending: int = 0
    """``pending``, by the tier the running stores write."""
    promoted: int = 0
    """Disk-resident keys a load left a copy of in host memory (``promote=True``)."""
    disk_clean: int = 0
    """Disk slots holding the disk copy of a key whose current copy is in host memory (promoted, or
    written at a persistent tier's close): ``disk_free + disk_ready + disk_clean`` is every disk
    slot not held by a running transfer."""
    recovered: int = 0
    """Entries found again in a persistent disk file when the offloader started (``persist=True``)."""
    dropped_at_open: int = 0
    """Slots of a persistent disk file whose header or checksum did not verify when the offloader
    started: torn or stale writes, never served."""
    checksum_failures: int = 0
    """Disk slots whose CRC32C (``verify=True``) or seal (``remote_secret``: MAC; ``encryption_key``: decryption) failed when loaded: each failed its load."""
    gpu_staging_bytes: int = 0
    """GPU memory kvoffload holds for staging copies (GPU caches with ``copy_engine="kernel"``)."""
    remote_lookup_hits: int = 0
    """Keys ``alookup()`` found on the remote store (after the local hits)."""
    remote_hits: int = 0
    """Keys loads read from the remote store (checked, then copied to the cache and kept as local entries)."""
    remote_misses: int = 0
    """Keys loads asked the remote for and did not get (gone since ``alookup()``, or rejected): each failed its load."""
    remote_bad_values: int = 0
    """Of those, values rejected by the checks (another key's, another cache's, truncated, corrupted;
    with ``remote_secret``, unsigned or forged; with ``encryption_key``, failing decryption)."""
    remote_unavailable: int = 0
    """Remote calls that found it unreachable (lookups then count local hits only, loads and writes fail)."""
    remote_writes: int = 0
    """Blocks the remote accepted from background writes (``remote_write="through"`` or ``"evict"``)."""
    remote_write_failures: int = 0
    """Blocks whose background write failed, was refused or was dropped at close."""
    remote_writes_dropped: int = 0
    """Evicted blocks not sent (``remote_write="evict"``): the staging buffer was full, or closing."""
    remote_writes_pending: int = 0
    """Blocks being written to the remote now (their local copies pinned, or their bytes staged, meanwhile; not in ``in_flight``)."""
    latency: dict[tuple[str, str, str], LatencyHistogram] = field(default_factory=dict, repr=False)
    """Per ``(kind, outcome, phase)``: kind ``store`` or ``load``; outcome ``done``, ``failed`` or
    ``cancelled``; phase ``queue`` (from the call until a worker took the transfer: GPU transfers
    through host memory are on their streams by then), ``copy`` (from then to the end), ``total``."""


@dataclass(frozen=True, slots=True)
class PersistentCounts:
    """What a persistent disk tier reports (all 0 for any other tier)."""

    recovered: int = 0
    """Entries found again in the disk file at start."""
    dropped_at_open: int = 0
    """Slots whose header or checksum did not verify at start."""
    checksum_failures: int = 0
    """Slots whose CRC32C or seal (MAC, decryption) failed when loaded."""


@dataclass(frozen=True, slots=True)
class TierCounts:
    """What the tiers report, a record per layer: the index (slot use, entry states, its counters),
    the disk file's IO and the persistent disk tier's counters."""

    index: IndexCounts = field(default_factory=IndexCounts)
    disk_io: DiskIoCounts = field(default_factory=DiskIoCounts)
    persistent: PersistentCounts = field(default_factory=PersistentCounts)

    def retired(self) -> TierCounts:
        """These counts once the tiers are gone: the counters kept, every slot and entry gone."""
        return TierCounts(self.index.retired(), self.disk_io, self.persistent)


class _Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BOUNDS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> LatencyHistogram:
        return LatencyHistogram(LATENCY_BOUNDS, tuple(self.counts), self.sum, self.count)


class _Counted(Protocol):
    counted: bool


class TransferCounters:
    """Transfers started and ended (by outcome, with latencies), and lookups; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.stores = self.loads = self.failed = self.cancelled = 0
        self.bytes_stored = self.bytes_loaded = self.bytes_stored_partially = 0
        self.lookups = self.lookup_hits = 0
        self.keys_loaded_from_host = self.keys_loaded_from_disk = 0
        self._latency: dict[tuple[str, str], tuple[_Histogram, _Histogram, _Histogram]] = {}
        """(kind, outcome) -> histograms of the queue, copy and total phases."""

    def started(self, plan: _Counted) -> None:
        """Count ``plan``'s transfer in flight, and mark it counted in the same step (an interrupt
        right after leaves both or neither)."""
        with self.lock:
            self.in_flight += 1
            plan.counted = True

    def looked_up(self, hits: int) -> None:
        with self.lock:
            self.lookups += 1
            self.lookup_hits += hits

    def ended(
        self, kind: Literal["store", "load"], result: TransferResult | None, failed: bool, cancelled: bool, *,
        started: float, taken: float | None, now: float, partial_bytes: int = 0, from_disk: int = 0, counted: bool = True,
    ) -> None:
        """Count a transfer's end. Runs before the transfer is finished, so a waiter that wakes
        already sees it counted. ``taken``: when a worker took it (None: it never started);
        ``counted``: whether :meth:`started` counted it in flight."""
        outcome = "cancelled" if cancelled else "failed" if failed or result is None else "done"
        taken = started if taken is None else taken
        with self.lock:
            self.in_flight -= counted
            if outcome == "cancelled":
                self.cancelled += 1
            elif outcome == "failed":
                self.failed += 1
            elif result is not None and kind == "store":
                self.stores += 1
                self.bytes_stored += result.nbytes
            elif result is not None:
                self.loads += 1
                self.bytes_loaded += result.nbytes
                self.keys_loaded_from_disk += from_disk
                self.keys_loaded_from_host += len(result.keys) - from_disk
            self.bytes_stored_partially += partial_bytes
            phases = self._latency.get((kind, outcome))
            if phases is None:
                phases = self._latency[(kind, outcome)] = (_Histogram(), _Histogram(), _Histogram())
            for h, seconds in zip(phases, (max(taken - started, 0.0), max(now - taken, 0.0), max(now - started, 0.0))):
                h.counts[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1  # observed here: no call per phase
                h.sum += seconds
                h.count += 1

    def latency(self) -> dict[tuple[str, str, str], LatencyHistogram]:
        """Snapshots of every histogram observed so far; call with :attr:`lock` held."""
        return {
            (kind, outcome, phase): h.snapshot()
            for (kind, outcome), hs in self._latency.items()
            for phase, h in zip(("queue", "copy", "total"), hs)
        }
