"""The deadlines of an index's holds (leases), and the pins given back later.

A lease (:meth:`~.index.BlockIndex.hold`) pins its hits as a load does, so no store evicts or spills
them, until it is released (:meth:`~.index.BlockIndex.unpin`), a load takes its pins over
(:meth:`~.index.BlockIndex.pin`'s ``taking``), or its deadline passes. :class:`Holds` keeps the
deadlines and gives back the expired holds (:meth:`Holds.expire`): at the start of the index's next
lookup, hold, pin, reserve or count, and at the deadline itself from a worker (``runtime.HoldExpiry``),
whether or not anything calls the offloader. A lease the garbage collector takes is handed to
:meth:`Holds.release_later`, which takes no lock.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable
from itertools import chain
from typing import TYPE_CHECKING

from ..base.convoy_free_lock import ConvoyFreeLock

if TYPE_CHECKING:
    from .index import Pin

__all__ = ["Holds"]


class Holds:
    """The holds of one index with a deadline, and the pins to give back at the next call.

    ``lock``: the index's lock (the deadlines change with the pins, in its steps); ``unpin``: the
    index's :meth:`~.index.BlockIndex.unpin`, called without the lock.
    """

    __slots__ = ("_lock", "_unpin", "_deadlines", "_taken", "_later", "next_expiry")

    def __init__(self, lock: ConvoyFreeLock, unpin: Callable[[Iterable[Pin]], None]) -> None:
        self._lock = lock
        self._unpin = unpin
        self._deadlines: list[tuple[float, int, list[Pin]]] = []
        """Heap of (deadline, sequence number, pins) of the holds taken by :meth:`add`, earliest first."""
        self._taken = 0
        self._later: list[list[Pin]] = []
        """Pins of expired holds and of leases the garbage collector took, to give back."""
        self.next_expiry = float("inf")
        """The earliest deadline (-inf: pins wait in ``_later``); read without the lock: a float is read in one step."""

    def add(self, deadline: float, pins: list[Pin]) -> None:
        """Under the index's lock, before the hold's pins are taken (an interrupt between leaves a hold that
        expires, never one held for good): give ``pins`` back at ``deadline`` (``inf``: never; an infinite
        hold has nothing to expire: its lease's release or collection ends it)."""
        if deadline < float("inf"):
            self._taken += 1
            heapq.heappush(self._deadlines, (deadline, self._taken, pins))
            self.next_expiry = self._deadlines[0][0]

    def expire(self) -> None:
        """Give back the holds whose deadline has passed and the pins handed to :meth:`release_later`
        (cheap while there are none). Takes the index's lock, then unpins without it."""
        now = time.monotonic()
        if self.next_expiry > now:
            return
        deadlines, later = self._deadlines, self._later
        with self._lock:
            while deadlines and deadlines[0][0] <= now:
                later.append(deadlines[0][2])  # first: an interrupt between these two leaves it in both, never in neither
                heapq.heappop(deadlines)
            due = later[:]
        # Unpinning is idempotent: until the step below, an interrupt anywhere leaves the due pins listed (and
        # next_expiry passed) for the next call to give back.
        self._unpin(chain.from_iterable(due))
        with self._lock:
            done = {id(pins) for pins in due}
            for i in range(len(later) - 1, -1, -1):  # by position: release_later() appends meanwhile, lock-free
                if id(later[i]) in done:
                    del later[i]
            self.next_expiry = float("-inf") if later else deadlines[0][0] if deadlines else float("inf")

    def release_later(self, pins: list[Pin]) -> None:
        """Give ``pins`` back at the start of the next call on the index. Takes no lock: safe in a
        garbage collector's finalizer, which may run while this very thread holds the index's lock."""
        self.next_expiry = float("-inf")  # first: no thread switch comes between these two
        self._later.append(pins)

    def timed(self) -> int:
        """How many holds wait for their deadline (an infinite hold never does)."""
        return len(self._deadlines)
