"""The index's records: each key's :class:`Entry` and its :class:`State`, each tier's slot ownership
(:class:`Tier`). :class:`~.index.BlockIndex` changes them, under its lock; the module docstring of
``index.py`` says how. :class:`Entry` is compiled (``index_records.c``, with the per-key steps the
index makes on every store and load): one key's block, its ``key``, ``state``, ``tier`` and
``slot`` where loads find it, ``loads`` (running loads and leases that pinned it, for
``stats().pinned``) and ``clean_slot`` (a READY host entry's clean disk copy, -1: none)."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from .index_records import Entry, own_slots

__all__ = ["DISK", "HOST", "TIER_NAMES", "VISIBLE", "Entry", "State", "Tier"]

HOST, DISK = 0, 1
TIER_NAMES = ("host", "disk")


class State(enum.Enum):
    """Where an entry is in its life (see the module docstring of ``index.py``)."""

    PENDING = "pending"
    READY = "ready"
    SPILLING = "spilling"
    GONE = "gone"


VISIBLE = (State.READY, State.SPILLING)
"""The states a lookup finds and a load reads."""


@dataclass
class Tier:
    """Slot ownership of one tier."""

    size: int
    owner: list[Entry | None] = field(init=False)
    readers: list[int] = field(init=False)
    free: list[int] = field(init=False)
    lru: OrderedDict[Hashable, Entry] = field(default_factory=OrderedDict)
    """READY and SPILLING entries whose current copy is in this tier, least recently used first (by key)."""

    def __post_init__(self) -> None:
        self.owner = [None] * self.size
        self.readers = [0] * self.size
        self.free = list(range(self.size - 1, -1, -1))  # low numbers first: fresh stores are contiguous

    def take(self, entry: Entry) -> int:
        slot = self.free.pop()
        self.owner[slot] = entry
        return slot

    def take_in_order(self, entries: list[Entry], slots: list[int] | None = None) -> None:
        """Give each of ``entries`` a slot: ``slots[i]`` (taken by :meth:`claim`), else a free slot, in
        ascending order: consecutive slots make one copy descriptor per run (slots freed in some
        order, say by a discard, are taken back sorted)."""
        if not entries:
            return
        if slots is None:  # :meth:`claim`, inlined: a call fewer per store
            slots = sorted(self.free[-len(entries):])
            del self.free[-len(entries):]
        own_slots(entries, slots, self.owner)

    def claim(self, n: int) -> list[int]:
        """Take ``n`` free slots off the free list, in ascending order, owned by nobody yet (until
        :meth:`take_in_order` gives them to entries)."""
        slots = sorted(self.free[-n:])
        del self.free[-n:]
        return slots

    def rebuild_free_list(self) -> None:
        """The free list made anew from ownership and readers: every slot neither owned nor read."""
        self.free = [s for s in range(self.size - 1, -1, -1) if self.owner[s] is None and not self.readers[s]]
