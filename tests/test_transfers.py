"""Round trips on random data, awaiting from tasks, loops in other threads and plain threads."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

import kvoffload
from support.caches import block_bytes, random_caches, same_bytes
from kvoffload._testing import copy_calls


def snapshot(caches):
    return {n: t.clone() for n, t in caches.items()}


@pytest.mark.asyncio
@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000])
async def test_round_trip_random_ids_byte_for_byte(chunk_blocks):
    caches = random_caches(128, seed=chunk_blocks)
    orig = snapshot(caches)
    rng = random.Random(chunk_blocks)
    src = rng.sample(range(128), 100)
    dst = rng.sample(range(128), 100)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=100, chunk_bytes=chunk_blocks * slot) as off:
        r = await off.store({("k", i): src[i] for i in range(100)})
        assert r.kind == "store" and len(r.keys) == 100 and r.nbytes == 100 * off.layout.block_bytes and r.seconds > 0
        for t in caches.values():
            t.zero_()
        r = await off.load({("k", i): dst[i] for i in range(100)})
        assert r.kind == "load" and len(r.keys) == 100
    for n in caches:
        assert same_bytes(caches[n][dst], orig[n][src]), n
    untouched = sorted(set(range(128)) - set(dst))
    for n in caches:
        assert not caches[n][untouched].any(), "a load wrote outside its destination blocks"


@pytest.mark.asyncio
async def test_contiguous_runs_round_trip():
    caches = random_caches(64, seed=5)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=64) as off:
        await off.store({i: i for i in range(10, 50)})
        await off.load({i: i - 10 for i in range(10, 50)})
    for n in caches:
        assert same_bytes(caches[n][:40], orig[n][10:50])


@pytest.mark.asyncio
async def test_many_concurrent_transfers_from_many_tasks():
    caches = random_caches(256, seed=9)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=256, chunk_bytes=8 * 4096) as off:
        await asyncio.gather(*(off.store({i: i}) for i in range(256)))
        assert off.lookup(range(256)) == 256
        for t in caches.values():
            t.zero_()
        results = await asyncio.gather(*(off.load({i: 255 - i}) for i in range(256)))
        assert all(len(r.keys) == 1 for r in results)
        assert off.stats().loads == 256 and off.stats().in_flight == 0
    for n in caches:
        assert same_bytes(caches[n].flip(0), orig[n])


@pytest.mark.asyncio
async def test_one_block_transfers_handed_over_together_share_their_copies(faults):
    """Small transfers that reach the worker together are copied together: while the worker is held
    in its first copy, the rest of 256 one-block stores (then loads) queue up, and the lot takes at
    most three copy calls, not 256; everything still round-trips byte for byte."""
    caches = random_caches(256, seed=13)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=256) as off:
        for path, start in (("to_host", lambda i: off.store({i: i})), ("to_device", lambda i: off.load({i: 255 - i}))):
            if path == "to_device":
                for t in caches.values():
                    t.zero_()
            gate = faults.gate(off, path)
            transfers = [start(i) for i in range(256)]
            await gate.entered_async()
            gate.open()
            await asyncio.gather(*transfers)
            assert 1 <= gate.passed <= 3, f"{path}: {gate.passed} copy calls for 256 one-block transfers"
            assert sum(len(args[-1]) for args in gate.calls) == 256  # rows (stores) or block ids (loads)
    for n in caches:
        assert same_bytes(caches[n].flip(0), orig[n])


@pytest.mark.asyncio
async def test_a_failure_ordering_after_the_callers_stream_fails_the_transfer_and_leaks_nothing(monkeypatch):
    """If recording the caller's stream position fails (a failed device), store() and load() still
    return a transfer; it fails with TransferError, and its slots and pins go back."""
    from kvoffload._core.workers.copier import CpuBlockCopier

    caches = random_caches(8, seed=21)
    async with kvoffload.Offloader(caches, host_blocks=4) as off:
        await off.store({"kept": 0})

        def broken(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(CpuBlockCopier, "caller_event", broken)
        for t in (off.store({"new": 1}), off.load({"kept": 2})):
            with pytest.raises(kvoffload.TransferError, match="illegal memory access") as err:
                await t
            assert isinstance(err.value.__cause__, RuntimeError)
        s = off.stats()
        assert (s.host_free, s.pending, s.pinned, s.in_flight, s.failed) == (3, 0, 0, 0, 2), s
        assert "new" not in off
        monkeypatch.undo()
        await off.load({"kept": 3})
    for n in caches:
        assert same_bytes(caches[n][3], caches[n][0]), n


def test_transfers_from_plain_threads_and_other_loops():
    caches = random_caches(128, seed=3)
    orig = snapshot(caches)
    errors: list[BaseException] = []
    with kvoffload.Offloader(caches, host_blocks=128) as off:

        def plain(lo: int) -> None:
            try:
                for i in range(lo, lo + 32):
                    r = off.store({i: i}).result(timeout=30)
                    assert r.keys == (i,)
            except BaseException as e:
                errors.append(e)

        def with_loop(lo: int) -> None:
            async def run() -> None:
                await asyncio.gather(*(off.store({i: i}) for i in range(lo, lo + 32)))

            try:
                asyncio.run(run())
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=f, args=(lo,)) for f, lo in ((plain, 0), (plain, 32), (with_loop, 64), (with_loop, 96))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert off.lookup(range(128)) == 128
        for t in caches.values():
            t.zero_()
        off.load({i: i for i in range(128)}).result(30)
    for n in caches:
        assert same_bytes(caches[n], orig[n])


def test_done_callback_and_result_timeout(caches):
    with kvoffload.Offloader(caches, host_blocks=16) as off:
        seen: list[kvoffload.Transfer] = []
        done = threading.Event()
        t = off.store({"a": 1})
        t.add_done_callback(lambda tr: (seen.append(tr), done.set()))
        assert done.wait(10)
        assert seen == [t] and t.done() and not t.cancelled() and t.exception() is None
        late: list[kvoffload.Transfer] = []
        t.add_done_callback(late.append)  # already done: runs at once
        assert late == [t]
        assert t.result(0).keys == ("a",)


def test_result_times_out_while_running(caches, faults):
    with kvoffload.Offloader(caches, host_blocks=16) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({"a": 1})
        gate.wait_entered()
        with pytest.raises(TimeoutError):
            t.result(timeout=0.05)
        assert not t.done()
        gate.open()
        assert t.result(10).keys == ("a",)


@pytest.mark.asyncio
async def test_copy_error_fails_transfer_and_loses_nothing(faults):
    caches = random_caches(32, seed=4)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        await off.store({i: i for i in range(8)})
        broken = faults.fail(off, "to_host", OSError(5, "injected copy failure"))
        t = off.store({i: i for i in range(8, 12)})
        with pytest.raises(kvoffload.TransferError) as ei:
            await t
        assert isinstance(ei.value.__cause__, OSError)
        assert isinstance(t.exception(), kvoffload.TransferError)
        assert off.lookup(range(12)) == 8 and off.stats().pending == 0 and off.stats().failed == 1
        broken.remove()
        await off.store({i: i for i in range(8, 12)})  # the service goes on
        for t_ in caches.values():
            t_.zero_()
        await off.load({i: i for i in range(12)})
    for n in caches:
        assert same_bytes(caches[n][:12], orig[n][:12])


@pytest.mark.asyncio
async def test_discard_during_load_keeps_the_load_correct(caches):
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=8) as off:
        await off.store({"a": 1})
        t = off.load({"a": 30})
        off.discard(["a"])
        await t
        assert "a" not in off and off.stats().host_free == 8
    for n in caches:
        assert same_bytes(caches[n][30], orig[n][1])


@pytest.mark.asyncio
async def test_store_of_keys_being_stored_is_skipped(caches):
    async with kvoffload.Offloader(caches, host_blocks=8) as off:
        t1 = off.store({"a": 1, "b": 2})
        t2 = off.store({"b": 3, "c": 4})
        r1, r2 = await asyncio.gather(t1, t2)
        assert r2.skipped == ("b",)
        await off.load({"b": 9})
    assert block_bytes(caches, 9) == block_bytes(caches, 2)


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["kv-first transposed", "strided slice", "mixed"])
async def test_strided_views_round_trip_without_copies(layout):
    """Caches that are views: a (2, num_blocks, ...) K/V tensor transposed to put blocks first (two
    pieces per block), every other row of a larger buffer (blocks 2 rows apart), and both at once."""
    g = torch.Generator().manual_seed(7)
    kv = torch.randint(-2**15, 2**15, (2, 24, 4, 10), generator=g, dtype=torch.int16)  # 80 B pieces: not 16-aligned
    wide = torch.randint(-2**31, 2**31, (48, 33), generator=g, dtype=torch.int32)
    caches = {
        "kv-first transposed": {"kv": kv.transpose(0, 1)},
        "strided slice": {"rows": wide[::2]},
        "mixed": {"kv": kv.transpose(0, 1), "rows": wide[1::2]},
    }[layout]
    before = {n: t.clone() for n, t in caches.items()}
    kv_before, wide_before = kv.clone(), wide.clone()
    async with kvoffload.Offloader(caches, host_blocks=24, num_blocks=24) as off:
        await off.store({i: i for i in range(12)})
        await off.load({i: 23 - i for i in range(12)})
    for n, t in caches.items():
        assert torch.equal(t[12:24].flip(0), before[n][0:12]), n
        assert torch.equal(t[:12], before[n][:12]), n
    # nothing outside the views' blocks was written
    if "rows" in caches:
        other = slice(1, None, 2) if layout == "strided slice" else slice(0, None, 2)
        assert torch.equal(wide[other], wide_before[other])


def test_layouts_that_cannot_be_copied_without_a_copy_are_refused():
    with pytest.raises(ValueError, match="last dimension is not contiguous"):
        kvoffload.Offloader({"x": torch.zeros(64, 8).t()})
    with pytest.raises(ValueError, match="overlap"):
        kvoffload.Offloader({"x": torch.zeros(1, 8).expand(16, 8)})
    with pytest.raises(ValueError, match=r"not num_blocks=100; its blocks look like dim 1: pass t.transpose\(0, 1\)"):
        kvoffload.Offloader({"kv": torch.zeros(2, 100, 16)}, num_blocks=100)
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        kvoffload.Offloader({"kv": torch.zeros(4, 16)}, num_blocks=0)


@pytest.mark.asyncio
async def test_per_tensor_waits_on_cpu_caches_end_with_the_load():
    """Without per-tensor copies (CPU caches), every tensor is ready when the whole load is; names
    are checked; stream_wait needs a GPU per-tensor load."""
    caches = random_caches(16, seed=61)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        await off.store({i: i for i in range(4)})
        t = off.load({i: 8 + i for i in range(4)}, per_tensor=True)
        for name in caches:
            await t.wait_tensor(name)
            assert t.tensor_done(name) and t.done()
        with pytest.raises(ValueError, match="no tensor 'nope'"):
            await t.wait_tensor("nope")
        with pytest.raises(ValueError, match="per_tensor=True"):
            t.stream_wait("k0")
    for n in caches:
        assert same_bytes(caches[n][8:12], orig[n][0:4])


@pytest.mark.asyncio
async def test_expedited_loads_on_cpu_caches_take_the_load_worker():
    """CPU caches get no third worker (its copies would wait for the GIL behind the load worker's);
    expedited loads still round trip byte for byte. (The GPU test shows one overtaking a bulk load.)"""
    caches = random_caches(64, seed=71)
    orig = snapshot(caches)
    async with kvoffload.Offloader(caches, host_blocks=64, expedited_loads=True) as off:
        assert [t.name for t in threading.enumerate() if t.name == "kvoffload-expedited"] == []
        await off.store({i: i for i in range(32)})
        bulk = off.load({i: 32 + i for i in range(31)})
        quick = await off.load({31: 63}, expedited=True)
        assert quick.keys == (31,)
        await bulk
    for n in caches:
        assert same_bytes(caches[n][32:64], orig[n][0:32])
