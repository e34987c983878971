"""Promotion: a load of disk-resident keys leaves a copy of them in free host slots, so that a hot
prefix stored on disk is read from host memory the next time.

The promoted entry keeps its disk copy as a clean copy: when host memory needs room it is dropped
from host memory without a write (it is disk-resident again), and when the disk needs room the
clean copy goes first (the entry stays in host memory). Promotion never evicts nor spills anything:
it only takes host slots free when the load is called. ``promote=False`` turns it off.
"""

from __future__ import annotations

import asyncio
import errno

import numpy as np
import pytest
import torch

import kvoffload
from support.caches import block_bytes, random_caches, same_bytes
from support.interrupts import interrupter
from support.waiting import wait_for_transfers_to_end
from kvoffload._testing import check_index, pinned_buffers

NUM_BLOCKS = 64
HOST, DISK = 4, 8


def make(make_offloader, tmp_path, caches, host: int = HOST, disk: int = DISK, **kw) -> kvoffload.Offloader:
    """An offloader with a host and a disk tier, one block per chunk (every transfer spans chunks)."""
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    return make_offloader(caches, host_blocks=host, disk_path=tmp_path / "kv.bin", disk_blocks=disk, chunk_bytes=slot, **kw)


def clean_copies(off: kvoffload.Offloader) -> int:
    """Disk slots holding the clean copy of a host-resident entry (neither free nor a disk entry's)."""
    return off.stats().disk_clean


async def to_disk(off: kvoffload.Offloader, blocks: dict) -> None:
    """Store ``blocks`` (at most a host tier's worth) and push them to disk, leaving every host slot free."""
    await off.store(blocks)
    filler = {("filler", i): 60 + i % 4 for i in range(off.stats().host_slots)}
    await off.store(filler)  # spills ``blocks`` to disk
    off.discard(filler)
    s = off.stats()
    assert s.host_free == s.host_slots and all(k in off for k in blocks), s


async def loaded(off: kvoffload.Offloader, caches, keys: list, first_block: int = 32) -> dict:
    """Load ``keys`` into blocks from ``first_block`` on; the bytes each key loaded."""
    await off.load({k: first_block + i for i, k in enumerate(keys)})
    return {k: block_bytes(caches, first_block + i) for i, k in enumerate(keys)}


@pytest.mark.asyncio
async def test_a_disk_resident_prefix_loaded_once_is_loaded_from_host_the_next_time(make_offloader, tmp_path):
    caches = random_caches(NUM_BLOCKS, seed=11)
    off = make(make_offloader, tmp_path, caches)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    before = off.stats()
    assert before.disk_ready == HOST and before.promoted == 0
    assert await loaded(off, caches, list(prefix)) == expected
    s = off.stats()
    assert s.keys_loaded_from_disk - before.keys_loaded_from_disk == HOST
    assert s.promoted == HOST and s.host_ready == HOST and s.disk_ready == 0 and s.host_free == 0
    assert clean_copies(off) == HOST  # the disk copies stay, clean
    assert s.evicted == before.evicted and s.spilled == before.spilled
    assert await loaded(off, caches, list(prefix), first_block=40) == expected
    t = off.stats()
    assert t.keys_loaded_from_host - s.keys_loaded_from_host == HOST
    assert t.keys_loaded_from_disk == s.keys_loaded_from_disk and t.disk_bytes_read == s.disk_bytes_read
    check_index(off)


@pytest.mark.asyncio
async def test_a_promoting_load_reads_the_disk_straight_into_the_host_slab(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=12)
    off = make(make_offloader, tmp_path, caches)
    await to_disk(off, {("p", i): i for i in range(HOST)})
    slab = pinned_buffers(off)[0].tensor.numpy()
    lo, hi = slab.ctypes.data, slab.ctypes.data + slab.nbytes
    reads = faults.spy(off, "preadv")
    await off.load({("p", i): 32 + i for i in range(HOST)})
    buffers = [np.asarray(b) for _fd, bufs, _offset in reads.calls for b in bufs]
    assert sum(b.nbytes for b in buffers) == HOST * off.layout.slot_bytes  # each block read once
    assert all(lo <= b.ctypes.data and b.ctypes.data + b.nbytes <= hi for b in buffers), "a read went through a bounce buffer"
    assert off.stats().promoted == HOST


@pytest.mark.asyncio
async def test_promotion_takes_only_free_host_slots_and_never_evicts_or_spills(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=13)
    off = make(make_offloader, tmp_path, caches)
    on_disk = {("d", i): i for i in range(3)}
    await to_disk(off, on_disk)
    await off.store({("h", i): 10 + i for i in range(HOST)})  # the host tier is full
    before = off.stats()
    assert before.host_free == 0
    writes = faults.spy(off, "pwritev")
    await off.load({k: 32 + i for i, k in enumerate(on_disk)})
    s = off.stats()
    assert (s.promoted, s.evicted, s.spilled, writes.entered) == (0, before.evicted, before.spilled, 0), s
    assert all(("h", i) in off for i in range(HOST)) and s.host_ready == HOST and s.disk_ready == before.disk_ready
    # One host slot free: the first disk-resident key of the load takes it, the others stay on disk.
    off.discard([("h", 0)])
    await off.load({k: 32 + i for i, k in enumerate(on_disk)})
    s = off.stats()
    assert (s.promoted, s.evicted, s.host_free, writes.entered) == (1, before.evicted, 0, 0), s
    await off.load({("d", 0): 40, ("d", 1): 41})
    t = off.stats()
    assert t.keys_loaded_from_host - s.keys_loaded_from_host == 1 and t.keys_loaded_from_disk - s.keys_loaded_from_disk == 1
    check_index(off)


@pytest.mark.asyncio
async def test_a_store_takes_back_the_host_slots_of_promotions_not_started_instead_of_spilling(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=24)
    off = make(make_offloader, tmp_path, caches)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    await off.store({"h": 10})
    gate = faults.gate(off, "preadv")
    t = off.load({k: 32 + i for i, k in enumerate(prefix)})  # the 3 free host slots, for its first 3 keys
    await gate.entered_async(count=2)  # the reads of the first two chunks are running: their slots are the load's
    writes = faults.spy(off, "pwritev")
    before = off.stats()
    await off.store({"n": 11})  # the third promotion's slot, not yet read into, is taken back
    s = off.stats()
    assert (s.spilled, s.evicted, writes.entered) == (before.spilled, before.evicted, 0), s
    gate.open()
    await t
    assert {k: block_bytes(caches, 32 + i) for i, k in enumerate(prefix)} == expected
    s = off.stats()
    assert s.promoted == 2 and s.host_ready == 4 and all(k in off for k in ("h", "n", *prefix)), s
    assert_nothing_leaked(off)


@pytest.mark.asyncio
async def test_a_promoted_entry_dropped_from_host_memory_writes_nothing_and_loads_byte_exact_from_disk(
    make_offloader, tmp_path, faults,
):
    caches = random_caches(NUM_BLOCKS, seed=14)
    off = make(make_offloader, tmp_path, caches)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    await off.load({k: 32 + i for i, k in enumerate(prefix)})
    before = off.stats()
    assert before.promoted == HOST
    writes = faults.spy(off, "pwritev")
    await off.store({("n", i): 10 + i for i in range(HOST)})  # host room: the promoted entries go back to disk
    s = off.stats()
    assert writes.entered == 0 and s.disk_bytes_written == before.disk_bytes_written
    assert (s.spilled, s.evicted) == (before.spilled, before.evicted)
    assert s.host_ready == HOST and s.disk_ready == HOST and clean_copies(off) == 0
    assert await loaded(off, caches, list(prefix)) == expected
    assert off.stats().keys_loaded_from_disk - s.keys_loaded_from_disk == HOST
    check_index(off)


@pytest.mark.asyncio
async def test_disk_pressure_drops_a_clean_copy_not_an_entry(make_offloader, tmp_path):
    caches = random_caches(NUM_BLOCKS, seed=15)
    off = make(make_offloader, tmp_path, caches, host=4, disk=4)
    stored = {("k", i): i for i in range(4)}
    await to_disk(off, stored)  # the disk tier is full
    await off.store({("n", 0): 4, ("n", 1): 5})
    await off.load({("k", 0): 32, ("k", 1): 33})  # promoted into the two free host slots
    assert off.stats().disk_free == 0 and clean_copies(off) == 2
    before = off.stats()
    # Host room: ("n", 0) is the least recently used and has no disk copy, so it is spilled; the disk
    # slot it takes is a clean copy's, not a disk entry's.
    await off.store({("m", 0): 6})
    s = off.stats()
    stored.update({("n", 0): 4, ("n", 1): 5, ("m", 0): 6})
    assert s.evicted == before.evicted and s.spilled == before.spilled + 1, s
    assert all(k in off for k in stored) and clean_copies(off) == 1 and s.disk_free == 0
    assert (s.host_ready, s.disk_ready) == (4, 3)
    expected = {k: block_bytes(caches, b) for k, b in stored.items()}
    assert await loaded(off, caches, list(stored)) == expected
    check_index(off)


@pytest.mark.asyncio
async def test_discarding_a_promoted_entry_frees_both_of_its_slots(make_offloader, tmp_path):
    caches = random_caches(NUM_BLOCKS, seed=16)
    off = make(make_offloader, tmp_path, caches)
    await to_disk(off, {"a": 1, "b": 2})
    await off.load({"a": 32})
    before = off.stats()
    assert before.promoted == 1 and clean_copies(off) == 1
    assert off.discard(["a"]) == 1
    s = off.stats()
    assert "a" not in off and s.host_free == before.host_free + 1 and s.disk_free == before.disk_free + 1
    assert clean_copies(off) == 0 and s.host_free == HOST and s.disk_free == DISK - 1
    check_index(off)


@pytest.mark.asyncio
async def test_promote_false_never_promotes(make_offloader, tmp_path):
    caches = random_caches(NUM_BLOCKS, seed=17)
    off = make(make_offloader, tmp_path, caches, promote=False)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    for first in (32, 40):
        assert await loaded(off, caches, list(prefix), first) == expected
    s = off.stats()
    assert s.promoted == 0 and s.keys_loaded_from_disk == 2 * HOST and s.keys_loaded_from_host == 0
    assert s.host_free == HOST and s.disk_ready == HOST and clean_copies(off) == 0


def assert_nothing_leaked(off: kvoffload.Offloader) -> None:
    check_index(off)
    s = off.stats()
    assert (s.in_flight, s.pinned, s.pending, s.spilling) == (0, 0, 0, 0), s
    assert s.host_free + s.host_ready == s.host_slots, s
    assert s.disk_free + s.disk_ready + clean_copies(off) == s.disk_slots, s


@pytest.mark.asyncio
async def test_a_failed_disk_read_promotes_nothing_and_gives_the_host_slots_back(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=18)
    off = make(make_offloader, tmp_path, caches)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    fault = faults.fail(off, "preadv", OSError(errno.EIO, "injected"))
    with pytest.raises(kvoffload.TransferError):
        await off.load({k: 32 + i for i, k in enumerate(prefix)})
    assert fault.injected >= 1
    s = off.stats()
    assert s.promoted == 0 and s.host_free == HOST and s.disk_ready == HOST, s
    assert_nothing_leaked(off)
    fault.active = False
    assert await loaded(off, caches, list(prefix)) == expected
    assert off.stats().promoted == HOST


@pytest.mark.asyncio
async def test_a_load_cancelled_mid_promotion_keeps_what_landed_and_leaks_nothing(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=19)
    off = make(make_offloader, tmp_path, caches)
    prefix = {("p", i): i for i in range(HOST)}
    expected = {k: block_bytes(caches, b) for k, b in prefix.items()}
    await to_disk(off, prefix)
    gate = faults.gate(off, "preadv")
    t = off.load({k: 32 + i for i, k in enumerate(prefix)})
    gate.allow(1)  # the first chunk's read lands
    await gate.entered_async(count=2)  # the second chunk's read waits at the gate
    t.cancel()
    gate.open()
    with pytest.raises(kvoffload.TransferCancelled):
        await t
    s = off.stats()
    assert s.promoted <= 2 and s.host_ready == s.promoted, s  # nothing unfinished promoted
    assert_nothing_leaked(off)
    gate.remove()
    assert await loaded(off, caches, list(prefix)) == expected
    assert off.stats().promoted == HOST
    assert_nothing_leaked(off)


@pytest.mark.asyncio
async def test_a_key_discarded_during_its_promotion_loads_and_leaves_no_copy(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=20)
    off = make(make_offloader, tmp_path, caches)
    expected = block_bytes(caches, 1)
    await to_disk(off, {"a": 1})
    gate = faults.gate(off, "preadv")
    t = off.load({"a": 32})
    await gate.entered_async()
    assert off.stats().host_free == HOST - 1  # the host slot the read goes to
    assert off.discard(["a"]) == 1
    gate.open()
    await t
    assert block_bytes(caches, 32) == expected
    s = off.stats()
    assert "a" not in off and s.promoted == 0 and s.host_free == HOST and s.disk_free == DISK, s
    assert_nothing_leaked(off)


@pytest.mark.asyncio
async def test_concurrent_loads_of_a_disk_resident_key_leave_one_host_copy(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=21)
    off = make(make_offloader, tmp_path, caches)
    expected = block_bytes(caches, 1)
    await to_disk(off, {"a": 1})
    gate = faults.gate(off, "preadv")
    first = off.load({"a": 32})
    second = off.load({"a": 33})  # both find "a" on disk, and a free host slot each
    await gate.entered_async(count=2)
    assert off.stats().host_free == HOST - 2
    gate.open()
    await asyncio.gather(first, second)
    assert block_bytes(caches, 32) == expected and block_bytes(caches, 33) == expected
    s = off.stats()
    assert s.promoted == 1 and s.host_ready == 1 and s.host_free == HOST - 1 and clean_copies(off) == 1, s
    assert_nothing_leaked(off)


@pytest.mark.asyncio
async def test_pending_keys_are_counted_by_the_tier_their_store_writes(make_offloader, tmp_path, faults):
    caches = random_caches(NUM_BLOCKS, seed=22)
    off = make(make_offloader, tmp_path, caches)
    gate = faults.gate(off, "to_host")
    t = off.store({("k", i): i for i in range(HOST + 2)})  # larger than the host tier: two keys go to disk
    await gate.entered_async()
    s = off.stats()
    assert (s.pending, s.host_pending, s.disk_pending) == (HOST + 2, HOST, 2), s
    gate.open()
    await t
    s = off.stats()
    assert (s.pending, s.host_pending, s.disk_pending) == (0, 0, 0), s


# An interrupt may also land in another library's gc callback, which swallows it (reported as unraisable).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupts_anywhere_in_promoting_loads_and_the_stores_between_them_leak_no_slot(make_offloader, tmp_path):
    caches = random_caches(NUM_BLOCKS, seed=23)
    off = make(make_offloader, tmp_path, caches, host=8, disk=14)  # too small for a disk copy of every key and a clean copy
    keys = [("k", b) for b in range(16)]
    off.store({k: k[1] for k in keys}).result(10)  # the first 8 on disk, the last 8 in host memory
    fresh = {("fresh", j): 16 + j for j in range(3)}
    interrupted = 0
    with interrupter(seed=3) as ctrl_c:
        for i in range(1500):
            store = load = None
            try:
                ctrl_c.arm()  # an interrupt at a random point of the round (or none, if it ends first)
                if i % 2 == 0:  # host room: promoted entries go back to disk (no write), clean copies may go
                    store = off.store(fresh)
                    off.discard(fresh)  # what the store took is free again once it ends
                load = off.load({keys[(i * 5 + j) % 16]: 32 + j for j in range(3)})  # into the free host slots
                ctrl_c.armed = False
            except KeyboardInterrupt:
                ctrl_c.armed = False
                interrupted += 1
            for t in (store, load):
                if t is not None:
                    t.result(10)
    s = off.stats()
    # Promotions, returns to clean copies and clean copies dropped for the spills of the others, all of them
    # cut short at random points: nothing is lost (8 spills would do without dropped clean copies).
    assert interrupted > 100 and s.promoted > 200 and s.spilled > 100 and s.evicted == 0, (interrupted, s)
    wait_for_transfers_to_end(off)
    off.discard(fresh)
    assert_nothing_leaked(off)
    for k in keys:
        off.load({k: 63}).result(10)
        assert block_bytes(caches, 63) == block_bytes(caches, k[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.asyncio
@pytest.mark.parametrize("chunk_blocks", [2, 64])
async def test_a_promoting_load_into_a_gpu_cache_is_byte_exact_and_the_next_one_reads_host_memory(tmp_path, chunk_blocks):
    caches = random_caches(256, "cuda", seed=25)
    orig = {n: t.clone() for n, t in caches.items()}
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=48, disk_path=tmp_path / "kv", disk_blocks=64,
                                   chunk_bytes=chunk_blocks * slot) as off:
        await off.store({i: i for i in range(40)})
        await off.store({("filler", i): 100 + i for i in range(48)})  # the 40 keys go to disk
        off.discard([("filler", i) for i in range(48)])
        for first, tier in ((128, "disk"), (192, "host")):
            for t in caches.values():
                t[first : first + 40].zero_()
            before = off.stats()
            await off.load({i: first + i for i in range(40)})
            torch.cuda.synchronize()
            for n in caches:
                assert same_bytes(caches[n][first : first + 40], orig[n][:40]), (tier, n)
            s = off.stats()
            loaded = s.keys_loaded_from_disk - before.keys_loaded_from_disk if tier == "disk" else s.keys_loaded_from_host - before.keys_loaded_from_host
            assert loaded == 40 and s.promoted == 40, (tier, s)
    assert not (tmp_path / "kv").exists()
