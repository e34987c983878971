"""kvoffload's vLLM backend driven by vLLM 0.33's real ``Scheduler``.

Each test builds vLLM's ``Scheduler`` (with its scheduler-role connector and kvoffload's
manager) for a tiny model described by a local config (no weights, no network), and a
worker-role connector over CPU KV tensors with kvoffload's worker. :class:`Engine` steps them
as the model runner does: ``schedule()``, then the worker connector's ``handle_preemptions``,
``start_load_kv``, the forward pass, ``wait_for_save``, ``get_finished``, then
``update_from_output``. The "forward pass" writes each block it computes with bytes derived
from the block's hash and the weights' version; blocks a load will write are poisoned first,
every loaded block is checked byte for byte once its load has landed (unless the connector
reported it as a load error), and every full prompt block of a request that finishes is checked
byte for byte as the request finishes.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: pip install --no-deps vllm==0.33.0")

from vllm import ModelRegistry, SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvoffload._testing import copy_calls  # noqa: E402
from kvoffload.vllm import KvoffloadManager, KvoffloadWorker, Metric  # noqa: E402
from support.waiting import HANG_S  # noqa: E402

BLOCK = 16  # tokens per GPU block
BPC = 2  # GPU blocks per offloaded chunk
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PAGE = 2 * BLOCK * 2 * 16 * 2  # K and V x 16 tokens x 2 heads x 16 dims x bf16: 2 KiB per block per layer
EOS = 999


class TinyLM(torch.nn.Module):
    """An architecture vLLM's registry accepts without importing a real model: the scheduler
    never runs it."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


ModelRegistry.register_model("KvoffloadTinyLM", TinyLM)
init_none_hash(sha256)


def block_bytes(version: int, block_hash: bytes, layer: int) -> torch.Tensor:
    """What the model computes for one block of one layer under weights ``version``."""
    seed = int.from_bytes(hashlib.blake2b(b"%d/%d/" % (version, layer) + block_hash, digest_size=8).digest(), "little")
    return torch.randint(-128, 128, (PAGE,), generator=torch.Generator().manual_seed(seed >> 1), dtype=torch.int8)


class Engine:
    """vLLM's Scheduler and a worker-side connector over CPU KV tensors, stepped as the model runner steps them."""

    def __init__(self, tmp_path: Any, extra: dict[str, Any], *, num_gpu_blocks: int = 64,
                 connector: str = "KvoffloadConnector", load_failure_policy: str = "fail") -> None:
        model_dir = tmp_path / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({
            "architectures": ["KvoffloadTinyLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": len(LAYERS), "vocab_size": 1000,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
        }))
        if connector == "OffloadingConnector":
            extra = {"spec_name": "KvoffloadSpec", "spec_module_path": "kvoffload.vllm", **extra}
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                             is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector, kv_connector_module_path="kvoffload.vllm" if connector.startswith("Kvoffload") else None,
                kv_role="kv_both", kv_connector_extra_config={"blocks_per_chunk": BPC, **extra},
                kv_load_failure_policy=load_failure_policy),
        )
        self.config.cache_config.num_gpu_blocks = num_gpu_blocks
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16))],
        )
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=kv_cache_config, block_size=BLOCK, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
        )
        self.worker_connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.kv = {name: torch.zeros(num_gpu_blocks, 2, BLOCK, 2, 16, dtype=torch.bfloat16) for name in LAYERS}
        self.pages = [t.view(num_gpu_blocks, -1).view(torch.int8) for t in self.kv.values()]
        self.worker_connector.register_kv_caches(self.kv)
        self.version = 1
        """The weights' version: what the forward pass writes depends on it."""
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.loads_checked = 0
        self.loaded_blocks: dict[str, int] = {}
        self.load_jobs: collections.Counter[str] = collections.Counter()
        """Load jobs per request id."""
        self.sync_loads = 0
        """Load jobs its request waits for in their step (``sync_load_budget_bytes``)."""
        self.failed_loads = 0
        """Loads whose blocks the connector reported as load errors (not checked: vLLM recomputes them)."""
        self.abandoned_loads = 0
        """Loads whose request was aborted before they ended (not checked: nothing reads their blocks)."""
        self.contexts_checked: set[str] = set()
        """Requests that finished with every full prompt block holding the bytes the model computes."""
        self._async_loads: dict[str, list[Any]] = {}
        self._jobs_seen: set[int] = set()
        self._jobs_done: set[int] = set()
        self.hit_sources: collections.Counter[CacheHitSource] = collections.Counter()
        """Tokens of connector hits by source, as vLLM's prefix cache metrics count them."""
        self.stats: list[dict[str, Any]] = []
        """kvoffload's metrics payloads as vLLM sends them to its Prometheus logger."""
        self._next_id = 0

    @property
    def manager(self) -> KvoffloadManager:
        manager = self.scheduler.connector.connector_scheduler.manager
        assert isinstance(manager, KvoffloadManager)
        return manager

    @property
    def worker(self) -> KvoffloadWorker:
        worker = self.worker_connector.connector_worker.worker
        assert isinstance(worker, KvoffloadWorker)
        return worker

    def add(self, tokens: list[int]) -> Request:
        self._next_id += 1
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, EOS)
        req = Request(request_id=f"r{self._next_id}", prompt_token_ids=tokens, sampling_params=params,
                      pooling_params=None, block_hasher=self.hasher)
        self.scheduler.add_request(req)
        return req

    def expected(self, block_hash: bytes) -> list[torch.Tensor]:
        return [block_bytes(self.version, block_hash, i) for i in range(len(LAYERS))]

    def _check_load(self, job: Any, load_errors: set[int]) -> None:
        if load_errors & set(job.dst_spec.block_ids.tolist()):
            self.failed_loads += 1
            return
        req = self.scheduler.requests[job.req_id]
        if req.is_finished():  # aborted while it loaded: its blocks go back to the pool unread
            self.abandoned_loads += 1
            return
        first = int(job.dst_spec.block_indices[0])
        for i, block_id in enumerate(job.dst_spec.block_ids.tolist()):
            want = self.expected(req.block_hashes[first + i])
            for layer, page in enumerate(self.pages):
                assert torch.equal(page[block_id], want[layer]), (
                    f"{job.req_id}: block {first + i} (GPU block {block_id}) of layer {layer} does not hold the "
                    f"bytes computed under weights v{self.version}")
        self.loads_checked += 1
        self.loaded_blocks[job.req_id] = self.loaded_blocks.get(job.req_id, 0) + len(job.dst_spec.block_ids)

    def step(self, wait_when_idle: bool = True) -> Any:
        """One engine step; a step that schedules nothing first waits (on events) for the transfers in flight."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self._jobs_seen |= set(meta.load_jobs) | set(meta.store_jobs)
        self.load_jobs.update(job.req_id for job in meta.load_jobs.values())
        self.sync_loads += sum(job.sync for job in meta.load_jobs.values())
        wc = self.worker_connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        for job in meta.load_jobs.values():  # poison: a load must write every byte of its blocks
            for page in self.pages:
                page[torch.as_tensor(job.dst_spec.block_ids, dtype=torch.long)] = 0x5A
        wc.start_load_kv(None)
        sync_loads = [job for job in meta.load_jobs.values() if job.sync]  # waited for inside start_load_kv
        for job in meta.load_jobs.values():
            if not job.sync:
                self._async_loads.setdefault(job.req_id, []).append(job)
        self._forward(out)
        if wait_when_idle and out.total_num_scheduled_tokens == 0:
            self.worker.wait(self._jobs_seen - self._jobs_done)
        wc.wait_for_save()
        # as vLLM's model runner asks: results, then the load errors of the same pass
        results = wc.get_transfer_results(out.finished_req_ids)
        load_errors = wc.get_block_ids_with_load_errors()
        for job in sync_loads:
            self._check_load(job, load_errors)
        for req_id in results.finished_recving:
            for job in self._async_loads.pop(req_id, []):
                self._check_load(job, load_errors)
        worker_meta = wc.build_connector_worker_meta()
        if worker_meta is not None:
            self._jobs_done |= set(worker_meta.completed_jobs)
        stats = wc.get_kv_connector_stats()
        wc.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[EOS] if self.scheduler.requests[r].num_computed_tokens >= self.scheduler.requests[r].num_tokens else []
                   for r in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None, finished_recving=results.finished_recving or None,
                kv_connector_stats=stats, kv_connector_worker_meta=worker_meta, invalid_block_ids=load_errors,
                failed_recving=results.failed_recving),
        )
        # the block tables as this step's forward pass read them: a request that finishes frees its blocks
        contexts = {r: (self.scheduler.requests[r], self.scheduler.kv_cache_manager.get_block_ids(r)[0]) for r in req_ids}
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        for req, block_ids in contexts.values():
            if req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                self._check_context(req, block_ids)
        for outputs in engine_outputs.values():
            sched_stats = outputs.scheduler_stats
            if sched_stats is None:
                continue
            if sched_stats.kv_connector_stats:
                self.stats.append(sched_stats.kv_connector_stats)
            if sched_stats.connector_prefix_cache_stats is not None:
                self.hit_sources.update(sched_stats.connector_prefix_cache_stats.hits_by_source)
        return out

    def _check_context(self, req: Request, block_ids: list[int]) -> None:
        """Every full prompt block of a request that finished holds what the model computes for it."""
        for b in range(req.num_prompt_tokens // BLOCK):
            want = self.expected(req.block_hashes[b])
            for layer, page in enumerate(self.pages):
                assert torch.equal(page[block_ids[b]], want[layer]), (
                    f"{req.request_id} finished with block {b} (GPU block {block_ids[b]}) of layer {layer} not holding "
                    f"the bytes computed under weights v{self.version}")
        self.contexts_checked.add(req.request_id)

    def _forward(self, out: Any) -> None:
        """Write what the model computes: every block whose last token was computed this step."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # schedule() already counted this step's tokens
            begin = end - n
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for b in range(begin // BLOCK, end // BLOCK):
                if (b + 1) * BLOCK > begin:
                    for layer, page in enumerate(self.pages):
                        page[block_ids[b]] = block_bytes(self.version, req.block_hashes[b], layer)

    def run(self, *requests: list[int], max_steps: int = 200) -> list[Request]:
        """Add requests for these prompts, step until they finished and every transfer ended."""
        reqs = [self.add(tokens) for tokens in requests]
        self.run_until_idle(max_steps)
        for r in reqs:
            assert r.is_finished(), f"{r.request_id} is still {r.status} after {max_steps} steps"
        return reqs

    def run_until_idle(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and not self.scheduler.connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps: {[r.status for r in self.scheduler.requests.values()]}")

    def counter(self, name: str, labels: tuple[str, ...] = ()) -> float:
        """A kvoffload counter summed over the stats payloads the scheduler produced so far."""
        return sum(p["data"].get(name, {}).get(labels, 0) for p in self.stats)

    def drop_gpu_prefix_cache(self) -> None:
        """Empty the GPU prefix cache (not the connector's), so the next hits come from kvoffload."""
        assert self.scheduler.reset_prefix_cache()

    def close(self) -> None:
        self.worker_connector.shutdown()
        self.scheduler.shutdown()


def prompt(seed: int, chunks: int, extra: int = 3) -> list[int]:
    """``chunks`` full chunks of tokens (and a few more, so the prompt's last token is computed)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 900, (chunks * BPC * BLOCK + extra,), generator=g).tolist()


def hits(engine: Engine, req: Request) -> int:
    """Tokens of ``req`` the connector loaded (and the test checked)."""
    return engine.loaded_blocks.get(req.request_id, 0) * BLOCK


@pytest.fixture
def make_engine(tmp_path: Any) -> Any:
    engines: list[Engine] = []

    def make(extra: dict[str, Any], **kwargs: Any) -> Engine:
        engines.append(Engine(tmp_path, extra, **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


TIERS = {
    "host": {"host_blocks": 16},
    "host+disk": {"host_blocks": 4, "disk_blocks": 12, "disk_path": "{tmp}/kv"},
}


def tiers(name: str, tmp_path: Any) -> dict[str, Any]:
    return {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in TIERS[name].items()}


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
