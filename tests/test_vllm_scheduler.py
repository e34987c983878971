"""kvoffload's vLLM backend driven by vLLM 0.33's real ``Scheduler``.

Each test steps vLLM's ``Scheduler`` and a worker-role connector as vLLM's model runner does
(``support.vllm_scheduler.Engine``), checking every loaded block byte for byte.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed with what its Scheduler imports (the test extra)")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload._testing import copy_calls  # noqa: E402
from kvoffload.vllm import Metric  # noqa: E402
from support.redis_servers import binaries, command, redis_server  # binaries: a fixture
from support.vllm_scheduler import BLOCK, BPC, LAYERS, PAGE, TIERS, Engine, hits, prompt, tiers  # noqa: E402
from support.waiting import HANG_S, spin_until  # noqa: E402


@pytest.fixture
def make_engine(tmp_path: Any) -> Any:
    engines: list[Engine] = []

    def make(extra: dict[str, Any], **kwargs: Any) -> Engine:
        engines.append(Engine(tmp_path, extra, **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


@pytest.mark.parametrize("tier", list(TIERS))
def test_prefixes_round_trip_through_the_real_scheduler(make_engine: Callable[..., Engine], tmp_path: Any, tier: str) -> None:
    engine = make_engine(tiers(tier, tmp_path))
    a = prompt(1, chunks=3)
    (first,) = engine.run(a)
    assert hits(engine, first) == 0
    assert len(engine.manager.stored_keys()) == 3
    engine.drop_gpu_prefix_cache()
    (again,) = engine.run(a + [7, 8, 9])
    assert hits(engine, again) == 3 * BPC * BLOCK
    # Mid-chunk: the GPU prefix cache keeps block 0, so the load starts at block 1, inside chunk 0.
    engine.drop_gpu_prefix_cache()
    engine.run(a[:BLOCK + 5])
    (mid,) = engine.run(a + [4])
    assert hits(engine, mid) == 3 * BPC * BLOCK - BLOCK
    assert engine.loads_checked == 2
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed, s.in_flight) == (0, 0, 0), s


@pytest.mark.parametrize("tier", list(TIERS))
def test_the_managers_evictions_keep_the_offloader_in_step(make_engine: Callable[..., Engine], tmp_path: Any, tier: str) -> None:
    engine = make_engine(tiers(tier, tmp_path))  # room for 8 chunks
    prompts = [prompt(10 + i, chunks=2) for i in range(6)]  # 12 chunks through 8 chunks of room
    for p in prompts:
        engine.run(p)
    assert len(engine.manager.stored_keys()) == 8
    engine.drop_gpu_prefix_cache()
    for p in prompts[2:]:  # the 4 most recent prompts are stored: each loads whole
        (r,) = engine.run(p + [1])
        assert hits(engine, r) == 2 * BPC * BLOCK
    (r,) = engine.run(prompts[0] + [1])  # evicted by the manager: computed again
    assert hits(engine, r) == 0
    assert engine.loads_checked == 4
    assert engine.worker.offloader.stats().evicted == 0, "the offloader evicted behind the manager's back"


def gate(engine: Engine, direction: str) -> tuple[threading.Event, threading.Event]:
    """Hold the worker's copies in one direction (``to_host``: stores, ``to_device``: loads)
    until the returned ``release`` is set; ``entered`` is set once one is held."""
    calls = copy_calls(engine.worker.offloader)
    real = getattr(calls, direction)
    entered, release = threading.Event(), threading.Event()

    def held(*args: Any) -> Any:
        entered.set()
        assert release.wait(30), "the test never released the gate"
        return real(*args)

    setattr(calls, direction, held)
    return entered, release


def weight_update(engine: Engine) -> None:
    """What an RL loop does between rollouts: reset every cache, the connector's too; new weights."""
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    engine.version += 1


@pytest.mark.parametrize("tier", list(TIERS))
def test_after_a_reset_and_new_weights_loads_return_the_new_bytes(
    make_engine: Callable[..., Engine], tmp_path: Any, tier: str,
) -> None:
    engine = make_engine(tiers(tier, tmp_path))
    a = prompt(20, chunks=2)
    engine.run(a)  # stored under weights v1
    weight_update(engine)
    (computed,) = engine.run(a + [1])
    assert hits(engine, computed) == 0, "a hit on bytes stored before the reset"
    engine.drop_gpu_prefix_cache()
    (loaded,) = engine.run(a + [2])
    assert hits(engine, loaded) == 2 * BPC * BLOCK and engine.loads_checked == 1  # holding the bytes of weights v2
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed) == (0, 0), s
    assert s.host_ready + s.disk_ready == 2 * BPC, "blocks from before the reset are still held"


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_store_in_flight_at_a_reset_neither_defers_requests_nor_serves_its_bytes(
    make_engine: Callable[..., Engine], tmp_path: Any, tier: str,
) -> None:
    engine = make_engine(tiers(tier, tmp_path))
    a = prompt(21, chunks=2)
    entered, release = gate(engine, "to_host")
    engine.add(a)
    for _ in range(5):  # until its store has started (and is held by the gate)
        engine.step(wait_when_idle=False)
        if engine.worker.offloader.stats().pending:
            break
    assert entered.wait(10)
    weight_update(engine)
    release.set()  # the store from before the reset ends now, late
    engine.run_until_idle()
    (computed,) = engine.run(a + [1])  # not deferred, waiting for the old store; computed under v2
    assert hits(engine, computed) == 0
    engine.drop_gpu_prefix_cache()
    (loaded,) = engine.run(a + [2])
    assert hits(engine, loaded) == 2 * BPC * BLOCK and engine.loads_checked == 1
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed) == (0, 0), s
    assert s.host_ready + s.disk_ready == 2 * BPC, "blocks of the store from before the reset are still held"


def test_a_reset_under_capacity_pressure_never_loses_a_chunk_the_manager_serves(
    make_engine: Callable[..., Engine], tmp_path: Any,
) -> None:
    engine = make_engine({"host_blocks": 8})  # room for 4 chunks
    old = [prompt(30 + i, chunks=2) for i in range(2)]
    engine.run(*old)
    weight_update(engine)
    new = [prompt(40 + i, chunks=2) for i in range(2)]
    engine.run(*new)
    engine.drop_gpu_prefix_cache()
    reqs = engine.run(*(p + [1] for p in new))
    assert [hits(engine, r) for r in reqs] == [2 * BPC * BLOCK] * 2
    assert engine.loads_checked == 2
    assert engine.worker.offloader.stats().evicted == 0


def test_a_store_waits_while_a_load_holds_the_host_tier(make_engine: Callable[..., Engine], tmp_path: Any) -> None:
    engine = make_engine(tiers("host+disk", tmp_path))  # host memory: 4 blocks, 2 chunks
    a, b = prompt(50, chunks=2), prompt(51, chunks=2)
    engine.run(a)  # a's two chunks fill host memory
    engine.drop_gpu_prefix_cache()
    entered, release = gate(engine, "to_device")
    engine.add(a + [1])  # loads a's chunks, pinning every host slot while the gate holds the load
    engine.add(b)  # computed; its store needs host slots
    engine.step(wait_when_idle=False)  # a's load starts; b is computed
    assert entered.wait(10) and engine.worker.offloader.stats().pinned == 2 * BPC
    for _ in range(3):  # b's store is submitted, and finds host memory pinned by the load
        engine.step(wait_when_idle=False)
    assert engine.counter(Metric.STORE_WAITS) == 1
    assert engine.counter(Metric.FAILED_JOBS, ("store",)) == 0
    release.set()
    engine.run_until_idle()
    engine.drop_gpu_prefix_cache()
    (rb,) = engine.run(b + [1])
    assert hits(engine, rb) == 2 * BPC * BLOCK
    assert engine.loads_checked == 2
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed) == (0, 0), s


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_request_aborted_while_it_loads_cancels_the_load_and_frees_its_blocks_at_once(
    make_engine: Callable[..., Engine], tmp_path: Any, faults: Any, tier: str,
) -> None:
    """vLLM's scheduler keeps the GPU blocks of a request aborted while it waits for its load until
    the worker reports the load; the worker learns of the abort from the next step's
    ``finished_req_ids`` and cancels the load, which stops once the copy running then has landed.
    Its blocks go back to vLLM's pool, the manager's pins drop, nothing stays pinned or in flight
    in the offloader, nothing is reported failed, and the chunks load whole for a later request.
    From disk the load is held in a read instead of a copy."""
    engine = make_engine({**tiers(tier, tmp_path), "chunk_bytes": len(LAYERS) * PAGE})  # one copy (or read) per block
    a = prompt(140, chunks=2)
    engine.run(a)
    if tier == "host+disk":
        engine.run(prompt(141, chunks=2))  # pushes a's chunks out of host memory, onto disk
    engine.drop_gpu_prefix_cache()
    pool = engine.scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    copies = faults.gate(engine.worker.offloader, "to_device" if tier == "host" else "preadv")
    r = engine.add(a + [1])
    engine.step(wait_when_idle=False)  # r's load of 4 blocks starts; its first copy is held
    copies.wait_entered()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = engine.worker._loads.values()
    ended = threading.Event()

    def on_end(_: Any) -> None:
        ended.set()
        with copies.cond:
            copies.cond.notify_all()

    load.add_done_callback(on_end, on_ending_thread=True)
    engine.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    engine.step(wait_when_idle=False)  # the abort reaches the worker; the step never waits for the held copy
    assert not ended.is_set() and pool.get_num_free_blocks() < free  # the held copy still writes r's blocks
    copies.allow(1)  # the copy running at the cancel lands
    with copies.cond:  # then the load ends, or (not cancelled) its next copy arrives
        assert copies.cond.wait_for(lambda: ended.is_set() or copies.entered > 1, HANG_S)
    assert ended.is_set() and load.cancelled(), "the aborted request's load went on copying"
    assert copies.entered == 1
    engine.step(wait_when_idle=False)  # reported: vLLM frees r's blocks, the manager drops its pins
    assert r.request_id not in engine.scheduler.requests
    assert pool.get_num_free_blocks() == free, "the aborted request's blocks were not given back"
    assert not +engine.manager._pins, engine.manager._pins
    s = engine.worker.offloader.stats()
    assert (s.pinned, s.in_flight, s.pending, s.failed, s.evicted) == (0, 0, 0, 0, 0), s
    assert engine.counter(Metric.FAILED_JOBS, ("load",)) == 0 and engine.abandoned_loads == 1
    stored = engine.manager.stored_keys()
    assert len(stored) == (2 if tier == "host" else 4)  # the cancel forgot no chunk
    copies.open()
    engine.run_until_idle()
    (again,) = engine.run(a + [2])  # the chunks still serve, byte for byte
    assert hits(engine, again) == 2 * BPC * BLOCK and engine.loads_checked == 1
    assert again.request_id in engine.contexts_checked and set(engine.manager.stored_keys()) == set(stored)
    assert not +engine.manager._pins and pool.get_num_free_blocks() == free
    s = engine.worker.offloader.stats()
    assert (s.pinned, s.in_flight, s.failed) == (0, 0, 0), s


def test_a_chunk_evicted_while_the_worker_spills_it_costs_no_other_chunk(
    make_engine: Callable[..., Engine], tmp_path: Any, faults: Any,
) -> None:
    """Two stores of one step: the first makes room in host memory by spilling the oldest host chunk to
    disk, the second makes the manager evict that very chunk. Until the spill ends its disk slot is not
    free: the second store waits for it, instead of the offloader evicting a disk chunk the manager
    still serves (whose load would then fail, and stop vLLM)."""
    engine = make_engine(tiers("host+disk", tmp_path))  # 8 chunks, 2 in host memory
    old = [prompt(80 + i, chunks=1) for i in range(5)]
    hot = [prompt(90 + i, chunks=1) for i in range(2)]
    for p in old + hot:  # old chunks end on disk, hot ones in host memory
        engine.run(p)
    engine.drop_gpu_prefix_cache()
    engine.run(*(p + [1] for p in old))  # loaded: the hot chunks are now the manager's least recently used
    assert engine.loads_checked == 5
    engine.add(prompt(100, chunks=1))
    engine.add(prompt(101, chunks=1))
    engine.step()  # both computed: their stores are prepared in this step, the second evicting hot[0]
    writes = faults.gate(engine.worker.offloader, "pwritev")
    engine.step(wait_when_idle=False)  # the worker submits both stores; hot[0] is on its way to disk
    writes.wait_entered()
    writes.open()
    engine.run_until_idle()
    assert engine.counter(Metric.EVICTED_CHUNKS) == 1
    engine.drop_gpu_prefix_cache()
    reqs = engine.run(*(p + [2] for p in old))  # vLLM stops at a failed load
    assert [hits(engine, r) for r in reqs] == [BPC * BLOCK] * 5
    assert engine.worker.offloader.stats().evicted == 0, "the offloader evicted behind the manager's back"


def test_hit_sources_and_kvoffload_metrics_reach_vllm(make_engine: Callable[..., Engine], tmp_path: Any) -> None:
    engine = make_engine(tiers("host+disk", tmp_path))  # host memory holds 2 chunks
    engine.worker.stats_period_s = 0  # every step's figures, not one read a second
    a, b = prompt(60, chunks=2), prompt(61, chunks=2)
    engine.run(a)
    engine.run(b)  # pushes a's chunks to disk
    engine.drop_gpu_prefix_cache()
    engine.run(a + [1])
    assert engine.hit_sources == {CacheHitSource.DISK: 2 * BPC * BLOCK}
    engine.run(b + [1])
    assert engine.hit_sources == {CacheHitSource.DISK: 2 * BPC * BLOCK, CacheHitSource.HOST: 2 * BPC * BLOCK}
    # kvoffload's figures, as the scheduler hands them to vLLM's metrics loggers
    assert engine.counter(Metric.LOADED_BLOCKS, ("disk",)) == 2 * BPC
    assert engine.counter(Metric.LOADED_BLOCKS, ("host",)) == 2 * BPC
    assert engine.counter(Metric.LOADED_CHUNKS, ("disk",)) == 2 and engine.counter(Metric.LOADED_CHUNKS, ("host",)) == 2
    assert engine.counter(Metric.SPILLED_BLOCKS) >= 2 * BPC
    assert engine.counter(Metric.DISK_BYTES, ("written",)) > 0 and engine.counter(Metric.DISK_BYTES, ("read",)) > 0
    assert engine.counter(Metric.EVICTED_BLOCKS, ("host",)) == engine.counter(Metric.EVICTED_BLOCKS, ("disk",)) == 0
    assert any(Metric.JOB_SECONDS in p["data"] for p in engine.stats)
    # ... and vLLM's Prometheus logger registers and takes every one of them
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (
        prometheus_client.Gauge, prometheus_client.Counter, prometheus_client.Histogram)}
    prom = OffloadPromMetrics(engine.config, types, ["engine"], {0: ["0"]})
    for payload in engine.stats:
        prom.observe(payload, 0)
    assert registry.get_sample_value("vllm:kvoffload_loaded_blocks_total", {"engine": "0", "tier": "disk"}) == 2 * BPC


def test_a_plain_offloading_connector_runs_the_same_backend(make_engine: Callable[..., Engine], tmp_path: Any) -> None:
    engine = make_engine({"host_blocks": 16}, connector="OffloadingConnector")
    a = prompt(70, chunks=2)
    engine.run(a)
    engine.drop_gpu_prefix_cache()
    (r,) = engine.run(a + [1])
    assert hits(engine, r) == 2 * BPC * BLOCK and engine.loads_checked == 1
    assert not any(Metric.LOADED_BLOCKS in p["data"] for p in engine.stats)  # the workers' figures need KvoffloadConnector
    assert any(Metric.LOADED_CHUNKS in p["data"] for p in engine.stats)


FAILED_LOADS = {
    "copy": ("host", "to_device"),  # the copy into the cache fails
    "disk-read": ("host+disk", "preadv"),  # the chunks are on disk; reading them fails
    "missing": ("host", None),  # the worker's offloader lost the chunks (a load of a key it does not hold)
    "sync-load": ("host", "to_device"),  # a load the request waits for in its step (sync_load_budget_bytes)
}


def fail_loads(engine: Engine, faults: Any, case: str) -> Any:
    """Make every load of the engine's stored chunks fail, as ``FAILED_LOADS[case]`` says; returns the fault."""
    _, path = FAILED_LOADS[case]
    if path is None:
        worker = engine.worker
        assert worker.offloader.discard(worker._blocks_of(engine.manager.generation, engine.manager.stored_keys()))
        return None
    return faults.fail(engine.worker.offloader, path, OSError(5, "injected IO error"))


@pytest.mark.parametrize("case", list(FAILED_LOADS))
def test_a_failed_load_is_recomputed_and_its_chunks_are_not_offered_again(
    make_engine: Callable[..., Engine], tmp_path: Any, faults: Any, case: str,
) -> None:
    extra = tiers(FAILED_LOADS[case][0], tmp_path)
    if case == "sync-load":
        extra["sync_load_budget_bytes"] = 1 << 30
    engine = make_engine(extra, load_failure_policy="recompute")
    a = prompt(110, chunks=2)
    engine.run(a)
    if case == "disk-read":
        engine.run(prompt(111, chunks=2))  # pushes a's chunks out of host memory, onto disk
    engine.drop_gpu_prefix_cache()
    fault = fail_loads(engine, faults, case)
    (r,) = engine.run(a + [1])  # vLLM 0.33 asserts on a load reported failed: that ended the engine
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert fault is None or fault.injected
    assert engine.failed_loads == 1 and hits(engine, r) == 0
    assert r.request_id in engine.contexts_checked  # recomputed: its blocks hold the model's bytes
    assert engine.load_jobs[r.request_id] == 1, "the chunks whose load failed were offered again"
    assert engine.sync_loads == (1 if case == "sync-load" else 0)
    assert engine.counter(Metric.FAILED_JOBS, ("load",)) == 1
    if fault is not None:
        fault.active = False
    # The engine serves on. An async load's request is looked up again after the failure (finding
    # nothing) and stores its recomputed chunks; vLLM does not store again what a sync load covered.
    engine.drop_gpu_prefix_cache()
    (again,) = engine.run(a + [2])
    assert again.status == RequestStatus.FINISHED_STOPPED and again.request_id in engine.contexts_checked
    assert hits(engine, again) == (0 if case == "sync-load" else 2 * BPC * BLOCK)
    engine.drop_gpu_prefix_cache()
    (last,) = engine.run(a + [3])
    assert hits(engine, last) == 2 * BPC * BLOCK and last.request_id in engine.contexts_checked
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.in_flight) == (0, 0), s
    assert s.host_ready + s.disk_ready == len(engine.manager.stored_keys()) * BPC, "the worker holds chunks the manager forgot"


def test_with_policy_fail_a_failed_load_fails_its_request_and_the_engine_serves_on(
    make_engine: Callable[..., Engine], tmp_path: Any, faults: Any,
) -> None:
    engine = make_engine({"host_blocks": 16}, load_failure_policy="fail")
    a, b = prompt(120, chunks=2), prompt(121, chunks=2)
    engine.run(a)
    engine.drop_gpu_prefix_cache()
    fault = fail_loads(engine, faults, "copy")
    failed, computed = engine.run(a + [1], b)
    assert fault.injected and engine.failed_loads == 1
    assert failed.status == RequestStatus.FINISHED_ERROR
    assert computed.status == RequestStatus.FINISHED_STOPPED and computed.request_id in engine.contexts_checked
    fault.active = False
    engine.drop_gpu_prefix_cache()
    (later,) = engine.run(a + [2])  # the failed chunks are forgotten: computed, and stored again
    assert later.status == RequestStatus.FINISHED_STOPPED and hits(engine, later) == 0
    assert later.request_id in engine.contexts_checked
    engine.drop_gpu_prefix_cache()
    (last,) = engine.run(a + [3])
    assert hits(engine, last) == 2 * BPC * BLOCK and engine.loads_checked == 1
    assert engine.load_jobs[failed.request_id] == 1


def test_a_failed_store_costs_neither_the_engine_nor_a_later_request(
    make_engine: Callable[..., Engine], tmp_path: Any, faults: Any,
) -> None:
    engine = make_engine({"host_blocks": 16})
    fault = faults.fail(engine.worker.offloader, "to_host", OSError(5, "injected IO error"))
    a = prompt(130, chunks=2)
    (r,) = engine.run(a)  # vLLM 0.33 asserts on a store reported failed too
    assert fault.injected and r.status == RequestStatus.FINISHED_STOPPED
    assert engine.counter(Metric.FAILED_JOBS, ("store",)) >= 1
    assert engine.manager.stored_keys() == [], "a chunk whose store failed is offered"
    fault.active = False
    engine.drop_gpu_prefix_cache()
    (again,) = engine.run(a + [1])
    assert hits(engine, again) == 0 and len(engine.manager.stored_keys()) == 2
    engine.drop_gpu_prefix_cache()
    (last,) = engine.run(a + [2])
    assert hits(engine, last) == 2 * BPC * BLOCK and engine.loads_checked == 1


# -- every tier under vLLM: a persistent tier across engines, a remote tier shared by engines ---------

PERSISTENT = {"host_blocks": 4, "disk_blocks": 12, "disk_path": "{tmp}/kv", "persist": True, "fingerprint": "tiny-v1"}


def persistent(tmp_path: Any, **changes: Any) -> dict[str, Any]:
    return {**{k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in PERSISTENT.items()}, **changes}


def test_a_restarted_engine_serves_its_prefixes_from_the_persistent_tier(tmp_path: Any) -> None:
    a, b = prompt(70, chunks=3), prompt(71, chunks=2)
    first = Engine(tmp_path, persistent(tmp_path))
    try:
        first.run(a, b)  # 5 chunks: 2 in host memory, 3 on disk
        assert len(first.manager.stored_keys()) == 5
    finally:
        first.close()  # the host tier's chunks go to disk, with a checkpoint
    again = Engine(tmp_path, persistent(tmp_path))  # new scheduler, new worker: the handshake tells the manager
    try:
        assert len(again.manager.stored_keys()) == 5, "the manager does not know what the persistent tier holds"
        ra, rb = again.run(a + [1], b + [2])
        assert (hits(again, ra), hits(again, rb)) == (3 * BPC * BLOCK, 2 * BPC * BLOCK)
        assert again.loads_checked == 2  # byte for byte
        assert again.hit_sources[CacheHitSource.DISK] == 5 * BPC * BLOCK
        s = again.worker.offloader.stats()
        assert (s.recovered, s.evicted, s.failed) == (5 * BPC, 0, 0), s
    finally:
        again.close()
    other = Engine(tmp_path, persistent(tmp_path, fingerprint="tiny-v2"))  # other weights: a file of its own
    try:
        assert other.manager.stored_keys() == []
        (r,) = other.run(a + [3])
        assert hits(other, r) == 0
    finally:
        other.close()


def test_a_restart_adopts_only_whole_chunks_and_frees_the_rest(tmp_path: Any) -> None:
    a, b = prompt(72, chunks=2), prompt(73, chunks=2)
    first = Engine(tmp_path, persistent(tmp_path))
    try:
        first.run(a, b)
        bk = first.manager.stored_keys()[-1]  # one of b's chunks loses a block: the chunk cannot be loaded
        from kvoffload.vllm import block_key
        assert first.worker.offloader.discard([block_key(0, bk, 1)]) == 1
    finally:
        first.close()
    again = Engine(tmp_path, persistent(tmp_path))
    try:
        assert len(again.manager.stored_keys()) == 3
        s = again.worker.offloader.stats()
        assert s.host_ready + s.disk_ready == 3 * BPC, "the broken chunk's other block still holds a slot"
        prompts = [prompt(80 + i, chunks=2) for i in range(5)]  # fill the whole capacity: nothing is held behind the manager
        again.run(*prompts)
        assert again.worker.offloader.stats().evicted == 0
    finally:
        again.close()


def run_sharing(engine: Engine, *prompts: list[int]) -> list[Any]:
    """``engine.run``, each step's remote lookups answered before the next (a real engine steps on
    meanwhile; the requests wait either way)."""
    reqs = [engine.add(p) for p in prompts]
    for _ in range(200):
        if not engine.scheduler.has_requests():
            break
        engine.step()
        spin_until(lambda: not engine.worker.remote_lookups_running, what="the remote lookups answering")
    assert all(r.is_finished() for r in reqs), [r.status for r in reqs]
    engine.run_until_idle()
    return reqs


def test_under_the_plain_offloading_connector_a_restart_drops_what_the_manager_cannot_learn(
    tmp_path: Any, caplog: Any,
) -> None:
    first = Engine(tmp_path, persistent(tmp_path))
    try:
        first.run(prompt(74, chunks=3))
    finally:
        first.close()
    plain = Engine(tmp_path, persistent(tmp_path), connector="OffloadingConnector")  # no handshake
    try:
        assert plain.manager.stored_keys() == []
        plain.run(*(prompt(75 + i, chunks=2) for i in range(4)))  # the whole capacity
        assert plain.worker.offloader.stats().evicted == 0, "chunks nobody told the manager of held its slots"
        assert "learns of them only under KvoffloadConnector" in caplog.text
    finally:
        plain.close()


@pytest.fixture
def redis_url(binaries: Any) -> Any:
    with redis_server(binaries) as server:
        yield server.url


def test_engines_sharing_a_remote_tier_serve_each_others_prefixes(tmp_path: Any, redis_url: str) -> None:
    shared = {"host_blocks": 8, "remote": redis_url, "fingerprint": "tiny-v1"}
    a = prompt(90, chunks=3)
    writer = Engine(tmp_path, shared)
    reader = Engine(tmp_path, shared)
    try:
        run_sharing(writer, a)
        writer.worker.offloader.close()  # its background writes to the remote end here
        (r,) = run_sharing(reader, a + [1])  # waits (vLLM's RETRY) while its workers look the chunks up, then loads them
        assert hits(reader, r) == 3 * BPC * BLOCK and reader.loads_checked == 1  # byte for byte
        assert reader.hit_sources[CacheHitSource.EXTERNAL_UNSPECIFIED] == 3 * BPC * BLOCK
        assert len(reader.manager.stored_keys()) == 3  # fetched chunks stay, counted by the manager
        reader.drop_gpu_prefix_cache()
        (again,) = run_sharing(reader, a + [2])
        assert hits(reader, again) == 3 * BPC * BLOCK
        assert reader.hit_sources[CacheHitSource.HOST] == 3 * BPC * BLOCK  # now from its own host tier
        (miss,) = run_sharing(reader, prompt(91, chunks=2))  # on no engine: looked up, missed, computed
        assert hits(reader, miss) == 0
        s = reader.worker.offloader.stats()
        assert (s.evicted, s.failed, s.remote_hits) == (0, 0, 3 * BPC), s
    finally:
        writer.close()
        reader.close()


def test_a_remote_value_gone_before_its_load_is_recomputed_not_offered_again(tmp_path: Any, redis_url: str) -> None:
    shared = {"host_blocks": 8, "remote": redis_url}
    a = prompt(92, chunks=2)
    writer = Engine(tmp_path, shared)
    reader = Engine(tmp_path, shared, load_failure_policy="recompute")
    try:
        run_sharing(writer, a)
        writer.worker.offloader.close()
        reader.add(a + [1])
        for _ in range(10):  # until the workers' lookups have answered (the next step prepares the load)
            reader.step(wait_when_idle=False)
            if len(reader.manager.found_remote()) == 2:
                break
            spin_until(lambda: not reader.worker.remote_lookups_running, what="the remote lookups answering")
        assert len(reader.manager.found_remote()) == 2
        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        command(port, "FLUSHALL")
        run_sharing(reader)
        assert reader.failed_loads == 1 and reader.contexts_checked  # recomputed, and finished holding the right bytes
        assert reader.worker.offloader.stats().in_flight == 0
    finally:
        writer.close()
        reader.close()
