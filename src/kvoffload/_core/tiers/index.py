"""Key -> location index over the tiers: entry states, slot ownership, LRU order, readers.

Thread-safe: the facade reserves and pins from the caller's thread, the worker
loops publish, spill and release from theirs. One lock guards everything; no IO,
no copy and no caller code ever runs under it. Keys are native (``base/keys.py``;
the facade checks them): hashed and compared by the interpreter's own code, each
is found by one dict lookup under the lock (``1`` and ``True`` are one key).

Entries
    Each key present has one :class:`~.entries.Entry` in exactly one :class:`~.entries.State`::

        PENDING  --publish-->  READY  --spill starts-->  SPILLING  --spill done-->  READY (on disk)
           |                     |                           |      --spill failed-> READY (on host)
           +--abort/discard--> GONE <--discard/evict---------+--discard--> GONE

    PENDING: a store is writing its slot; invisible. READY: visible, loads read
    its slot. SPILLING: visible and loadable from its host slot while a store
    writes its bytes to a disk slot. GONE: out of the index (discarded,
    evicted, or its store did not finish); what it still holds is released by
    whoever holds it. docs/design.md has the full table.

    A READY entry is in one of three places; promotion (a load of a disk-resident
    entry given a free host slot, :meth:`BlockIndex.pin`) and room-making move it::

        READY (on disk)  --promotion done-->  READY (on host, clean disk copy)  --disk room: copy dropped-->  READY (on host)
              ^                                            |
              +-------------- host room: host copy dropped, nothing written -+

    On host with a clean disk copy: its current copy is its host slot (loads read
    it), and it still owns the disk slot it was promoted from (``Entry.clean_slot``),
    whose bytes are its own, unchanged. When host memory needs room and it is the
    victim, it goes back to that slot at once: no write, neither spilled nor
    evicted. When the disk needs room, clean copies go first (the oldest
    promotion first), before any disk entry is evicted; the entry stays in host
    memory. A discard frees both slots. Only a READY host entry has a clean copy.

Slots
    Every slot of a tier is either free (in the pool) or owned by exactly one
    entry; any slot may also have *readers* (running loads). A slot goes back to
    the pool in one place, :meth:`BlockIndex._release`, and only once it has
    neither owner nor readers. A spilled entry's host slot changes owner in one
    step when its bytes are on disk: it becomes the slot of the store's new
    entry (the *heir*), which writes it only after its last reader is gone
    (:meth:`BlockIndex.when_unread`). An entry owns at most one slot per tier:
    its current copy's, plus on disk a clean copy (``Entry.clean_slot``) or, while
    SPILLING, its spill's destination.

    A promoting load takes a free host slot as a reader with no owner
    (:attr:`Pin.promote_slot`). Until the load starts reading into it
    (:meth:`BlockIndex.start_promotion`), a store that needs host room takes it
    back before anything else (the load then reads that key the plain way): a
    promotion never makes a store spill or evict. Once started, the IO threads
    read the entry's disk slot into it, then :meth:`BlockIndex.promotion_done`
    makes it the entry's host slot if the entry is still READY on disk.
    Otherwise (discarded, or promoted by another load meanwhile) and when the
    load fails or is cancelled, the slot goes back to the pool with the load's
    last reader: one host copy per entry at most.

Holds and interrupts
    A lease (:meth:`BlockIndex.hold`) pins its hits as a load does, until it is released, a load
    takes its pins over, or its deadline passes (``holds.py``). An interrupt (a signal handler's
    ``KeyboardInterrupt``) anywhere in a step leaves slot ownership true; ``repair.py`` rebuilds the
    rest from it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from ..base.convoy_free_lock import ConvoyFreeLock
from ..base.errors import CapacityError, MissingKeysError
from .entries import DISK, HOST, TIER_NAMES, VISIBLE, Entry, State, Tier
from .index_records import Pin, find_visible, new_entries, pin_entries, publish_entries, reserve_free, unpin_pins
from .holds import Holds
from .repair import IndexRepair

StartCopies = Callable[[list[int]], Callable[[], None]]
"""``start_copies(slots)``: start a transfer's copies between its blocks and ``slots`` (host slots, in
its blocks' order) now, under the index's lock; returns what waits until they completed (called
before the slots go back, should the call that started them be cut short)."""

__all__ = ["DISK", "HOST", "BlockIndex", "Entry", "Evicted", "IndexCounts", "Pin", "Reservation", "Spill", "State"]


@dataclass(eq=False, slots=True)
class Spill:
    """Move ``victim`` from ``host_slot`` to ``disk_slot``; ``host_slot`` then belongs to ``heir``."""

    victim: Entry
    heir: Entry
    host_slot: int
    disk_slot: int
    ended: bool = False


@dataclass(frozen=True, slots=True)
class Evicted:
    """An entry a reservation evicted: its key and the slot that held its bytes (now the store's)."""

    key: Hashable
    tier: int
    slot: int


@dataclass(frozen=True, slots=True)
class IndexCounts:
    """What :meth:`BlockIndex.counts` reports: slot use and entry states now, and the index's
    counters so far (the counters never go down)."""

    host_slots: int = 0
    host_free: int = 0
    disk_slots: int = 0
    disk_free: int = 0
    host_ready: int = 0
    disk_ready: int = 0
    pending: int = 0
    host_pending: int = 0
    disk_pending: int = 0
    """``pending``, by the tier the running stores write."""
    pinned: int = 0
    """Entries pinned by running loads or held by leases."""
    spilling: int = 0
    host_promoting: int = 0
    """Host slots reserved by loads that promote disk-resident keys into them."""
    disk_clean: int = 0
    """Disk slots holding the clean copy of a host entry (promoted, or written at a persistent tier's close)."""
    evicted: int = 0
    evicted_host: int = 0
    evicted_disk: int = 0
    spilled: int = 0
    promoted: int = 0

    def retired(self) -> IndexCounts:
        """These counts once the tiers are gone: the counters kept, every slot and entry gone."""
        return IndexCounts(
            evicted=self.evicted, evicted_host=self.evicted_host, evicted_disk=self.evicted_disk,
            spilled=self.spilled, promoted=self.promoted,
        )


@dataclass
class Reservation:
    """What :meth:`BlockIndex.reserve` set aside for one store."""

    entries: list[Entry]
    skipped: list[Hashable]
    spills: list[Spill]
    """Spills the store must write before it writes their heirs' slots (heirs come last in ``entries``)."""
    to_disk: int = 0
    """How many leading ``entries`` have disk slots: all of them when the store tier is the disk; the
    first ones of a store larger than the host slots it can have (the rest, its last blocks, are in
    host slots, which it writes after these)."""
    evicted: list[Evicted] = field(default_factory=list)
    """With :attr:`BlockIndex.report_evictions`: the entries evicted to make room, whose slots keep
    their bytes until the store writes them."""


class BlockIndex:
    """One index over the host and disk tiers.

    ``promote``: a load of disk-resident entries takes free host slots for them (promotion, see the
    module docstring); never with one tier only. Keys are native (the facade checked them); an
    iterable of keys is made a list before the lock is taken: it may be the caller's code.
    """

    def __init__(self, host_slots: int, disk_slots: int, promote: bool = False) -> None:
        self._lock = ConvoyFreeLock()  # callers' threads and the workers' share it, all running Python
        self._promote = promote and host_slots > 0 and disk_slots > 0
        self._entries: dict[Hashable, Entry] = {}
        """Key -> entry, for every entry but GONE ones."""
        self._tiers = (Tier(host_slots), Tier(disk_slots))
        self._readers = tuple(t.readers for t in self._tiers)
        self._owners = tuple(t.owner for t in self._tiers)
        self._lrus = tuple(t.lru for t in self._tiers)
        """Per tier, its reader counts, owners and LRU (the same objects as the tiers'): what the compiled
        per-key steps (``index_records.c``) change."""
        self.has_disk = disk_slots > 0
        """Whether there is a disk tier (without one, no entry or pin is ever on disk)."""
        self._unread_waiters: dict[int, list[Callable[[], object]]] = {}
        """Host slot -> callbacks to run once it has no readers (heirs waiting to write)."""
        self.evicted = 0
        self.evicted_by_tier = [0, 0]
        self.spilled = 0
        self.promoted = 0
        """Entries that became host-resident by a load's promotion."""
        self._promoting = 0
        """Host slots taken by promoting loads that no entry owns yet (pins with a ``promote_slot`` not ``promoted``)."""
        self._unstarted: dict[Pin, None] = {}
        """Pins whose promotion slot no read has started into yet, oldest first: a store may take those slots back."""
        self._clean: OrderedDict[Hashable, Entry] = OrderedDict()
        """Key -> each entry with a clean disk copy, oldest promotion first: the order the disk drops them in."""
        self.holds = Holds(self._lock, self.unpin)
        """The leases' deadlines (:meth:`hold`); ``runtime.HoldExpiry`` gives expired ones back at the deadline."""
        self._repair = IndexRepair(self._entries, self._tiers, self._clean, self._unread_waiters)
        self.on_disk_slot_freed: Callable[[int], object] | None = None
        """Called under the lock with each disk slot that goes back to the pool (a persistent tier voids
        its header): it must take no lock but its own and run no caller code."""
        self.report_evictions = False
        """List the entries each reservation evicts in :attr:`Reservation.evicted` (write on eviction)."""
        self._evicted: list[Evicted] | None = None
        """The evictions of the reservation being made (under the lock), when reported."""

    @property
    def store_tier(self) -> int:
        """Where stores write: host memory if it has slots, else disk."""
        return HOST if self._tiers[HOST].size else DISK

    # -- queries ------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are visible (in any tier); each of them becomes most recently used."""
        keys = list(keys)  # the caller's iterable runs here, not under the lock
        if self.holds.next_expiry <= time.monotonic():
            self.holds.expire()
        with self._lock:
            entries, tiers, n = self._entries, self._tiers, 0
            for key in keys:
                e = entries.get(key)
                if e is None or e.state not in VISIBLE:
                    break
                n += 1
                tiers[e.tier].lru.move_to_end(key)
            return n

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            e = self._entries.get(key)
            return e is not None and e.state in VISIBLE

    def counts(self) -> IndexCounts:
        """Snapshot of slot use per tier and of entry states, with the index's counters."""
        if self.holds.next_expiry <= time.monotonic():
            self.holds.expire()
        with self._lock:
            host, disk = self._tiers
            states = [e.state for e in self._entries.values()]
            pending_tiers = [e.tier for e in self._entries.values() if e.state is State.PENDING]
            return IndexCounts(
                host_slots=host.size,
                host_free=len(host.free),
                disk_slots=disk.size,
                disk_free=len(disk.free),
                host_ready=len(host.lru),
                disk_ready=len(disk.lru),
                pending=len(pending_tiers),
                host_pending=pending_tiers.count(HOST),
                disk_pending=pending_tiers.count(DISK),
                pinned=sum(1 for e in self._entries.values() if e.loads),
                spilling=states.count(State.SPILLING),
                host_promoting=self._promoting,
                disk_clean=len(self._clean),
                evicted=self.evicted,
                evicted_host=self.evicted_by_tier[HOST],
                evicted_disk=self.evicted_by_tier[DISK],
                spilled=self.spilled,
                promoted=self.promoted,
            )

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
                    assert tier.owner[e.slot] is e, f"an entry reads {TIER_NAMES[t]} slot {e.slot} it does not own"
                # Whoever owns a slot owns it as its current copy's; on disk also as its clean copy or as the
                # destination of its spill; a GONE entry keeps what it held until whoever holds it lets go.
                owned: set[int] = set()
                for s, o in enumerate(tier.owner):
                    if o is None:
                        continue
                    assert id(o) not in owned, f"an entry owns two {TIER_NAMES[t]} slots"
                    owned.add(id(o))
                    assert (
                        o.state is State.GONE or (o.tier, o.slot) == (t, s)
                        or (t == DISK and (s == o.clean_slot or o.state is State.SPILLING))
                    ), f"{TIER_NAMES[t]} slot {s} is owned by an entry that does not use it ({o.state}, {TIER_NAMES[o.tier]} slot {o.slot})"
            host, disk = self._tiers
            for key, e in self._entries.items():
                assert key is e.key and e.state is not State.GONE
                if e.state is State.PENDING:
                    assert key not in self._tiers[e.tier].lru
                else:
                    assert key in self._tiers[e.tier].lru and key not in self._tiers[1 - e.tier].lru
                if e.clean_slot >= 0:  # a clean disk copy: a READY host entry's, its bytes kept in a disk slot it owns
                    assert e.state is State.READY and e.tier == HOST, f"a clean disk copy of a {e.state} {TIER_NAMES[e.tier]} entry"
                    assert disk.owner[e.clean_slot] is e and self._clean.get(key) is e
                else:
                    assert key not in self._clean
            for key, e in self._clean.items():
                assert self._entries.get(key) is e and e.clean_slot >= 0
            # Each promoting load's host slot is taken (not free), read by the load and owned by nobody yet.
            reserved = sum(1 for s in range(host.size) if host.owner[s] is None and host.readers[s])
            assert 0 <= len(self._unstarted) <= self._promoting <= reserved, (len(self._unstarted), self._promoting, reserved)
            for p in self._unstarted:
                assert p.promote_slot >= 0 and not p.promoted and host.owner[p.promote_slot] is None

    # -- store side ---------------------------------------------------------------

    def reserve(
        self, keys: Iterable[Hashable], into: Reservation | None = None, *, staged_in_host: bool = True,
        start_copies: StartCopies | None = None,
    ) -> Reservation:
        """Reserve one slot in the store tier per new key, making room as needed.

        Keys already present (in any state but GONE) are skipped. Room comes
        from free slots, then from least-recently-used READY entries that no load
        reads: one with a clean disk copy goes back to it (nothing written);
        another is spilled to disk when the store tier is host memory and the disk
        has (or can make) room, evicted otherwise. A store larger than the host
        slots it can have (free or evictable) takes them all for its last keys and
        disk slots for its first ones (``to_disk``). Disk room is made by dropping
        clean copies (oldest promotion first), then by evicting the disk's
        least-recently-used entries. Raises :class:`CapacityError`, with
        nothing reserved, spilled or evicted, when too few slots can be had: its
        message tells a store larger than the tiers together from one refused
        because running transfers hold the slots.

        ``into`` (an empty reservation) is filled in place, in one step with the index's changes: a
        caller that an interrupt (a signal handler's ``KeyboardInterrupt``) stops anywhere finds in it
        exactly what it holds. An interrupt inside this call undoes what the call changed.

        ``staged_in_host=False``: the disk-bound blocks need no host slot on their way (a remote
        load stages them in the disk tier's bounce buffer), so they may have all of the disk slots.

        ``start_copies``: where every key is new and free host slots take them all (nothing spilled,
        evicted or skipped), called with those slots (in key order) as soon as they are taken, before
        the entries are made (about a microsecond a key), so that a large store's copies run meanwhile.
        """
        into = Reservation([], [], []) if into is None else into
        if self.holds.next_expiry <= time.monotonic():  # expired holds make room first (a look: no call while none)
            self.holds.expire()
        with self._lock:
            host = self._tiers[HOST]
            if start_copies is None and host.size and reserve_free(keys, self._entries, host.free, host.owner, State.PENDING, HOST, into):
                return into  # the usual store: every key new, free host slots for all, taken in one step
            new_keys: list[Hashable] = []
            skipped: list[Hashable] = []
            present = self._entries
            if isinstance(keys, dict) and present.keys().isdisjoint(keys):  # the usual store: every key new (at C speed)
                new_keys = list(keys)
            else:
                seen: set[Hashable] = set()
                for key in keys:
                    if key in present or key in seen:
                        skipped.append(key)
                    else:
                        seen.add(key)
                        new_keys.append(key)
            t = HOST if self._tiers[HOST].size else DISK  # store_tier, without a call
            tier = self._tiers[t]
            disk = self._tiers[DISK]
            n = len(new_keys)
            # Promotions not started yet give their host slots back first: they never cost a store anything.
            taken_back = min(max(0, n - len(tier.free)), len(self._unstarted)) if t == HOST else 0
            free = len(tier.free) + taken_back
            shortfall = n - free
            victims: list[Entry] = []
            direct = 0  # leading new keys that go to disk slots although the store tier is host memory
            if shortfall > 0:
                victims = self._evictable(t, shortfall)
                if len(victims) < shortfall:
                    # Larger than the host slots to be had: the first blocks go to disk (through the host slots
                    # that the last ones take), as long as the disk has or can make room for them.
                    host_room = free + len(victims)
                    direct = n - host_room
                    if t != HOST or not disk.size or (staged_in_host and not host_room):
                        raise self._capacity_error(n)
                    if direct > len(disk.free) and direct - len(disk.free) > self._disk_room(direct - len(disk.free), victims):
                        raise self._capacity_error(n)
            # Everything above only looked; from here on the index changes, and an interrupt (a signal
            # handler's KeyboardInterrupt) anywhere below is undone before it propagates.
            changed: list[Entry] = []  # entries other than the victims that lost a slot: evicted, or a clean copy dropped
            entries: list[Entry] = []
            evicted: list[Evicted] | None = [] if self.report_evictions else None
            self._evicted = evicted
            early: list[int] | None = None  # the slots start_copies was given
            settle: Callable[[], None] | None = None
            try:
                if start_copies is not None and t == HOST and shortfall <= 0 and not taken_back and not skipped and n:
                    early = tier.claim(n)
                    settle = start_copies(early)
                if taken_back:
                    self._take_back_promotions(taken_back)  # stays done if cut short below: those loads read the plain way
                for v in victims:  # a victim with a clean disk copy goes back to it: nothing to write
                    if v.clean_slot >= 0:
                        self._demote(v)
                if direct > len(disk.free):  # room on disk for the first blocks (the look above made sure of it)
                    made = self._make_disk_room(direct - len(disk.free), changed)
                    assert made
                entries = new_entries(new_keys, State.PENDING, t)
                if direct:
                    for e in entries[:direct]:
                        e.tier = DISK
                    disk.take_in_order(entries[:direct])
                to_spill: list[tuple[Entry, int]] = []
                spilling = t == HOST and disk.size > 0  # without a disk tier every victim is evicted
                if spilling:  # disk room for the victims, made at once; those left without a disk slot are evicted
                    short = sum(1 for v in victims if v.tier == t) - len(disk.free)
                    if short > 0:
                        self._make_disk_room(short, changed)
                for v in victims:
                    if v.tier != t:  # gone back to its clean disk copy
                        continue
                    if spilling and disk.free:
                        to_spill.append((v, disk.take(v)))
                    else:
                        self._evict(v)
                # Free slots first; the spilled host slots go to the last new entries, which the store writes last.
                n_free = len(entries) - direct - len(to_spill)
                tier.take_in_order(entries[direct : direct + n_free], early)
                spills = []
                for e, (v, disk_slot) in zip(entries[direct + n_free :], to_spill):
                    v.state = State.SPILLING
                    e.slot = v.slot  # owned by the victim until its bytes are on disk
                    spills.append(Spill(v, e, v.slot, disk_slot))
                self._entries.update(zip(new_keys, entries))
                to_disk = len(entries) if t == DISK else direct
                into.entries, into.skipped, into.spills, into.to_disk = entries, skipped, spills, to_disk  # one step: no call between
                if evicted:
                    into.evicted = evicted
                return into
            except BaseException:
                if settle is not None:  # copies into the slots taken: they must have landed before the slots go back
                    settle()
                self._repair.undo_reservation(victims + changed, entries)
                raise
            finally:
                self._evicted = None

    def _capacity_error(self, n: int) -> CapacityError:
        """Under the lock: the error for a store of ``n`` new blocks that cannot have the slots it needs,
        saying whether it is larger than the tiers together or running transfers hold the slots now."""
        host, disk = self._tiers
        capacity = host.size + disk.size
        if n > capacity:
            return CapacityError(
                f"a store of {n} blocks is larger than the host tier ({host.size} slots) and the disk tier "
                f"({disk.size} slots) together",
                requested=n, capacity=capacity,
            )
        room = [
            (
                name, len(t.free) + (len(self._unstarted) if i == HOST else 0),
                len(self._evictable(i, t.size)) + (len(self._droppable_clean(t.size, [])) if i == DISK else 0), t.size,
            )
            for i, (name, t) in enumerate(zip(TIER_NAMES, self._tiers))
        ]
        note = ""
        if not host.size or not disk.size:
            name, free, evictable, size = room[self.store_tier]
            msg = f"need {n} free {name} slots: {free} free and only {evictable} evictable of {size}"
        else:
            msg = f"need {n} free slots: " + ", ".join(
                f"the {name} tier has {free} free and {evictable} evictable of {size}" for name, free, evictable, size in room
            )
            if not room[HOST][1] + room[HOST][2]:
                note = " (blocks bound for disk go through host slots: a store needs at least one)"
        return CapacityError(f"{msg}; the rest are in use by running transfers or held by leases{note}", requested=n, capacity=capacity)

    def _evictable(self, t: int, n: int) -> list[Entry]:
        out: list[Entry] = []
        tier = self._tiers[t]
        for e in tier.lru.values():
            if len(out) == n:
                break
            if e.state is State.READY and not tier.readers[e.slot]:
                out.append(e)
        return out

    def _droppable_clean(self, n: int, victims: list[Entry]) -> list[Entry]:
        """Up to ``n`` entries whose clean disk copy no load reads, oldest promotion first, ``victims`` aside."""
        out: list[Entry] = []
        readers = self._tiers[DISK].readers
        aside = {id(v) for v in victims}
        for e in self._clean.values():
            if len(out) == n:
                break
            if not readers[e.clean_slot] and id(e) not in aside:
                out.append(e)
        return out

    def _disk_room(self, n: int, victims: list[Entry]) -> int:
        """How many of ``n`` disk slots beyond the free ones a store could have (only looks): clean copies to
        drop, disk entries to evict, and ``victims`` (host victims) going back to their clean copies, which
        are evictable once there."""
        room = len(self._droppable_clean(n, victims))
        if room < n:
            room += len(self._evictable(DISK, n - room))
        readers = self._tiers[DISK].readers
        room += sum(1 for v in victims if v.clean_slot >= 0 and not readers[v.clean_slot])
        return room

    def _make_disk_room(self, n: int, changed: list[Entry]) -> bool:
        """Free ``n`` disk slots: drop clean copies (oldest promotion first), then evict the disk's least
        recently used entries; each entry changed is appended to ``changed`` first. False if too few could go."""
        left = n
        for e in self._droppable_clean(n, []):
            changed.append(e)
            self._drop_clean_copy(e)
            left -= 1
        if left:
            for e in self._evictable(DISK, left):
                changed.append(e)
                self._evict(e)
                left -= 1
        return not left

    def _demote(self, e: Entry) -> None:
        """A READY host entry with a clean disk copy goes back to it: disk-resident (most recently used
        there), its host slot released; nothing is written, nothing counted as spilled or evicted."""
        host_slot = e.slot
        e.tier, e.slot, e.clean_slot = DISK, e.clean_slot, -1  # one step: no call between
        del self._clean[e.key]
        del self._tiers[HOST].lru[e.key]
        self._tiers[DISK].lru[e.key] = e
        self._release(HOST, host_slot, e)

    def _drop_clean_copy(self, e: Entry) -> None:
        """A host entry lets go of its clean disk copy: the disk slot is released; the entry stays as it is."""
        disk_slot = e.clean_slot
        e.clean_slot = -1
        del self._clean[e.key]
        self._release(DISK, disk_slot, e)

    def _evict(self, e: Entry) -> None:
        """READY -> GONE to make room; its slots are free at once (nobody reads them)."""
        if self._evicted is not None:
            self._evicted.append(Evicted(e.key, e.tier, e.slot))
        self._forget(e)
        self._release(e.tier, e.slot, e)
        if e.clean_slot >= 0:
            self._release(DISK, e.clean_slot, e)
        self.evicted += 1
        self.evicted_by_tier[e.tier] += 1

    def spill_done(self, spill: Spill) -> None:
        """The victim's bytes are on disk: loads now find it there; its host slot becomes the heir's."""
        with self._lock:
            if spill.ended:
                return
            spill.ended = True
            v, host, disk = spill.victim, self._tiers[HOST], self._tiers[DISK]
            if v.state is State.SPILLING:
                self.spilled += 1  # a victim discarded meanwhile was not moved: not counted
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
            discarded = publish_entries(entries, self._lrus, State.PENDING, State.READY)
            for e in discarded or ():  # discarded while its store ran
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

    def pin(
        self, keys: Sequence[Hashable], into: list[Pin] | None = None, taking: Sequence[Pin | None] | None = None,
        start_copies: StartCopies | None = None,
    ) -> list[Pin]:
        """Pin the current copy of each key for a load (each becomes most recently used).

        ``taking[i]``, where given and still held (a lease's pin of ``keys[i]``, :meth:`hold`), is not
        pinned again: its hold passes to the new pin, on the copy it holds, even if the key was
        discarded since. Raises :class:`MissingKeysError`, pinning and taking nothing, if any other key
        is not visible. The pins are appended to ``into`` as they are taken (:attr:`Pin.held`), so that
        a caller an interrupt stops anywhere can give back exactly what it holds (:meth:`unpin` skips
        pins not held).

        With promotion on, each pin of a disk-resident entry takes a free host slot while there is one
        (:attr:`Pin.promote_slot`; nothing is evicted or spilled for it): the load reads the disk copy
        into it, then calls :meth:`promotion_done`.

        ``start_copies``: where every key is visible in host memory and none is taken over, called with
        their host slots (in key order) once that is known, before the pins are made (about a
        microsecond a key), so that a large load's copies run meanwhile.
        """
        keys = list(keys)
        out: list[Pin] = [] if into is None else into
        if self.holds.next_expiry <= time.monotonic():
            self.holds.expire()
        with self._lock:
            found, missing = find_visible(self._entries, keys, State.READY, State.SPILLING)
            if taking is not None:  # a lease's held pins stand for their keys, visible or not
                missing = [k for k, e, t in zip(keys, found, taking) if (e is None or e.state not in VISIBLE) and not (t is not None and t.held)]
            if not missing:
                self._pin(found, out, taking, self._promote, start_copies)
        if missing:
            raise MissingKeysError(missing)  # its message shows the keys: their __repr__ runs here, not under the lock
        return out

    def _pin(
        self, found: list[Entry | None], pins: list[Pin], taking: Sequence[Pin | None] | None = None, promote: bool = False,
        start_copies: StartCopies | None = None,
    ) -> None:
        """:meth:`pin`, under the lock, of entries ``found`` visible (None or not visible only where
        ``taking`` holds a pin): the pins are appended to ``pins``. ``promote``: pins of disk-resident
        entries take free host slots (:attr:`Pin.promote_slot`); ``start_copies`` as for :meth:`pin`.
        Each entry is pinned in one step (``index_records.pin_entries``)."""
        moved: list[tuple[Pin, Pin]] = []
        first = len(pins)
        host_free, host_readers = self._tiers[HOST].free, self._tiers[HOST].readers
        settle: Callable[[], None] | None = None
        try:
            if taking is None:
                if start_copies is not None:
                    slots = [e.slot for e in found if e.tier == HOST]  # type: ignore[union-attr]  # none missing
                    if len(slots) == len(found):
                        settle = start_copies(slots)
                pin_entries(found, pins, self._readers, self._lrus)  # type: ignore[arg-type]  # none missing
            else:
                for e, old in zip(found, taking):
                    if old is not None and old.held:
                        p = Pin(old.entry, old.tier, old.slot)
                        moved.append((p, old))
                        pins.append(p)
                        p.held, old.held = True, False  # one step: the hold passes from the lease to the load
                    else:
                        assert e is not None
                        pin_entries([e], pins, self._readers, self._lrus)
            if promote and host_free:
                ready = State.READY
                for p in pins[first:]:
                    e = p.entry
                    if not host_free:
                        break
                    if p.tier == DISK and e.tier == DISK and e.state is ready:
                        slot = host_free[-1]
                        host_readers[slot] += 1  # these five in one step: no call between them
                        del host_free[-1]
                        p.promote_slot = slot
                        self._promoting += 1
                        self._unstarted[p] = None
        except BaseException:  # an interrupt: give back what was pinned so far, and taken holds to their lease
            if settle is not None:  # copies out of the slots: they must have landed before the slots go back
                settle()
            for p, old in moved:
                if p.held:
                    p.held, old.held = False, True
            for p in pins:
                if p.held:
                    p.held = False
                    self._tiers[p.tier].readers[p.slot] -= 1
                    p.entry.loads -= 1
                slot = p.promote_slot
                if slot >= 0:
                    p.promote_slot = -1
                    host_readers[slot] -= 1
                    self._promoting -= 1
                    if p in self._unstarted:
                        del self._unstarted[p]
                    self._release(HOST, slot, None)
            raise

    def start_promotion(self, pins: Iterable[Pin]) -> list[Pin]:
        """The load is about to read the disk copies of ``pins`` into their promotion slots: from now on no
        store takes those back. Returns the pins whose slot is still theirs (a store took the others':
        read those keys the plain way)."""
        with self._lock:
            started = [p for p in pins if p in self._unstarted]
            for p in started:
                del self._unstarted[p]
            return started

    def _take_back_promotions(self, n: int) -> None:
        """Under the lock: free the host slots of up to ``n`` promotions no read has started into, the
        latest first (their loads read those keys the plain way)."""
        host = self._tiers[HOST]
        for p in list(reversed(self._unstarted))[:n]:
            slot = p.promote_slot
            host.readers[slot] -= 1  # these four in one step: no call between them
            p.promote_slot = -1
            self._promoting -= 1
            del self._unstarted[p]
            self._release(HOST, slot, None)

    def promotion_done(self, pins: Iterable[Pin]) -> None:
        """The disk copies of ``pins`` are in their :attr:`Pin.promote_slot` host slots: each entry still READY on
        disk at the slot its pin read becomes host-resident there (most recently used), keeping that disk slot as
        its clean copy. A pin whose entry was discarded or promoted by another load meanwhile promotes nothing:
        its host slot goes back with the load's :meth:`unpin`."""
        with self._lock:
            host, disk = self._tiers
            for p in pins:
                slot, e = p.promote_slot, p.entry
                if slot < 0 or p.promoted or not (e.state is State.READY and e.tier == DISK and e.slot == p.slot):
                    continue
                assert host.owner[slot] is None and host.readers[slot]
                del disk.lru[e.key]
                host.owner[slot] = e
                e.tier, e.slot, e.clean_slot = HOST, slot, p.slot
                p.promoted = True
                self._promoting -= 1
                self.promoted += 1
                host.lru[e.key] = e
                self._clean[e.key] = e

    def hold(self, keys: Iterable[Hashable], into: list[Pin], hold_s: float) -> int:
        """Pin the current copy of each leading visible key (a lease; each becomes most recently used)
        until :meth:`unpin` or, at the latest, the first call on the index ``hold_s`` seconds from now
        (``inf``: until :meth:`unpin`; :attr:`holds` keeps the deadline).

        Returns how many keys lead (what :meth:`lookup` returns). The pins are appended to ``into`` as
        they are taken, as :meth:`pin` does; :meth:`pin` takes them over for a load (``taking``).
        """
        keys = list(keys)
        if self.holds.next_expiry <= time.monotonic():
            self.holds.expire()
        deadline = time.monotonic() + hold_s
        with self._lock:
            found: list[Entry | None] = []
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.state not in VISIBLE:
                    break
                found.append(e)
            if not found:
                return 0
            self.holds.add(deadline, into)  # first: an interrupt below leaves a hold that expires
            self._pin(found, into)  # a lease never promotes
            return len(found)

    def unpin(self, pins: Iterable[Pin]) -> None:
        """Release pins taken by :meth:`pin` or :meth:`hold` (those still held: each goes back once), and
        their promotions' host slots (freed unless the entry took them).

        A lease releases its pins in the caller's thread: an interrupt (a signal handler's
        ``KeyboardInterrupt``) anywhere in here loses no slot and no waiter; the pins it did not
        reach stay held (unpin them again)."""
        ready: list[Callable[[], object]] = []
        interrupted: BaseException | None = None
        host = self._tiers[HOST]
        with self._lock:
            try:
                # Each held pin let go in one step; the slots whose last reader left unowned, or while heirs
                # wait for a host slot, and the pins with a promotion slot come back (usually none).
                left = unpin_pins(pins, self._readers, self._owners, self._unread_waiters)
                for t, slot in left[0] if left is not None else ():
                    self._last_reader_gone(t, slot, ready)
                for p in left[1] if left is not None else ():
                    slot = p.promote_slot
                    if slot >= 0:
                        p.promote_slot = -1  # these four in one step: no call between them
                        host.readers[slot] -= 1
                        self._promoting -= not p.promoted
                        if p in self._unstarted:
                            del self._unstarted[p]
                        if not host.readers[slot]:
                            self._last_reader_gone(HOST, slot, ready)
            except BaseException as e:
                interrupted = e
                self._repair.after_unpin(ready)
        for callback in ready:
            callback()
        if interrupted is not None:
            raise interrupted

    def _last_reader_gone(self, t: int, slot: int, ready: list[Callable[[], object]]) -> None:
        """Under the lock: ``slot`` of tier ``t`` has no readers left: free it if unowned, and add what waited
        for that (a heir waiting to write a host slot) to ``ready``."""
        self._release(t, slot, None)
        waiting = self._unread_waiters.get(slot) if t == HOST else None
        if waiting is not None:
            ready += waiting  # these two in one step
            del self._unread_waiters[slot]

    # -- persistence ----------------------------------------------------------------

    def restore(self, entries: Sequence[tuple[Hashable, int]]) -> None:
        """Before any transfer: make each ``(key, disk slot)`` a READY disk entry, least recently used
        first (a persistent disk tier's entries found again). Keys are native (bytes, str, int)."""
        with self._lock:
            disk = self._tiers[DISK]
            assert not self._entries, "restore() comes before any store"
            for key, slot in entries:
                e = Entry(key, State.READY, DISK, slot)
                disk.owner[slot] = e
                self._entries[key] = e
                disk.lru[key] = e
            disk.rebuild_free_list()

    def ready_keys(self) -> list[Hashable]:
        """The keys of every ready entry, least recently used first: the disk tier's, then the host
        tier's (host entries are newer: the host tier holds those stored or promoted last)."""
        with self._lock:
            return [e.key for t in (DISK, HOST) for e in self._tiers[t].lru.values() if e.state is State.READY]

    def disk_copies(self) -> list[tuple[Hashable, int]]:
        """``(key, disk slot)`` of every ready entry with a copy on disk (its current copy, or the clean
        copy of a promoted one), least recently used first: what a checkpoint lists."""
        with self._lock:
            out = [(e.key, e.slot) for e in self._tiers[DISK].lru.values() if e.state is State.READY]
            out += [(e.key, e.clean_slot) for e in self._clean.values() if e.state is State.READY and e.clean_slot >= 0]
            return out

    def drop_disk_slot(self, slot: int) -> None:
        """The bytes in disk ``slot`` are not its entry's (a failed header or checksum check): the entry
        is forgotten if that was its current copy, else it loses that clean copy. The slot goes back to
        the pool when its last reader is gone."""
        with self._lock:
            e = self._tiers[DISK].owner[slot]
            if e is None or e.state is State.GONE:
                return
            if e.tier == DISK and e.slot == slot and e.state is State.READY:
                self._forget(e)
                self._release(DISK, slot, e)
            elif e.clean_slot == slot:
                self._drop_clean_copy(e)

    def copy_host_entries_to_disk(self) -> list[tuple[Entry, int, int]]:
        """For a persistent tier's close, when no transfer runs, so that a restart finds the newest entries:
        give each ready host entry without a disk copy, most recently used first, a disk slot as its clean
        copy. Host entries count as newer than every disk entry (the host tier holds those stored or
        promoted last). The slot is a free one; else that of the disk's least recently used ready entry,
        which is evicted (forgotten, counted in :attr:`evicted`); else the clean copy of an older host
        entry, which is dropped (that entry would be lost before this one); never a slot a load or a
        lease reads. It stops at the first entry that finds none. Returns ``(entry, host slot, disk
        slot)`` for the writes to make, oldest first; an entry whose write fails must be passed to
        :meth:`drop_disk_slot` (an entry evicted for it stays gone)."""
        with self._lock:
            host, disk = self._tiers
            ready = State.READY
            by_age = [e for e in host.lru.values() if e.state is ready]  # oldest first
            evictable = iter(self._evictable(DISK, disk.size))  # a list: each eviction takes its entry out of the LRU
            older = 0  # by_age[:older] have no clean copy left to give (none, dropped, or read)
            out: list[tuple[Entry, int, int]] = []
            for i in range(len(by_age) - 1, -1, -1):  # the most recently used first
                e = by_age[i]
                if e.clean_slot >= 0:
                    continue
                if not disk.free:
                    victim = next(evictable, None)
                    if victim is not None:
                        self._evict(victim)
                    else:
                        while older < i and (by_age[older].clean_slot < 0 or disk.readers[by_age[older].clean_slot]):
                            older += 1
                        if older >= i:
                            break
                        self._drop_clean_copy(by_age[older])
                        older += 1
                slot = disk.take(e)  # the slot just freed, if one was: unread, it went back to the pool at once
                e.clean_slot = slot
                self._clean[e.key] = e
                out.append((e, e.slot, slot))
            out.reverse()  # listed oldest first, as the disk's order goes
            for e, _, _ in out:
                self._clean.move_to_end(e.key)
            return out

    # -- removal --------------------------------------------------------------------

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget keys (in any state); returns how many were present.

        A READY entry's slots (a clean disk copy's too) are released at once
        (freed when no load reads them); a PENDING or SPILLING entry's slots are
        released when its store ends.
        """
        keys = list(keys)
        with self._lock:
            return self._discard([self._entries.get(k) for k in keys])

    def _discard(self, found: list[Entry | None]) -> int:
        """:meth:`discard`, under the lock: ``found`` the entry of each key (None: absent)."""
        n = 0
        gone, ready = State.GONE, State.READY  # an enum member costs a descriptor call per use: once here
        forgotten: list[Entry] = []
        try:
            for e in found:
                if e is None or e.state is gone:  # absent, or named twice
                    continue
                n += 1
                if e.state is ready:
                    forgotten.append(e)
                self._forget(e)
                if forgotten and forgotten[-1] is e:
                    self._release(e.tier, e.slot, e)
                    if e.clean_slot >= 0:
                        self._release(DISK, e.clean_slot, e)
        except BaseException:  # an interrupt: the READY entries forgotten so far give their slots back
            for e in forgotten:
                if e.state is gone:
                    self._repair.unlist(e)
                    self._release(e.tier, e.slot, e)
                    if e.clean_slot >= 0:
                        self._release(DISK, e.clean_slot, e)
            raise
        return n

    def _forget(self, e: Entry) -> None:
        """Take ``e`` out of the index: -> GONE (first, so that an interrupt between these steps leaves an
        entry that is GONE, never one that looks alive without being in the index)."""
        e.state = State.GONE
        del self._entries[e.key]
        self._tiers[e.tier].lru.pop(e.key, None)
        if e.clean_slot >= 0:
            self._clean.pop(e.key, None)

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
            if t == DISK and self.on_disk_slot_freed is not None:
                self.on_disk_slot_freed(slot)
