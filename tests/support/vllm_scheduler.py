"""vLLM 0.33's real ``Scheduler`` with kvoffload's connector, stepped as vLLM's model runner steps it.

:class:`Engine` builds vLLM's ``Scheduler`` (with its scheduler-role connector and kvoffload's
manager) for a tiny model described by a local config (no weights, no network), and a
worker-role connector over CPU KV tensors with kvoffload's worker, then passes the workers'
handshake metadata to the scheduler's connector as vLLM's engine core does at start. It steps
them as the model runner does: ``schedule()``, then the worker connector's
``handle_preemptions``, ``start_load_kv``, the forward pass, ``wait_for_save``,
``get_finished``, then ``update_from_output``. The "forward pass" writes each block it computes
with bytes derived from the block's hash and the weights' version; blocks a load will write are
poisoned first, every loaded block is checked byte for byte once its load has landed (unless the
connector reported it as a load error), and every full prompt block of a request that finishes is
checked byte for byte as the request finishes.

A hybrid model (``groups``: several KV cache groups, such as full attention and sliding window)
gets its KV tensors as vLLM lays them out: one backing allocation, layer-outermost, the ``l``-th
layer of every group at the same place (``KVCacheTensor`` of each group aliasing from byte 0), so
a block id belongs to one group at a time. Each group's blocks are written and checked in that
group's layers only (``get_block_ids`` gives one list per group).
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from vllm import ModelRegistry, SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.vllm import KvoffloadManager, KvoffloadWorker

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


def attention(sliding_window: int | None = None) -> AttentionSpec:
    """The KV cache spec of one of the tiny model's attention layers: full attention, or a sliding
    window of ``sliding_window`` tokens."""
    if sliding_window is None:
        return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                             sliding_window=sliding_window)


def block_bytes(version: int, block_hash: bytes, layer: int) -> torch.Tensor:
    """What the model computes for one block of one layer under weights ``version``."""
    seed = int.from_bytes(hashlib.blake2b(b"%d/%d/" % (version, layer) + block_hash, digest_size=8).digest(), "little")
    return torch.randint(-128, 128, (PAGE,), generator=torch.Generator().manual_seed(seed >> 1), dtype=torch.int8)


class Engine:
    """vLLM's Scheduler and a worker-side connector over CPU KV tensors, stepped as the model runner steps them."""

    def __init__(self, tmp_path: Any, extra: dict[str, Any], *, num_gpu_blocks: int = 64,
                 connector: str = "KvoffloadConnector", load_failure_policy: str = "fail",
                 groups: Sequence[KVCacheGroupSpec] | None = None) -> None:
        """``groups``: the model's KV cache groups (layers and spec), in vLLM's order; by default one
        full-attention group over ``LAYERS``. Every spec has ``BLOCK`` tokens and ``PAGE`` bytes per block."""
        if groups is None:
            groups = [KVCacheGroupSpec(list(LAYERS), attention())]
        self.groups = list(groups)
        for group in self.groups:
            assert group.kv_cache_spec.block_size == BLOCK and group.kv_cache_spec.page_size_bytes == PAGE, group
        self.layer_ids = {name: i for i, name in enumerate(n for g in self.groups for n in g.layer_names)}
        """Layer name -> the index its bytes are derived from (:func:`block_bytes`)."""
        model_dir = tmp_path / "model"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps({
            "architectures": ["KvoffloadTinyLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": len(self.layer_ids),
            "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
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
        # vLLM's layer-outermost layout: one allocation; the l-th layer of every group at l * layer_stride
        positions = max(len(g.layer_names) for g in self.groups)
        layer_stride = num_gpu_blocks * PAGE
        kv_cache_config = KVCacheConfig(
            num_blocks=num_gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=positions * layer_stride, layers=list(g.layer_names),
                                            layer_stride=layer_stride, block_stride=PAGE) for g in self.groups],
            kv_cache_groups=self.groups,
        )
        self.scheduler = Scheduler(
            vllm_config=self.config, kv_cache_config=kv_cache_config, block_size=BLOCK, log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
        )
        self.worker_connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        backing = torch.zeros(positions, num_gpu_blocks, 2, BLOCK, 2, 16, dtype=torch.bfloat16)
        self.kv = {name: backing[pos] for g in self.groups for pos, name in enumerate(g.layer_names)}
        self.pages = [backing[pos].view(num_gpu_blocks, -1).view(torch.int8) for pos in range(positions)]
        """Each layer position's pages (int8, one row per GPU block), shared by that position's layer of every group."""
        self.worker_connector.register_kv_caches(self.kv)
        # vLLM's engine core hands the workers' handshake metadata, keyed (pp_rank, tp_rank), to the scheduler's connector
        handshake = self.worker_connector.get_handshake_metadata()
        if handshake is not None:
            self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.version = 1
        """The weights' version: what the forward pass writes depends on it."""
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.loads_checked = 0
        self.loaded_blocks: dict[str, int] = {}
        """GPU blocks loaded per request id, in the first group (full attention: one per ``BLOCK`` tokens loaded)."""
        self.loaded_group_blocks: dict[str, list[int]] = {}
        """GPU blocks loaded per request id, per group."""
        self.checked_loads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        """Each load checked: its request id, its blocks per group and each group's first block index."""
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

    def expected(self, block_hash: bytes, group: int = 0) -> list[torch.Tensor]:
        """What the model computes for one block of ``group``, per layer of the group (its layer positions, in order)."""
        return [block_bytes(self.version, block_hash, self.layer_ids[name]) for name in self.groups[group].layer_names]

    def _check_block(self, what: str, group: int, index: int, block_id: int, block_hash: bytes) -> None:
        """GPU block ``block_id`` holds block ``index`` of ``group`` in every layer of the group."""
        assert block_id != 0, f"{what}: block {index} of group {group} is vLLM's null block"
        for pos, want in enumerate(self.expected(block_hash, group)):
            assert torch.equal(self.pages[pos][block_id], want), (
                f"{what}: block {index} (GPU block {block_id}) of group {group}'s layer {pos} does not hold "
                f"the bytes computed under weights v{self.version}")

    def _check_load(self, job: Any, load_errors: set[int]) -> None:
        if load_errors & set(job.dst_spec.block_ids.tolist()):
            self.failed_loads += 1
            return
        req = self.scheduler.requests[job.req_id]
        if req.is_finished():  # aborted while it loaded: its blocks go back to the pool unread
            self.abandoned_loads += 1
            return
        block_ids = job.dst_spec.block_ids.tolist()
        sizes = [int(n) for n in job.dst_spec.group_sizes]
        assert len(sizes) == len(self.groups) and sum(sizes) == len(block_ids)
        offset = 0
        for group, (n, first) in enumerate(zip(sizes, job.dst_spec.block_indices)):
            for i, block_id in enumerate(block_ids[offset:offset + n]):
                self._check_block(f"{job.req_id} loaded", group, int(first) + i, block_id, req.block_hashes[int(first) + i])
            offset += n
        self.loads_checked += 1
        self.checked_loads.append((job.req_id, tuple(sizes), tuple(int(i) for i in job.dst_spec.block_indices)))
        self.loaded_blocks[job.req_id] = self.loaded_blocks.get(job.req_id, 0) + sizes[0]
        counts = self.loaded_group_blocks.setdefault(job.req_id, [0] * len(self.groups))
        for group, n in enumerate(sizes):
            counts[group] += n

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
        contexts = {r: (self.scheduler.requests[r], self.scheduler.kv_cache_manager.get_block_ids(r)) for r in req_ids}
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

    def _check_context(self, req: Request, block_ids: Sequence[list[int]]) -> None:
        """Every full prompt block of a request that finished holds what the model computes for it, in
        every group that still holds it (a sliding window group gave the blocks behind its window back)."""
        for group, (spec, ids) in enumerate(zip(self.groups, block_ids)):
            for b in range(req.num_prompt_tokens // BLOCK):
                if ids[b] == 0 and isinstance(spec.kv_cache_spec, SlidingWindowSpec):
                    continue
                self._check_block(f"{req.request_id} finished with", group, b, ids[b], req.block_hashes[b])
        self.contexts_checked.add(req.request_id)

    def _forward(self, out: Any) -> None:
        """Write what the model computes: every block whose last token was computed this step, in each
        group's layers."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # schedule() already counted this step's tokens
            begin = end - n
            for group, block_ids in enumerate(self.scheduler.kv_cache_manager.get_block_ids(req_id)):
                for b in range(begin // BLOCK, end // BLOCK):
                    if (b + 1) * BLOCK > begin:
                        assert block_ids[b] != 0, f"{req_id}: block {b} of group {group} computed into the null block"
                        for pos, name in enumerate(self.groups[group].layer_names):
                            self.pages[pos][block_ids[b]] = block_bytes(self.version, req.block_hashes[b],
                                                                         self.layer_ids[name])

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


TIERS = {
    "host": {"host_blocks": 16},
    "host+disk": {"host_blocks": 4, "disk_blocks": 12, "disk_path": "{tmp}/kv"},
}


def tiers(name: str, tmp_path: Any) -> dict[str, Any]:
    return {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in TIERS[name].items()}


