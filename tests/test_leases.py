"""Hits held until loaded: ``lookup(keys, hold=True)`` returns a :class:`kvoffload.Lease` whose hits no
store evicts and no discard takes from its load; every way a lease ends gives its pins back."""

from __future__ import annotations

import asyncio
import gc
import math
import sys

import pytest

import kvoffload
from support.caches import block_bytes, random_caches
from support.interrupts import interrupter
from support.waiting import spin_until, wait_for_transfers_to_end

NUM_BLOCKS = 64
HOST = 8


def tiers(kind: str, tmp_path) -> dict:
    if kind == "host":
        return {"host_blocks": HOST}
    return {"host_blocks": HOST, "disk_path": tmp_path / "kv.bin", "disk_blocks": HOST}


def assert_index_sound(off) -> None:
    off._runtime.storage.index.check()


async def storm(off, rounds: int = 12, per_store: int = 3) -> None:
    """Stores of fresh keys, two at a time, filling the tiers many times over."""
    for r in range(rounds):
        await asyncio.gather(*(
            off.store({("storm", r, s, i): 8 + (3 * s + i) for i in range(per_store)}) for s in range(2)
        ))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["host", "host+disk"])
async def test_a_held_hit_survives_an_eviction_storm_and_loads_byte_exact(make_offloader, tmp_path, kind):
    caches = random_caches(NUM_BLOCKS, seed=5)
    off = make_offloader(caches, **tiers(kind, tmp_path))
    expected = block_bytes(caches, 1)
    await off.store({"held": 1})
    lease = off.lookup(["held", "absent", "held"], hold=True)
    assert isinstance(lease, kvoffload.Lease)
    assert lease.count == 1 and lease.keys == ("held",)
    assert off.stats().pinned == 1
    await storm(off)
    assert off.stats().evicted > 2 * HOST  # the tiers turned over many times
    assert "held" in off
    await off.load({"held": 40}, lease=lease)
    assert block_bytes(caches, 40) == expected
    assert off.stats().pinned == 0
    assert_index_sound(off)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["host", "host+disk"])
async def test_without_hold_the_same_storm_evicts_the_hit(make_offloader, tmp_path, kind):
    caches = random_caches(NUM_BLOCKS, seed=5)
    off = make_offloader(caches, **tiers(kind, tmp_path))
    await off.store({"hit": 1})
    assert off.lookup(["hit"]) == 1
    await storm(off)
    assert "hit" not in off
    with pytest.raises(kvoffload.MissingKeysError):
        off.load({"hit": 40})


@pytest.mark.asyncio
async def test_a_discarded_held_hit_is_forgotten_but_its_lease_still_loads_it(make_offloader):
    caches = random_caches(NUM_BLOCKS, seed=6)
    off = make_offloader(caches, host_blocks=HOST)
    expected = block_bytes(caches, 2)
    await off.store({"k": 2})
    lease = off.lookup(["k"], hold=True)
    assert off.discard(["k"]) == 1
    assert "k" not in off and off.lookup(["k"]) == 0
    await off.load({"k": 41}, lease=lease)
    assert block_bytes(caches, 41) == expected
    s = off.stats()
    assert s.pinned == 0 and s.host_free == HOST, s
    assert_index_sound(off)


def _end_by_release(off, lease) -> None:
    lease.release()
    lease.release()  # idempotent


def _end_by_gc(off, lease) -> None:
    del lease
    gc.collect()


ENDINGS = {"release": _end_by_release, "gc": _end_by_gc}


@pytest.mark.parametrize("ending", ["release", "gc"])
def test_ending_a_lease_gives_its_pins_back(make_offloader, caches, ending):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({i: i for i in range(4)}).result(10)
    lease = off.lookup(range(6), hold=True)
    assert lease.count == 4 and off.stats().pinned == 4
    ENDINGS[ending](off, lease)
    del lease
    assert off.stats().pinned == 0
    off.store({i: i for i in range(10, 10 + HOST)}).result(10)  # the released hits are evictable again
    assert off.lookup(range(4)) == 0
    assert_index_sound(off)


def test_leaving_the_with_block_gives_the_pins_back(make_offloader, caches):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({i: i for i in range(3)}).result(10)
    with off.lookup(range(3), hold=True) as lease:
        assert lease.count == 3 and off.stats().pinned == 3
    assert off.stats().pinned == 0


def test_an_expired_lease_gives_its_pins_back_and_its_load_pins_anew(make_offloader, caches):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({"a": 1, "b": 2}).result(10)
    lease = off.lookup(["a", "b"], hold=True, hold_s=0)
    assert lease.count == 2
    assert off.stats().pinned == 0  # expired at once
    off.load({"a": 30, "b": 31}, lease=lease).result(10)
    assert block_bytes(caches, 30) == block_bytes(caches, 1) and block_bytes(caches, 31) == block_bytes(caches, 2)
    assert off.stats().pinned == 0
    assert_index_sound(off)


def test_an_expired_lease_frees_a_waiting_store_with_no_other_call(make_offloader, caches, tmp_path, faults):
    """A store that spills a held hit to disk waits for the lease before writing the hit's host slot.
    The lease expires at its deadline with nobody calling the offloader, and the store finishes; a
    lease with a later deadline taken first does not delay it."""
    off = make_offloader(caches, host_blocks=2, disk_path=tmp_path / "kv.bin", disk_blocks=4)
    off.store({"v": 1, "w": 2}).result(10)  # host memory full; "v" is the least recently used
    later = off.lookup(["w"], hold=True, hold_s=60)
    writes = faults.gate(off, "pwritev")
    store = off.store({"new": 3})  # spills "v" to disk; "new" then takes its host slot
    lease = off.lookup(["v"], hold=True, hold_s=0.5)  # a reader of that host slot, until it expires
    assert lease.count == 1
    writes.open()
    writes.wait_passed()
    assert not store.done()  # the spill is on disk: the store waits for the lease
    store.result(timeout=5)  # nothing else calls the offloader meanwhile
    assert off.stats().pinned == 1  # "w", held for a minute more
    later.release()
    assert off.stats().pinned == 0
    off.load({"v": 40, "new": 41}, lease=lease).result(10)  # expired: pinned anew, "v" from disk
    assert block_bytes(caches, 40) == block_bytes(caches, 1) and block_bytes(caches, 41) == block_bytes(caches, 3)
    assert_index_sound(off)


def test_a_load_with_a_released_lease_pins_anew_or_raises_missing_keys(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({"a": 1, "b": 2}).result(10)
    lease = off.lookup(["a", "b"], hold=True)
    lease.release()
    off.load({"a": 30}, lease=lease).result(10)  # still stored: pinned anew
    assert block_bytes(caches, 30) == block_bytes(caches, 1)
    off.discard(["b"])
    with pytest.raises(kvoffload.MissingKeysError):
        off.load({"b": 31}, lease=lease)
    assert off.stats().pinned == 0
    assert_index_sound(off)


def test_a_load_through_a_lease_takes_its_pins_and_releases_the_rest(make_offloader, caches):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({i: i for i in range(4)}).result(10)
    lease = off.lookup(range(4), hold=True)
    off.load({1: 40, 0: 41}, lease=lease).result(10)
    assert block_bytes(caches, 40) == block_bytes(caches, 1) and block_bytes(caches, 41) == block_bytes(caches, 0)
    assert off.stats().pinned == 0  # the loaded keys' pins went with the load, the others when it was submitted
    lease.release()  # nothing left to give back: no slot is released twice
    assert off.stats().pinned == 0
    assert_index_sound(off)


def test_a_load_that_raises_keeps_the_lease(make_offloader, caches):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({"a": 1}).result(10)
    lease = off.lookup(["a"], hold=True)
    with pytest.raises(kvoffload.MissingKeysError):
        off.load({"a": 30, "absent": 31}, lease=lease)
    assert off.stats().pinned == 1
    off.load({"a": 30}, lease=lease).result(10)
    assert off.stats().pinned == 0
    assert_index_sound(off)


def test_a_lease_of_another_offloader_is_refused(make_offloader, caches):
    one = make_offloader(caches, host_blocks=HOST)
    other = make_offloader(caches, host_blocks=HOST)
    one.store({"a": 1}).result(10)
    other.store({"a": 1}).result(10)
    with one.lookup(["a"], hold=True) as lease:
        with pytest.raises(ValueError, match="another offloader"):
            other.load({"a": 30}, lease=lease)
        with pytest.raises(TypeError):
            one.load({"a": 30}, lease=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        one.lookup(["a"], hold=True, hold_s=-1)


def test_an_infinite_hold_outlives_a_finite_one_until_released(make_offloader, caches):
    """``hold_s=inf``: no deadline. A finite hold expires beside it, with nobody calling the offloader;
    the infinite one stays through stores that turn the host tier over, arms no timer, leaves nothing
    in the index's deadline heap, and ends by ``release()`` (or garbage collection)."""
    off = make_offloader(caches, host_blocks=HOST)
    off.store({"forever": 1, "brief": 2}).result(10)
    forever = off.lookup(["forever"], hold=True, hold_s=math.inf)
    brief = off.lookup(["brief"], hold=True, hold_s=0.05)
    assert (forever.count, brief.count, off.stats().pinned) == (1, 1, 2)
    rt = off._runtime
    spin_until(lambda: off.stats().pinned == 1, what="the finite hold's expiry")
    spin_until(lambda: rt.hold_expiry._handle is None, what="the end of the finite hold's wake-up")  # none armed after it
    for r in range(2):
        off.store({(r, i): 10 + i for i in range(HOST - 1)}).result(10)
    assert "forever" in off and "brief" not in off and off.stats().pinned == 1
    assert rt.hold_expiry._handle is None and not rt.storage.index.holds.timed()
    forever.release()
    assert off.stats().pinned == 0
    off.load({"forever": 40}, lease=forever).result(10)  # released: pinned anew
    assert block_bytes(caches, 40) == block_bytes(caches, 1)
    again = off.lookup(["forever"], hold=True, hold_s=float("inf"))
    assert off.stats().pinned == 1
    del again
    gc.collect()
    assert off.stats().pinned == 0 and not rt.storage.index.holds.timed()
    assert_index_sound(off)


def test_hold_s_is_seconds_or_inf_and_other_durations_stay_finite(make_offloader, caches):
    off = make_offloader(caches, host_blocks=HOST)
    off.store({"a": 1}).result(10)
    for bad in (math.nan, -1, -math.inf):
        with pytest.raises(ValueError, match="hold_s"):
            off.lookup(["a"], hold=True, hold_s=bad)
    with pytest.raises(TypeError, match="hold_s"):
        off.lookup(["a"], hold=True, hold_s="30")  # type: ignore[call-overload]
    with off.lookup(["a"], hold=True, hold_s=sys.float_info.max):  # finite: a timer far away, no overflow
        assert off.stats().pinned == 1
    assert off.stats().pinned == 0
    with pytest.raises(ValueError, match="timeout"):
        off.close(timeout=math.inf)  # None is close()'s "no limit"


def test_lookup_counts_as_a_use_for_eviction(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({i: i for i in range(4)}).result(10)  # 0 is the least recently used
    assert off.lookup([0]) == 1  # now 1 is
    off.store({4: 4}).result(10)
    assert 0 in off and 1 not in off


# An interrupt may also land in another library's gc callback, which swallows it (reported as unraisable).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupts_anywhere_in_held_lookups_and_their_loads_leak_no_pin(make_offloader):
    caches = random_caches(NUM_BLOCKS, seed=8)
    off = make_offloader(caches, host_blocks=16)
    off.store({("k", b): b for b in range(12)}).result(10)
    interrupted = 0
    with interrupter(seed=2) as ctrl_c:
        for i in range(1500):
            keys = [("k", (i + j) % 12) for j in range(4)]
            lease = load = None
            try:
                ctrl_c.arm()  # an interrupt at a random point of the round (or none, if it ends first)
                lease = off.lookup(keys, hold=True)
                if i % 3 == 0:
                    off.discard(keys[:1])  # held: forgotten, but still loaded through the lease
                if i % 4:  # most rounds load through the lease; the others let it go
                    load = off.load({k: 32 + n for n, k in enumerate(lease.keys)}, lease=lease)
                if lease is not None:
                    lease.release()
                ctrl_c.armed = False
            except KeyboardInterrupt:
                ctrl_c.armed = False
                interrupted += 1
            if lease is not None:
                lease.release()  # what an interrupt cut short, finished
            if load is not None:
                load.result(10)
            if keys[0] not in off:
                off.store({keys[0]: keys[0][1]}).result(10)
    assert interrupted > 100, interrupted
    gc.collect()
    wait_for_transfers_to_end(off)
    s = off.stats()
    assert (s.in_flight, s.pinned) == (0, 0), s
    assert_index_sound(off)
    for b in range(12):
        if ("k", b) in off:
            off.load({("k", b): 63}).result(10)
            assert block_bytes(caches, 63) == block_bytes(caches, b)
