"""CUDA paths: run on a GPU machine by scripts/gpu_check.sh; skipped without CUDA."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import kvoffload
import kvoffload._testing
from kvoffload._testing import pinned_buffers
from support.caches import check_every_visible_key, random_caches, same_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU spin: long enough that an unordered copy runs first


def gpu_caches(num_blocks: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    return random_caches(num_blocks, "cuda", seed)


@pytest.mark.asyncio
@pytest.mark.parametrize("use_batch_copy", [True, False])
@pytest.mark.parametrize("chunk_blocks", [2, 64])  # 2 x 4 tensors: direct DMA; 64 x 4: staged (+ a direct tail)
async def test_round_trip_random_ids(use_batch_copy, chunk_blocks):
    caches = gpu_caches(256)
    orig = {n: t.clone() for n, t in caches.items()}
    g = torch.Generator().manual_seed(1)
    src = torch.randperm(256, generator=g).tolist()[:200]
    dst = torch.randperm(256, generator=g).tolist()[:200]
    # small chunks so that a transfer spans many chunks and runs of slots
    async with kvoffload.Offloader(caches, host_blocks=220, chunk_bytes=chunk_blocks * caches_block(caches),
                                   use_batch_copy=use_batch_copy) as off:
        r = await off.store({i: src[i] for i in range(200)})
        assert len(r.keys) == 200
        for t in caches.values():
            t.zero_()
        await off.load({i: dst[i] for i in range(200)})
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][dst], orig[n][src]), n


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ["kernel", "torch", "dma"])
@pytest.mark.parametrize("blocks", [2, 300])  # direct descriptors; staged through the kernel or torch (dma: never staged)
async def test_strided_views_round_trip_on_the_gpu(monkeypatch, engine, blocks):
    """A (2, num_blocks, ...) K/V tensor transposed (two pieces per block, 80-byte pieces: not
    16-byte aligned) beside every other row of a larger buffer (blocks two rows apart)."""
    if engine == "torch":
        monkeypatch.setattr("kvoffload._core.cuda.cuda_copier.piece_kernel", lambda device_index: None)
    g = torch.Generator().manual_seed(blocks)
    kv = torch.randint(-2**15, 2**15, (2, 600, 4, 10), generator=g, dtype=torch.int16).cuda()
    wide = torch.randint(-2**31, 2**31, (1200, 33), generator=g, dtype=torch.int32).cuda()
    caches = {"kv": kv.transpose(0, 1), "rows": wide[1::2]}
    orig = {n: t.clone() for n, t in caches.items()}
    wide_other = wide[0::2].clone()
    src = torch.randperm(600, generator=g).tolist()[:blocks]
    dst = torch.randperm(600, generator=g).tolist()[:blocks]
    async with kvoffload.Offloader(caches, host_blocks=blocks, num_blocks=600, copy_engine="dma" if engine == "dma" else "kernel") as off:
        await off.store({i: src[i] for i in range(blocks)})
        for t in caches.values():
            t.zero_()
        await off.load({i: dst[i] for i in range(blocks)})
        torch.cuda.synchronize()
    for n in caches:
        assert same_bytes(caches[n][dst], orig[n][src]), n
    assert torch.equal(wide[0::2], wide_other), "rows outside the view were written"


@pytest.mark.asyncio
async def test_per_tensor_load_hands_over_layer_by_layer():
    """32 layers, 0.5 GiB in all, loaded tensor by tensor: wait_tensor returns with its layer in place,
    stream_wait orders a kernel on another stream after that layer's copy (the host never waits),
    and every layer lands byte for byte. (How early layer 0 lands is the bench's business.)"""
    layers, blocks = 32, 256
    caches = {f"layer.{i}": torch.randn(blocks, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for i in range(layers)}
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=blocks) as off:
        await off.store({i: i for i in range(blocks)})
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        load = off.load({i: blocks - 1 - i for i in range(blocks)}, per_tensor=True)
        side = torch.cuda.Stream()
        load.stream_wait("layer.0", side)  # the host does not wait
        with torch.cuda.stream(side):
            first_sum = caches["layer.0"].float().sum()  # runs once layer 0 landed
        await load.wait_tensor("layer.0")
        assert load.tensor_done("layer.0")
        assert torch.equal(caches["layer.0"].flip(0), orig["layer.0"]), "wait_tensor returned before its layer landed"
        await load
        torch.cuda.synchronize()
        assert torch.equal(first_sum, orig["layer.0"].flip(0).float().sum()), "the side stream ran before layer 0 landed"
        for n in caches:
            assert torch.equal(caches[n].flip(0), orig[n]), n
        await load.wait_tensor("layer.31")  # after the end: at once


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ["kernel", "kernel with 8 CTAs", "DMA", "copy_engine=dma"])
async def test_per_tensor_loads_of_any_layout_are_exact(monkeypatch, engine):
    """Per-tensor loads of strided views (two 80-byte pieces per block, not 16-byte aligned) and of
    rows of a wider buffer, more blocks than one launch takes, in random order: every tensor
    lands byte for byte, each by its own event, and nothing outside the views is written."""
    if engine == "DMA":
        monkeypatch.setattr("kvoffload._core.cuda.cuda_copier.piece_kernel", lambda device_index: None)
    g = torch.Generator().manual_seed(7)
    kv = torch.randint(-2**15, 2**15, (2, 1200, 4, 10), generator=g, dtype=torch.int16).cuda()
    wide = torch.randint(-2**31, 2**31, (2400, 33), generator=g, dtype=torch.int32).cuda()
    caches = {"kv": kv.transpose(0, 1), "rows": wide[1::2]}
    orig = {n: t.clone() for n, t in caches.items()}
    wide_other = wide[0::2].clone()
    n = 1000  # two launches of the scatter per tensor
    src = torch.randperm(1200, generator=g).tolist()[:n]
    dst = torch.randperm(1200, generator=g).tolist()[:n]
    async with kvoffload.Offloader(caches, host_blocks=n, num_blocks=1200, gather_ctas=8 if "8 CTAs" in engine else 0,
                                   copy_engine="dma" if engine == "copy_engine=dma" else "kernel") as off:
        await off.store({i: src[i] for i in range(n)})
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        load = off.load({i: dst[i] for i in range(n)}, per_tensor=True)
        for name in caches:
            await load.wait_tensor(name)
            assert same_bytes(caches[name][dst], orig[name][src]), name
        await load
    assert torch.equal(wide[0::2], wide_other), "rows outside the view were written"


def caches_block(caches):
    return kvoffload.BlockLayout.of(caches).slot_bytes


def test_the_copy_kernel_compiles_with_nvrtc():
    from kvoffload._core.cuda.kernels import piece_kernel

    assert piece_kernel(torch.cuda.current_device()) is not None, "NVRTC did not compile the copy kernel (see the log)"


@pytest.mark.asyncio
@pytest.mark.parametrize("engine", ["kernel", "kernel with 8 CTAs", "torch"])
async def test_round_trip_of_more_blocks_than_one_launch_takes(monkeypatch, engine):
    # 2,500 blocks of odd-sized pieces in one chunk: three kernel launches per gather and per scatter.
    if engine == "torch":  # the fallback where NVRTC is unavailable
        monkeypatch.setattr("kvoffload._core.cuda.cuda_copier.piece_kernel", lambda device_index: None)
    caches = gpu_caches(3000, seed=4)
    orig = {n: t.clone() for n, t in caches.items()}
    g = torch.Generator().manual_seed(2)
    src = torch.randperm(3000, generator=g).tolist()[:2500]
    dst = torch.randperm(3000, generator=g).tolist()[:2500]
    async with kvoffload.Offloader(caches, host_blocks=2500, gather_ctas=8 if "8 CTAs" in engine else 0) as off:
        await off.store({i: src[i] for i in range(2500)})
        for t in caches.values():
            t.zero_()
        await off.load({i: dst[i] for i in range(2500)})
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][dst], orig[n][src]), n


def test_transfers_from_a_thread_that_never_used_cuda():
    # store() and load() enqueue their copies in the calling thread; one that never touched CUDA
    # gets the device's context made current, and the transfers round-trip.
    caches = gpu_caches(64, seed=6)
    orig = {n: t.clone() for n, t in caches.items()}
    with kvoffload.Offloader(caches, host_blocks=64) as off:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                off.store({i: i for i in range(64)}).result(30)
                off.load({i: 63 - i for i in range(64)}).result(30)
            except BaseException as e:
                errors.append(e)

        th = threading.Thread(target=run)
        th.start()
        th.join(60)
        assert not errors, errors
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][list(range(63, -1, -1))], orig[n]), n


def test_batch_copy_resolved_and_slab_pinned():
    from kvoffload._core.cuda.driver import CopyEntryPoints, driver

    assert CopyEntryPoints().batched, "cuMemcpyBatchAsync should resolve on a CUDA 12.8+ driver"
    with kvoffload.Offloader(gpu_caches(8), host_blocks=8) as off:
        buf = pinned_buffers(off)[0]
        assert buf.pinned
        err, _flags = driver().cuMemHostGetFlags(buf.address)
        assert int(err) == 0, "host slab is not page-locked"


async def store_right_after_kernel_write(n: int = 1, chunk_blocks: int | None = None) -> bool:
    """A kernel writes ``n`` blocks right before store(); True if the stored bytes are the written ones.
    ``chunk_blocks``: the transfer's chunks (several: full ones on two streams, the last on one)."""
    caches = gpu_caches(2 * n + 14)
    side = torch.cuda.Stream()
    chunk = {"chunk_bytes": chunk_blocks * caches_block(caches)} if chunk_blocks else {}
    src, dst = list(range(n)), list(range(n, 2 * n))
    src_rows, dst_rows = slice(0, n), slice(n, 2 * n)  # views of the cache (an index list would copy)
    async with kvoffload.Offloader(caches, host_blocks=n + 14, **chunk) as off:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for t in caches.values():
                t[src_rows].view(torch.uint8).fill_(0xAB)
            transfer = off.store({("k", i): b for i, b in enumerate(src)})  # waits for `side` (the current stream)
        await transfer
        for t in caches.values():
            t[dst_rows].zero_()
        await off.load({("k", i): b for i, b in enumerate(dst)})
        torch.cuda.synchronize()
        return all(bool((t[dst_rows].view(torch.uint8) == 0xAB).all()) for t in caches.values())


async def load_right_after_kernel_read(n: int = 1, chunk_blocks: int | None = None) -> bool:
    """A kernel reads ``n`` blocks right before load() overwrites them; True if it saw the old bytes."""
    caches = gpu_caches(2 * n + 14)
    side = torch.cuda.Stream()
    chunk = {"chunk_bytes": chunk_blocks * caches_block(caches)} if chunk_blocks else {}
    src, dst = list(range(n)), list(range(n, 2 * n))
    src_rows, dst_rows = slice(0, n), slice(n, 2 * n)  # views of the cache (an index list would copy)
    async with kvoffload.Offloader(caches, host_blocks=n + 14, **chunk) as off:
        await off.store({("new", i): b for i, b in enumerate(src)})
        old = {name: t[dst_rows].clone() for name, t in caches.items()}
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            snapshot = {name: t[dst_rows].clone() for name, t in caches.items()}  # reads the blocks after the sleep
            transfer = off.load({("new", i): b for i, b in enumerate(dst)})
        await transfer
        torch.cuda.synchronize()
        assert all(same_bytes(caches[name][dst_rows], caches[name][src_rows]) for name in caches)
        return all(same_bytes(snapshot[name], old[name]) for name in caches)


@pytest.mark.asyncio
async def test_awaited_one_block_transfers_in_flight_end_as_they_land_byte_exact():
    """One-block stores still in flight when awaited (queued behind a kernel on the caller's stream)
    ask for no ring at the call, and one when awaited (the first of the two; the second rides on
    it): both end once their copies landed, and the round trip is byte-exact."""
    caches = gpu_caches(16)
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        for step in range(3):
            torch.cuda._sleep(SLEEP_CYCLES // 5)  # ~20 ms: the copies land well after the await
            transfers = [off.store({(step, "s"): 2}), off.store({(step, "t"): 3})]
            assert not any(t.done() for t in transfers)
            results = await asyncio.wait_for(asyncio.gather(*(_awaited(t) for t in transfers)), 10)
            assert [r.kind for r in results] == ["store", "store"]
            torch.cuda._sleep(SLEEP_CYCLES // 5)
            await off.load({(step, "s"): 7})
            assert all(same_bytes(t[7], t[2]) for t in caches.values())


async def _awaited(transfer):
    return await transfer


async def _later_store_done_when_earlier_resumes() -> bool:
    """A store queued behind ~50 ms of kernel, then one behind ~1 s more, whose result() a thread
    sleeps in; a task then awaits the first (still in flight). Whether the second had ended when the
    task resumed (it should not have: the first lands a second sooner); both round trips checked."""
    caches = gpu_caches(16)
    asleep = threading.Event()

    class Watched:
        """The real copier, telling when a thread's own ring was enqueued."""

        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        def ring_when_complete(self, event, semaphore, in_order=True, for_thread=False):
            self._real.ring_when_complete(event, semaphore, in_order, for_thread)
            if for_thread:
                asleep.set()

    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        kvoffload._testing.take_gpu_path(off, lambda kind, copier: Watched(copier))
        torch.cuda._sleep(SLEEP_CYCLES // 2)
        early = off.store({"early": 2})
        torch.cuda._sleep(SLEEP_CYCLES * 10)
        late = off.store({"late": 3})
        waiter = threading.Thread(target=late.result)
        waiter.start()
        assert await asyncio.to_thread(asleep.wait, 10), "the thread never slept in result()"
        assert not early.done()
        await asyncio.wait_for(early, 10)
        late_done = late.done()
        await asyncio.to_thread(waiter.join, 10)
        assert late.done()
        await off.load({"early": 7, "late": 8})
        assert all(same_bytes(t[7], t[2]) and same_bytes(t[8], t[3]) for t in caches.values())
    return late_done


@pytest.mark.asyncio
async def test_a_thread_asleep_on_a_later_copy_holds_back_no_earlier_one():
    """A thread asleep in ``result()`` on a later copy and a task awaiting an earlier copy of the same
    worker: the task resumes once its copy landed, a second before the thread's, which then ends too;
    both byte-exact. (With the thread's ring on the watcher's in-order stream, the task's ring queued
    behind it and only the watcher's 50 ms recheck ended the earlier copy.)"""
    assert not await _later_store_done_when_earlier_resumes()



SHAPES = [(1, None), (4, None), (20, 8)]
"""(blocks, chunk blocks): one block, one short chunk, and two full chunks (two streams each) before a short one."""
SHAPE_IDS = ["one block", "one short chunk", "full chunks then a short one"]


@pytest.mark.asyncio
@pytest.mark.parametrize("n, chunk_blocks", SHAPES, ids=SHAPE_IDS)
async def test_store_waits_for_callers_stream(n, chunk_blocks):
    assert await store_right_after_kernel_write(n, chunk_blocks), "store read the blocks before the kernel wrote them"


@pytest.mark.asyncio
@pytest.mark.parametrize("n, chunk_blocks", SHAPES, ids=SHAPE_IDS)
async def test_load_waits_for_callers_stream(n, chunk_blocks):
    assert await load_right_after_kernel_read(n, chunk_blocks), "load overwrote the blocks while a kernel still read them"


@pytest.mark.asyncio
@pytest.mark.parametrize("n, chunk_blocks", SHAPES, ids=SHAPE_IDS)
async def test_ordering_tests_fail_without_the_wait(monkeypatch, n, chunk_blocks):
    """The two tests above can fail: with the wait on the caller's stream removed, both see the race."""
    from kvoffload._core.cuda.cuda_copier import CudaBlockCopier

    monkeypatch.setattr(CudaBlockCopier, "wait_for", lambda self, event: None)
    assert not await store_right_after_kernel_write(n, chunk_blocks)
    assert not await load_right_after_kernel_read(n, chunk_blocks)


@pytest.mark.asyncio
async def test_after_event_overrides_current_stream():
    caches = gpu_caches(16)
    side = torch.cuda.Stream()
    async with kvoffload.Offloader(caches, host_blocks=16) as off:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for t in caches.values():
                t[2].view(torch.uint8).fill_(0x5C)
            done = torch.cuda.Event()
            done.record(side)
        # called on the default stream, which has nothing queued: only `after` orders the copy
        await off.store({"k": 2}, after=done)
        await off.load({"k": 9})
        torch.cuda.synchronize()
        for t in caches.values():
            assert bool((t[9].view(torch.uint8) == 0x5C).all())


@pytest.mark.asyncio
async def test_an_expedited_load_does_not_wait_behind_a_bulk_load():
    """A one-block expedited load completes while a bulk load is still held behind a kernel on the
    caller's stream (on the load worker's streams, a regular load would wait for it); then the bulk
    load lands too, both byte for byte."""
    caches = gpu_caches(64, seed=71)
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=64, chunk_bytes=4 * caches_block(caches), expedited_loads=True) as off:
        await off.store({i: i for i in range(32)})
        gate = torch.cuda.Stream()
        with torch.cuda.stream(gate):
            torch.cuda._sleep(SLEEP_CYCLES)
            bulk = off.load({i: 32 + i for i in range(31)})
        quick = await off.load({31: 63}, expedited=True)
        assert quick.keys == (31,) and not bulk.done(), "the expedited load waited for the bulk one"
        await bulk
        torch.cuda.synchronize()
    for n in caches:
        assert same_bytes(caches[n][32:64], orig[n][0:32]), n


def big_caches(gib: float) -> dict[str, torch.Tensor]:
    """32 layers of 64 KiB pieces per block, ``gib`` GiB in all, random bf16."""
    blocks = int(gib * 2**30) // (32 * 2**16)
    g = torch.Generator(device="cuda").manual_seed(3)
    return {f"layer.{i}": torch.randn(blocks, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for i in range(32)}


@pytest.mark.asyncio
@pytest.mark.parametrize("per_tensor", [False, True], ids=["bulk", "per-tensor"])
async def test_cancelled_load_skips_every_copy_not_started(per_tensor):
    """A 4 GiB load enqueued whole, held behind a kernel on the caller's stream, is cancelled before any
    of its copies started: its kernels read the cancel flag and skip everything, so not one cache byte
    changes, and nothing is written after the cancellation reached the caller."""
    caches = big_caches(4.0)
    orig_last = caches["layer.31"].clone()
    blocks = next(iter(caches.values())).shape[0]
    async with kvoffload.Offloader(caches, host_blocks=blocks) as off:
        await off.store({i: i for i in range(blocks)})
        for attempt in range(3):  # the premise needs the gate still closed at cancel() (a long GC pause could open it)
            for t in caches.values():
                t.zero_()
            torch.cuda.synchronize()
            gate = torch.cuda.Stream()
            with torch.cuda.stream(gate):
                torch.cuda._sleep(5 * SLEEP_CYCLES)
                opened = torch.cuda.Event()
                opened.record(gate)
                load = off.load({i: blocks - 1 - i for i in range(blocks)}, per_tensor=per_tensor)
            load.cancel()
            closed_at_cancel = not opened.query()
            with pytest.raises(kvoffload.TransferCancelled):
                await load
            if closed_at_cancel:
                break
        assert closed_at_cancel, "the gate opened before cancel() three times"
        if per_tensor:
            with pytest.raises(kvoffload.TransferCancelled):
                await load.wait_tensor("layer.0")
            assert not load.tensor_done("layer.0")
        for n, t in caches.items():
            assert not bool(t.any()), f"{n}: a cancelled copy wrote the cache"
        # the offloader keeps working: the next load (behind what is left of the cancelled one) is exact
        await off.load({i: i for i in range(blocks)})
        torch.cuda.synchronize()
        assert torch.equal(caches["layer.31"], orig_last)


@pytest.mark.asyncio
async def test_load_cancelled_mid_copy_writes_nothing_after_cancelled_error():
    """A 4 GiB load cancelled once its copies run: CancelledError reaches the awaiting task only when
    no copy writes the cache any more (a snapshot taken then still holds once the GPU is idle), part
    of the load never landed, and the offloader's pins and slots are back."""
    caches = big_caches(4.0)
    orig_last = caches["layer.31"].clone()
    blocks = next(iter(caches.values())).shape[0]
    async with kvoffload.Offloader(caches, host_blocks=blocks) as off:
        await off.store({i: i for i in range(blocks)})
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        gate = torch.cuda.Stream()
        with torch.cuda.stream(gate):
            torch.cuda._sleep(SLEEP_CYCLES // 10)
            opened = torch.cuda.Event()
            opened.record(gate)
            task = asyncio.ensure_future(off.load({i: i for i in range(blocks)}))
        while not opened.query():  # the copies start when the gate opens
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = {n: t.clone() for n, t in caches.items()}  # on the default stream, after the cancellation
        torch.cuda.synchronize()
        s = off.stats()
        assert s.pending == 0 and s.in_flight == 0
        assert not torch.equal(snapshot["layer.31"], orig_last), "the whole load landed before the cancel"
    # closed: every stream has drained
    for n, t in caches.items():
        assert torch.equal(t, snapshot[n]), f"{n}: written after CancelledError"


@pytest.mark.asyncio
async def test_cancel_mid_transfer_leaves_no_torn_entry():
    # A host-tier store is enqueued whole at call time; here its copies wait behind a kernel on the
    # caller's stream when it is cancelled. TransferCancelled comes only once they all ended, none of its
    # keys is published, and the slots it held are reused safely. (Eight chunks: with a hundred, the
    # driver's queue fills behind the stalled stream and store() itself returns only once it drains.)
    caches = gpu_caches(512)
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=512, chunk_bytes=64 * caches_block(caches)) as off:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            t = off.store({i: i for i in range(512)})
        assert not t.done()
        t.cancel()
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        assert side.query()  # the copies waited for the caller's kernel, and the cancel for the copies
        s = off.stats()
        assert s.pending == 0 and s.in_flight == 0 and s.host_free + s.host_ready == 512
        await check_every_visible_key(off, caches, orig, {i: i for i in range(512)})
        # the offloader keeps working, in the slots the cancelled store held
        for n, t in caches.items():
            t.copy_(orig[n])
        await off.store({("again", i): 511 - i for i in range(512 - s.host_ready)})
        await check_every_visible_key(off, caches, orig, {("again", i): 511 - i for i in range(512 - s.host_ready)})


def test_a_thread_blocked_on_a_load_of_several_chunks_ends_without_the_workers_loop():
    """result() on a load of several chunks (one a cancel can stop early) returns, byte-exact, while
    the load worker's loop is held: the landing watcher, rung by the driver, ends it. The waiting
    thread never used CUDA before."""
    caches = gpu_caches(256)
    orig = {n: t.clone() for n, t in caches.items()}
    src, dst = list(range(200)), [255 - i for i in range(200)]
    with kvoffload.Offloader(caches, host_blocks=220, chunk_bytes=16 * caches_block(caches)) as off:
        off.store({i: src[i] for i in range(200)}).result()
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        held, release = threading.Event(), threading.Event()
        load_worker = off._runtime.workers[1]
        assert load_worker.kind == "load"
        load_worker.loop.mailbox.post(lambda: (held.set(), release.wait(60)))
        assert held.wait(10)
        try:
            t = off.load({i: dst[i] for i in range(200)})
            assert t._job is not None and t._job.cancel_flag is not None, "not a load a cancel stops early"
            outcome: list[object] = []
            waiter = threading.Thread(target=lambda: outcome.append(t.result()))
            waiter.start()
            waiter.join(30)
            ended_by_its_waiter = not waiter.is_alive()
        finally:
            release.set()
        waiter.join(30)
        assert ended_by_its_waiter, "result() waited for the held worker's loop"
        assert len(outcome) == 1 and outcome[0].kind == "load"
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][dst], orig[n][src]), n


def test_a_thread_waiting_on_several_chunks_behind_a_thread_running_python_gets_every_byte():
    """result() on stores and loads of several chunks from a thread while this thread runs Python
    without a pause: the waiter, rung a chunk early, takes the GIL back while the last chunk moves
    (and may sleep on the last keeping it); each transfer ends, byte-exact, and the loop ran on."""
    caches = gpu_caches(256)
    orig = {n: t.clone() for n, t in caches.items()}
    src, dst = list(range(100)), [255 - i for i in range(100)]  # apart: every round stores the same bytes
    with kvoffload.Offloader(caches, host_blocks=120, chunk_bytes=16 * caches_block(caches)) as off:
        outcome: list[object] = []
        wrong: list[tuple[int, str]] = []

        def rounds() -> None:
            for r in range(5):
                for t in caches.values():
                    t[dst] = 0
                outcome.append(off.store({(r, i): src[i] for i in range(100)}).result())
                outcome.append(off.load({(r, i): dst[i] for i in range(100)}).result())
                wrong.extend((r, n) for n in caches if not same_bytes(caches[n][dst], orig[n][src]))
                off.discard([(r, i) for i in range(100)])

        waiter = threading.Thread(target=rounds)
        turns, deadline = 0, time.monotonic() + 60
        waiter.start()
        while waiter.is_alive() and time.monotonic() < deadline:  # pure Python: the GIL changes hands only when asked
            turns += 1
        waiter.join(10)
        assert not waiter.is_alive() and [o.kind for o in outcome] == ["store", "load"] * 5  # type: ignore[attr-defined]
        assert turns > 0 and wrong == []


@pytest.mark.asyncio
async def test_many_concurrent_transfers_gpu():
    caches = gpu_caches(128)
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=128) as off:
        await asyncio.gather(*(off.store({i: i}) for i in range(128)))
        for t in caches.values():
            t.zero_()
        await asyncio.gather(*(off.load({i: 127 - i}) for i in range(128)))
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n].flip(0), orig[n])


@pytest.mark.asyncio
@pytest.mark.parametrize("host_blocks", [0, 32], ids=["disk-only", "spill"])
@pytest.mark.parametrize("chunk_blocks", [2, 64])
async def test_gpu_disk_round_trip(tmp_path, host_blocks, chunk_blocks):
    caches = gpu_caches(256, seed=5)
    orig = {n: t.clone() for n, t in caches.items()}
    g = torch.Generator().manual_seed(3)
    src = torch.randperm(256, generator=g).tolist()[:160]
    dst = torch.randperm(256, generator=g).tolist()[:160]
    async with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=200,
                                   chunk_bytes=chunk_blocks * caches_block(caches)) as off:
        for i in range(0, 160, 16):
            await off.store({k: src[k] for k in range(i, i + 16)})
        s = off.stats()
        assert s.ready == 160 and s.disk_ready == 160 - host_blocks
        for t in caches.values():
            t.zero_()
        await off.load({k: dst[k] for k in range(160)})
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][dst], orig[n][src]), n
    assert not (tmp_path / "kv").exists()


@pytest.mark.asyncio
async def test_gpu_disk_store_waits_for_callers_stream(tmp_path):
    caches = gpu_caches(16)
    side = torch.cuda.Stream()
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=16) as off:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for t in caches.values():
                t[3].view(torch.uint8).fill_(0x3C)
            transfer = off.store({"k": 3})
        await transfer
        await off.load({"k": 7})
        torch.cuda.synchronize()
        assert all(bool((t[7].view(torch.uint8) == 0x3C).all()) for t in caches.values())


@pytest.mark.asyncio
async def test_gpu_disk_cancel_mid_transfer(tmp_path, faults):
    caches = gpu_caches(256, seed=6)
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=256,
                                   chunk_bytes=4 * caches_block(caches)) as off:
        gate = faults.gate(off, "pwritev")
        t = off.store({i: i for i in range(256)})
        gate.allow(2)
        await gate.entered_async(count=3)  # two chunks written, the third held
        t.cancel()
        gate.open()
        try:
            await t
        except kvoffload.TransferCancelled:
            pass
        s = off.stats()
        assert s.pending == 0 and s.in_flight == 0 and s.disk_free + s.disk_ready + s.disk_clean == 256
        await check_every_visible_key(off, caches, orig, {i: i for i in range(256)})


def test_start_from_a_thread_that_never_touched_cuda():
    """Pinning needs a CUDA context; a fresh thread has none until kvoffload makes one current."""
    import threading

    caches = gpu_caches(8)
    box: dict = {}

    def run():
        try:
            with kvoffload.Offloader(caches, host_blocks=8) as off:
                off.store({"a": 1}).result(30)
                off.load({"a": 2}).result(30)
            box["ok"] = True
        except BaseException as e:  # reported below
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert box.get("ok"), box.get("error")
    torch.cuda.synchronize()
    assert all(same_bytes(x[2], x[1]) for x in caches.values())


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["copy", "short-write", "EIO-read"])
async def test_gpu_faults_fail_the_transfer_and_lose_nothing(tmp_path, faults, fault):
    import errno

    from kvoffload._core.cuda.driver import CudaError

    caches = gpu_caches(64, seed=8)
    orig = {n: t.clone() for n, t in caches.items()}
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=32) as off:
        await off.store({i: i for i in range(8)})
        if fault == "copy":
            faults.fail(off, "to_host", CudaError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE", "injected"))
            failing = off.store({i: i for i in range(8, 12)})
        elif fault == "short-write":
            faults.fail(off, "pwritev", lambda real, fd, bufs, offset: real(fd, bufs, offset) - 4096)
            failing = off.store({i: i for i in range(8, 12)})
        else:
            faults.fail(off, "preadv", OSError(errno.EIO, "Input/output error"))
            failing = off.load({i: 40 + i for i in range(8)})
        with pytest.raises(kvoffload.TransferError):
            await failing
        faults.restore()
        s = off.stats()
        assert s.pending == 0 and s.pinned == 0 and off.lookup(range(12)) == 8
        for t in caches.values():
            t.zero_()
        await off.load({i: i for i in range(8)})
        await off.store({("after", 0): 0})  # the service goes on
        torch.cuda.synchronize()
        for n in caches:
            assert same_bytes(caches[n][:8], orig[n][:8])


def test_pinned_memory_is_released_on_close(tmp_path):
    from kvoffload._core.cuda.driver import driver

    with kvoffload.Offloader(gpu_caches(8), host_blocks=8, disk_path=tmp_path / "kv", disk_blocks=8) as off:
        buffers = pinned_buffers(off)
        addresses = [b.address for b in buffers]
        for a in addresses:
            assert int(driver().cuMemHostGetFlags(a)[0]) == 0  # page-locked while open
    for a in addresses:
        assert int(driver().cuMemHostGetFlags(a)[0]) != 0, "host memory still page-locked after close()"


def test_a_driver_event_reports_completion_and_a_cuda_error_by_the_drivers_name():
    """The real DriverEvent on a healthy device: ``query()`` is False while the work recorded before it
    runs and True once it is done, ``synchronize()`` returns without raising; a CUDA error code is raised
    as :class:`CudaError` named by the driver. (A real device fault cannot be provoked safely: it poisons
    the process's context for every later test. ``tests/test_device_errors.py`` drives the failure paths
    over a stand-in driver.)"""
    from kvoffload._core.cuda.driver import CudaError, DriverEvent, check, enqueue_calls

    device = torch.cuda.current_device()
    enqueue_calls().ensure_context(device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    event = DriverEvent(device).record(stream.cuda_stream)
    assert event.query() is False, "the event completed before the work recorded before it"
    event.synchronize()
    assert event.query() is True
    with pytest.raises(CudaError) as ei:
        check("cuEventQuery", 700)
    assert ei.value.code == 700 and "CUDA_ERROR_ILLEGAL_ADDRESS" in str(ei.value), str(ei.value)


def test_a_gone_driver_events_handle_is_reused_and_records_anew():
    """A DriverEvent's handle goes back to a pool when the event is gone; the next event takes it and
    tracks its own work, not the old one's: recorded behind new work, it is pending until that ends."""
    from kvoffload._core.cuda.driver import DriverEvent, enqueue_calls

    device = torch.cuda.current_device()
    enqueue_calls().ensure_context(device)
    stream = torch.cuda.Stream()
    first = DriverEvent(device).record(stream.cuda_stream)
    first.synchronize()
    handle = first.handle
    del first
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    second = DriverEvent(device).record(stream.cuda_stream)
    assert second.handle == handle, "the gone event's handle was not reused"
    assert second.query() is False, "the reused event reported the old work's completion"
    second.synchronize()
    assert second.query() is True
