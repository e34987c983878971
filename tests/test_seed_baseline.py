"""The benchmark's seed-style baseline (kvoffload.bench.seed_baseline) moves the right bytes on CPU tensors."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch

from support.caches import block_bytes, random_caches, same_bytes
from kvoffload.bench import seed_baseline
from kvoffload.bench.seed_baseline import DiskBaseline, HostBaseline

NUM_BLOCKS = 32


def snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in caches.items()}


def scramble(caches: dict[str, torch.Tensor], seed: int) -> None:
    """Overwrite every tensor with other random bits, so a load that does nothing is caught."""
    other = random_caches(NUM_BLOCKS, seed=seed)
    for name, t in caches.items():
        t.copy_(other[name])


def assert_blocks(caches, original, pairs):
    """Block ``dst`` of ``caches`` holds what block ``src`` of ``original`` held, for each pair."""
    for src, dst in pairs:
        assert block_bytes(caches, dst) == block_bytes(original, src), f"block {dst} should hold original block {src}"


def baseline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("seed-")]


@pytest.fixture(params=["host", "disk"])
def make(request, tmp_path):
    made = []

    def factory(caches, capacity):
        if request.param == "host":
            b = HostBaseline(caches, host_blocks=capacity)
        else:
            b = DiskBaseline(caches, str(tmp_path / "kv.bin"), slots=capacity)
        made.append(b)
        return b

    yield factory
    for b in made:
        b.close()
    assert not baseline_threads()


def test_round_trip_random_blocks(make):
    caches = random_caches(NUM_BLOCKS, seed=1)
    original = snapshot(caches)
    b = make(caches, 48)
    g = torch.Generator().manual_seed(7)
    gpu = torch.randperm(NUM_BLOCKS, generator=g)[:20].tolist()
    slots = torch.randperm(48, generator=g)[:20].tolist()
    b.wait(b.store(list(zip(gpu, slots))))
    assert all(same_bytes(caches[n], original[n]) for n in caches), "a store must not change the cache"

    scramble(caches, seed=2)
    # load every stored slot into a different (shuffled) cache block
    dst = torch.randperm(NUM_BLOCKS, generator=g)[:20].tolist()
    b.wait(b.load(list(zip(slots, dst))))
    assert_blocks(caches, original, zip(gpu, dst))


def test_full_cache_round_trip_in_several_jobs(make):
    caches = random_caches(NUM_BLOCKS, seed=3)
    original = snapshot(caches)
    b = make(caches, NUM_BLOCKS)
    # odd and even lengths exercise both bounce slots being pending at the end of a disk job
    jobs = [b.store([(i, NUM_BLOCKS - 1 - i) for i in range(lo, hi)]) for lo, hi in ((0, 1), (1, 4), (4, 11), (11, NUM_BLOCKS))]
    for j in reversed(jobs):  # waiting in any order works
        b.wait(j)
    scramble(caches, seed=4)
    b.wait(b.load([(NUM_BLOCKS - 1 - i, i) for i in range(NUM_BLOCKS)]))
    assert all(same_bytes(caches[n], original[n]) for n in caches)


def test_store_and_load_in_flight_together(make):
    caches = random_caches(NUM_BLOCKS, seed=5)
    original = snapshot(caches)
    b = make(caches, 16)
    b.wait(b.store([(i, i) for i in range(8)]))
    # a load (slots 0..7 -> blocks 16..23) and a store (blocks 24..31 -> slots 8..15) run at once
    # on their two threads; they touch disjoint blocks and slots
    load = b.load([(i, 16 + i) for i in range(8)])
    store = b.store([(24 + i, 8 + i) for i in range(8)])
    b.wait(store)
    b.wait(load)
    assert_blocks(caches, original, [(i, 16 + i) for i in range(8)])
    b.wait(b.load([(8 + i, i) for i in range(8)]))
    assert_blocks(caches, original, [(24 + i, i) for i in range(8)])


def test_repeated_destination_keeps_the_last_write(make):
    caches = random_caches(NUM_BLOCKS, seed=6)
    original = snapshot(caches)
    b = make(caches, 4)
    b.wait(b.store([(3, 0), (4, 1), (5, 0)]))  # slot 0 written twice in one job
    b.wait(b.load([(0, 10), (1, 11)]))
    assert_blocks(caches, original, [(5, 10), (4, 11)])


def test_empty_job_and_bad_ids(make):
    caches = random_caches(NUM_BLOCKS, seed=8)
    b = make(caches, 4)
    b.wait(b.store([]))
    b.wait(b.load([]))
    with pytest.raises(ValueError):
        b.store([(NUM_BLOCKS, 0)])
    with pytest.raises(ValueError):
        b.store([(0, 4)])
    with pytest.raises(ValueError):
        b.load([(-1, 0)])
    with pytest.raises(ValueError):
        b.load([(0, NUM_BLOCKS)])
    with pytest.raises(TimeoutError):
        b.wait(10_000, timeout=0.05)  # never submitted


def test_host_copy_is_per_tensor():
    caches = random_caches(NUM_BLOCKS, seed=9)
    b = HostBaseline(caches, host_blocks=5)
    try:
        for name, t in caches.items():
            h = b.host_caches[name]
            assert h.shape == (5, *t.shape[1:]) and h.dtype == t.dtype and h.device.type == "cpu"
        b.wait(b.store([(7, 2)]))
        for name, t in caches.items():
            assert same_bytes(b.host_caches[name][2], t[7])
    finally:
        b.close()


def test_disk_file_is_private_and_removed(tmp_path):
    path = tmp_path / "kv.bin"
    planted = tmp_path / "elsewhere"
    planted.write_bytes(b"secret")
    path.symlink_to(planted)  # a planted symlink is replaced, never followed
    caches = random_caches(NUM_BLOCKS, seed=10)
    b = DiskBaseline(caches, str(path), slots=8)
    try:
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 8 * b.slot_bytes and b.slot_bytes % 4096 == 0
        assert planted.read_bytes() == b"secret"
        b.wait(b.store([(1, 7)]))
        with open(path, "rb") as f:
            f.seek(7 * b.slot_bytes)
            assert f.read(b.layout.block_bytes) == block_bytes(caches, 1)
    finally:
        b.close()
    assert not path.exists() and not path.is_symlink()
    b.close()  # idempotent


def test_disk_io_error_reaches_wait_and_thread_survives(tmp_path, monkeypatch):
    caches = random_caches(NUM_BLOCKS, seed=11)
    original = snapshot(caches)
    b = DiskBaseline(caches, str(tmp_path / "kv.bin"), slots=8)
    try:
        real = os.pwritev
        calls = {"n": 0}

        def failing(fd, bufs, off):
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(28, "No space left on device")
            return real(fd, bufs, off)

        monkeypatch.setattr(seed_baseline.os, "pwritev", failing)
        with pytest.raises(RuntimeError, match="No space"):
            b.wait(b.store([(0, 0), (1, 1), (2, 2)]))
        b.wait(b.store([(3, 3)]))  # the store thread is still alive
        scramble(caches, seed=12)
        b.wait(b.load([(3, 5)]))
        assert_blocks(caches, original, [(3, 5)])
    finally:
        b.close()
