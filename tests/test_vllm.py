"""kvoffload.vllm against vLLM 0.33's own classes (``pip install --no-deps vllm==0.33.0``).

The spec is built by vLLM's ``OffloadingSpecFactory`` from ``spec_module_path``, as the
``OffloadingConnector`` builds it; the tests then call the manager and the worker in the
scheduler's order (new request, lookup, prepare_store, submit_store, get_finished,
complete_store, prepare_load, submit_load, wait, complete_load, eviction, request finished) and
check every loaded block byte for byte, on the host tier and on host + disk.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed: pip install --no-deps vllm==0.33.0")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import kvoffload  # noqa: E402
from kvoffload._testing import copy_calls, disk_file_location, disk_file_stat  # noqa: E402

NUM_BLOCKS = 64
PAGE = 3 * 1024  # bytes per GPU block per layer tensor: not a multiple of 4096 on purpose
BPC = 2  # GPU blocks per offloaded chunk (one key)


def offloading_config(extra: dict, groups: int = 1, rank: int = 0) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"l{g}",), group_id=g) for g in range(groups)),
        worker_kv_bytes_per_block=2 * PAGE,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "KvoffloadSpec", "spec_module_path": "kvoffload.vllm", **extra},
        engine_id="test",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC),
        parallel=OffloadingParallelConfig(
            rank=rank, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )


def canonical_caches(device: str = "cpu", seed: int = 0) -> CanonicalKVCaches:
    g = torch.Generator().manual_seed(seed)
    tensors = [
        CanonicalKVCacheTensor(torch.randint(-128, 127, (NUM_BLOCKS, PAGE), generator=g, dtype=torch.int8).to(device), PAGE)
        for _ in range(2)
    ]
    return CanonicalKVCaches(tensors, [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])


def keys(name: str, n: int) -> list:
    return [make_offload_key(hashlib.sha256(f"{name}{i}".encode()).digest(), 0) for i in range(n)]


def gpu_spec(block_ids: list[int], first_index: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_index])


def run_job(worker, submit, job_id: int, *args) -> None:
    assert submit(job_id, *args) is True
    worker.wait({job_id})
    done = worker.get_finished()
    assert [(r.job_id, r.success) for r in done] == [(job_id, True)], done


def snapshot(caches: CanonicalKVCaches) -> list[torch.Tensor]:
    return [t.tensor.clone() for t in caches.tensors]


def assert_blocks(caches, before, dst: list[int], src: list[int]) -> None:
    for t, b in zip(caches.tensors, before):
        assert torch.equal(t.tensor[dst].cpu(), b[src].cpu())


@pytest.fixture(params=["host", "host+disk"])
def spec_and_worker(request, tmp_path):
    extra = {"host_blocks": 16} if request.param == "host" else {
        "host_blocks": 8, "disk_blocks": 8, "disk_path": str(tmp_path / "kv")}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    caches = canonical_caches(seed=1)
    worker = spec.get_worker(caches)
    yield spec, worker, caches, request.param, tmp_path
    worker.shutdown()


@pytest.mark.slow
def test_scheduler_call_order_round_trips_byte_for_byte(spec_and_worker):
    spec, worker, caches, tiers, tmp_path = spec_and_worker
    assert isinstance(spec, __import__("kvoffload.vllm").vllm.KvoffloadSpec)
    manager = spec.get_manager()
    orig = snapshot(caches)
    if tiers == "host+disk":
        assert os.path.basename(worker.disk_path) == "kv.dp0.rank_0", "rank 0 of engine 0 has its own disk path"
        assert os.listdir(tmp_path) == [], "its file has no name"
    ctx = ReqContext(req_id="r1")
    manager.on_new_request(ctx)
    ks = keys("a", 4)  # 4 chunks = 8 GPU blocks
    assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 4
    out = manager.prepare_store(ks, ctx)
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert manager.lookup(ks[0], ctx) == LookupResult.HIT_PENDING
    src = [3, 9, 10, 11, 20, 2, 40, 41]
    run_job(worker, worker.submit_store, 1, gpu_spec(src), out.store_spec)
    manager.complete_store(ks, ctx)
    assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 4
    manager.on_request_finished(ctx)

    ctx2 = ReqContext(req_id="r2")
    manager.on_new_request(ctx2)
    for t in caches.tensors:
        t.tensor[50:64] = 0
    load = manager.prepare_load(ks[:3], ctx2)
    run_job(worker, worker.submit_load, 2, load, gpu_spec([50, 51, 52, 53, 54, 55]))
    manager.complete_load(ks[:3], ctx2)
    assert_blocks(caches, orig, [50, 51, 52, 53, 54, 55], src[:6])
    # A load that starts in the middle of a chunk (block index 1): the chunk's first block is skipped.
    load = manager.prepare_load(ks[:3], ctx2)
    run_job(worker, worker.submit_load, 3, load, gpu_spec([60, 61, 62, 63, 56], first_index=1))
    manager.complete_load(ks[:3], ctx2)
    assert_blocks(caches, orig, [60, 61, 62, 63, 56], src[1:6])
    s = worker.offloader.stats()
    assert (s.in_flight, s.pinned, s.pending, s.evicted) == (0, 0, 0, 0), s


def test_the_managers_evictions_reach_the_worker_and_pins_hold(spec_and_worker):
    spec, worker, caches, tiers, _ = spec_and_worker
    manager = spec.get_manager()
    assert manager.capacity == 8  # (host + disk blocks) / blocks per chunk
    orig = snapshot(caches)
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    first = keys("first", 8)
    out = manager.prepare_store(first, ctx)
    run_job(worker, worker.submit_store, 1, gpu_spec(list(range(16))), out.store_spec)
    manager.complete_store(first, ctx)
    manager.touch(first[:2], ctx)  # now the most recently used
    pinned = manager.prepare_load(first[2:3], ctx)  # a load in preparation: never evicted
    more = keys("more", 5)
    out = manager.prepare_store(more, ctx)
    assert out.evicted_keys == first[3:8], "least recently used, unpinned chunks go first"
    run_job(worker, worker.submit_store, 2, gpu_spec(list(range(16, 26))), out.store_spec)
    manager.complete_store(more, ctx)
    for k in first[3:8]:
        assert (0, k, 0) not in worker.offloader and (0, k, 1) not in worker.offloader
    assert worker.offloader.stats().evicted == 0, "kvoffload evicted on its own, behind the manager"
    # every chunk still stored loads its own bytes, the pinned one included
    for t in caches.tensors:
        t.tensor[40:] = 0
    run_job(worker, worker.submit_load, 3, pinned, gpu_spec([40, 41]))
    manager.complete_load(first[2:3], ctx)
    assert_blocks(caches, orig, [40, 41], [4, 5])
    load = manager.prepare_load(more + first[:2], ctx)
    run_job(worker, worker.submit_load, 4, load, gpu_spec(list(range(44, 58))))
    assert_blocks(caches, orig, list(range(44, 58)), list(range(16, 26)) + [0, 1, 2, 3])
    # With every chunk pinned, or being stored, nothing can be stored: None, nothing evicted.
    assert manager.prepare_store(keys("none", 1), ctx) is not None  # first[2] is unpinned again
    assert manager.prepare_store(keys("none2", 1), ctx) is None
    manager.complete_load(more + first[:2], ctx)


def stored_loads_byte_for_byte(manager, worker, caches, orig, src_of: dict, job_id: int) -> None:
    """Every chunk the manager holds as stored loads, as the scheduler loads it, the bytes stored from ``src_of[key]``."""
    ctx = ReqContext(req_id="check")
    live = manager.stored_keys()
    assert [manager.lookup(k, ctx) for k in live] == [LookupResult.HIT] * len(live)
    load = manager.prepare_load(live, ctx)
    dst = list(range(NUM_BLOCKS - BPC * len(live), NUM_BLOCKS))
    run_job(worker, worker.submit_load, job_id, load, gpu_spec(dst))
    manager.complete_load(live, ctx)
    assert_blocks(caches, orig, dst, [b for k in live for b in src_of[k]])


def test_a_chunk_evicted_in_a_step_is_not_stored_again_in_that_step(spec_and_worker):
    """Every store spec of a scheduler step carries the step's evictions so far, and the worker discards
    them before it stores. A chunk evicted early in a step and offered again later in it (a request whose
    prefix the GPU cache still holds offers every chunk) would be discarded by the specs after it, while
    the manager serves it: it is not stored again before the next step."""
    spec, worker, caches, _, _ = spec_and_worker
    manager = spec.get_manager()
    orig = snapshot(caches)
    ctx = ReqContext(req_id="r")
    first = keys("first", 8)
    out = manager.prepare_store(first, ctx)
    run_job(worker, worker.submit_store, 1, gpu_spec(list(range(16))), out.store_spec)
    manager.complete_store(first, ctx)
    manager.on_schedule_end(None)
    src_of = {k: [2 * i, 2 * i + 1] for i, k in enumerate(first)}
    # one scheduler step: a store evicts first[0]; a request offers first[0] again; another store follows
    a, b = keys("a", 1), keys("b", 1)
    out_a = manager.prepare_store(a, ctx)
    assert out_a.evicted_keys == [first[0]]
    again = manager.prepare_store(first[:1], ctx)
    out_b = manager.prepare_store(b, ctx)
    manager.on_schedule_end(None)
    jobs = [(out_a, a, [20, 21]), (again, again.keys_to_store, [0, 1]), (out_b, b, [22, 23])]
    for job_id, (out, ks, src) in enumerate(jobs, start=2):  # the worker runs them in the step's order
        if ks:
            run_job(worker, worker.submit_store, job_id, gpu_spec(src), out.store_spec)
            manager.complete_store(ks, ctx)
            src_of[ks[0]] = src
    stored_loads_byte_for_byte(manager, worker, caches, orig, src_of, job_id=9)
    assert again.keys_to_store == [] and manager.lookup(first[0], ctx) == LookupResult.MISS
    assert worker.offloader.stats().evicted == 0


def test_a_chunk_evicted_while_the_worker_spills_it_costs_no_other_chunk(tmp_path, faults):
    """A chunk the manager evicts may still be on its way to disk in the worker (a store before made room
    in host memory by spilling it); its disk slot is free only once that spill ends. The next store waits
    for it, rather than have the offloader evict, behind the manager's back, a chunk the manager serves."""
    spec = OffloadingSpecFactory.create_spec(
        offloading_config({"host_blocks": 4, "disk_blocks": 12, "disk_path": str(tmp_path / "kv")}))
    caches = canonical_caches(seed=4)
    worker = spec.get_worker(caches)
    try:
        manager = spec.get_manager()  # 8 chunks, 2 of them in host memory
        orig = snapshot(caches)
        ctx = ReqContext(req_id="r")
        old, hot = keys("old", 5), keys("hot", 2)
        src_of = {}
        for job_id, (ks, first_block) in enumerate([(old, 0), (hot, 10)], start=1):
            out = manager.prepare_store(ks, ctx)
            src = list(range(first_block, first_block + BPC * len(ks)))
            run_job(worker, worker.submit_store, job_id, gpu_spec(src), out.store_spec)
            manager.complete_store(ks, ctx)
            manager.on_schedule_end(None)
            src_of |= {k: src[BPC * i:BPC * i + BPC] for i, k in enumerate(ks)}
        load = manager.prepare_load(old, ctx)  # the old chunks (on disk) become the most recently used
        run_job(worker, worker.submit_load, 3, load, gpu_spec(list(range(40, 50))))
        manager.complete_load(old, ctx)
        # One scheduler step, two stores: the first fits (the worker spills hot[0] to disk for it), the
        # second makes the manager evict hot[0], its least recently used chunk.
        n1, n2 = keys("n1", 1), keys("n2", 1)
        out1 = manager.prepare_store(n1, ctx)
        out2 = manager.prepare_store(n2, ctx)
        manager.on_schedule_end(None)
        assert out1.evicted_keys == [] and out2.evicted_keys == [hot[0]]
        writes = faults.gate(worker.offloader, "pwritev")
        assert worker.submit_store(4, gpu_spec([20, 21]), out1.store_spec)
        writes.wait_entered()  # hot[0] is on its way to disk
        assert worker.submit_store(5, gpu_spec([22, 23]), out2.store_spec)
        writes.open()
        worker.wait({4, 5})
        assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [(4, True), (5, True)]
        manager.complete_store(n1, ctx)
        manager.complete_store(n2, ctx)
        src_of |= {n1[0]: [20, 21], n2[0]: [22, 23]}
        assert worker.offloader.stats().evicted == 0, "the offloader evicted behind the manager's back"
        stored_loads_byte_for_byte(manager, worker, caches, orig, src_of, job_id=6)
    finally:
        worker.shutdown()


def test_a_failed_transfer_is_reported_as_failed(spec_and_worker):
    spec, worker, caches, _, _ = spec_and_worker
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r")
    ks = keys("f", 2)
    out = manager.prepare_store(ks, ctx)
    calls = copy_calls(worker.offloader)

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    calls.to_host = broken
    assert worker.submit_store(7, gpu_spec([1, 2, 3, 4]), out.store_spec) is True
    worker.wait({7})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(7, False)]
    manager.complete_store(ks, ctx, success=False)
    assert [manager.lookup(k, ctx) for k in ks] == [LookupResult.MISS] * 2
    assert all((0, k, 0) not in worker.offloader for k in ks)


def test_a_cancelled_load_is_reported_done_not_failed_and_the_cancel_never_waits(faults):
    """``cancel_loads`` (``KvoffloadConnector`` calls it for the loads of requests vLLM aborted) returns
    while a copy of the load is held; the load ends once that copy has landed, writes nothing after it,
    releases its slots, and is reported done with no bytes: no failure, no load error."""
    from kvoffload.vllm import slot_bytes_for

    spec = OffloadingSpecFactory.create_spec(offloading_config({"host_blocks": 16, "chunk_bytes": slot_bytes_for(2 * PAGE)}))
    caches = canonical_caches(seed=5)
    worker = spec.get_worker(caches)
    worker.reports_failures = True
    try:
        manager = spec.get_manager()
        ctx = ReqContext(req_id="r")
        ks = keys("c", 2)
        out = manager.prepare_store(ks, ctx)
        run_job(worker, worker.submit_store, 1, gpu_spec([1, 2, 3, 4]), out.store_spec)
        manager.complete_store(ks, ctx)
        orig = snapshot(caches)
        copies = faults.gate(worker.offloader, "to_device")
        assert worker.submit_load(2, manager.prepare_load(ks, ctx), gpu_spec([30, 31, 32, 33])) is True
        copies.wait_entered()
        assert worker.cancel_loads([2, 99]) == [2]  # returns with the copy held; 99 is no job
        assert worker.has_job(2) and not worker.get_finished()
        copies.allow(1)
        worker.wait({2})
        assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [(2, True, None)]
        assert worker.take_failures() == [] and not worker.has_job(2)
        assert copies.entered == 1, "the cancelled load went on copying"
        for t, before in zip(caches.tensors, orig):
            assert torch.equal(t.tensor[31:34], before[31:34]), "written after the cancel"
        assert worker.cancel_loads([2]) == []  # reported: nothing left to cancel
        manager.complete_load(ks, ctx)
        s = worker.offloader.stats()
        assert (s.pinned, s.in_flight, s.failed) == (0, 0, 0), s
        # the chunks still load whole, and a load cancelled after it ended is reported as it ended
        copies.open()
        assert worker.submit_load(3, manager.prepare_load(ks, ctx), gpu_spec([40, 41, 42, 43])) is True
        worker.wait({3})
        assert worker.cancel_loads([3]) == []
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
        manager.complete_load(ks, ctx)
        assert_blocks(caches, orig, [40, 41, 42, 43], [1, 2, 3, 4])
    finally:
        worker.shutdown()


def test_the_workers_offloader_promotes_nothing(spec_and_worker):
    """A load from disk leaves no copy in host memory: the manager counts every slot."""
    _, worker, _, _, _ = spec_and_worker
    assert worker.offloader.options.promote is False


def test_a_hybrid_spec_is_accepted_and_maps_each_groups_blocks():
    """Two KV cache groups over the same tensors (the second uses only tensor 0): a job's keys map to its
    GPU blocks group by group, each group's first block possibly inside a chunk, a block of either
    group stored as its whole row in every tensor."""
    spec = OffloadingSpecFactory.create_spec(offloading_config({"host_blocks": 16}, groups=2))
    caches = canonical_caches(seed=3)
    hybrid = CanonicalKVCaches(caches.tensors, [caches.group_data_refs[0], [CanonicalKVCacheRef(0, PAGE)]])
    with pytest.raises(ValueError, match="KV cache groups"):
        spec.get_worker(caches)  # one group's refs for a config of two
    worker = spec.get_worker(hybrid)
    try:
        manager = spec.get_manager()
        orig = snapshot(hybrid)
        ctx = ReqContext(req_id="r")
        manager.on_new_request(ctx)
        full = keys("full", 2)
        window = [make_offload_key(hashlib.sha256(f"window{i}".encode()).digest(), 1) for i in range(2)]
        out = manager.prepare_store([*full, *window], ctx)
        # group 0: blocks 1-3 of the request (chunk 0 from its second block, chunk 1); group 1: blocks 2-5
        src = [5, 6, 7, 20, 21, 22, 23]
        run_job(worker, worker.submit_store, 1, GPULoadStoreSpec(src, group_sizes=[3, 4], block_indices=[1, 2]),
                out.store_spec)
        manager.complete_store(out.keys_to_store, ctx)
        for t in hybrid.tensors:
            t.tensor[40:] = 0
        # group 0 loads nothing (its block index means nothing then); group 1 from block 3, inside its chunk 1
        load = manager.prepare_load(window, ctx)
        run_job(worker, worker.submit_load, 2, load, GPULoadStoreSpec([40, 41, 42], group_sizes=[0, 3], block_indices=[5, 3]))
        manager.complete_load(window, ctx)
        assert_blocks(hybrid, orig, [40, 41, 42], [21, 22, 23])
        load = manager.prepare_load([*full, window[1]], ctx)
        run_job(worker, worker.submit_load, 3, load,
                GPULoadStoreSpec([50, 51, 52, 53, 54], group_sizes=[3, 2], block_indices=[1, 4]))
        manager.complete_load([*full, window[1]], ctx)
        assert_blocks(hybrid, orig, [50, 51, 52, 53, 54], [5, 6, 7, 22, 23])
        with pytest.raises(ValueError, match="do not match"):  # two chunks of group 0, but only one key
            worker.submit_load(4, manager.prepare_load(full[:1], ctx),
                               GPULoadStoreSpec([60, 61, 62], group_sizes=[3, 0], block_indices=[0, 0]))
        s = worker.offloader.stats()
        assert (s.evicted, s.failed) == (0, 0), s
    finally:
        worker.shutdown()


def test_missing_sizes_are_refused():
    with pytest.raises(ValueError, match="no room"):
        OffloadingSpecFactory.create_spec(offloading_config({}))
    with pytest.raises(ValueError, match="not both"):
        OffloadingSpecFactory.create_spec(offloading_config({"host_blocks": 16, "host_bytes": 1 << 20}))
    spec = OffloadingSpecFactory.create_spec(offloading_config({"host_bytes": 10 * 8192}))  # slots of 8 KiB
    assert spec.get_manager().capacity == 5


def test_each_rank_uses_its_own_disk_file(tmp_path):
    workers = []
    for rank in (0, 1):
        spec = OffloadingSpecFactory.create_spec(
            offloading_config({"host_blocks": 0, "disk_blocks": 8, "disk_path": str(tmp_path / "kv")}, rank=rank))
        workers.append(spec.get_worker(canonical_caches(seed=rank)))
    try:
        assert [os.path.basename(w.disk_path) for w in workers] == ["kv.dp0.rank_0", "kv.dp0.rank_1"]
        assert len({disk_file_stat(w.offloader).st_ino for w in workers}) == 2 and os.listdir(tmp_path) == []
    finally:
        for w in workers:
            w.shutdown()
    assert os.listdir(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_on_cuda_tensors(tmp_path):
    spec = OffloadingSpecFactory.create_spec(
        offloading_config({"host_blocks": 8, "disk_blocks": 8, "disk_path": str(tmp_path / "kv")}))
    caches = canonical_caches("cuda", seed=3)
    worker = spec.get_worker(caches)
    try:
        manager = spec.get_manager()
        orig = snapshot(caches)
        ctx = ReqContext(req_id="g")
        ks = keys("g", 8)
        out = manager.prepare_store(ks, ctx)
        run_job(worker, worker.submit_store, 1, gpu_spec(list(range(16))), out.store_spec)
        manager.complete_store(ks, ctx)
        more = keys("g2", 4)
        out = manager.prepare_store(more, ctx)  # evicts 4 chunks
        run_job(worker, worker.submit_store, 2, gpu_spec(list(range(16, 24))), out.store_spec)
        manager.complete_store(more, ctx)
        live = manager.stored_keys()
        load = manager.prepare_load(live, ctx)
        dst = list(range(32, 32 + 2 * len(live)))
        run_job(worker, worker.submit_load, 3, load, gpu_spec(dst))
        src_of = {k: [2 * i, 2 * i + 1] for i, k in enumerate(ks)} | {k: [16 + 2 * i, 17 + 2 * i] for i, k in enumerate(more)}
        torch.cuda.synchronize()
        assert_blocks(caches, orig, dst, [b for k in live for b in src_of[k]])
    finally:
        worker.shutdown()


def config_of(extra: dict, world_size: int = 1, rank: int = 0, dp: int = 0) -> OffloadingConfig:
    config = offloading_config(extra, rank=rank)
    parallel = config.parallel.__class__(**{**config.parallel.__dict__, "world_size": world_size, "tp_size": world_size,
                                            "data_parallel_index": dp})
    return config.__class__(**{**config.__dict__, "parallel": parallel})


@pytest.mark.parametrize("extra, message", [
    ({"host_blocks": 16, "disk_bytse": "1GiB"}, r"unknown key\(s\) 'disk_bytse' \(did you mean 'disk_bytes'\?\).*accepts"),
    ({"host_blocks": 16, "disk_byte": 1 << 30, "disk_path": "/tmp/kv"}, r"'disk_byte' \(did you mean 'disk_bytes'\?\)"),
    ({"host_blocks": 16, "disk_path": "/tmp/kv"}, r"\['disk_path'\].*needs its size too"),
    ({"host_blocks": 16, "disk_blocks": 8}, r"\['disk_blocks'\].*needs disk_path"),
    ({"host_bytes": "16GB"}, r"\['host_bytes'\]: '16GB' is not a size.*GiB"),
    ({"host_bytes": 1.5e9}, r"\['host_bytes'\]: 1500000000.0 \(float\) is not a size"),
    ({"host_blocks": 16.0}, r"\['host_blocks'\]: 16.0 \(float\) is not an integer"),
    ({"host_blocks": True}, r"\['host_blocks'\]: True \(bool\) is not an integer"),
    ({"host_blocks": 16, "expedited_loads": "no"}, r"\['expedited_loads'\]: 'no' is not a boolean"),
    ({"host_blocks": 16, "use_page_cache": 1}, r"\['use_page_cache'\]: 1 is not a boolean"),
    ({"host_blocks": 16, "copy_engine": "sm"}, r"\['copy_engine'\]: 'sm' is not one of 'kernel', 'dma'"),
    ({"host_blocks": 16, "eviction_policy": "lru"}, r"unknown key\(s\) 'eviction_policy'"),
    ({"host_blocks": 16, "host_bytes": "1GiB"}, r"give one of host_blocks or host_bytes, not both"),
    ({"host_bytes": 4096}, r"less than one block slot"),
    ({"host_blocks": 16, "persist": True}, r"persist=True needs a disk tier"),
    ({"host_blocks": 16, "persist": "yes", "disk_blocks": 8, "disk_path": "/tmp/kv"}, r"\['persist'\]: 'yes' is not a boolean"),
    ({"host_blocks": 16, "verify": True}, r"verify needs persist=True"),
    ({"host_blocks": 16, "fingerprint": "m"}, r"fingerprint needs persist=True or remote"),
    ({"host_blocks": 16, "fingerprint": 7, "persist": True, "disk_blocks": 8, "disk_path": "/tmp/kv"},
     r"\['fingerprint'\]: 7 is not a non-empty string"),
    ({"host_blocks": 16, "remote": "http://cache:6379"}, r"remote='http://cache:6379' has the scheme 'http'"),
    ({"host_blocks": 16, "remote": ""}, r"\['remote'\]: '' is not a non-empty string"),
    ({"host_blocks": 16, "remote": "redis://cache:6379/0", "remote_write": "always"},
     r"\['remote_write'\]: 'always' is not one of 'through', 'evict', 'none'"),
    ({"host_blocks": 16, "namespace": 3}, r"\['namespace'\]: 3 is not a non-empty string"),
    ({"host_blocks": 16, "remote_secret": ["env:KVOFFLOAD_TEST_NEVER_SET"], "remote": "redis://cache:6379/0"},
     r"KVOFFLOAD_TEST_NEVER_SET"),
    ({"host_blocks": 16, "remote_secret": "env:KVOFFLOAD_TEST_NEVER_SET"}, r"remote_secret"),
])
def test_the_extra_config_is_checked_strictly(extra, message):
    with pytest.raises(ValueError, match=message):
        OffloadingSpecFactory.create_spec(offloading_config(extra))


def test_the_security_options_reach_the_offloader(monkeypatch):
    """``remote_secret`` (an environment variable's name, or a list of them: JSON holds no bytes),
    ``namespace`` and ``encryption_key`` pass to the offloader, checked by it when the spec is made."""
    monkeypatch.setenv("KVOFFLOAD_TEST_SECRET", "s" * 32)
    spec = OffloadingSpecFactory.create_spec(offloading_config(
        {"host_blocks": 16, "remote": "redis://cache:6379/0", "remote_secret": ["env:KVOFFLOAD_TEST_SECRET"], "namespace": "tenant-a"}))
    assert spec.options["remote_secret"] == ["env:KVOFFLOAD_TEST_SECRET"] and spec.options["namespace"] == "tenant-a"


def test_sizes_take_binary_suffixes_and_are_totals_for_the_engines_ranks():
    # slots of 8 KiB (2 pages of 3 KiB, rounded up to 4 KiB)
    one = OffloadingSpecFactory.create_spec(config_of({"host_bytes": "8MiB", "disk_bytes": "16 MiB", "disk_path": "/tmp/kv"}))
    assert (one.host_blocks, one.disk_blocks) == (1024, 2048)
    # tensor parallelism: the same numbers give each of 4 ranks a quarter, as vLLM's cpu_bytes_to_use does
    tp = OffloadingSpecFactory.create_spec(config_of({"host_bytes": "8MiB", "disk_bytes": 16 << 20, "disk_path": "/tmp/kv"}, world_size=4))
    assert (tp.host_blocks, tp.disk_blocks) == (256, 512)
    assert tp.get_manager().capacity == (256 + 512) // BPC
    # the vLLM guide's tensor-parallel example: 64 GiB of host memory and a 100 GiB file per rank
    readme = OffloadingSpecFactory.create_spec(config_of(
        {"host_bytes": "256GiB", "disk_path": "/mnt/nvme/kv", "disk_bytes": "400GiB"}, world_size=4))
    assert (readme.host_blocks * 8192, readme.disk_blocks * 8192) == (64 << 30, 100 << 30)
    # blocks are vLLM blocks: every rank holds its share of each
    assert OffloadingSpecFactory.create_spec(config_of({"host_blocks": 64}, world_size=4)).host_blocks == 64
    # vLLM's own name for the host size, and vLLM's own keys, are accepted
    spec = OffloadingSpecFactory.create_spec(config_of({"cpu_bytes_to_use": 8 << 20, "offload_prompt_only": True,
                                                        "sync_load_budget_bytes": 0, "expedited_loads": "false"}))
    assert spec.host_blocks == 1024 and spec.options["expedited_loads"] is False


@pytest.mark.slow
def test_engines_sharing_a_disk_path_never_share_a_file(tmp_path):
    workers = []
    try:
        for dp in (0, 1, 0):  # two data-parallel engines, and a second server with the same settings as the first
            spec = OffloadingSpecFactory.create_spec(
                config_of({"host_blocks": 0, "disk_blocks": 8, "disk_path": str(tmp_path / "kv")}, dp=dp))
            workers.append(spec.get_worker(canonical_caches(seed=dp)))
        assert [os.path.basename(w.disk_path) for w in workers] == ["kv.dp0.rank_0", "kv.dp1.rank_0", "kv.dp0.rank_0"]
        assert len({disk_file_stat(w.offloader).st_ino for w in workers}) == 3, "two engines share a file"
        assert os.listdir(tmp_path) == [], "a disk file has a name"
    finally:
        for w in workers:
            w.shutdown()
    assert os.listdir(tmp_path) == []


def test_a_directory_as_disk_path_holds_each_ranks_file(tmp_path):
    (tmp_path / "nvme").mkdir()
    spec = OffloadingSpecFactory.create_spec(config_of({"host_blocks": 0, "disk_blocks": 8, "disk_path": str(tmp_path / "nvme")}))
    worker = spec.get_worker(canonical_caches(seed=0))
    try:
        assert worker.disk_path == str(tmp_path / "nvme" / "kv.dp0.rank_0")  # in the directory, never beside it
        assert os.path.dirname(disk_file_location(worker.offloader)) == str(tmp_path / "nvme")
    finally:
        worker.shutdown()
    assert os.listdir(tmp_path) == ["nvme"] and os.listdir(tmp_path / "nvme") == []


def test_each_ranks_persistent_or_shared_tier_has_an_identity_of_its_own(tmp_path):
    extra = {"host_blocks": 0, "disk_blocks": 8, "disk_path": str(tmp_path / "kv"), "persist": True, "fingerprint": "w1"}
    specs = [OffloadingSpecFactory.create_spec(config_of(extra, world_size=2, rank=r)) for r in (0, 1)]
    prints = [spec.options["fingerprint"] for spec in specs]
    assert prints[0] != prints[1] and all("w1" in p and "tiny" in p for p in prints)
    shared = [OffloadingSpecFactory.create_spec(config_of({"host_blocks": 8, "remote": "redis://cache:6379/0"}, world_size=2, rank=r))
              for r in (0, 1)]
    assert shared[0].options["fingerprint"] != shared[1].options["fingerprint"]  # the same rank of engines alike shares
    workers = []
    try:
        for spec, seed in zip(specs, (0, 1)):
            workers.append(spec.get_worker(canonical_caches(seed=seed)))
        files = [w.offloader.disk_file for w in workers]
        assert [os.path.basename(os.path.dirname(f)) for f in files] == ["kv.dp0.rank_0", "kv.dp0.rank_1"]
        assert all(os.path.basename(f).startswith("kvoffload-") for f in files)  # named after its identity
    finally:
        for w in workers:
            w.shutdown()
