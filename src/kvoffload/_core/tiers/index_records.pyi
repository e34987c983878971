"""The index's records and its per-key steps, at C speed (``index_records.c``)."""

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

class Entry:
    """One key's block: its state, and the tier and slot where loads find it."""

    key: Hashable
    state: Any
    tier: int
    slot: int
    loads: int
    clean_slot: int
    def __init__(self, key: Hashable, state: Any, tier: int, slot: int, loads: int = 0, clean_slot: int = -1) -> None: ...

class Pin:
    """A load's or a lease's hold on one entry's copy: the slot it reads (or will)."""

    entry: Entry
    tier: int
    slot: int
    held: bool
    promote_slot: int
    promoted: bool
    def __init__(
        self, entry: Entry, tier: int, slot: int, held: bool = False, promote_slot: int = -1, promoted: bool = False,
    ) -> None: ...

def find_visible(
    entries: dict[Hashable, Entry], keys: list[Hashable], ready: object, spilling: object, /,
) -> tuple[list[Entry | None], list[Hashable]]: ...
def pin_entries(
    found: list[Entry], pins: list[Pin], readers: tuple[list[int], ...], lrus: tuple[OrderedDict[Hashable, Entry], ...], /,
) -> None: ...
def unpin_pins(
    pins: Iterable[Pin], readers: tuple[list[int], ...], owners: tuple[list[Entry | None], ...], waiters: dict[int, Any], /,
) -> tuple[list[tuple[int, int]], list[Pin]] | None: ...
def reserve_free(
    keys: object, entries: dict[Hashable, Entry], free: list[int], owner: list[Entry | None], pending: object, tier: int,
    into: Any, /,
) -> bool: ...
def new_entries(keys: list[Hashable], state: object, tier: int, /) -> list[Entry]: ...
def own_slots(entries: list[Entry], slots: list[int], owner: list[Entry | None], /) -> None: ...
def publish_entries(
    entries: Iterable[Entry], lrus: tuple[OrderedDict[Hashable, Entry], ...], pending: object, ready: object, /,
) -> list[Entry] | None: ...
