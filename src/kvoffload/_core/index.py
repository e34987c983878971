"""Key -> location index over the tiers: entry states, slot ownership, LRU order, readers.

Thread-safe: the facade reserves and pins from the caller's thread, the worker
loops publish, spill and release from theirs. One lock guards everything; no IO,
no copy and no caller code (iterables, callbacks) ever runs under it.

Entries
    Each key present has one :class:`Entry` in exactly one :class:`State`::

        PENDING  --publish-->  READY  --spill starts-->  SPILLING  --spill done-->  READY (on disk)
           |                     |                           |      --spill failed-> READY (on host)
           +--abort/discard--> GONE <--discard/evict---------+--discard--> GONE

    PENDING: a store is writing its slot; invisible. READY: visible, loads read
    its slot. SPILLING: visible and loadable from its host slot while a store
    writes its bytes to a disk slot. GONE: out of the index (discarded,
    evicted, or its store did not finish); what it still holds is released by
    whoever holds it. docs/design.md has the full table.

Slots
    Every slot of a tier is either free (in the pool) or owned by exactly one
    entry; any slot may also have *readers* (running loads). A slot goes back to
    the pool in one place, :meth:`BlockIndex._release`, and only once it has
    neither owner nor readers. A spilled entry's host slot changes owner in one
    step when its bytes are on disk: it becomes the slot of the store's new
    entry (the *heir*), which writes it only after its last reader is gone
    (:meth:`BlockIndex.when_unread`).
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .errors import CapacityError, MissingKeysError

__all__ = ["BlockIndex", "Reservation", "Spill", "Pin"]

HOST, DISK = 0, 1
TIER_NAMES = ("host", "disk")


class State(enum.Enum):
    """Where an entry is in its life (see the module docstring)."""

    PENDING = "pending"
    READY = "ready"
    SPILLING = "spilling"
    GONE = "gone"


@dataclass(eq=False, slots=True)
class Entry:
    """One key's block: its state, and the tier and slot where loads find it."""

    key: Hashable
    state: State
    tier: int
    slot: int
    loads: int = 0
    """Running loads that pinned this entry (for ``stats().pinned``)."""


@dataclass(eq=False, slots=True)
class Spill:
    """Move ``victim`` from ``host_slot`` to ``disk_slot``; ``host_slot`` then belongs to ``heir``."""

    victim: Entry
    heir: Entry
    host_slot: int
    disk_slot: int
    ended: bool = False


@dataclass(eq=False)
class Pin:
    """A load's hold on one entry's copy: the slot it reads."""

    entry: Entry
    tier: int
    slot: int


@dataclass
class Reservation:
    """What :meth:`BlockIndex.reserve` set aside for one store."""

    entries: list[Entry]
    skipped: list[Hashable]
    spills: list[Spill]
    """Spills the store must write before it writes their heirs' slots (heirs come last in ``entries``)."""


@dataclass
class _Tier:
    """Slot ownership of one tier."""

    size: int
    owner: list[Entry | None] = field(init=False)
    readers: list[int] = field(init=False)
    free: list[int] = field(init=False)
    lru: OrderedDict[Hashable, Entry] = field(default_factory=OrderedDict)
    """READY and SPILLING entries whose current copy is in this tier, least recently used first."""

    def __post_init__(self) -> None:
        self.owner = [None] * self.size
        self.readers = [0] * self.size
        self.free = list(range(self.size - 1, -1, -1))  # low numbers first: fresh stores are contiguous

    def take(self, entry: Entry) -> int:
        slot = self.free.pop()
        self.owner[slot] = entry
        return slot

    def take_in_order(self, entries: list[Entry]) -> None:
        """Give each of ``entries`` a free slot, in ascending order: consecutive slots make one copy
        descriptor per run (slots freed in some order, say by a discard, are taken back sorted)."""
        if not entries:
            return
        slots = sorted(self.free[-len(entries):])
        del self.free[-len(entries):]
        for e, slot in zip(entries, slots):
            self.owner[slot] = e
            e.slot = slot


class BlockIndex:
    """One index over the host and disk tiers."""

    def __init__(self, host_slots: int, disk_slots: int) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, Entry] = {}
        self._tiers = (_Tier(host_slots), _Tier(disk_slots))
        self._unread_waiters: dict[int, list[Callable[[], object]]] = {}
        """Host slot -> callbacks to run once it has no readers (heirs waiting to write)."""
        self.evicted = 0
        self.evicted_by_tier = [0, 0]
        self.spilled = 0

    @property
    def store_tier(self) -> int:
        """Where stores write: host memory if it has slots, else disk."""
        return HOST if self._tiers[HOST].size else DISK

    # -- queries ------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are visible (in any tier)."""
        keys = list(keys)  # the caller's iterable runs here, not under the lock
        n = 0
        with self._lock:
            for key in keys:
                if not self._visible(self._entries.get(key)):
                    break
                n += 1
        return n

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return self._visible(self._entries.get(key))

    @staticmethod
    def _visible(e: Entry | None) -> bool:
        return e is not None and e.state in (State.READY, State.SPILLING)

    def counts(self) -> dict[str, int]:
        """Snapshot of slot use per tier and of entry states."""
        with self._lock:
            host, disk = self._tiers
            states = [e.state for e in self._entries.values()]
            return {
                "host_slots": host.size,
                "host_free": len(host.free),
                "disk_slots": disk.size,
                "disk_free": len(disk.free),
                "host_ready": len(host.lru),
                "disk_ready": len(disk.lru),
                "pending": states.count(State.PENDING),
                "pinned": sum(1 for e in self._entries.values() if e.loads),
                "spilling": states.count(State.SPILLING),
                "evicted": self.evicted,
                "evicted_host": self.evicted_by_tier[HOST],
                "evicted_disk": self.evicted_by_tier[DISK],
                "spilled": self.spilled,
            }

    def check(self) -> None:
        """Assert every invariant of the slot and entry states (tests call this)."""
        with self._lock:
            for t, tier in enumerate(self._tiers):
                free = set(tier.free)
                assert len(free) == len(tier.free), f"{TIER_NAMES[t]}: a slot is free twice: {sorted(tier.free)}"
                for s in free:
                    assert tier.owner[s] is None and not tier.readers[s], f"{TIER_NAMES[t]} slot {s} is free but in use"
                for s in range(tier.size):
                    assert tier.readers[s] >= 0
                    if s not in free:
                        assert tier.owner[s] is not None or tier.readers[s], f"{TIER_NAMES[t]} slot {s} is lost"
                for key, e in tier.lru.items():
                    assert self._entries.get(key) is e and e.tier == t and e.state in (State.READY, State.SPILLING)
                    assert tier.owner[e.slot] is e, f"{key!r} reads {TIER_NAMES[t]} slot {e.slot} it does not own"
            for key, e in self._entries.items():
                assert e.key == key and e.state is not State.GONE
                if e.state is State.PENDING:
                    assert key not in self._tiers[e.tier].lru
                else:
                    assert key in self._tiers[e.tier].lru

    # -- store side ---------------------------------------------------------------

    def reserve(self, keys: Iterable[Hashable]) -> Reservation:
        """Reserve one slot in the store tier per new key, making room as needed.

        Keys already present (in any state but GONE) are skipped. Room comes
        from free slots, then from least-recently-used READY entries that no load
        reads: spilled to disk when the store tier is host memory and the disk
        has (or can make) room, evicted otherwise. Raises :class:`CapacityError`,
        with nothing reserved, spilled or evicted, when too few slots can be had.
        """
        keys = list(keys)
        with self._lock:
            new_keys: list[Hashable] = []
            skipped: list[Hashable] = []
            seen: set[Hashable] = set()
            for key in keys:
                if key in self._entries or key in seen:
                    skipped.append(key)
                else:
                    seen.add(key)
                    new_keys.append(key)
            t = self.store_tier
            tier = self._tiers[t]
            shortfall = len(new_keys) - len(tier.free)
            victims: list[Entry] = []
            if shortfall > 0:
                victims = self._evictable(t, shortfall)
                if len(victims) < shortfall:
                    raise CapacityError(
                        f"need {len(new_keys)} free {TIER_NAMES[t]} slots: {len(tier.free)} free and only "
                        f"{len(victims)} evictable of {tier.size}; the rest are in use by running transfers"
                    )
            to_spill: list[tuple[Entry, int]] = []
            for v in victims:
                disk_slot = self._disk_slot_for_spill(v) if t == HOST else None
                if disk_slot is None:
                    self._evict(v)
                else:
                    to_spill.append((v, disk_slot))
            # Free slots first; the spilled host slots go to the last new entries, which the store writes last.
            entries = [Entry(key, State.PENDING, t, -1) for key in new_keys]
            n_free = len(entries) - len(to_spill)
            tier.take_in_order(entries[:n_free])
            spills = []
            for e, (v, disk_slot) in zip(entries[n_free:], to_spill):
                v.state = State.SPILLING
                e.slot = v.slot  # owned by the victim until its bytes are on disk
                spills.append(Spill(v, e, v.slot, disk_slot))
            for e in entries:
                self._entries[e.key] = e
            return Reservation(entries, skipped, spills)

    def _evictable(self, t: int, n: int) -> list[Entry]:
        out: list[Entry] = []
        tier = self._tiers[t]
        for e in tier.lru.values():
            if len(out) == n:
                break
            if e.state is State.READY and not tier.readers[e.slot]:
                out.append(e)
        return out

    def _disk_slot_for_spill(self, victim: Entry) -> int | None:
        disk = self._tiers[DISK]
        if not disk.free:
            old = self._evictable(DISK, 1)  # make room on disk by evicting its oldest entry
            if not old:
                return None
            self._evict(old[0])
        return disk.take(victim)

    def _evict(self, e: Entry) -> None:
        """READY -> GONE to make room; its slot is free at once (nobody reads it)."""
        self._forget(e)
        self._release(e.tier, e.slot, e)
        self.evicted += 1
        self.evicted_by_tier[e.tier] += 1

    def spill_done(self, spill: Spill) -> None:
        """The victim's bytes are on disk: loads now find it there; its host slot becomes the heir's."""
        with self._lock:
            if spill.ended:
                return
            spill.ended = True
            v, host, disk = spill.victim, self._tiers[HOST], self._tiers[DISK]
            self.spilled += 1
            if v.state is State.SPILLING:
                host.lru.pop(v.key)
                v.state, v.tier, v.slot = State.READY, DISK, spill.disk_slot
                disk.lru[v.key] = v
            else:  # discarded while its bytes were written: the disk copy is not needed
                self._release(DISK, spill.disk_slot, v)
            assert host.owner[spill.host_slot] is v
            host.owner[spill.host_slot] = spill.heir

    def spill_failed(self, spill: Spill) -> None:
        """The write failed or was never made: the victim stays in host memory, the disk slot is freed."""
        with self._lock:
            if spill.ended:
                return
            spill.ended = True
            v = spill.victim
            self._release(DISK, spill.disk_slot, v)
            if v.state is State.SPILLING:
                v.state = State.READY
            else:  # discarded meanwhile: nobody wants the host copy either
                self._release(HOST, spill.host_slot, v)

    def when_unread(self, slot: int, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once host ``slot`` has no readers: now, or from the last :meth:`unpin`."""
        with self._lock:
            if self._tiers[HOST].readers[slot]:
                self._unread_waiters.setdefault(slot, []).append(callback)
                return
        callback()

    def publish(self, entries: Iterable[Entry]) -> None:
        """PENDING -> READY for fully written entries (most recently used); a GONE one frees its slot."""
        with self._lock:
            for e in entries:
                if e.state is State.PENDING:
                    e.state = State.READY
                    self._tiers[e.tier].lru[e.key] = e
                else:  # discarded while its store ran
                    self._release(e.tier, e.slot, e)

    def abort(self, entries: Iterable[Entry]) -> None:
        """Entries whose store did not finish -> GONE, releasing the slots they own.

        Call after every spill of the store ended (:meth:`spill_failed` on the
        unfinished ones): a heir whose spill failed owns no slot and frees nothing.
        """
        with self._lock:
            for e in entries:
                if e.state is State.PENDING:
                    self._forget(e)
                self._release(e.tier, e.slot, e)

    # -- load side ------------------------------------------------------------------

    def pin(self, keys: Sequence[Hashable]) -> list[Pin]:
        """Pin the current copy of each key for a load (each becomes most recently used).

        Raises :class:`MissingKeysError`, pinning nothing, if any key is not visible.
        """
        with self._lock:
            found = [self._entries.get(k) for k in keys]
            missing = [k for k, e in zip(keys, found) if not self._visible(e)]
            if missing:
                raise MissingKeysError(missing)
            pins = []
            for e in found:
                assert e is not None
                tier = self._tiers[e.tier]
                tier.readers[e.slot] += 1
                e.loads += 1
                tier.lru.move_to_end(e.key)
                pins.append(Pin(e, e.tier, e.slot))
            return pins

    def unpin(self, pins: Iterable[Pin]) -> None:
        """Release pins taken by :meth:`pin`."""
        ready: list[Callable[[], object]] = []
        with self._lock:
            for p in pins:
                tier = self._tiers[p.tier]
                tier.readers[p.slot] -= 1
                p.entry.loads -= 1
                if not tier.readers[p.slot]:
                    self._release(p.tier, p.slot, None)
                    if p.tier == HOST:
                        ready += self._unread_waiters.pop(p.slot, [])
        for callback in ready:
            callback()

    # -- removal --------------------------------------------------------------------

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget keys (in any state); returns how many were present.

        A READY entry's slot is released at once (freed when no load reads it);
        a PENDING or SPILLING entry's slots are released when its store ends.
        """
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
                state = e.state
                self._forget(e)
                if state is State.READY:
                    self._release(e.tier, e.slot, e)
        return n

    def _forget(self, e: Entry) -> None:
        """Take ``e`` out of the index: -> GONE."""
        del self._entries[e.key]
        self._tiers[e.tier].lru.pop(e.key, None)
        e.state = State.GONE

    def _release(self, t: int, slot: int, owner: Entry | None) -> None:
        """``owner`` lets go of ``slot`` (None: a reader let go); the slot is free once unowned and unread.

        The only place a slot returns to the pool. Letting go of a slot one does
        not own does nothing, so each holder may release what it holds without
        knowing who else does.
        """
        tier = self._tiers[t]
        if owner is not None:
            if tier.owner[slot] is not owner:
                return
            tier.owner[slot] = None
        if tier.owner[slot] is None and not tier.readers[slot]:
            tier.free.append(slot)
