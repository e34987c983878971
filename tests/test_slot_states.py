"""The index's entry states and slot ownership: every transition, and a model run of interleavings.

The index is the one authority over which slot holds which key. These tests drive it exactly as the
tiers do (reserve, write spills, spill done/failed, wait for readers, write and publish chunk by
chunk, abort; pin, read a promotion's disk copy into its host slot, promotion done, read, unpin;
discard, evict), over a simulated memory in which every slot holds
the tag of the bytes last written there. A load checks, when it reads, that its slot still holds the
tag it pinned: a slot handed to a new owner while a load still reads it, or freed twice, shows up as
another key's bytes, as it would to a user. After every step each visible key's current copy, and
its clean disk copy if it has one, hold its tag: a clean copy overwritten while its entry still
counts on it would show there.

``test_interleavings_keep_every_slot_owned_once`` runs many stores, loads, discards and
cancellations interleaved step by step at random (at least 100,000 steps per CI run, figure printed at
the end), and checks every invariant after every step. Its keys are strings (half of the runs), nested
tuples (a new object at each use, equal to the others), or a mix of ints, the bools equal to them and
nested tuples of those. ``test_the_discarded_spill_victim_*`` replays, on a real offloader, the
sequence that once returned another key's bytes.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field

import pytest

import kvoffload
from support.caches import random_caches, same_bytes
from support.figures import report_figure
from kvoffload._core.tiers.index import DISK, HOST, BlockIndex, Pin, Reservation, State
from kvoffload._testing import check_index
from kvoffload import CapacityError

# -- transitions, one by one ------------------------------------------------------------------


def two_tier(host: int = 2, disk: int = 2) -> BlockIndex:
    return BlockIndex(host, disk)


def store(ix: BlockIndex, *keys: Hashable) -> None:
    store_rest(ix, ix.reserve(keys))


def store_rest(ix: BlockIndex, r: Reservation) -> None:
    """What a store does after its reservation, when every write succeeds."""
    for s in r.spills:
        ix.spill_done(s)
    ix.publish(r.entries)


def free(ix: BlockIndex) -> tuple[int, int]:
    c = ix.counts()
    return c.host_free, c.disk_free


def state_of(ix: BlockIndex, key: Hashable) -> State | None:
    e = ix._entries.get(key)
    return None if e is None else e.state


def test_pending_publish_and_abort():
    ix = two_tier()
    r = ix.reserve(["a", "b"])
    assert [state_of(ix, k) for k in "ab"] == [State.PENDING, State.PENDING]
    assert ix.lookup(["a"]) == 0 and "a" not in ix and free(ix) == (0, 2)
    ix.publish(r.entries[:1])
    ix.abort(r.entries[1:])
    assert state_of(ix, "a") is State.READY and state_of(ix, "b") is None and free(ix) == (1, 2)
    ix.check()


def test_discard_in_each_state_frees_each_slot_exactly_once():
    # PENDING: the slot is freed when the store ends (publish or abort), never by discard.
    for end in ("publish", "abort"):
        ix = two_tier()
        r = ix.reserve(["a"])
        assert ix.discard(["a"]) == 1 and free(ix) == (1, 2)
        (ix.publish if end == "publish" else ix.abort)(r.entries)
        assert "a" not in ix and free(ix) == (2, 2), end
        ix.check()
    # READY: at once, or at the last unpin when a load reads it.
    ix = two_tier()
    store(ix, "a")
    pins = ix.pin(["a"])
    assert ix.discard(["a"]) == 1 and free(ix) == (1, 2)
    ix.unpin(pins)
    assert free(ix) == (2, 2)
    ix.check()
    # SPILLING: visible until discarded; both slots released when the spill ends, however it ends.
    for end in ("done", "failed"):
        ix = two_tier(host=1)
        store(ix, "a")
        r = ix.reserve(["b"])
        (spill,) = r.spills
        assert state_of(ix, "a") is State.SPILLING and "a" in ix
        assert ix.discard(["a"]) == 1 and "a" not in ix
        (ix.spill_done if end == "done" else ix.spill_failed)(spill)
        (ix.publish if end == "done" else ix.abort)(r.entries)
        assert free(ix) == ((0, 2) if end == "done" else (1, 2)), end
        ix.check()


def test_spill_done_moves_the_victim_and_hands_its_host_slot_to_the_heir():
    ix = two_tier(host=1)
    store(ix, "a")
    r = ix.reserve(["b"])
    (spill,) = r.spills
    assert (spill.victim.key, spill.heir.key) == ("a", "b")
    ix.spill_done(spill)
    assert state_of(ix, "a") is State.READY and ix._entries["a"].tier == DISK
    ix.publish(r.entries)
    assert ix.lookup(["a", "b"]) == 2 and free(ix) == (0, 1)
    ix.check()


def test_spill_failed_keeps_the_victim_in_host_memory_and_the_heir_owns_nothing():
    ix = two_tier(host=1)
    store(ix, "a")
    r = ix.reserve(["b"])
    ix.spill_failed(r.spills[0])
    ix.abort(r.entries)
    assert state_of(ix, "a") is State.READY and ix._entries["a"].tier == HOST and free(ix) == (0, 2)
    ix.check()


def test_a_store_larger_than_the_host_tier_takes_disk_slots_for_its_first_keys():
    ix = two_tier(host=2, disk=4)
    store(ix, "old", "a", "b")  # "old" to disk (its first key), "a" and "b" to host
    assert [ix._entries[k].tier for k in ("old", "a", "b")] == [DISK, HOST, HOST]
    r = ix.reserve(["c", "d", "e", "f"])
    # the last two keys take the host slots (spilling "a" and "b"); the first two take disk slots,
    # evicting the disk's least recently used entry ("old") for one of them
    assert r.to_disk == 2 and [e.tier for e in r.entries] == [DISK, DISK, HOST, HOST]
    assert [s.victim.key for s in r.spills] == ["a", "b"] and state_of(ix, "old") is None
    ix.check()
    ix.spill_done(r.spills[0])
    ix.publish(r.entries[:1])  # the store is cancelled after its first key
    ix.spill_failed(r.spills[1])
    ix.abort(r.entries[1:])
    assert [state_of(ix, k) for k in "abcdef"] == [State.READY, State.READY, State.READY, None, None, None]
    assert ix._entries["a"].tier == DISK and ix._entries["b"].tier == HOST and free(ix) == (1, 2)
    ix.check()


def test_the_heir_waits_for_the_last_reader_of_its_host_slot():
    ix = two_tier(host=1)
    store(ix, "a")
    pins = ix.pin(["a"])  # a load reads a's host copy...
    with pytest.raises(kvoffload.CapacityError):  # ...so a is not evictable
        ix.reserve(["b"])
    ix.unpin(pins)
    r = ix.reserve(["b"])
    pins = ix.pin(["a"])  # a SPILLING entry is loadable from its host slot
    assert pins[0].tier == HOST
    ix.spill_done(r.spills[0])
    unread = threading.Event()
    ix.when_unread(r.spills[0].host_slot, unread.set)
    assert not unread.is_set()
    ix.unpin(pins)
    assert unread.is_set()
    ix.publish(r.entries)
    ix.check()


def test_evicted_entries_are_counted_and_pinned_ones_never_evicted():
    ix = BlockIndex(2, 0)
    store(ix, "a", "b")
    pins = ix.pin(["a"])
    store(ix, "c")  # evicts b, the only unpinned one
    assert ix.lookup(["a"]) == 1 and "b" not in ix and ix.evicted == 1
    ix.unpin(pins)
    ix.check()


def test_lookup_never_runs_the_callers_iterable_under_the_lock():
    ix = two_tier()
    store(ix, "a", "b")
    # The generator calls back into the index while lookup consumes it: a lock held would deadlock.
    assert ix.lookup(k for k in ["a", "b", "c"] if k in ix) == 2


def on_disk(ix: BlockIndex, *keys: Hashable) -> None:
    """Store ``keys`` and spill them to disk by filling the host tier, then discard the fillers: every host slot is free."""
    store(ix, *keys)
    fillers = [("filler", i) for i in range(ix.counts().host_slots)]
    store(ix, *fillers)
    ix.discard(fillers)
    assert all(ix._entries[k].tier == DISK for k in keys)


def where(ix: BlockIndex, key: Hashable) -> tuple[int, int, int]:
    """(tier, slot, clean disk slot) of ``key``'s entry."""
    e = ix._entries[key]
    return e.tier, e.slot, e.clean_slot


def promote(ix: BlockIndex, *keys: Hashable) -> list[Pin]:
    """A promoting load of ``keys``, to the end; its pins."""
    pins = ix.pin(keys)
    ix.promotion_done(pins)
    ix.unpin(pins)
    return pins


def test_promotion_makes_a_disk_entry_host_resident_and_keeps_its_disk_slot_as_a_clean_copy():
    ix = BlockIndex(2, 2, promote=True)
    on_disk(ix, "a")
    disk_slot = ix._entries["a"].slot
    pins = ix.pin(["a"])
    (p,) = pins
    assert p.tier == DISK and p.promote_slot >= 0 and free(ix) == (1, 1)  # a host slot taken for the read
    assert where(ix, "a") == (DISK, disk_slot, -1)  # still disk-resident until its bytes are in host memory
    ix.check()
    ix.promotion_done(pins)
    assert where(ix, "a") == (HOST, p.promote_slot, disk_slot) and ix.promoted == 1
    ix.unpin(pins)
    c = ix.counts()
    assert (c.host_ready, c.disk_ready, c.disk_clean, c.host_free, c.disk_free) == (1, 0, 1, 1, 1)
    assert ix.pin(["a"])[0].tier == HOST  # the next load reads host memory
    ix.check()


def test_promotion_takes_only_free_host_slots_and_is_off_unless_asked_for():
    ix = BlockIndex(2, 4, promote=True)
    on_disk(ix, "a", "b")
    store(ix, "h")  # one host slot left
    pins = ix.pin(["a", "b"])
    assert [p.promote_slot >= 0 for p in pins] == [True, False] and free(ix)[0] == 0
    ix.unpin(pins)  # the load ended before its read landed: the slot goes back, nothing promoted
    assert free(ix) == (1, 2) and ix.promoted == 0 and ix._entries["a"].tier == DISK
    ix.check()
    off = BlockIndex(2, 4)
    on_disk(off, "a")
    assert off.pin(["a"])[0].promote_slot == -1


def test_a_host_victim_with_a_clean_copy_goes_back_to_it_without_a_spill():
    ix = BlockIndex(1, 2, promote=True)
    on_disk(ix, "a")
    disk_slot = ix._entries["a"].slot
    promote(ix, "a")
    r = ix.reserve(["b"])
    assert r.spills == [] and where(ix, "a") == (DISK, disk_slot, -1)  # nothing to write
    ix.publish(r.entries)
    assert (ix.spilled, ix.evicted) == (1, 0)  # the filler's spill in on_disk, nothing since
    ix.check()


def test_disk_room_drops_clean_copies_oldest_promotion_first_before_evicting():
    ix = BlockIndex(4, 3, promote=True)
    on_disk(ix, "a", "b", "c")  # the disk tier is full
    store(ix, "x")
    promote(ix, "a")
    promote(ix, "b")
    store(ix, "y")  # host, least recently used first: x, a, b, y; disk: c, and the clean copies of a and b
    # x, the host victim, has no disk copy: its spill takes the disk slot of the oldest clean copy, a's.
    store(ix, "w")
    assert where(ix, "x")[0] == DISK and where(ix, "a")[::2] == (HOST, -1) and where(ix, "b")[2] >= 0
    store(ix, "v")  # then a is the victim: b's clean copy goes
    assert where(ix, "a")[0] == DISK and where(ix, "b")[::2] == (HOST, -1) and ix.evicted == 0
    store(ix, "u")  # no clean copy left: the disk's least recently used entry is evicted for b's spill
    assert "c" not in ix and ix.evicted == 1 and where(ix, "b")[0] == DISK
    ix.check()


def test_a_store_takes_back_the_host_slot_of_a_promotion_not_started_before_anything_else():
    ix = BlockIndex(2, 4, promote=True)
    on_disk(ix, "a", "b")
    store(ix, "h")
    pins = ix.pin(["a"])  # the last free host slot, for a's promotion
    r = ix.reserve(["n"])  # host room: the promotion's slot, not h (nothing spilled)
    assert r.spills == [] and pins[0].promote_slot == -1 and r.entries[0].tier == HOST
    ix.publish(r.entries)
    assert ix.start_promotion(pins) == [] and ix.spilled == 2 and "h" in ix  # the two spills of on_disk only
    ix.discard(["n"])
    started = ix.pin(["b"])
    assert started[0].promote_slot >= 0 and ix.start_promotion(started) == started  # once its read started, the slot stays the load's
    r = ix.reserve(["m"])
    assert [sp.victim.key for sp in r.spills] == ["h"]  # so a store makes room elsewhere
    store_rest(ix, r)
    ix.promotion_done(started)
    ix.unpin(pins + started)
    assert ix._entries["b"].tier == HOST and ix._entries["a"].tier == DISK
    ix.check()


def test_a_promotion_is_declined_when_its_entry_was_discarded_or_promoted_meanwhile():
    ix = BlockIndex(4, 2, promote=True)
    on_disk(ix, "a", "b")
    first, second = ix.pin(["a"]), ix.pin(["a"])  # two loads read a's disk copy, each into a host slot of its own
    gone = ix.pin(["b"])
    assert ix.discard(["b"]) == 1
    ix.promotion_done(first + second + gone)
    assert ix.promoted == 1 and where(ix, "a")[1] == first[0].promote_slot
    assert free(ix) == (1, 0)  # the declined host slots are freed when their loads end
    ix.unpin(first + second + gone)
    assert free(ix) == (3, 1) and ix.counts().disk_clean == 1
    ix.check()


def test_discarding_a_promoted_entry_frees_both_slots():
    ix = BlockIndex(2, 2, promote=True)
    on_disk(ix, "a")
    promote(ix, "a")
    pins = ix.pin(["a"])  # a load reads its host copy
    assert ix.discard(["a"]) == 1 and free(ix) == (1, 2)
    ix.unpin(pins)
    assert free(ix) == (2, 2)
    ix.check()


def test_slots_freed_in_any_order_go_to_the_next_store_in_ascending_order():
    """A store's slots ascend, however their keys were discarded: runs of consecutive host slots
    are what its copies are batched by (one descriptor per run)."""
    ix = BlockIndex(16, 0)
    store(ix, *range(16))
    ix.discard([3, 0, 9, 1, 2, 8, 15, 4, 5, 6, 7, 10, 14, 11, 12, 13])
    r = ix.reserve([("again", i) for i in range(16)])
    assert [e.slot for e in r.entries] == list(range(16))
    ix.publish(r.entries)
    ix.check()


def test_a_store_reserves_alike_whether_its_keys_come_as_a_dict_or_a_list():
    """The usual store (a dict of new keys, free host slots for all) is reserved in one compiled step;
    a list, a key already present or too few free slots take the general path: the same entries,
    slots and skipped keys either way, and nothing changed by a refusal."""
    for make in (dict.fromkeys, list):
        ix = BlockIndex(6, 0)
        store(ix, "x")
        ix.discard(["x"])
        r = ix.reserve(make(["c", "a", "b"]))
        assert [(e.key, e.state, e.tier, e.slot) for e in r.entries] == [
            ("c", State.PENDING, HOST, 0), ("a", State.PENDING, HOST, 1), ("b", State.PENDING, HOST, 2)]
        assert r.skipped == [] and r.spills == [] and r.to_disk == 0 and free(ix) == (3, 0)
        ix.check()
        r2 = ix.reserve(make(["d", "a"]))  # "a" pending: skipped
        assert [e.key for e in r2.entries] == ["d"] and r2.skipped == ["a"] and [e.slot for e in r2.entries] == [3]
        ix.publish(r.entries + r2.entries)
        ix.check()
        pins = ix.pin(["a", "b", "c", "d"])  # read by a load: not evictable
        with pytest.raises(CapacityError):  # three new keys, two free slots
            ix.reserve(make(["e", "f", "g"]))
        assert free(ix) == (2, 0) and "e" not in ix
        ix.unpin(pins)
        ix.check()


# -- the model: random interleavings of the tiers' protocol -------------------------------------

HOST_SLOTS, DISK_SLOTS = 4, 6
KEYS = [f"k{i}" for i in range(14)]
"""The model's keys by name; a run passes the index the key objects its kind makes of them (``World.keys``)."""


def _number(rng: random.Random, i: int) -> int:
    """``i``, or (0 and 1, half of the time) the bool equal to it: the same key."""
    return bool(i) if i < 2 and rng.random() < 0.5 else i


def _nested(rng: random.Random, i: int) -> tuple[object, ...]:
    """A new nested tuple object for key number ``i``, equal to every other one made for it."""
    return ("k", (_number(rng, i), f"k{i}".encode()), ())


KEY_KINDS: dict[str, Callable[[random.Random, str], Hashable]] = {
    "strings": lambda rng, name: name,
    "tuples": lambda rng, name: _nested(rng, int(name[1:])),
    "mixed": lambda rng, name: _number(rng, int(name[1:])) if int(name[1:]) % 2 == 0 else _nested(rng, int(name[1:])),
}


def name_of(key: Hashable) -> str:
    if type(key) is str:
        return key
    return f"k{int(key[1][0]) if type(key) is tuple else int(key)}"  # type: ignore[index,call-overload]


STEPS = int(os.environ.get("KVOFFLOAD_INDEX_STEPS", "200000"))
FIGURES: Counter[str] = Counter()


class Blocked:
    """Yielded by a process that waits for a callback (a heir waiting for readers)."""

    def __init__(self) -> None:
        self.ready = False

    def wake(self) -> None:
        self.ready = True


@dataclass
class World:
    ix: BlockIndex
    rng: random.Random
    kind: str
    mem: tuple[list[object], list[object]] = field(default_factory=lambda: ([None] * HOST_SLOTS, [None] * DISK_SLOTS))
    tag: dict[str, object] = field(default_factory=dict)
    """Key name -> tag of its published bytes, for keys the model knows as visible."""
    version: int = 0
    evicted_seen: int = 0
    trace: list[str] = field(default_factory=list)

    def log(self, line: str) -> None:
        self.trace.append(line)
        del self.trace[:-60]

    def keys(self, names: list[str]) -> list[Hashable]:
        """New key objects for ``names``, of this run's kind."""
        if self.kind == "strings":
            return list(names)
        make = KEY_KINDS[self.kind]
        return [make(self.rng, n) for n in names]


def store_process(w: World, names: list[str]) -> Generator[object, None, None]:
    """A store, step by step, as tiers/storage.py runs it; cancellable at every yield."""
    keys = w.keys(names)
    # A dict (as the facade passes a store's blocks: every key new and free slots for all of them is
    # reserved in one compiled step) or a list (as the remote tier passes its keys): the general path.
    r = w.ix.reserve(dict.fromkeys(keys) if w.rng.random() < 0.5 else keys)
    published = 0
    w.version += 1
    tags = {name_of(e.key): (name_of(e.key), w.version) for e in r.entries}
    try:
        for s in r.spills:
            yield "spill"
            FIGURES["spill writes"] += 1
            victim_tag = w.tag.get(name_of(s.victim.key)) if s.victim.state is State.SPILLING else None
            if victim_tag is not None:  # nobody overwrote the victim's host copy while it was written out
                assert w.mem[HOST][s.host_slot] == victim_tag, (s.victim.key, w.mem[HOST][s.host_slot], victim_tag)
            if w.rng.random() < 0.05:
                FIGURES["spill failures"] += 1
                raise IOError("injected")
            w.mem[DISK][s.disk_slot] = w.mem[HOST][s.host_slot]
            w.ix.spill_done(s)
        for s in r.spills:
            b = Blocked()
            w.ix.when_unread(s.host_slot, b.wake)
            if not b.ready:
                FIGURES["heir waits"] += 1
            while not b.ready:
                yield b
        # A store larger than the host slots it could have stages its first keys (disk slots) in the host
        # slots of its last ones on their way to disk: nobody else may read or own those meanwhile.
        staging = [e.slot for e in r.entries[r.to_disk:]] if 0 < r.to_disk < len(r.entries) else []
        for i, e in enumerate(r.entries):
            yield "chunk"
            if i < r.to_disk and staging:
                FIGURES["staged writes"] += 1
                w.mem[HOST][staging[i % len(staging)]] = tags[name_of(e.key)]
                yield "stage"
                w.mem[e.tier][e.slot] = w.mem[HOST][staging[i % len(staging)]]
            else:
                w.mem[e.tier][e.slot] = tags[name_of(e.key)]
            w.ix.publish([e])
            published += 1
            if e.state is State.READY:
                w.tag[name_of(e.key)] = tags[name_of(e.key)]
    finally:
        for s in r.spills:
            w.ix.spill_failed(s)
        w.ix.abort(r.entries[published:])


def load_process(w: World, names: list[str]) -> Generator[object, None, None]:
    """A load: pin; each promotion started (unless a store took its host slot back meanwhile), its disk
    copy read into its host slot, then made the entry's host copy (or the read fails); then each pinned
    copy read at a later step, checking it still holds the pinned bytes."""
    pins: list[Pin] = w.ix.pin(w.keys(names))
    expected = [w.tag[name_of(p.entry.key)] for p in pins]
    try:
        for p, want in zip(pins, expected):
            if p.promote_slot < 0:
                continue
            yield "start promotion"
            if not w.ix.start_promotion([p]):
                FIGURES["promotion slots taken back"] += 1
                continue  # read from its disk slot below
            yield "read into host"
            got = w.mem[DISK][p.slot]
            assert got == want, f"promotion of {p.entry.key!r} read {got!r} from disk slot {p.slot}, expected {want!r}"
            w.mem[HOST][p.promote_slot] = got  # nobody else may read or own this slot meanwhile
            if w.rng.random() < 0.05:
                FIGURES["promotion read failures"] += 1
                raise IOError("injected")
            yield "promote"
            w.ix.promotion_done([p])
            FIGURES["promotions"] += p.promoted
        for p, want in zip(pins, expected):
            yield "read"
            tier, slot = (HOST, p.promote_slot) if p.promote_slot >= 0 else (p.tier, p.slot)
            got = w.mem[tier][slot]
            assert got == want, f"load of {p.entry.key!r} read {got!r} from {('host', 'disk')[tier]} slot {slot}, expected {want!r}"
            FIGURES["reads checked"] += 1
    finally:
        w.ix.unpin(pins)


def check_world(w: World) -> None:
    w.ix.check()
    entries = {name_of(e.key): e for e in w.ix._entries.values()}
    visible = {k for k, e in entries.items() if e.state in (State.READY, State.SPILLING)}
    # `key in index` agrees, asked with new key objects of every key
    for k in KEYS:
        assert (w.keys([k])[0] in w.ix) == (k in visible), k
    assert visible <= set(w.tag), f"keys visible that were never published: {visible - set(w.tag)}"
    for k in set(w.tag) - visible:  # evicted (counted below)
        del w.tag[k]
        w.evicted_seen += 1
    assert w.evicted_seen == w.ix.evicted, (w.evicted_seen, w.ix.evicted)
    for k in visible:
        e = entries[k]
        assert w.mem[e.tier][e.slot] == w.tag[k], f"{k!r} in {('host', 'disk')[e.tier]} slot {e.slot} holds {w.mem[e.tier][e.slot]!r}"
        if e.clean_slot >= 0:
            assert w.mem[DISK][e.clean_slot] == w.tag[k], f"{k!r}'s clean copy in disk slot {e.clean_slot} holds {w.mem[DISK][e.clean_slot]!r}"
    c = w.ix.counts()
    assert c.host_free + c.host_ready <= HOST_SLOTS and c.disk_free + c.disk_ready + c.disk_clean <= DISK_SLOTS, c


def run_interleaving(seed: int, steps: int, kind: str) -> int:
    rng = random.Random(seed)
    w = World(BlockIndex(HOST_SLOTS, DISK_SLOTS, promote=True), rng, kind)
    procs: list[tuple[str, Generator[object, None, None], object]] = []
    done = 0
    while done < steps:
        op = rng.random()
        try:
            if op < 0.12 and len(procs) < 8:
                keys = rng.sample(KEYS, rng.randint(1, 3))
                w.log(f"store {keys}")
                g = store_process(w, keys)
                at = next(g, None)
                if at is not None:
                    procs.append(("store", g, at))
            elif op < 0.24 and len(procs) < 8:
                visible = [k for k in KEYS if w.keys([k])[0] in w.ix]
                if visible:
                    keys = rng.sample(visible, rng.randint(1, min(3, len(visible))))
                    w.log(f"load {keys}")
                    g = load_process(w, keys)
                    procs.append(("load", g, next(g)))
            elif op < 0.32:
                keys = rng.sample(KEYS, rng.randint(1, 2))
                n = w.ix.discard(w.keys(keys))
                for k in keys:
                    w.tag.pop(k, None)
                FIGURES["discards"] += n
                w.log(f"discard {keys} -> {n}")
            elif op < 0.38 and procs:
                kind, g, _ = procs.pop(rng.randrange(len(procs)))
                g.close()  # cancellation at whatever step it is
                FIGURES[f"{kind}s cancelled"] += 1
                w.log(f"cancel a {kind}")
            elif procs:
                i = rng.randrange(len(procs))
                kind, g, at = procs[i]
                if isinstance(at, Blocked) and not at.ready:
                    continue
                try:
                    procs[i] = (kind, g, next(g))
                except StopIteration:
                    procs.pop(i)
                    FIGURES[f"{kind}s completed"] += 1
                w.log(f"step a {kind} past {at}")
        except kvoffload.CapacityError:
            FIGURES["capacity refusals"] += 1
        except IOError:
            procs = [p for p in procs if p[1].gi_frame is not None]
        except AssertionError:
            print("\n".join(w.trace))
            raise
        try:
            check_world(w)
        except AssertionError:
            print(f"seed {seed}, step {done}; last operations:\n" + "\n".join(w.trace))
            raise
        done += 1
    for _, g, _ in procs:
        g.close()
    check_world(w)
    c = w.ix.counts()
    assert c.host_free + c.host_ready == HOST_SLOTS and c.disk_free + c.disk_ready + c.disk_clean == DISK_SLOTS, c
    FIGURES["evictions"] += w.ix.evicted
    FIGURES["clean copies at the end"] += c.disk_clean
    return done


@pytest.mark.slow
def test_interleavings_keep_every_slot_owned_once():
    started = time.perf_counter()
    total, seed = 0, 0
    kinds = ["strings", "tuples", "strings", "mixed"]
    while total < STEPS:
        total += run_interleaving(seed, 2000, kinds[seed % len(kinds)])
        seed += 1
    f = FIGURES
    report_figure(
        f"test_slot_states: {total} interleaved steps in {seed} runs ({time.perf_counter() - started:.1f} s; "
        f"keys: {', '.join(kinds)}, in turn): "
        f"{f['stores completed']} stores and {f['loads completed']} loads completed, "
        f"{f['stores cancelled']} stores and {f['loads cancelled']} loads cancelled mid-way, {f['discards']} keys discarded, "
        f"{f['spill writes']} spill writes ({f['spill failures']} failed), {f['heir waits']} heirs waited for a reader, "
        f"{f['staged writes']} blocks staged in host slots on their way to disk, "
        f"{f['promotions']} promotions ({f['promotion read failures']} reads failed, "
        f"{f['promotion slots taken back']} host slots taken back by stores before the read), "
        f"{f['evictions']} evictions, {f['reads checked']} reads checked, {f['capacity refusals']} capacity refusals"
    )
    assert f["promotions"] > 0 and f["clean copies at the end"] > 0


# -- the same on a real offloader ---------------------------------------------------------------


async def until(condition, timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds (a state change on a worker thread with no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["store ends", "store cancelled"])
async def test_the_discarded_spill_victim_never_frees_the_heirs_slot(tmp_path, faults, then):
    # A store spills victim b to disk; a load pins b's host copy; b is discarded while its spill runs.
    # Once the load ends, b's old host slot belongs to the store's new key: it must not go back to the
    # free list (a later store would overwrite it, and the new key would load another key's bytes).
    caches = random_caches(16, seed=3)
    orig = {n: t.clone() for n, t in caches.items()}
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    off = kvoffload.Offloader(caches, host_blocks=2, disk_path=str(tmp_path / "kv"), disk_blocks=4, chunk_bytes=slot).start()
    try:
        await off.store({"a": 0})
        await off.store({"b": 1})
        await off.load({"a": 10})  # a becomes the most recently used: b is the victim of the next store
        write = faults.gate(off, "pwritev")
        read = faults.gate(off, "to_device")
        st = off.store({"n": 2})  # spills b, then writes n into b's host slot
        await write.entered_async()
        ld = off.load({"b": 11})  # pins b's host copy while it is being spilled
        await read.entered_async()
        assert off.discard(["b"]) == 1
        write.open()
        # b's bytes are on disk while the load still reads its host copy; b being gone, its disk slot comes back
        # (a spill of a discarded victim moves nothing: stats().spilled does not count it)
        await until(lambda: off.stats().disk_free == 4)
        if then == "store cancelled":
            st.cancel()
        read.open()
        await ld
        assert same_bytes(caches["k0"][11], orig["k0"][1])  # the load read b's bytes, untouched
        if then == "store ends":
            await st
        else:
            with pytest.raises(kvoffload.TransferCancelled):
                await st
        check_index(off)
        s = off.stats()
        assert s.host_free + s.host_ready <= s.host_slots and s.pending == s.pinned == s.spilling == 0, s
        # Fill the host tier with new keys, then every visible key must load its own bytes.
        await off.store({"x": 3})
        await off.store({"y": 4})
        check_index(off)
        stored = {"a": 0, "n": 2, "x": 3, "y": 4}
        visible = {k: b for k, b in stored.items() if k in off}
        assert "b" not in off and {"x", "y"} <= set(visible)
        if then == "store ends":
            assert "n" in visible
        await off.load({k: 12 + i for i, k in enumerate(visible)})
        for i, (k, b) in enumerate(visible.items()):
            for n in caches:
                assert same_bytes(caches[n][12 + i], orig[n][b]), (k, n)
    finally:
        off.close()



def test_lookup_of_a_generator_that_asks_the_offloader_does_not_deadlock(caches):
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        off.store({"a": 0, "b": 1}).result(10)
        keys = ["a", "b", "c"]
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(off.lookup(k for k in keys if k in off)), daemon=True)
        t.start()
        t.join(10)
        assert result == [2], "lookup deadlocked on its own lock"


@pytest.mark.asyncio
async def test_a_key_discarded_while_its_store_runs_is_counted_never_published_and_the_store_succeeds(caches, faults):
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    with kvoffload.Offloader(caches, host_blocks=8, chunk_bytes=slot) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 0, "b": 1})
        await gate.entered_async()
        assert off.discard(["b"]) == 1  # pending: counted
        gate.open()
        result = await t
        assert result.keys == ("a", "b")
        assert "a" in off and "b" not in off
        check_index(off)
        s = off.stats()
        assert s.host_free == 7 and s.host_ready == 1 and s.pending == 0, s
