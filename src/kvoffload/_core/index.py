"""Key -> location index over the tiers, with LRU order, pins, and slot allocation.

Thread-safe: the facade reserves and pins from the caller's thread, the worker
loops publish, spill and release from theirs. One lock guards everything; no IO
or copy ever happens under it.

An :class:`Entry` lives in one tier (``HOST`` or ``DISK``) at one slot. It is
*pending* while a store fills its slot (invisible to ``lookup`` and ``load``)
and *ready* once all of its bytes are in place. Loads *pin* the copy they read;
pinned and pending entries are never evicted. When the host tier needs room and
a disk tier exists, least-recently-used host entries are *spilled*: they stay
visible and loadable from host memory while their bytes are written to a disk
slot, and switch to the disk slot in one step when the write is complete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import CapacityError, MissingKeysError

__all__ = ["HOST", "DISK", "Entry", "Spill", "Reservation", "BlockIndex", "SlotPool"]

HOST, DISK = 0, 1
TIER_NAMES = ("host", "disk")


class SlotPool:
    """Free slot numbers of one tier; hands out low numbers first so fresh stores are contiguous."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, slot: int) -> None:
        self._free.append(slot)


@dataclass(eq=False)
class Entry:
    """Where one key's block lives."""

    key: Hashable
    tier: int
    slot: int
    ready: bool = False
    pins: list[int] = field(default_factory=lambda: [0, 0])
    """Running loads reading this entry's copy in each tier."""
    spill_slot: int | None = None
    """Disk slot being written while the entry is spilled out of host memory."""
    orphan_host_slot: int | None = None
    """The host slot this entry was spilled from, given up by a store that did not finish while
    loads still read it; freed when the last of those loads lets go."""
    gone: bool = False
    """Removed from the index (discarded or dropped); slots are freed when the last user lets go."""


@dataclass(eq=False)
class Spill:
    """Move ``entry`` from its host slot to ``disk_slot``; the host slot then goes to a new entry."""

    entry: Entry
    host_slot: int
    disk_slot: int
    done: bool = False
    failed: bool = False


@dataclass
class Reservation:
    """What :meth:`BlockIndex.reserve` set aside for one store."""

    entries: list[Entry]
    skipped: list[Hashable]
    spills: list[Spill]
    """Host slots of these entries go to the new entries once written to disk (and unpinned)."""


class BlockIndex:
    """One index over the host and disk tiers."""

    def __init__(self, host_slots: int, disk_slots: int) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, Entry] = {}
        # ready entries per tier, least recently used first
        self._lru: tuple[OrderedDict[Hashable, Entry], OrderedDict[Hashable, Entry]] = (OrderedDict(), OrderedDict())
        self._pools = (SlotPool(host_slots), SlotPool(disk_slots))
        self.evicted = 0
        self.spilled = 0

    @property
    def store_tier(self) -> int:
        """Where stores write: host memory if it has slots, else disk."""
        return HOST if self._pools[HOST].size else DISK

    # -- queries ------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are ready (in any tier)."""
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or not e.ready:
                    break
                n += 1
        return n

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.ready

    def counts(self) -> dict[str, int]:
        """Snapshot of slot use per tier and of entry states."""
        with self._lock:
            ready = [len(lru) for lru in self._lru]
            return {
                "host_slots": self._pools[HOST].size,
                "host_free": len(self._pools[HOST]),
                "disk_slots": self._pools[DISK].size,
                "disk_free": len(self._pools[DISK]),
                "host_ready": ready[HOST],
                "disk_ready": ready[DISK],
                "pending": len(self._entries) - sum(ready),
                "pinned": sum(1 for e in self._entries.values() if e.pins[HOST] or e.pins[DISK]),
                "spilling": sum(1 for e in self._entries.values() if e.spill_slot is not None),
                "evicted": self.evicted,
                "spilled": self.spilled,
            }

    # -- store side ---------------------------------------------------------------

    def reserve(self, keys: Iterable[Hashable]) -> Reservation:
        """Reserve one slot in the store tier per new key, making room as needed.

        Keys already present (ready or pending) are skipped. Room comes from
        free slots, then from least-recently-used ready entries that no load
        pins: spilled to disk when the store tier is host memory and the disk
        has (or can make) room, dropped otherwise. Raises :class:`CapacityError`,
        with nothing reserved, spilled or dropped, when too few slots can be had.
        """
        with self._lock:
            new_keys: list[Hashable] = []
            skipped: list[Hashable] = []
            for key in keys:
                (skipped if key in self._entries else new_keys).append(key)
            tier = self.store_tier
            pool = self._pools[tier]
            shortfall = len(new_keys) - len(pool)
            victims: list[Entry] = []
            if shortfall > 0:
                victims = self._evictable(tier, shortfall)
                if len(victims) < shortfall:
                    raise CapacityError(
                        f"need {len(new_keys)} free {TIER_NAMES[tier]} slots: {len(pool)} free and only "
                        f"{len(victims)} evictable of {pool.size}; the rest are in use by running transfers"
                    )
            spills: list[Spill] = []
            for v in victims:
                disk_slot = self._disk_slot_for_spill(v) if tier == HOST else None
                if disk_slot is None:
                    self._drop(v)  # its slot goes back to the pool
                else:
                    v.spill_slot = disk_slot
                    spills.append(Spill(v, v.slot, disk_slot))
            # Spilled host slots are handed to the last new entries; the store writes them last.
            free_first = [pool.take() for _ in range(len(new_keys) - len(spills))]
            slots = free_first + [s.host_slot for s in spills]
            entries = []
            for key, slot in zip(new_keys, slots):
                e = Entry(key, tier, slot)
                self._entries[key] = e
                entries.append(e)
            return Reservation(entries, skipped, spills)

    def _evictable(self, tier: int, n: int) -> list[Entry]:
        out = []
        for e in self._lru[tier].values():
            if len(out) == n:
                break
            if not e.pins[tier] and e.spill_slot is None:
                out.append(e)
        return out

    def _disk_slot_for_spill(self, victim: Entry) -> int | None:
        disk = self._pools[DISK]
        if len(disk):
            return disk.take()
        for old in self._evictable(DISK, 1):  # make room on disk by dropping its oldest entry
            self._drop(old)
            return disk.take()
        return None

    def _drop(self, e: Entry) -> None:
        """Evict a ready, unpinned entry and free its slot."""
        self._remove(e)
        self._pools[e.tier].give(e.slot)
        self.evicted += 1

    def spill_done(self, spill: Spill) -> None:
        """The entry's bytes are on disk: readers now find it there."""
        with self._lock:
            e = spill.entry
            spill.done = True
            e.spill_slot = None
            self.spilled += 1
            if e.gone:  # discarded while it was being written
                self._pools[DISK].give(spill.disk_slot)
                return
            self._lru[HOST].pop(e.key, None)
            e.tier, e.slot = DISK, spill.disk_slot
            self._lru[DISK][e.key] = e

    def spill_failed(self, spill: Spill) -> None:
        """The disk write failed: the entry stays in host memory, the disk slot is freed."""
        with self._lock:
            if spill.done or spill.failed:
                return
            spill.failed = True
            e = spill.entry
            e.spill_slot = None
            self._pools[DISK].give(spill.disk_slot)
            if e.gone and not e.pins[HOST]:  # discarded meanwhile: nobody owns the host slot now
                self._pools[HOST].give(e.slot)

    def host_readers(self, spill: Spill) -> int:
        """Loads still reading the spilled entry's old host copy."""
        with self._lock:
            return spill.entry.pins[HOST]

    def publish(self, entries: Iterable[Entry]) -> None:
        """Make fully written entries visible (most recently used)."""
        with self._lock:
            for e in entries:
                if e.gone:  # discarded while it was being written
                    self._pools[e.tier].give(e.slot)
                    continue
                e.ready = True
                self._lru[e.tier][e.key] = e

    def abort(self, entries: Iterable[Entry], spills: Sequence[Spill]) -> None:
        """Drop pending entries whose store did not finish.

        A slot borrowed from a spill that did not complete still belongs to the
        spilled entry and is not freed.
        """
        with self._lock:
            still_owned = {s.host_slot for s in spills if not s.done}
            still_read = {s.host_slot: s.entry for s in spills if s.done and s.entry.pins[HOST]}
            for e in entries:
                if not e.gone and self._entries.get(e.key) is e:
                    del self._entries[e.key]
                e.gone = True
                if e.tier == HOST and e.slot in still_owned:
                    continue
                if e.tier == HOST and e.slot in still_read:  # a load still reads the old copy there
                    still_read[e.slot].orphan_host_slot = e.slot
                    continue
                self._pools[e.tier].give(e.slot)

    # -- load side ------------------------------------------------------------------

    def pin(self, keys: Sequence[Hashable]) -> list[tuple[Entry, int, int]]:
        """Pin the current copy of each key for a load: ``(entry, tier, slot)``, most recently used.

        Raises :class:`MissingKeysError`, pinning nothing, if any key is not ready.
        """
        with self._lock:
            found = [self._entries.get(k) for k in keys]
            missing = [k for k, e in zip(keys, found) if e is None or not e.ready]
            if missing:
                raise MissingKeysError(missing)
            out = []
            for e in found:
                assert e is not None
                e.pins[e.tier] += 1
                self._lru[e.tier].move_to_end(e.key)
                out.append((e, e.tier, e.slot))
            return out

    def unpin(self, pinned: Iterable[tuple[Entry, int, int]]) -> None:
        """Release pins taken by :meth:`pin`."""
        with self._lock:
            for e, tier, slot in pinned:
                e.pins[tier] -= 1
                if e.gone and e.pins[tier] == 0 and e.tier == tier and e.spill_slot is None:
                    self._pools[tier].give(slot)
                if tier == HOST and e.pins[HOST] == 0 and e.orphan_host_slot is not None:
                    self._pools[HOST].give(e.orphan_host_slot)
                    e.orphan_host_slot = None

    # -- removal --------------------------------------------------------------------

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget keys (ready or pending); returns how many were present."""
        keys = list(keys)
        for key in keys:
            hash(key)  # TypeError for an unhashable key before anything is forgotten
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    continue
                n += 1
                self._remove(e)
                e.gone = True
                # Free now only what nobody uses: a pending slot is freed by its
                # store, a pinned one at the last unpin, a spilling one when the
                # spill ends (its host slot then belongs to the spilling store).
                if e.ready and not e.pins[e.tier] and e.spill_slot is None:
                    self._pools[e.tier].give(e.slot)
        return n

    def _remove(self, e: Entry) -> None:
        del self._entries[e.key]
        self._lru[e.tier].pop(e.key, None)
