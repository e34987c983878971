"""Cancellation storms, shutdown under load, and resource use over open/close cycles (CPU, with a disk tier)."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import threading
import time

import pytest
import torch

import kvoffload
from conftest import check_every_visible_key, random_caches


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvoffload")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.asyncio
async def test_cancellation_storm_leaves_everything_free_and_correct(tmp_path):
    caches = random_caches(256, seed=41)
    orig = {n: t.clone() for n, t in caches.items()}
    rng = random.Random(41)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=48, disk_path=tmp_path / "kv", disk_blocks=96, chunk_bytes=2 * slot) as off:
        stored: dict = {}
        transfers: list[kvoffload.Transfer] = []
        cancelled_by_thread = threading.Event()

        def canceller() -> None:  # cancels from a plain thread, at random moments
            r = random.Random(7)
            while not cancelled_by_thread.is_set():
                if transfers:
                    t = transfers[r.randrange(len(transfers))]
                    t.cancel()
                time.sleep(r.random() * 0.002)

        th = threading.Thread(target=canceller)
        th.start()

        async def one(i: int) -> str:
            keys = {("k", i, j): rng.randrange(128) for j in range(rng.randint(1, 3))}
            try:
                if rng.random() < 0.3 and stored:
                    present = [k for k in list(stored)[-64:] if k in off]
                    if not present:
                        return "skip"
                    t = off.load({rng.choice(present): 128 + i % 128})
                else:
                    t = off.store(keys)
                    stored.update(keys)
            except kvoffload.CapacityError:  # every host slot is held by running stores: a valid answer
                return "capacity"
            transfers.append(t)
            how = rng.random()
            try:
                if how < 0.25:
                    async with asyncio.timeout(rng.random() * 0.003):
                        await t
                elif how < 0.5:
                    task = asyncio.ensure_future(_await(t))
                    await asyncio.sleep(rng.random() * 0.002)
                    task.cancel()
                    await task
                else:
                    await t
                return "done"
            except (asyncio.CancelledError, TimeoutError):
                return "cancelled"

        outcomes: list[str] = []
        for wave in range(45):  # 45 waves x 80 attempts: about 2,000 transfers (the rest find no room)
            outcomes += await asyncio.gather(*(one(wave * 80 + i) for i in range(80)))
        cancelled_by_thread.set()
        th.join()
        for t in transfers:  # every transfer ended one way or another
            assert t.done()
        s = off.stats()
        assert (s.pending, s.pinned, s.spilling, s.in_flight) == (0, 0, 0, 0), s
        assert s.host_free + s.host_ready == 48 and s.disk_free + s.disk_ready == 96, s
        n_cancelled = sum(t.cancelled() for t in transfers)
        assert n_cancelled > 100, "the storm cancelled too little to mean anything"
        for n, t in caches.items():
            t.copy_(orig[n])
        seen = len(await check_every_visible_key(off, caches, orig, stored))
        for n, t in caches.items():
            t.copy_(orig[n])
        await off.store({"after": 1})  # and it keeps working
    print(f"storm: {len(transfers)} transfers, {n_cancelled} cancelled, {seen} visible keys verified")


async def _await(t):
    return await t


@pytest.mark.parametrize("how", ["close", "context", "gc"])
def test_shutdown_under_load_in_both_directions(tmp_path, how):
    caches = random_caches(256, seed=42)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    path = tmp_path / "kv"
    fds = open_fds()
    off = kvoffload.Offloader(caches, host_blocks=64, disk_path=path, disk_blocks=128, chunk_bytes=slot).start()
    for b in range(0, 100, 50):  # more than the host tier holds: spills to disk
        off.store({("seed", i): i for i in range(b, b + 50)}).result(30)
    transfers = []
    for i in range(20):
        transfers.append(off.store({("s", i, j): (i * 7 + j) % 256 for j in range(3)}))
        transfers.append(off.load({("seed", i): 200 + i}))
    t0 = time.perf_counter()
    if how == "close":
        off.close()
    elif how == "context":
        with off:
            pass
    else:
        del off
        gc.collect()
    took = time.perf_counter() - t0
    assert took < 15, f"shutdown took {took:.1f} s"
    for t in transfers:
        assert t.done() and (t.cancelled() or t.exception() is None)
    assert not kv_threads(), kv_threads()
    assert not path.exists()
    assert open_fds() <= fds


def test_open_close_cycles_do_not_leak(tmp_path):
    caches = random_caches(64, seed=43)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes

    def cycle(i: int) -> None:
        with kvoffload.Offloader(caches, host_blocks=32, disk_path=tmp_path / f"kv{i}", disk_blocks=64, chunk_bytes=4 * slot) as off:
            off.store({j: j for j in range(32)}).result(30)
            off.store({j: j for j in range(32, 48)}).result(30)  # spills
            off.load({j: j for j in range(16)}).result(30)

    cycle(0)
    gc.collect()
    fds, threads, rss = open_fds(), threading.active_count(), rss_bytes()
    for i in range(1, 21):
        cycle(i)
    gc.collect()
    assert open_fds() <= fds
    assert threading.active_count() <= threads
    assert rss_bytes() - rss < 64 << 20, f"RSS grew {(rss_bytes() - rss) >> 20} MiB over 20 cycles"
    assert not list(tmp_path.iterdir())


def test_host_memory_is_the_configured_slots_plus_constant(tmp_path):
    caches = {"kv": torch.randint(0, 255, (64, 256 << 10), dtype=torch.uint8)}  # 256 KiB blocks
    before = rss_bytes()
    with kvoffload.Offloader(caches, host_blocks=128, chunk_bytes=8 << 20) as off:
        off.store({i: i for i in range(64)}).result(30)
        grown = rss_bytes() - before
    slab = 128 * (256 << 10)
    assert slab <= grown < slab + (48 << 20), f"RSS grew {grown >> 20} MiB for a {slab >> 20} MiB slab"
