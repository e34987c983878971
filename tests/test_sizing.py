"""Sizing: tiers in bytes or in blocks, a modest default host tier, and sizes that cannot fit refused
at once, before anything is allocated, with a message naming the option, the size and the limit."""

from __future__ import annotations

import errno
import gc
import logging
import os
import time
import tracemalloc

import pytest
import torch

import kvoffload
from support.caches import block_bytes, random_caches
from support.process import kvoffload_threads
from kvoffload._core.tiers import hostmem
from kvoffload._testing import disk_file_stat
from kvoffload._core.cuda import driver
from kvoffload._core.tiers.index import BlockIndex
from kvoffload._core.tiers.tiered_storage import TieredStorage

SLOT = 4096  # random_caches' slot size


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    caches = random_caches(16, seed=3)
    assert kvoffload.Offloader(caches, host_blocks=1).layout.slot_bytes == SLOT
    return caches


@pytest.fixture
def nothing_allocated(monkeypatch):
    """For starts that must be refused: records whether start() got as far as creating the tiers
    (host slab, index, disk file), and stops it there, so that a regression allocates nothing."""
    created = []

    def init(self, *args, **kwargs):
        created.append(True)
        raise RuntimeError("start() went on to allocate the tiers")

    monkeypatch.setattr(TieredStorage, "__init__", init)
    return created


def _with_disk_path(tmp_path, kwargs: dict) -> dict:
    """``kwargs`` with a ``disk_path`` if they size the disk tier."""
    return {**kwargs, "disk_path": tmp_path / "kv"} if {"disk_blocks", "disk_bytes"} & set(kwargs) else kwargs


@pytest.mark.asyncio
async def test_byte_sizes_give_whole_slots(caches, tmp_path):
    off = kvoffload.Offloader(caches, host_bytes=10 * SLOT + 100, disk_path=tmp_path / "kv", disk_bytes="64KiB")
    assert (off.stats().host_slots, off.stats().disk_slots) == (10, 16)
    assert (off.options.host_bytes, off.options.disk_bytes) == (10 * SLOT + 100, 64 << 10)
    async with off:
        await off.store({i: i for i in range(16)})
        assert off.lookup(range(16)) == 16
        assert (off.stats().host_slots, off.stats().disk_slots) == (10, 16)
        assert disk_file_stat(off).st_size == 16 * SLOT
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "size, slots",
    [("40960", 10), ("64KiB", 16), (" 8 KiB ", 2), ("1MiB", 256), ("1GiB", 1 << 18), ("1TiB", 1 << 28), (8 * SLOT, 8)],
)
def test_size_strings_take_binary_suffixes(caches, size, slots):
    assert kvoffload.Offloader(caches, host_bytes=size).stats().host_slots == slots


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_count_and_a_size_for_one_tier_are_refused(caches, tier, tmp_path):
    disk = {"disk_path": tmp_path / "kv"} if tier == "disk" else {}
    with pytest.raises(ValueError, match=f"{tier}_blocks.*{tier}_bytes"):
        kvoffload.Offloader(caches, **disk, **{f"{tier}_blocks": 8, f"{tier}_bytes": "1MiB"})
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "value, exc",
    [("64 KB", ValueError), ("1.5GiB", ValueError), ("GiB", ValueError), ("-1", ValueError), ("", ValueError),
     (-1, ValueError), (1.5, TypeError), (True, TypeError), (b"64", TypeError), ([4096], TypeError)],
)
@pytest.mark.parametrize("option", ["host_bytes", "disk_bytes"])
def test_malformed_sizes_are_refused_naming_the_option(caches, tmp_path, option, value, exc):
    with pytest.raises(exc, match=rf"{option}=.*(not a size|negative)"):
        kvoffload.Offloader(caches, **_with_disk_path(tmp_path, {option: value}))


@pytest.mark.parametrize("value", ["\u0663\u0662MiB", "\uff13\uff12MiB", "3\u0662KiB", "\u0968\u0966\u0966", "\U0001d7d14KiB"])
@pytest.mark.parametrize("option", ["host_bytes", "disk_bytes", "bounce_bytes"])
def test_size_strings_take_ascii_digits_only(caches, tmp_path, option, value):
    with pytest.raises(ValueError, match=rf"{option}=.*not a size"):
        kvoffload.Offloader(caches, **_with_disk_path(tmp_path, {option: value}))


@pytest.mark.parametrize("value, nbytes", [
    ("000000000000000000000064KiB", 64 << 10), ("0" * 400 + "4096", 4096), ("0" * 30, 0),
    (str((1 << 64) - 1), (1 << 64) - 1), ("16777215TiB", (1 << 64) - (1 << 40)), ((1 << 64) - 1, (1 << 64) - 1),
], ids=["24 digits", "400 zeros then 4096", "30 zeros", "2**64-1", "16777215TiB", "int 2**64-1"])
def test_sizes_are_bounded_by_their_value_not_their_digits(value, nbytes):
    assert kvoffload._parse_size("host_bytes", value) == nbytes


@pytest.mark.parametrize("value", [str(1 << 64), "16777216TiB", "1" + "0" * 5000 + "KiB", "9" * 21, 1 << 64, 10**5000],
                         ids=["2**64", "16777216TiB", "10**5000KiB", "21 nines", "int 2**64", "int 10**5000"])
def test_a_size_beyond_64_bits_is_refused_by_its_size(caches, value):
    with pytest.raises(ValueError, match=r"host_bytes=.* is too large: at most 2\*\*64 - 1 bytes"):
        kvoffload.Offloader(caches, host_bytes=value)


@pytest.mark.parametrize("option", ["host_bytes", "disk_bytes"])
def test_a_size_smaller_than_one_slot_is_refused(caches, tmp_path, option):
    with pytest.raises(ValueError, match=f"{option}=100 .*no slot of {SLOT} bytes"):
        kvoffload.Offloader(caches, **_with_disk_path(tmp_path, {option: 100}))


def test_the_default_host_tier_is_modest_and_logged(caches, caplog):
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        off = kvoffload.Offloader(caches)
    slots = off.stats().host_slots
    assert slots == (1 << 30) // SLOT
    assert any(r.levelno == logging.INFO and f"{slots} host slots" in r.getMessage() and "1 GiB" in r.getMessage()
               for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvoffload"):
        assert kvoffload.Offloader(caches, host_blocks=4096).stats().host_slots == 4096
    assert "host slots" not in caplog.text


ABSURD = {
    # name: (offloader keyword arguments, option the message names)
    "disk_blocks 8<<30": (dict(host_blocks=4, disk_blocks=8 << 30), "disk_blocks=8589934592"),
    "disk_blocks 10**9": (dict(host_blocks=4, disk_blocks=10**9), "disk_blocks=1000000000"),
    "host_blocks 10**9": (dict(host_blocks=10**9), "host_blocks=1000000000"),
    "disk_bytes 1PiB": (dict(host_blocks=4, disk_bytes=1 << 50), "disk_bytes=1125899906842624"),
    "host_bytes 64TiB": (dict(host_bytes="64TiB"), "host_bytes=70368744177664"),
}


@pytest.mark.parametrize("what", list(ABSURD))
def test_absurd_sizes_are_refused_at_start_before_allocating(caches, tmp_path, nothing_allocated, what):
    kwargs, named = ABSURD[what]
    off = kvoffload.Offloader(caches, **_with_disk_path(tmp_path, kwargs))
    t0 = time.monotonic()
    with pytest.raises(kvoffload.StartError, match=named) as info:
        off.start()
    assert time.monotonic() - t0 < 1
    assert isinstance(info.value.__cause__, MemoryError) and "slots a tier may have" in str(info.value)
    assert not nothing_allocated and not os.listdir(tmp_path) and not kvoffload_threads()
    off.close()


def test_a_host_tier_larger_than_memory_names_the_size_the_option_and_the_limit(caches, monkeypatch, nothing_allocated):
    from kvoffload._core import runtime

    monkeypatch.setattr(runtime, "_host_memory_limits", lambda: [("this machine's memory", 1 << 30)])
    off = kvoffload.Offloader(caches, host_bytes="2GiB")
    with pytest.raises(kvoffload.StartError, match=r"host_bytes=2147483648 \(2 GiB\).*2 GiB host slab.*this machine's memory: 1 GiB"):
        off.start()
    assert not nothing_allocated and not kvoffload_threads()
    off.close()


def test_a_disk_tier_larger_than_the_free_space_is_refused_before_allocating(caches, tmp_path, monkeypatch, nothing_allocated):
    real = os.statvfs

    def little_room(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 16, 16, *st[5:]))  # 64 KiB free

    monkeypatch.setattr(os, "statvfs", little_room)
    off = kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_bytes="1MiB")
    with pytest.raises(kvoffload.StartError, match=r"disk_bytes=1048576 \(1 MiB\) needs 1 MiB .* has 64 KiB free") as info:
        off.start()
    assert isinstance(info.value.__cause__, kvoffload.OffloadError)
    assert not nothing_allocated and not os.listdir(tmp_path) and not kvoffload_threads()
    off.close()


def test_a_disk_without_room_at_reserve_names_the_free_space(caches, tmp_path, monkeypatch):
    def no_space(fd, offset, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    off = kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_bytes="64KiB")
    with pytest.raises(kvoffload.StartError, match=r"cannot reserve 64 KiB .* free there\); .*disk_bytes or disk_blocks"):
        off.start()
    assert not os.listdir(tmp_path) and not kvoffload_threads()
    off.close()


@pytest.mark.parametrize("host_blocks", [0, 8])
def test_the_footprint_is_what_start_allocates(caches, tmp_path, host_allocations, host_blocks):
    from kvoffload._core.runtime import Footprint

    with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=8, chunk_bytes=3 * SLOT + 1) as off:
        need = Footprint.of(off.layout, off.options, off.options.tier_slots(SLOT))
        assert sum(host_allocations) == need.host_slab + need.disk_bounce
        assert need.disk_bounce == (2 if host_blocks else 4) * 3 * SLOT and need.host_slab == host_blocks * SLOT
        assert need.disk_file == disk_file_stat(off).st_size == 8 * SLOT and need.gpu_staging == 0
        assert off.stats().gpu_staging_bytes == 0  # CPU caches: no staging


@pytest.mark.parametrize("host_blocks", [0, 4])
def test_bounce_bytes_sizes_the_disk_bounce_buffers_and_transfers_still_round_trip(tmp_path, host_allocations, host_blocks):
    from kvoffload._core.runtime import Footprint

    caches = random_caches(64, seed=9)
    want = {k: block_bytes(caches, k) for k in range(32)}
    with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=64,
                             chunk_bytes=16 * SLOT, bounce_bytes=SLOT + 100) as off:  # one slot per half
        need = Footprint.of(off.layout, off.options, off.options.tier_slots(SLOT))
        assert need.disk_bounce == (2 if host_blocks else 4) * SLOT
        assert sum(host_allocations) == need.host_slab + need.disk_bounce
        off.store({k: k for k in range(32)}).result(10)
        for t in caches.values():
            t.zero_()
        off.load({k: k for k in range(32)}).result(10)
        assert all(block_bytes(caches, k) == want[k] for k in range(32))
        assert off.stats().disk_ready >= 32 - host_blocks


@pytest.mark.parametrize("value", [0, -1, 1.5, "lots", (128 << 20) + 1])
def test_a_bad_bounce_size_is_refused_naming_the_option(value):
    with pytest.raises((TypeError, ValueError), match="bounce_bytes"):
        kvoffload.Offloader(random_caches(8), bounce_bytes=value)  # the last: more than chunk_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_staging_buffers_are_what_the_footprint_says():
    from kvoffload._core.runtime import Footprint

    caches = random_caches(64, device="cuda", seed=4)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with kvoffload.Offloader(caches, host_blocks=8, chunk_bytes=1 << 20) as off:
        need = Footprint.of(off.layout, off.options, off.options.tier_slots(off.layout.slot_bytes))
        taken = torch.cuda.memory_allocated() - before
        assert need.gpu_staging == 4 * (1 << 20)
        assert need.gpu_staging <= taken < need.gpu_staging + (1 << 20), (taken, need.gpu_staging)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copy_engine, buffers", [("kernel", 4), ("dma", 0)])
def test_stats_report_the_gpu_staging_bytes_the_sizing_section_gives(copy_engine, buffers):
    """docs/how-to/sizing.md: ``4 * chunk`` of GPU memory with ``copy_engine="kernel"``, none with ``"dma"``;
    ``stats().gpu_staging_bytes`` says so while started, and what start() allocated agrees."""
    chunk = 1 << 20  # whole slots of random_caches' blocks
    caches = random_caches(64, device="cuda", seed=4)
    off = kvoffload.Offloader(caches, host_blocks=8, chunk_bytes=chunk, copy_engine=copy_engine)
    assert off.stats().gpu_staging_bytes == 0  # not started: nothing allocated
    gc.collect()  # tensors of earlier tests freed now, not while this one measures
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with off:
        taken = torch.cuda.memory_allocated() - before
        assert off.stats().gpu_staging_bytes == buffers * chunk
        assert buffers * chunk <= taken < buffers * chunk + (1 << 20), (taken, off.stats().gpu_staging_bytes)
    assert off.stats().gpu_staging_bytes == 0  # freed at close


def test_failed_pinning_names_the_memlock_limit(monkeypatch):
    def refuse(address, nbytes, device):
        raise driver.CudaError("cuMemHostRegister", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")

    monkeypatch.setattr(driver, "host_register", refuse)
    with pytest.raises(kvoffload.OffloadError, match=r"RLIMIT_MEMLOCK \(ulimit -l\) is (unlimited|\d+ bytes).*host_bytes or host_blocks"):
        hostmem.HostBuffer(1 << 16, pin=torch.device("cuda", 0))


def test_the_bookkeeping_estimate_covers_the_index():
    from kvoffload._core.runtime import BOOKKEEPING_BYTES_PER_SLOT

    tracemalloc.start()
    try:
        index = BlockIndex(1 << 16, 1 << 16)
        taken, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index is not None and taken <= (2 << 16) * BOOKKEEPING_BYTES_PER_SLOT


@pytest.mark.parametrize("one_key", ["xyz", b"xyz", bytearray(b"xyz"), memoryview(b"xyz")])
def test_a_string_where_keys_are_expected_is_a_type_error(caches, one_key):
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        off.store({"x": 0, "y": 1, "z": 2, 120: 3, 121: 4, 122: 5}).result(10)
        with pytest.raises(TypeError, match="iterable of keys"):
            off.lookup(one_key)
        with pytest.raises(TypeError, match="iterable of keys"):
            off.discard(one_key)
        assert off.lookup(["x", "y", "z"]) == 3
