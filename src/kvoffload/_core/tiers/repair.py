"""Making the index whole again after an interrupt (a signal handler's ``KeyboardInterrupt``) cut one
of its steps short.

Each step of :class:`~.index.BlockIndex` changes slot ownership (``Tier.owner``, ``Tier.readers``)
and an entry's fields (state, tier, slot, clean copy) together, with no call between: those stay
true whatever the interrupt. What it may leave behind is the rest, derived from them: the free
lists, the dicts that list entries (by key, by LRU order, by clean copy), the heirs waiting for a
host slot that nobody reads any more. :class:`IndexRepair` rebuilds that from them, under the
index's lock; the paths that need it are rare (an interrupt), so it scans.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from .entries import DISK, HOST, Entry, State, Tier

__all__ = ["IndexRepair"]


class IndexRepair:
    """The repairs of one index, over its structures (the same objects as the index's, never rebound)."""

    __slots__ = ("entries", "tiers", "clean", "unread_waiters")

    def __init__(
        self, entries: dict[Hashable, Entry], tiers: tuple[Tier, Tier], clean: OrderedDict[Hashable, Entry],
        unread_waiters: dict[int, list[Callable[[], object]]],
    ) -> None:
        self.entries = entries
        self.tiers = tiers
        self.clean = clean
        self.unread_waiters = unread_waiters

    def after_unpin(self, ready: list[Callable[[], object]]) -> None:
        """After an interrupt cut an unpin short: the free lists are rebuilt from slot ownership and
        readers, and heirs waiting for a host slot nobody reads are added to ``ready``."""
        for tier in self.tiers:
            tier.rebuild_free_list()
        host = self.tiers[HOST]
        for slot in [s for s in self.unread_waiters if not host.readers[s]]:
            ready += self.unread_waiters.pop(slot)

    def undo_reservation(self, changed: list[Entry], new: list[Entry]) -> None:
        """After an exception cut a reservation short: the ``new`` entries go, every victim whose spill
        was planned stays where it was, and every entry ``changed`` is made whole as its fields say (an
        eviction, a return to a clean copy or a clean copy's drop that was cut short completes); then
        the free lists are rebuilt from slot ownership. What completed stays done."""
        for e in new:
            e.state = State.GONE
            self.unlist(e)
            self.disown(e)
        for v in changed:
            if v.state is State.SPILLING:  # its spill never started: the disk slot taken for it goes
                v.state = State.READY
            self.reconcile(v)
        for tier in self.tiers:
            tier.rebuild_free_list()

    def reconcile(self, e: Entry) -> None:
        """``e``'s places in the index's dicts and the slots it owns made to match its state, tier, slot
        and clean copy (a GONE entry: out of the dicts, owning nothing)."""
        key = e.key
        if e.state is State.GONE:
            self.unlist(e)
            self.disown(e)
            return
        for t, tier in enumerate(self.tiers):
            listed = tier.lru.get(key) is e
            if listed and (t != e.tier or e.state is State.PENDING):
                del tier.lru[key]
            elif not listed and t == e.tier and e.state is not State.PENDING:
                tier.lru[key] = e
        if (self.clean.get(key) is e) != (e.clean_slot >= 0):
            if e.clean_slot >= 0:
                self.clean[key] = e
            else:
                del self.clean[key]
        keep = {(e.tier, e.slot), (DISK, e.clean_slot)}
        for t, tier in enumerate(self.tiers):
            for s, owner in enumerate(tier.owner):
                if owner is e and (t, s) not in keep:
                    tier.owner[s] = None

    def unlist(self, e: Entry) -> None:
        """A GONE entry out of the index's dicts, wherever the step that forgot it left it (idempotent)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        for listing in (self.tiers[HOST].lru, self.tiers[DISK].lru, self.clean):
            if listing.get(e.key) is e:
                del listing[e.key]

    def disown(self, e: Entry) -> None:
        """Every slot ``e`` owns is owned by nobody."""
        for tier in self.tiers:
            for s, owner in enumerate(tier.owner):
                if owner is e:
                    tier.owner[s] = None
