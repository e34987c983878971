"""Key -> location index with LRU order, pins, and slot allocation.

Thread-safe: the facade reserves and pins from the caller's thread, the worker
loops publish and release from theirs. One lock guards everything; no IO or
copy ever happens under it.

An entry is *pending* while a store fills its slot (invisible to ``lookup`` and
``load``) and *ready* once all of its bytes are in place. A ready entry may be
*pinned* by running loads; pinned and pending entries are never evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .errors import CapacityError, MissingKeysError

__all__ = ["Entry", "BlockIndex", "SlotPool"]


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
    slot: int
    ready: bool = False
    pins: int = 0
    gone: bool = False
    """Discarded or evicted while pinned or pending: its slot is freed when the last user lets go."""


class BlockIndex:
    """Index of one tier's slots (the host tier; the disk tier gets its own)."""

    def __init__(self, slots: int) -> None:
        self._lock = threading.Lock()
        self._entries: dict[Hashable, Entry] = {}
        self._lru: OrderedDict[Hashable, Entry] = OrderedDict()  # ready entries, oldest first
        self._pool = SlotPool(slots)
        self.evicted = 0

    # -- queries ------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading keys are ready."""
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
        """Snapshot of slot use: total, used, ready, pending, pinned entries, free slots."""
        with self._lock:
            ready = len(self._lru)
            pinned = sum(1 for e in self._lru.values() if e.pins)
            return {
                "slots": self._pool.size,
                "free": len(self._pool),
                "ready": ready,
                "pending": len(self._entries) - ready,
                "pinned": pinned,
                "evicted": self.evicted,
            }

    # -- store side ---------------------------------------------------------------

    def reserve(self, keys: Iterable[Hashable]) -> tuple[list[Entry], list[Hashable]]:
        """Reserve one slot per new key, evicting least-recently-used entries as needed.

        Returns ``(new pending entries, skipped keys)``; keys already present
        (ready or pending) are skipped. Raises :class:`CapacityError`, with
        nothing reserved or evicted, when too few slots can be freed.
        """
        with self._lock:
            new_keys: list[Hashable] = []
            skipped: list[Hashable] = []
            for key in keys:
                (skipped if key in self._entries else new_keys).append(key)
            shortfall = len(new_keys) - len(self._pool)
            if shortfall > 0:
                victims = [e for e in self._lru.values() if not e.pins][:shortfall]
                if len(victims) < shortfall:
                    raise CapacityError(
                        f"need {len(new_keys)} free slots, {len(self._pool)} free and only "
                        f"{len(victims)} evictable of {self._pool.size}; the rest are in use by running transfers"
                    )
                for e in victims:
                    self._remove(e)
                    self._pool.give(e.slot)
                self.evicted += len(victims)
            entries = []
            for key in new_keys:
                e = Entry(key, self._pool.take())
                self._entries[key] = e
                entries.append(e)
            return entries, skipped

    def publish(self, entries: Iterable[Entry]) -> None:
        """Make fully written entries visible (most recently used)."""
        with self._lock:
            for e in entries:
                if e.gone:  # discarded while it was being written
                    self._pool.give(e.slot)
                    continue
                e.ready = True
                self._lru[e.key] = e

    def abort(self, entries: Iterable[Entry]) -> None:
        """Drop pending entries whose store did not finish, freeing their slots."""
        with self._lock:
            for e in entries:
                if not e.gone and self._entries.get(e.key) is e:
                    del self._entries[e.key]
                self._pool.give(e.slot)

    # -- load side ------------------------------------------------------------------

    def pin(self, keys: Iterable[Hashable]) -> list[Entry]:
        """Pin ready entries for a load (most recently used); :class:`MissingKeysError` if any is absent."""
        with self._lock:
            found = [self._entries.get(k) for k in keys]
            missing = [k for k, e in zip(keys, found) if e is None or not e.ready]
            if missing:
                raise MissingKeysError(missing)
            for e in found:
                assert e is not None
                e.pins += 1
                self._lru.move_to_end(e.key)
            return found  # type: ignore[return-value]

    def unpin(self, entries: Iterable[Entry]) -> None:
        """Release pins taken by :meth:`pin`."""
        with self._lock:
            for e in entries:
                e.pins -= 1
                if e.gone and e.pins == 0:
                    self._pool.give(e.slot)

    # -- removal --------------------------------------------------------------------

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget keys (ready or pending); returns how many were present."""
        n = 0
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None:
                    continue
                n += 1
                self._remove(e)
                if e.ready and not e.pins:
                    self._pool.give(e.slot)
                else:
                    e.gone = True
        return n

    def _remove(self, e: Entry) -> None:
        del self._entries[e.key]
        self._lru.pop(e.key, None)
