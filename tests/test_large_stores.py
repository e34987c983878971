"""Stores larger than the host tier: their first blocks go through the host tier to the disk tier, their
last ones stay in host memory; a store that cannot fit says whether it is too large or the tiers are busy."""

from __future__ import annotations

import errno

import pytest
import torch

import kvoffload
from support.caches import random_caches, same_bytes

HOST, DISK, N = 16, 256, 100
NUM_BLOCKS = 128


def snapshot(caches):
    return {n: t.clone() for n, t in caches.items()}


def restore(caches, orig) -> None:
    for n, t in caches.items():
        t.copy_(orig[n])


def perm(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def two_tier(make_offloader, caches, tmp_path, host: int = HOST, disk: int = DISK, chunk_blocks: int = 4):
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    return make_offloader(
        caches, host_blocks=host, disk_path=tmp_path / "kv.bin", disk_blocks=disk, chunk_bytes=chunk_blocks * slot,
    )


async def assert_loads(off, caches, orig, key_to_block, seed: int = 7) -> None:
    """Every key loads, byte for byte, the block it was stored from (into random destination blocks)."""
    for t in caches.values():
        t.zero_()
    dests = perm(NUM_BLOCKS, seed)[: len(key_to_block)]
    await off.load(dict(zip(key_to_block, dests)))
    for k, d in zip(key_to_block, dests):
        for n in caches:
            assert same_bytes(caches[n][d], orig[n][key_to_block[k]]), (k, n)


def assert_nothing_held(off, host: int = HOST, disk: int = DISK) -> None:
    s = off.stats()
    assert s.pending == 0 and s.pinned == 0 and s.spilling == 0 and s.in_flight == 0, s
    assert s.host_free + s.host_ready == host and s.disk_free + s.disk_ready + s.disk_clean == disk, s


@pytest.mark.asyncio
async def test_a_store_larger_than_the_host_tier_round_trips_through_the_disk_tier(tmp_path, make_offloader):
    caches = random_caches(NUM_BLOCKS, seed=3)
    orig = snapshot(caches)
    src = perm(NUM_BLOCKS, 1)[:N]
    blocks = {("p", i): src[i] for i in range(N)}
    off = two_tier(make_offloader, caches, tmp_path)
    r = await off.store(blocks)
    assert list(r.keys) == list(blocks) and r.nbytes == N * off.layout.block_bytes
    assert off.lookup(list(blocks)) == N
    s = off.stats()
    assert (s.host_ready, s.disk_ready, s.evicted) == (HOST, N - HOST, 0), s  # the last blocks stay in host memory
    assert_nothing_held(off)
    await assert_loads(off, caches, orig, blocks)


@pytest.mark.asyncio
async def test_a_second_large_store_evicts_the_first_ones_oldest_blocks(tmp_path, make_offloader):
    disk = 128
    caches = random_caches(NUM_BLOCKS, seed=4)
    orig = snapshot(caches)
    first = {("a", i): b for i, b in enumerate(perm(NUM_BLOCKS, 2)[:N])}
    second = {("b", i): b for i, b in enumerate(perm(NUM_BLOCKS, 3)[:N])}
    off = two_tier(make_offloader, caches, tmp_path, disk=disk)
    await off.store(first)
    await off.store(second)
    # Room for the second store came from the least recently used blocks: the first store's oldest.
    kept = HOST + disk - N
    first_keys = list(first)
    assert off.lookup(second) == N
    assert off.lookup(first_keys) == 0 and off.lookup(first_keys[N - kept:]) == kept
    assert not any(k in off for k in first_keys[: N - kept])
    s = off.stats()
    assert s.evicted == N - kept and s.ready == HOST + disk, s
    assert_nothing_held(off, disk=disk)
    await assert_loads(off, caches, orig, {**{k: first[k] for k in first_keys[N - kept:]}, **second})


@pytest.mark.asyncio
async def test_a_large_store_cancelled_mid_way_publishes_no_unfinished_key_and_frees_its_slots(tmp_path, make_offloader, faults):
    caches = random_caches(NUM_BLOCKS, seed=5)
    orig = snapshot(caches)
    blocks = {("c", i): b for i, b in enumerate(perm(NUM_BLOCKS, 4)[:N])}
    off = two_tier(make_offloader, caches, tmp_path)
    gate = faults.gate(off, "pwritev")
    t = off.store(blocks)
    gate.allow(2)  # two chunks reach the disk, then the store is held mid-way
    await gate.passed_async(count=2)
    await gate.entered_async(count=3)
    t.cancel()
    gate.open()
    with pytest.raises(kvoffload.TransferCancelled):
        await t
    visible = [k in off for k in blocks]
    published = sum(visible)
    assert visible == [True] * published + [False] * (N - published)  # finished chunks only, in order
    assert published < N - HOST and off.lookup(list(blocks)) == published
    assert_nothing_held(off)
    assert off.stats().ready == published
    if published:
        await assert_loads(off, caches, orig, dict(list(blocks.items())[:published]))
    restore(caches, orig)
    r = await off.store(blocks)  # the rest can be stored again
    assert len(r.keys) == N - published and off.lookup(list(blocks)) == N
    await assert_loads(off, caches, orig, blocks)


@pytest.mark.asyncio
async def test_an_io_error_mid_way_through_a_large_store_fails_it_and_leaks_nothing(tmp_path, make_offloader, faults):
    caches = random_caches(NUM_BLOCKS, seed=6)
    orig = snapshot(caches)
    blocks = {("e", i): b for i, b in enumerate(perm(NUM_BLOCKS, 5)[:N])}
    off = two_tier(make_offloader, caches, tmp_path)
    fault = faults.fail(off, "pwritev", OSError(errno.EIO, "injected"), from_call=4)
    with pytest.raises(kvoffload.TransferError):
        await off.store(blocks)
    assert fault.injected >= 1
    published = off.lookup(list(blocks))
    assert not any(k in off for k in list(blocks)[published:])
    assert published < N - HOST
    assert_nothing_held(off)
    assert off.stats().ready == published
    fault.active = False
    restore(caches, orig)
    await off.store(blocks)
    await assert_loads(off, caches, orig, blocks)


@pytest.mark.parametrize("disk", [0, 64])
def test_a_store_larger_than_the_tiers_together_names_the_request_and_the_capacity(tmp_path, make_offloader, disk):
    caches = random_caches(NUM_BLOCKS, seed=7)
    if disk:
        off = two_tier(make_offloader, caches, tmp_path, disk=disk)
    else:
        off = make_offloader(caches, host_blocks=HOST)
    before = off.stats()
    with pytest.raises(kvoffload.CapacityError) as ei:
        off.store({i: i for i in range(N)})
    msg = str(ei.value)
    assert f"a store of {N} blocks is larger than the host tier ({HOST} slots) and the disk tier ({disk} slots) together" in msg
    assert "running transfers" not in msg
    assert (ei.value.requested, ei.value.capacity) == (N, HOST + disk)
    assert off.stats() == before


@pytest.mark.asyncio
@pytest.mark.parametrize("disk", [0, 16])
async def test_a_store_refused_while_transfers_hold_the_slots_says_they_are_busy(tmp_path, make_offloader, faults, disk):
    caches = random_caches(NUM_BLOCKS, seed=8)
    off = two_tier(make_offloader, caches, tmp_path, disk=disk) if disk else make_offloader(caches, host_blocks=HOST, chunk_bytes=4 * kvoffload.BlockLayout.of(caches).slot_bytes)
    await off.store({("h", i): i for i in range(HOST)})
    gate = faults.gate(off, "to_device")
    load = off.load({("h", i): HOST + i for i in range(HOST)})  # holds every host slot while it runs
    try:
        await gate.entered_async()
        n = HOST + disk  # fits the tiers, but no host slot is free to take it now
        with pytest.raises(kvoffload.CapacityError) as ei:
            off.store({("n", i): i for i in range(n)})
        msg = str(ei.value)
        assert f"need {n} free" in msg and "in use by running transfers" in msg and "larger than" not in msg
        assert (ei.value.requested, ei.value.capacity) == (n, HOST + disk)
    finally:
        gate.open()
    await load
    assert_nothing_held(off, disk=disk)


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_gpu_a_store_larger_than_the_host_tier_round_trips(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    caches = random_caches(NUM_BLOCKS, "cuda", seed=9)
    orig = snapshot(caches)
    blocks = {("g", i): b for i, b in enumerate(perm(NUM_BLOCKS, 6)[:N])}
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=HOST, disk_path=tmp_path / "kv.bin", disk_blocks=DISK, chunk_bytes=4 * slot) as off:
        r = await off.store(blocks)
        assert len(r.keys) == N and off.lookup(list(blocks)) == N
        s = off.stats()
        assert (s.host_ready, s.disk_ready) == (HOST, N - HOST), s
        await assert_loads(off, caches, orig, blocks)
        torch.cuda.synchronize()
