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

    def observe(self, seconds: list[float]) -> None:
        """Count each of ``seconds`` in its bucket, the first whose bound it does not exceed (a negative
        one counts as 0): sorted here, then one bisection per bucket bound."""
        seconds.sort()
        counts, right, below = self.counts, bisect.bisect_right, 0
        negative = bisect.bisect_left(seconds, 0.0)
        for i, bound in enumerate(LATENCY_BOUNDS):  # bucket i: bound i-1 < x <= bound i (bisect_left's)
            upto = right(seconds, bound, below)
            counts[i] += upto - below
            below = upto
        counts[-1] += len(seconds) - below
        self.sum += sum(seconds[negative:]) if negative else sum(seconds)
        self.count += len(seconds)

    def copy(self) -> _Histogram:
        h = _Histogram()
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h

    def snapshot(self) -> LatencyHistogram:
        return LatencyHistogram(LATENCY_BOUNDS, tuple(self.counts), self.sum, self.count)


class _Counted(Protocol):
    counted: bool


EndRecord = tuple[Literal["store", "load"], "TransferResult | None", bool, bool, float, "float | None", float, int, int, bool]
"""One transfer's end, as :meth:`TransferCounters.ended` takes it: (kind, result, failed, cancelled,
started, taken, now, partial_bytes, from_disk, counted). ``taken``: when a worker took it (None: it
never started); ``counted``: whether :meth:`TransferCounters.started` counted it in flight."""

FOLD_AT = 256
"""Ends waiting at which the end that adds one counts them all (:meth:`TransferCounters.fold`)."""


class EndTotals:
    """What the transfers' ends counted (:meth:`TransferCounters.fold` makes each anew)."""

    __slots__ = ("ended_in_flight", "stores", "loads", "failed", "cancelled", "bytes_stored", "bytes_loaded",
                 "bytes_stored_partially", "keys_loaded_from_host", "keys_loaded_from_disk", "latency")

    def __init__(self) -> None:
        self.ended_in_flight = self.stores = self.loads = self.failed = self.cancelled = 0
        """``ended_in_flight``: ends of transfers that were counted in flight."""
        self.bytes_stored = self.bytes_loaded = self.bytes_stored_partially = 0
        self.keys_loaded_from_host = self.keys_loaded_from_disk = 0
        self.latency: dict[tuple[str, str], tuple[_Histogram, _Histogram, _Histogram]] = {}
        """(kind, outcome) -> histograms of the queue, copy and total phases."""

    def plus(self, ends: list[EndRecord]) -> EndTotals:
        """These totals with ``ends`` counted too: a new record (this one is left as it is). The ends are
        grouped by kind and outcome, and each group's phases counted into their histograms sorted, by
        one bisection per bucket bound (:meth:`_Histogram.observe`): a fold of 256 ends takes about
        a quarter of the time of one observation per end and phase (it runs in the thread whose end
        completes the batch)."""
        t = EndTotals()
        for name in EndTotals.__slots__[:-1]:
            setattr(t, name, getattr(self, name))
        t.latency = {k: (a.copy(), b.copy(), c.copy()) for k, (a, b, c) in self.latency.items()}
        groups: dict[tuple[str, str], list[EndRecord]] = {}
        for e in ends:
            key = (e[0], "cancelled" if e[3] else "failed" if e[2] or e[1] is None else "done")
            group = groups.get(key)
            if group is None:
                groups[key] = [e]
            else:
                group.append(e)
        t.ended_in_flight += sum([e[9] for e in ends])
        t.bytes_stored_partially += sum([e[7] for e in ends])
        for (kind, outcome), group in groups.items():
            if outcome == "cancelled":
                t.cancelled += len(group)
            elif outcome == "failed":
                t.failed += len(group)
            else:  # done: every end of the group has a result
                results = [e[1] for e in group if e[1] is not None]
                nbytes = sum([r.nbytes for r in results])
                if kind == "store":
                    t.stores += len(group)
                    t.bytes_stored += nbytes
                else:
                    t.loads += len(group)
                    t.bytes_loaded += nbytes
                    from_disk = sum([e[8] for e in group])
                    t.keys_loaded_from_disk += from_disk
                    t.keys_loaded_from_host += sum([len(r.keys) for r in results]) - from_disk
            phases = t.latency.get((kind, outcome))
            if phases is None:
                phases = t.latency[(kind, outcome)] = (_Histogram(), _Histogram(), _Histogram())
            taken = [e[4] if e[5] is None else e[5] for e in group]  # never taken: no time queued
            queued = [k - e[4] for k, e in zip(taken, group)]
            copying = [e[6] - k for k, e in zip(taken, group)]
            total = [e[6] - e[4] for e in group]
            for h, seconds in zip(phases, (queued, copying, total)):
                h.observe(seconds)
        return t


class TransferCounters:
    """Transfers started and ended (by outcome, with latencies), and lookups; thread-safe.

    A transfer's end is counted lazily, so that it costs the end one append and no lock: its record
    waits in a list until :meth:`fold` counts every record waiting, which each reader calls first (as
    does an end that finds :data:`FOLD_AT` waiting). An interrupt (a signal handler's
    ``KeyboardInterrupt``) anywhere loses or doubles no end: the totals with a batch counted replace
    the old ones in one step, naming the batch's last record, and the next fold drops what that
    names first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started_in_flight = 0
        """Transfers counted in flight by :meth:`started`; ``in_flight`` is this less the ones that ended."""
        self.lookups = self.lookup_hits = 0
        self._ends: list[EndRecord] = []
        """Ends not counted yet, oldest first (appends from any thread; only :meth:`fold` takes from it)."""
        self._folded: tuple[EndTotals, EndRecord | None] = (EndTotals(), None)
        """The totals, and the last record they count while it may still be in :attr:`_ends`: set together, in one step."""

    @property
    def totals(self) -> EndTotals:
        """What the ends folded so far counted: read under :attr:`lock`, after :meth:`fold`."""
        return self._folded[0]

    @property
    def in_flight(self) -> int:
        """Transfers started and not ended (as of the last :meth:`fold`)."""
        return self.started_in_flight - self.totals.ended_in_flight

    def started(self, plan: _Counted) -> None:
        """Count ``plan``'s transfer in flight, and mark it counted in the same step (an interrupt
        right after leaves both or neither)."""
        with self.lock:
            self.started_in_flight += 1
            plan.counted = True

    def looked_up(self, hits: int) -> None:
        with self.lock:
            self.lookups += 1
            self.lookup_hits += hits

    def ended(self, record: EndRecord) -> None:
        """Count a transfer's end (by the next :meth:`fold`). Runs before the transfer is finished,
        so a waiter that wakes and reads the counters already sees it counted."""
        ends = self._ends
        ends.append(record)
        if len(ends) >= FOLD_AT:
            with self.lock:
                self.fold()

    def fold(self) -> None:
        """Count every end waiting (call with :attr:`lock` held)."""
        ends = self._ends
        totals, last = self._folded
        if last is not None:  # counted by the last fold, and maybe not dropped yet (an interrupt came between)
            for i, record in enumerate(ends):
                if record is last:
                    del ends[: i + 1]
                    break
            self._folded = (totals, None)
        n = len(ends)
        if n:
            batch = ends[:n]
            self._folded = (totals.plus(batch), batch[-1])  # one step: counted, and what it counted named
            del ends[:n]
            self._folded = (self._folded[0], None)

    def latency(self) -> dict[tuple[str, str, str], LatencyHistogram]:
        """Snapshots of every histogram observed so far; call with :attr:`lock` held, after :meth:`fold`."""
        return {
            (kind, outcome, phase): h.snapshot()
            for (kind, outcome), hs in self.totals.latency.items()
            for phase, h in zip(("queue", "copy", "total"), hs)
        }
