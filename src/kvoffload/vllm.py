"""kvoffload as a vLLM offloading backend (vLLM 0.33's ``OffloadingConnector``).

Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvoffloadSpec", "spec_module_path": "kvoffload.vllm",
                                      "host_bytes": 17179869184, "disk_path": "/mnt/nvme/kv", "disk_bytes": 107374182400}}'

Sizes are per worker (per rank): ``host_blocks`` or ``host_bytes``, ``disk_blocks`` or
``disk_bytes`` (blocks are vLLM GPU blocks), ``disk_path`` (rank N uses ``<disk_path>.rank_N``).

How it maps onto vLLM's contract:

* The manager (scheduler process) is the only lookup authority. It keeps every offloaded
  chunk key in LRU order with its state (being stored, or stored) and its pins (prepared
  loads), and a capacity of ``(host_blocks + disk_blocks) // blocks_per_chunk`` chunks. When a
  store needs room it evicts least-recently-used stored chunks nobody loads, and sends their
  keys to the workers inside the store spec: a worker discards them before it stores, so the
  offloader's own eviction never fires behind the manager's back.
* A worker (one per rank) wraps one :class:`kvoffload.Offloader` over vLLM's canonical KV
  tensors, keyed per GPU block as ``(chunk key, block index in the chunk)``, so a load that
  starts in the middle of a chunk reads exactly its blocks. Jobs become :class:`~kvoffload.Transfer`
  objects; done callbacks report them, ``get_finished`` hands the reports over. A transfer that
  failed is reported with ``success=False`` (vLLM 0.33 then stops the worker: that is its
  choice; silent corruption would be ours).
* One KV cache group only: a hybrid model with several groups is refused at ``get_worker``.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Collection, Hashable
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
import torch
from vllm.v1.kv_offload.config import OffloadingConfig

from . import Offloader, Transfer

__all__ = ["KvoffloadSpec", "KvoffloadManager", "KvoffloadWorker", "KeysSpec"]

_SLOT_ALIGN = 4096


class KeysSpec(LoadStoreSpec):  # type: ignore[misc]
    """What a worker needs for a job: the chunk keys in order, and (stores) keys to discard first."""

    def __init__(self, keys: list[OffloadKey], evicted: list[OffloadKey] | None = None) -> None:
        self.keys = list(keys)
        self.evicted = list(evicted or ())

    def __repr__(self) -> str:
        return f"KeysSpec({len(self.keys)} keys, {len(self.evicted)} evicted)"


def _blocks_option(extra: dict[str, Any], tier: str, slot_bytes: int) -> int:
    blocks, nbytes = extra.get(f"{tier}_blocks"), extra.get(f"{tier}_bytes")
    if blocks is not None and nbytes is not None:
        raise ValueError(f"give {tier}_blocks or {tier}_bytes in kv_connector_extra_config, not both")
    if blocks is not None:
        return int(blocks)
    if nbytes is not None:
        return int(nbytes) // slot_bytes
    return 0


class KvoffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM ``OffloadingSpec``: one manager in the scheduler, one worker per rank."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1:
            raise ValueError(
                f"kvoffload serves models with one KV cache group; this one has {len(config.groups)} "
                "(hybrid attention): use vLLM's CPUOffloadingSpec for it"
            )
        extra = dict(self.extra_config)
        block_bytes = int(config.worker_kv_bytes_per_block)
        self.slot_bytes = -(-block_bytes // _SLOT_ALIGN) * _SLOT_ALIGN
        self.host_blocks = _blocks_option(extra, "host", self.slot_bytes)
        self.disk_blocks = _blocks_option(extra, "disk", self.slot_bytes)
        self.disk_path: str | None = extra.get("disk_path")
        if self.disk_blocks and not self.disk_path:
            raise ValueError("disk_blocks/disk_bytes need disk_path in kv_connector_extra_config")
        if self.host_blocks + self.disk_blocks < self.blocks_per_chunk:
            raise ValueError(
                "kv_connector_extra_config gives kvoffload no room: set host_blocks or host_bytes "
                "(and optionally disk_blocks or disk_bytes and disk_path)"
            )
        self.rank = int(config.parallel.rank)
        self.options: dict[str, Any] = {
            k: extra[k] for k in ("chunk_bytes", "io_threads", "use_page_cache", "completion") if k in extra
        }
        self.options["expedited_loads"] = bool(extra.get("expedited_loads", True))  # vLLM waits on expedited loads at once
        self._manager: KvoffloadManager | None = None

    def get_manager(self) -> KvoffloadManager:
        if self._manager is None:
            self._manager = KvoffloadManager((self.host_blocks + self.disk_blocks) // self.blocks_per_chunk)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvoffloadWorker:
        if len(kv_caches.group_data_refs) != 1:
            raise ValueError(f"kvoffload serves one KV cache group; got {len(kv_caches.group_data_refs)}")
        disk_path = f"{self.disk_path}.rank_{self.rank}" if self.disk_blocks else None
        return KvoffloadWorker(kv_caches, self.blocks_per_chunk, self.host_blocks, self.disk_blocks, disk_path, self.options)


class KvoffloadManager(OffloadingManager):  # type: ignore[misc]
    """The scheduler's index of offloaded chunks: states, pins, LRU, capacity in chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ready: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()  # LRU first
        self._storing: set[OffloadKey] = set()
        self._pins: collections.Counter[OffloadKey] = collections.Counter()

    def _free(self) -> int:
        return self.capacity - len(self._ready) - len(self._storing)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._ready:
            return LookupResult.HIT
        return LookupResult.HIT_PENDING if key in self._storing else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KeysSpec:
        for k in keys:
            if k not in self._ready:
                raise KeyError(f"prepare_load of a chunk that is not stored: {k!r}")
        for k in keys:
            self._pins[k] += 1
            self._ready.move_to_end(k)
        return KeysSpec(list(keys))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for k in keys:
            if k in self._ready:
                self._ready.move_to_end(k)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for k in keys:
            if self._pins[k] <= 1:
                del self._pins[k]
            else:
                self._pins[k] -= 1

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        new = [k for k in dict.fromkeys(keys) if k not in self._ready and k not in self._storing]
        shortfall = len(new) - self._free()
        evicted: list[OffloadKey] = []
        if shortfall > 0:
            for k in self._ready:  # least recently used first
                if len(evicted) == shortfall:
                    break
                if not self._pins[k]:
                    evicted.append(k)
            if len(evicted) < shortfall:
                return None  # everything else is being stored or loaded: nothing can be stored now
            for k in evicted:
                del self._ready[k]
        self._storing.update(new)
        return PrepareStoreOutput(keys_to_store=new, store_spec=KeysSpec(new, evicted), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        for k in keys:
            if k in self._storing:
                self._storing.discard(k)
                if success:
                    self._ready[k] = None

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self._ready.clear()

    def stored_keys(self) -> list[OffloadKey]:
        """Stored chunk keys, least recently used first."""
        return list(self._ready)


class KvoffloadWorker(OffloadingWorker):  # type: ignore[misc]
    """One rank's transfers: an :class:`Offloader` over vLLM's canonical KV tensors."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, host_blocks: int, disk_blocks: int,
        disk_path: str | None, options: dict[str, Any],
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.store_limit = host_blocks or disk_blocks
        """Blocks per store call: a job larger than the store tier is stored in parts, in turn, so
        that each part spills the one before it to disk."""
        tensors = {f"tensor.{i}": t.tensor for i, t in enumerate(kv_caches.tensors)}
        self.cuda = kv_caches.tensors[0].tensor.is_cuda
        if disk_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(disk_path)), exist_ok=True)
        self.offloader = Offloader(tensors, host_blocks=host_blocks, disk_path=disk_path, disk_blocks=disk_blocks, **options)
        self.offloader.start()
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._reported: dict[int, threading.Event] = {}
        """Jobs submitted and not yet handed over by get_finished; each event is set once its result is in _finished."""
        self._loads: dict[int, Transfer] = {}
        """Load jobs not yet reported: :meth:`wait` waits on them itself."""

    def _gpu_blocks(self, keys: list[OffloadKey], gpu: GPULoadStoreSpec) -> dict[Hashable, int]:
        """``(chunk key, block index in chunk) -> GPU block id`` for every GPU block of the job."""
        bpc = self.blocks_per_chunk
        first = int(gpu.block_indices[0]) if len(gpu.block_indices) else 0
        skip = first % bpc
        out: dict[Hashable, int] = {}
        for i, block_id in enumerate(gpu.block_ids.tolist()):
            chunk, sub = divmod(skip + i, bpc)
            out[(keys[chunk], sub)] = int(block_id)
        return out

    def _begin(self, job_id: int) -> None:
        with self._lock:
            self._reported[job_id] = threading.Event()

    def _report(self, job_id: int, ok: bool, nbytes: int | None = None, seconds: float | None = None) -> None:
        with self._lock:
            self._finished.append(TransferResult(job_id, ok, nbytes, seconds))
            reported = self._reported.get(job_id)
        if reported is not None:
            reported.set()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KeysSpec)
        self._begin(job_id)
        if dst_spec.evicted:  # the manager's evictions, before anything new takes room
            self.offloader.discard((k, sub) for k in dst_spec.evicted for sub in range(self.blocks_per_chunk))
        blocks = list(self._gpu_blocks(dst_spec.keys, src_spec).items())
        # Later parts start from a worker thread: they follow the caller's stream through an event.
        after = torch.cuda.Event() if self.cuda else None
        if after is not None:
            after.record()
        self._store_part(job_id, blocks, 0, after, time.perf_counter(), 0)
        return True

    def _store_part(
        self, job_id: int, blocks: list[tuple[Hashable, int]], start: int, after: Any, started: float, nbytes: int,
    ) -> None:
        end = start + self.store_limit
        try:
            transfer = self.offloader.store(dict(blocks[start:end]), after=after)
        except Exception:  # reported as failed; vLLM decides what follows
            self._report(job_id, False)
            return

        def part_ended(t: Transfer) -> None:
            if t.cancelled() or t.exception() is not None:
                self._report(job_id, False)
            elif end < len(blocks):
                self._store_part(job_id, blocks, end, after, started, nbytes + t.result().nbytes)
            else:
                self._report(job_id, True, nbytes + t.result().nbytes, time.perf_counter() - started)

        transfer._on_end(part_ended)  # on the thread that ends it: no caller's loop involved

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        assert isinstance(src_spec, KeysSpec)
        self._begin(job_id)
        try:
            transfer = self.offloader.load(self._gpu_blocks(src_spec.keys, dst_spec), expedited=expedited)
        except Exception:
            self._report(job_id, False)
            return True

        def ended(t: Transfer) -> None:
            ok = not t.cancelled() and t.exception() is None
            result = t.result() if ok else None
            with self._lock:
                self._loads.pop(job_id, None)
            self._report(job_id, ok, result.nbytes if result else None, result.seconds if result else None)

        with self._lock:
            self._loads[job_id] = transfer
        transfer._on_end(ended)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._finished = self._finished, []
            for r in done:
                self._reported.pop(r.job_id, None)
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has ended; ``get_finished`` then reports them."""
        with self._lock:
            events = [self._reported[j] for j in job_ids if j in self._reported]
            loads = [self._loads[j] for j in job_ids if j in self._loads]
        for t in loads:  # waited on here: ended in this thread once its copies land, no worker hop
            try:
                t.result()
            except Exception:  # reported as failed by its done callback
                pass
        for e in events:
            e.wait()

    def shutdown(self) -> None:
        self.offloader.close()
