"""The disk tier on CPU caches: round trips, spill, security, faults, cancellation, responsiveness."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time

import pytest

import kvoffload
from support.caches import random_caches, same_bytes
from kvoffload._testing import disk_file_stat, uses_o_direct


def snapshot(caches):
    return {n: t.clone() for n, t in caches.items()}


async def assert_keys_load(off, caches, orig, key_to_block):
    """Every key loads, byte for byte, the block it was stored from."""
    for t in caches.values():
        t.zero_()
    keys = list(key_to_block)
    await off.load({k: i for i, k in enumerate(keys)})
    for i, k in enumerate(keys):
        for n in caches:
            assert same_bytes(caches[n][i], orig[n][key_to_block[k]]), (k, n)


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk_blocks", [1, 3, 64])
async def test_disk_only_round_trip(tmp_path, chunk_blocks):
    caches = random_caches(128, seed=chunk_blocks)
    orig = snapshot(caches)
    path = tmp_path / "kv.bin"
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    src = [int(x) for x in (torch_perm(128, chunk_blocks)[:100])]
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=path, disk_blocks=100, chunk_bytes=chunk_blocks * slot) as off:
        st = disk_file_stat(off)
        assert st.st_mode & 0o777 == 0o600 and st.st_nlink == 0  # private, and without a name
        assert st.st_size == 100 * slot and st.st_blocks * 512 >= 100 * slot  # reserved up front
        assert os.listdir(tmp_path) == []
        r = await off.store({("k", i): src[i] for i in range(100)})
        assert len(r.keys) == 100
        s = off.stats()
        assert s.disk_ready == 100 and s.host_ready == 0 and s.disk_free == 0
        await assert_keys_load(off, caches, orig, {("k", i): src[i] for i in range(100)})
    assert not path.exists()


def torch_perm(n, seed):
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.asyncio
async def test_o_direct_is_used_and_slots_are_aligned(tmp_path, faults):
    import mmap

    # only where tmp_path's file system takes O_DIRECT (ext4/xfs do; tmpfs and some network file systems do not)
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    probe = tmp_path / "o_direct_probe"
    buf = mmap.mmap(-1, 4096)  # page aligned
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf, 0)
        finally:
            os.close(fd)
    except OSError as e:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT IO: {e}")
    finally:
        buf.close()
        probe.unlink(missing_ok=True)
    caches = random_caches(16)
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=16) as off:
        assert uses_o_direct(off)  # ext4/xfs here; tmpfs would fall back with a warning
        spy = faults.spy(off, "pwritev")
        await off.store({i: i for i in range(16)})
        calls = [(offset, [memoryview(b).nbytes for b in bufs], [_addr(b) for b in bufs]) for _fd, bufs, offset in spy.calls]
    assert calls
    for offset, sizes, addrs in calls:
        assert offset % 4096 == 0 and all(s % 4096 == 0 for s in sizes) and all(a % 4096 == 0 for a in addrs)


def _addr(buf):
    import numpy as np

    return np.asarray(buf).ctypes.data


@pytest.mark.asyncio
async def test_spill_keeps_every_key_visible_and_correct(tmp_path):
    caches = random_caches(256, seed=21)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=16, disk_path=tmp_path / "kv", disk_blocks=200) as off:
        stored = {}
        for i in range(0, 200, 8):
            blocks = {("s", j): (j * 7) % 256 for j in range(i, i + 8)}
            await off.store(blocks)
            stored.update(blocks)
            assert off.lookup(list(stored)) == len(stored)  # nothing dropped while the disk has room
        s = off.stats()
        assert s.host_ready == 16 and s.disk_ready == 184 and s.spilled == 184 and s.evicted == 0
        await assert_keys_load(off, caches, orig, stored)


@pytest.mark.asyncio
async def test_disk_full_drops_least_recently_used(tmp_path):
    caches = random_caches(64, seed=22)
    async with kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=8) as off:
        for i in range(16):
            await off.store({i: i})
        s = off.stats()
        assert s.ready == 12 and s.evicted == 4
        assert [i in off for i in range(16)] == [False] * 4 + [True] * 12


@pytest.mark.asyncio
async def test_lookup_and_load_while_a_key_is_spilling(tmp_path, faults):
    caches = random_caches(64, seed=23)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=2, disk_path=tmp_path / "kv", disk_blocks=8) as off:
        await off.store({"a": 1, "b": 2})
        gate = faults.gate(off, "pwritev")
        t = off.store({"c": 3})  # spills "a"
        await gate.entered_async()
        assert off.lookup(["a", "b"]) == 2 and off.stats().spilling == 1
        for x in caches.values():
            x[10].zero_()
        await off.load({"a": 10})  # read from host memory while it moves
        for n in caches:
            assert same_bytes(caches[n][10], orig[n][1])
        gate.open()
        await t
        assert off.stats().disk_ready == 1 and off.lookup(["a", "b", "c"]) == 3
        await assert_keys_load(off, caches, orig, {"a": 1, "b": 2, "c": 3})


def test_symlink_at_path_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"do not overwrite")
    link = tmp_path / "kv"
    link.symlink_to(target)
    caches = random_caches(8)
    with kvoffload.Offloader(caches, host_blocks=0, disk_path=link, disk_blocks=8) as off:
        off.store({i: i for i in range(8)}).result(10)
        assert link.is_symlink() and disk_file_stat(off).st_ino != os.stat(target).st_ino
    assert target.read_bytes() == b"do not overwrite"
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["kv", "precious"]


def test_missing_directory_and_full_disk_fail_clearly(tmp_path, monkeypatch):
    caches = random_caches(8)
    with pytest.raises(kvoffload.StartError) as info:
        kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "nope" / "kv", disk_blocks=8).start()
    assert isinstance(info.value.__cause__, FileNotFoundError)

    def no_space(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    off = kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=8)
    with pytest.raises(kvoffload.StartError, match="cannot reserve"):
        off.start()
    assert not (tmp_path / "kv").exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]


def test_o_direct_rejected_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    caches = random_caches(8)
    orig = snapshot(caches)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=8) as off:
            assert not uses_o_direct(off)
            off.store({i: i for i in range(8)}).result(10)
            for t in caches.values():
                t.zero_()
            off.load({i: i for i in range(8)}).result(10)
    assert "O_DIRECT" in caplog.text
    for n in caches:
        assert same_bytes(caches[n], orig[n])


def test_page_cache_mode(tmp_path):
    caches = random_caches(32, seed=3)
    orig = snapshot(caches)
    with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=32, use_page_cache=True) as off:
        assert not uses_o_direct(off)
        off.store({i: i for i in range(32)}).result(10)
        for t in caches.values():
            t.zero_()
        off.load({i: 31 - i for i in range(32)}).result(10)
    for n in caches:
        assert same_bytes(caches[n].flip(0), orig[n])


# -- faults --------------------------------------------------------------------------------


def short_write(real, fd, bufs, offset):
    return real(fd, bufs, offset) - 4096


def short_read(real, fd, bufs, offset):
    return real(fd, bufs, offset) - 1


enospc = OSError(errno.ENOSPC, "No space left on device")
eio = OSError(errno.EIO, "Input/output error")


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", [short_write, enospc], ids=["short-write", "ENOSPC"])
@pytest.mark.parametrize("host_blocks", [0, 4], ids=["disk-store", "spill"])
async def test_write_faults_fail_the_store_and_lose_nothing(tmp_path, faults, fault, host_blocks):
    caches = random_caches(64, seed=31)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=32, chunk_bytes=2 * 4096) as off:
        first = {("ok", i): i for i in range(4)}
        await off.store(first)
        before = off.stats()
        broken = faults.fail(off, "pwritev", fault)
        with pytest.raises(kvoffload.TransferError) as ei:
            await off.store({("bad", i): 10 + i for i in range(4)})
        assert isinstance(ei.value.__cause__, OSError)
        assert off.lookup([("bad", i) for i in range(4)]) == 0  # nothing torn is visible
        s = off.stats()
        assert s.pending == 0 and s.failed == 1 and s.spilling == 0
        assert (s.host_free, s.disk_free) == (before.host_free, before.disk_free)
        await assert_keys_load(off, caches, orig, first)  # the old entries are intact
        broken.remove()
        for n, t in caches.items():
            t.copy_(orig[n])
        await off.store({("bad", i): 10 + i for i in range(4)})  # and the service goes on
        await assert_keys_load(off, caches, orig, {**first, **{("bad", i): 10 + i for i in range(4)}})


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", [eio, short_read], ids=["EIO", "short-read"])
@pytest.mark.slow
async def test_read_faults_fail_the_load_and_keep_the_entries(tmp_path, faults, fault):
    caches = random_caches(64, seed=32)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=32) as off:
        stored = {i: i for i in range(8)}
        await off.store(stored)
        broken = faults.fail(off, "preadv", fault)
        with pytest.raises(kvoffload.TransferError) as ei:
            await off.load({i: 20 + i for i in range(8)})
        assert isinstance(ei.value.__cause__, OSError)
        assert off.stats().pinned == 0 and off.lookup(list(stored)) == 8
        broken.remove()
        await assert_keys_load(off, caches, orig, stored)


@pytest.mark.asyncio
async def test_spill_failure_keeps_victims_in_host_memory(tmp_path, faults):
    caches = random_caches(64, seed=33)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=16) as off:
        first = {i: i for i in range(4)}
        await off.store(first)
        faults.fail(off, "pwritev", enospc)
        with pytest.raises(kvoffload.TransferError):
            await off.store({10: 10, 11: 11})
        s = off.stats()
        assert s.host_ready == 4 and s.disk_ready == 0 and s.disk_free == 16 and s.host_free == 0
        await assert_keys_load(off, caches, orig, first)


# -- cancellation and responsiveness -----------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("host_blocks", [0, 2], ids=["disk-store", "spill"])
async def test_cancel_mid_io_waits_for_it_and_publishes_nothing_unfinished(tmp_path, faults, host_blocks):
    # A disk-only store of four one-block chunks: with two bounce halves, its third chunk waits for
    # the first write, which the gate holds, so the cancel always finds the store unfinished. (A
    # store of two chunks can have both writes queued when the cancel comes, and then completes
    # first, as documented: its task may be running, with no await left, when the cancel is asked.)
    caches = random_caches(64, seed=34)
    orig = snapshot(caches)
    new = 2 if host_blocks else 4
    async with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=32, chunk_bytes=4096) as off:
        if host_blocks:
            await off.store({("old", i): i for i in range(2)})
        before = off.stats()
        gate = faults.gate(off, "pwritev")
        t = off.store({("new", i): 40 + i for i in range(new)})
        io_running_at_end = []
        t.add_done_callback(lambda _: io_running_at_end.append(gate.in_flight))
        await gate.entered_async()
        t.cancel()
        assert not t.done(), "cancel completed while a pwritev was still running"
        gate.open()
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        assert gate.passed >= 1 and io_running_at_end == [0], "the store ended while its pwritev was still running"
        gate.remove()
        s = off.stats()
        assert s.pending == 0 and s.spilling == 0 and s.in_flight == 0
        assert off.lookup([("new", i) for i in range(new)]) == 0 or host_blocks == 0
        assert off.lookup([("new", i) for i in range(new)]) < new, "the cancelled store published every key"
        assert (s.host_free + s.host_ready, s.disk_free + s.disk_ready + s.disk_clean) == (before.host_free + before.host_ready, before.disk_free + before.disk_ready + before.disk_clean)
        visible = {k: v for k, v in {**{("old", i): i for i in range(2)}, **{("new", i): 40 + i for i in range(new)}}.items() if k in off}
        if visible:
            await assert_keys_load(off, caches, orig, visible)
        for n, t in caches.items():
            t.copy_(orig[n])
        await off.store({("after", 0): 5})
        await assert_keys_load(off, caches, orig, {("after", 0): 5})


@pytest.mark.asyncio
async def test_caller_loop_stays_responsive_during_a_large_disk_transfer(tmp_path):
    import torch

    caches = {"kv": torch.randint(0, 255, (256, 256 * 1024), dtype=torch.uint8)}  # 64 MiB
    lags: list[float] = []
    stop, beating = asyncio.Event(), asyncio.Event()

    async def heartbeat():
        while not stop.is_set():
            beating.set()
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=256) as off:
        hb = asyncio.create_task(heartbeat())
        await asyncio.wait_for(beating.wait(), 10)
        t0 = time.perf_counter()
        await off.store({i: i for i in range(256)})
        await off.load({i: 255 - i for i in range(256)})
        busy = time.perf_counter() - t0
        stop.set()
        await hb
    assert busy > 0.02 and len(lags) > 3
    assert max(lags) < 0.1, f"event loop stalled {max(lags) * 1e3:.0f} ms during disk IO"


@pytest.mark.asyncio
@pytest.mark.parametrize("host_blocks", [0, 16], ids=["disk-only", "spill"])
async def test_concurrent_disk_transfers_share_bounce_buffers_safely(tmp_path, host_blocks):
    """Many stores and loads at once, each spanning chunks: every byte lands where it belongs."""
    caches = random_caches(256, seed=35)
    orig = snapshot(caches)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=200,
                                   chunk_bytes=3 * slot) as off:
        groups = [{(g, i): (g * 16 + i * 5) % 128 for i in range(7)} for g in range(16)]
        if host_blocks:  # pending stores hold host slots: two at a time fit in 16 slots
            for g in range(0, 16, 2):
                await asyncio.gather(off.store(groups[g]), off.store(groups[g + 1]))
        else:
            await asyncio.gather(*(off.store(grp) for grp in groups))
        stored = {k: v for grp in groups for k, v in grp.items()}
        assert off.lookup(list(stored)) == len(stored)
        for t in caches.values():
            t.zero_()
        # every group loads at once into its own destination range [128 + 7g, 128 + 7g + 7)
        await asyncio.gather(*(off.load({k: 128 + g * 7 + i for i, k in enumerate(grp)}) for g, grp in enumerate(groups)))
        for g, grp in enumerate(groups):
            for i, k in enumerate(grp):
                for n in caches:
                    assert same_bytes(caches[n][128 + g * 7 + i], orig[n][stored[k]]), (k, n)
