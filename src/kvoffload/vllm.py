"""kvoffload as a vLLM offloading backend (vLLM 0.33's ``OffloadingConnector``).

Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvoffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": {"host_bytes": "64GiB", "disk_path": "/mnt/nvme/kv", "disk_bytes": "400GiB"}}'

``KvoffloadConnector`` is vLLM's ``OffloadingConnector`` with kvoffload's per-rank figures added
to vLLM's metrics; ``"kv_connector": "OffloadingConnector"`` with ``"spec_name": "KvoffloadSpec",
"spec_module_path": "kvoffload.vllm"`` runs the same backend without them.

Sizes are totals for the engine, as vLLM's ``cpu_bytes_to_use`` is: ``host_bytes`` and
``disk_bytes`` are divided among its workers (ranks). ``host_blocks`` / ``disk_blocks`` count vLLM
blocks, which every rank holds its share of. Unknown keys and malformed values are errors.

How it maps onto vLLM's contract:

* The manager (scheduler process) is the only lookup authority. It keeps every offloaded
  chunk key in LRU order with its state (being stored, or stored) and its pins (prepared
  loads), and a capacity of ``(host_blocks + disk_blocks) // blocks_per_chunk`` chunks. When a
  store needs room it evicts least-recently-used stored chunks nobody loads, and sends their
  keys to the workers inside the store spec (every spec of a scheduler step carries the
  step's evictions so far, whichever of them a worker submits first): a worker discards them
  before it stores, so the offloader's own eviction never fires behind the manager's back. A
  chunk evicted in a step is not stored again in that step (a later spec of the step would
  discard the new copy).
* A cache reset (``reset_prefix_cache(reset_connector=True)``, ``pause``/``sleep``) forgets
  every chunk, stored, being stored or pinned, and starts a new *generation*. Every spec
  carries its generation and workers key blocks by it, so nothing stored before a reset can
  be served after it; the first spec of a new generation makes a worker discard everything of
  older ones, and stores of an older generation still running are dropped as they end.
* A worker (one per rank) wraps one :class:`kvoffload.Offloader` over vLLM's canonical KV
  tensors, keyed per GPU block by the chunk key, generation and block index in the chunk
  (:func:`block_key`, bytes), so a
  load that starts in the middle of a chunk reads exactly its blocks. Its offloader promotes
  nothing (``promote=False``): the manager counts every slot. Stores start in order, each job
  whole (one larger than host memory sends its first blocks on to disk); a store that cannot
  get slots because running loads (or stores) hold them waits for them to end instead of
  failing. Only an IO or CUDA error (or a chunk the offloader lost) fails a job.
* A failed job must not end the engine: vLLM 0.33's ``OffloadingConnector`` asserts on a result
  with ``success=False``. ``KvoffloadConnector`` reports it as ended instead, and a failed load's
  GPU blocks through ``get_block_ids_with_load_errors`` in the same pass, so vLLM's scheduler
  recomputes them (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``, the
  default). The failure also reaches the manager, in the workers' metadata: a failed load's
  chunks are never offered again (vLLM looks the request up again: offering them would loop)
  and are forgotten once no load pins them; a failed store's chunks are not stored; the workers
  discard both before the next store. Under the plain ``OffloadingConnector`` a failure is still
  reported with ``success=False``: it stops the engine rather than serve bytes never loaded.

* A request aborted while its load runs: vLLM 0.33's scheduler frees its GPU blocks only once the
  load is reported (``Scheduler.finish_requests``: ``delay_free_blocks`` for
  ``WAITING_FOR_REMOTE_KVS``; ``_update_from_kv_xfer_finished`` frees them). ``KvoffloadConnector``
  learns of the abort on the worker from ``get_finished(finished_req_ids)`` of the next step and
  cancels the load (``KvoffloadWorker.cancel_loads``, never blocking): it ends once the copy
  running then has landed and is reported done, not failed, so the blocks come back and the
  manager's pins drop as soon as that report reaches the scheduler; its chunks stay stored. Its half-written blocks were never in
  vLLM's prefix cache (it caches a loading request's blocks only once the load is reported).

* A persistent tier (``persist``, with a disk tier): each rank's file lives in a directory of its
  own (:func:`disk_file_stem`), named after its cache identity, whose fingerprint
  (:func:`rank_fingerprint`) adds the model, KV dtype and the rank's place in the parallel layout
  to the one given. At start each worker finds its chunks again (blocks of generation 0 only: a
  block stored after a reset was computed by weights the restarted engine need not have), and
  ``KvoffloadConnector`` hands them to the manager in vLLM's handshake (engine core, before any
  request): a chunk every rank holds whole is stored, on disk; the others are discarded before the
  first store. Under the plain ``OffloadingConnector`` (no handshake) they are dropped at the first
  job, logged.
* A remote tier (``remote``) shared by engines: under ``KvoffloadConnector`` a chunk the manager
  does not hold is looked up by the workers, each for its own blocks (vLLM's ``RETRY`` defers the
  request meanwhile, never the step): the manager's asks go in the step's connector metadata, the
  ranks' answers come back in their worker metadata, and a chunk every rank found is a hit for
  ``REMOTE_FOUND_S``. Its load fetches the blocks and keeps them as a stored chunk, so the manager
  makes room for it as for a store (the evictions travel in the load's spec). A fetch that fails (a
  value gone from the remote) is a failed load: recomputed, and not looked up again for
  ``REMOTE_MISSING_S``. Stores reach the remote as ``remote_write`` says (by default as they end).

Why a hit the manager reports is still there when the worker loads it (no lease is taken):

* Against the manager's evictions, its pins. vLLM calls ``lookup`` and ``prepare_load`` (which
  pins) in one scheduler step, holding the manager for the step, and every ``prepare_store``
  of the step comes after them (``build_connector_meta``); a pin lasts until ``complete_load``,
  which vLLM calls only once every worker reported the load, and a worker reports it after the
  offloader has released the load's slots. Stores a worker submits before that load were
  prepared in earlier steps, whose evictions the lookup already saw, or (jobs vLLM flushes at
  once) later in the same step, after the pin.
* Against the offloader's own eviction: it evicts only when a store finds too few free or
  spillable slots, and the manager never promises more chunks than there are slots. The slots
  of chunks the manager evicted are free once the worker discards them, except one a running
  store is spilling to disk: its disk slot is free when that spill ends. So after discards
  that find something, the next store waits for the stores running then to end. Stores of an
  older generation are waited for the same way, and vLLM flushes every job at a reset.
* A lease (``lookup(keys, hold=True)``) would not help here: a worker sees a load's keys only in
  ``submit_load``, where the load pins them anyway, and the manager's lookup runs in another
  process.

* Hybrid models (several KV cache groups: full attention, sliding window, ...) are served as
  vLLM's CPU offloading spec serves them: the scheduler looks keys up group by group (a sliding
  window group stores and loads only what its window reaches) and every key names its group. vLLM
  lays the groups over the same KV tensors and gives a block id to one group at a time, so the
  worker keeps one offloader over all canonical tensors and copies a block of any group as its
  whole row in each (a group's layers byte for byte, the rest unused bytes of that block): a job's
  keys map to its GPU blocks group by group, each group's first block possibly inside a chunk. A
  slot holds a block of any group and the manager counts chunks of every group alike.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import CapacityError, Offloader, Options, Transfer
from . import _WorkerLoop as WorkerLoop
from . import _check_remote_url as check_remote_url
from ._vllm_versions import is_sync_load, manager_lock, sliding_window_chunks
from . import _parse_size as parse_size
from . import _refuse_unknown_keys as refuse_unknown_keys
from . import _slot_bytes_for as slot_bytes_for

log = logging.getLogger("kvoffload")

__all__ = ["KvoffloadSpec", "KvoffloadManager", "KvoffloadWorker", "KeysSpec", "KvoffloadConnector", "JobFailure",
           "parse_extra_config"]

# -- configuration ------------------------------------------------------------------------

_VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
    "self_describing_kv_events", "sync_load_budget_bytes", "canonical_layout",
})
"""Keys of ``kv_connector_extra_config`` that vLLM itself reads for its offloading connector."""
_SIZE_KEYS = ("host_bytes", "disk_bytes", "cpu_bytes_to_use", "chunk_bytes")
_COUNT_KEYS = {"host_blocks": 0, "disk_blocks": 0, "io_threads": 1, "gather_ctas": 0}
_BOOL_KEYS = ("use_page_cache", "expedited_loads", "use_batch_copy", "persist", "verify")
_CHOICE_KEYS = {"copy_engine": ("kernel", "dma"), "remote_write": ("through", "evict", "none")}
_TEXT_KEYS = ("fingerprint", "remote", "namespace", "encryption_key")
_KVOFFLOAD_KEYS = frozenset({*_SIZE_KEYS, *_COUNT_KEYS, *_BOOL_KEYS, *_CHOICE_KEYS, *_TEXT_KEYS, "disk_path", "remote_secret"})
_OFFLOADER_KEYS = ("chunk_bytes", "io_threads", "gather_ctas", "use_page_cache", "expedited_loads", "use_batch_copy",
                   "copy_engine", "persist", "verify", "fingerprint", "remote",
                   "remote_write", "remote_secret", "namespace", "encryption_key")
def _error(key: str, message: str) -> ValueError:
    return ValueError(f"kv_connector_extra_config[{key!r}]: {message}")


def _size(key: str, value: object) -> int:
    """Bytes: an int, or a string of digits with an optional binary suffix (``"16GiB"``), as the
    ``Offloader``'s own byte sizes take them."""
    try:
        return parse_size(key, value)
    except (TypeError, ValueError) as e:  # its message begins "key=value": the key is in _error's prefix
        raise _error(key, str(e).removeprefix(f"{key}=")) from None


def _count(key: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(key, f"{value!r} ({type(value).__name__}) is not an integer")
    if value < minimum:
        raise _error(key, f"{value!r} is less than {minimum}")
    return value


def _text(key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _error(key, f"{value!r} is not a non-empty string")
    return value


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise _error(key, f"{value!r} is not a boolean: give true or false")


@dataclass(frozen=True)
class ExtraConfig:
    """``kv_connector_extra_config``, checked and turned into one rank's sizes."""

    host_blocks: int
    """Host slots per rank (vLLM blocks)."""
    disk_blocks: int
    """Disk slots per rank (vLLM blocks)."""
    disk_path: str | None
    """The stem of the disk paths: each rank of each engine gets its own (:func:`disk_file_stem`)."""
    offloader_options: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of :class:`kvoffload.Offloader`."""


def parse_extra_config(extra: Mapping[str, Any], *, slot_bytes: int, world_size: int, blocks_per_chunk: int = 1) -> ExtraConfig:
    """Check ``extra`` (``kv_connector_extra_config``) and size one rank's tiers.

    Raises ``ValueError`` naming the key and what was given: for an unknown key (listing the
    accepted ones), a malformed value, or sizes that leave no room. ``host_bytes``,
    ``disk_bytes`` and ``cpu_bytes_to_use`` (vLLM's name for the host size) are totals for the
    engine, divided among ``world_size`` ranks; ``host_blocks`` / ``disk_blocks`` count vLLM
    blocks (every rank holds its share of each). A rank's slot holds its bytes of one block,
    ``slot_bytes``.
    """
    refuse_unknown_keys("kv_connector_extra_config", extra, _KVOFFLOAD_KEYS, "vLLM", _VLLM_KEYS)
    if extra.get("canonical_layout") not in (None, False):
        raise _error("canonical_layout", "kvoffload keeps each rank's pages as they are; canonical_layout is not supported")
    world_size = max(1, world_size)

    def tier(name: str, byte_keys: tuple[str, ...]) -> tuple[int, str | None]:
        given = [k for k in (f"{name}_blocks", *byte_keys) if k in extra]
        if len(given) > 1:
            raise _error(given[1], f"give one of {' or '.join(given)}, not both")
        if not given:
            return 0, None
        key = given[0]
        if key.endswith("_blocks"):
            return _count(key, extra[key], 0), key
        total = _size(key, extra[key])
        blocks = total // world_size // slot_bytes
        if total and not blocks:
            raise _error(key, f"{extra[key]!r} is {total} bytes, {total // world_size} per rank over {world_size} ranks: "
                              f"less than one block slot ({slot_bytes} bytes per rank)")
        return blocks, key

    host_blocks, host_key = tier("host", ("host_bytes", "cpu_bytes_to_use"))
    disk_blocks, disk_key = tier("disk", ("disk_bytes",))
    disk_path = extra.get("disk_path")
    if disk_path is not None and (not isinstance(disk_path, str) or not disk_path or "\0" in disk_path):
        raise _error("disk_path", f"{disk_path!r} is not a path")
    if disk_key is not None and disk_path is None:
        raise _error(disk_key, "the disk tier needs disk_path too")
    if disk_path is not None and disk_key is None:
        raise _error("disk_path", "the disk tier needs its size too: disk_bytes (such as '400GiB') or disk_blocks")
    if (host_blocks + disk_blocks) < blocks_per_chunk:
        raise ValueError(
            "kv_connector_extra_config gives kvoffload no room: set host_bytes (such as '64GiB', the total for "
            f"the engine's ranks) or host_blocks, and optionally disk_path with disk_bytes or disk_blocks "
            f"(got {host_key or 'no host size'}, {disk_key or 'no disk size'}: {host_blocks} host and {disk_blocks} "
            f"disk slots per rank, fewer than one chunk of {blocks_per_chunk} blocks)"
        )
    # vLLM waits on expedited loads at once; the manager owns capacity: a load leaves no copy behind (promote)
    options: dict[str, Any] = {"expedited_loads": True, "promote": False}
    for key in _OFFLOADER_KEYS:
        if key not in extra:
            continue
        value = extra[key]
        if key in _SIZE_KEYS:
            options[key] = _size(key, value)
        elif key in _COUNT_KEYS:
            options[key] = _count(key, value, _COUNT_KEYS[key])
        elif key in _BOOL_KEYS:
            options[key] = _bool(key, value)
        elif key in _TEXT_KEYS:
            options[key] = _text(key, value)
        elif key == "remote_secret":  # "env:NAME", or a list of them for a rotation (JSON holds no bytes)
            options[key] = [_text(key, item) for item in value] if isinstance(value, list) else _text(key, value)
        elif value not in _CHOICE_KEYS[key]:
            raise _error(key, f"{value!r} is not one of {', '.join(map(repr, _CHOICE_KEYS[key]))}")
        else:
            options[key] = value
    try:
        Options(host_blocks=host_blocks, disk_blocks=disk_blocks, disk_path=disk_path, **options)
        if "remote" in options:
            check_remote_url(options["remote"])
    except (TypeError, ValueError, ImportError) as e:
        raise ValueError(f"kv_connector_extra_config: {e}") from None
    return ExtraConfig(host_blocks, disk_blocks, disk_path, options)


def rank_fingerprint(config: OffloadingConfig, given: str | None) -> str:
    """The fingerprint of one rank's persistent or shared tier: the one given (the weights' identity,
    such as a checkpoint hash), the model and KV dtype vLLM runs, and the rank's place in the parallel
    layout. Ranks never read each other's blocks; the same rank of engines laid out alike shares them.
    The tier's cache identity adds the KV tensors' shapes and dtypes."""
    p, cache = config.parallel, config.cache
    return "; ".join((
        f"vllm model={config.model.name} kv_dtype={config.model.dtype} layout={config.kv_cache_layout}",
        f"tokens_per_hash={cache.tokens_per_hash} blocks_per_chunk={cache.blocks_per_chunk}",
        "groups=" + ",".join(f"{g.group_id}:{g.tokens_per_block}:{sliding_window_chunks(g)}:{len(g.layer_names)}:"
                             f"{hashlib.blake2b(chr(0).join(g.layer_names).encode(), digest_size=4).hexdigest()}"
                             for g in config.groups),
        f"pp={p.pp_size} tp={p.tp_size} pcp={p.pcp_size} dcp={p.dcp_size} rank={p.rank}",
        f"fingerprint={given or ''}",
    ))


def disk_file_stem(disk_path: str, data_parallel_index: int, rank: int) -> str:
    """The disk path of one rank of one data-parallel engine: ``<disk_path>.dp<D>.rank_<R>``, or
    ``<disk_path>/kv.dp<D>.rank_<R>`` when ``disk_path`` is a directory (its file goes in it).

    Its file has no name while the engine runs (the disk tier's file is nameless unless persistent),
    so several ``vllm serve`` processes given one ``disk_path`` never collide. A persistent tier's
    stem is a directory holding a file per cache identity (``kvoffload-<16 hex digits>.cache``):
    an engine started with another model, layout or fingerprint opens a file of its own.
    """
    stem = os.path.join(disk_path, "kv") if os.path.isdir(disk_path) else disk_path
    return f"{stem}.dp{data_parallel_index}.rank_{rank}"


# -- metrics ----------------------------------------------------------------------------------

class Metric:
    """Names of the metrics kvoffload adds to vLLM's (``/metrics``, and the periodic log)."""

    # The manager's (scheduler process), with plain OffloadingConnector too:
    LOADED_CHUNKS = "vllm:kvoffload_loaded_chunks"
    STORED_CHUNKS = "vllm:kvoffload_stored_chunks"
    STORING_CHUNKS = "vllm:kvoffload_storing_chunks"
    EVICTED_CHUNKS = "vllm:kvoffload_evicted_chunks"
    REFUSED_STORES = "vllm:kvoffload_refused_stores"
    RESETS = "vllm:kvoffload_resets"
    # The workers' (summed over ranks), with KvoffloadConnector:
    LOADED_BLOCKS = "vllm:kvoffload_loaded_blocks"
    SPILLED_BLOCKS = "vllm:kvoffload_spilled_blocks"
    EVICTED_BLOCKS = "vllm:kvoffload_evicted_blocks"
    DISK_BYTES = "vllm:kvoffload_disk_bytes"
    DISK_IO_ERRORS = "vllm:kvoffload_disk_io_errors"
    FAILED_JOBS = "vllm:kvoffload_failed_jobs"
    STORE_WAITS = "vllm:kvoffload_store_waits"
    JOB_SECONDS = "vllm:kvoffload_job_seconds"


_JOB_SECONDS_BUCKETS = tuple(1e-4 * 2**i for i in range(18))  # 100 us .. 13 s


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """What vLLM needs to register kvoffload's metrics (``OffloadingSpec.build_metric_definitions``)."""
    counter, gauge, hist = OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingHistogramMetadata
    return {
        Metric.LOADED_CHUNKS: counter("Chunks prepared for loading, by the tier the manager expects them in.", ("tier",)),
        Metric.STORED_CHUNKS: gauge("Chunks stored, by the tier the manager expects them in.", ("tier",)),
        Metric.STORING_CHUNKS: gauge("Chunks being stored."),
        Metric.EVICTED_CHUNKS: counter("Chunks the manager evicted to make room for stores."),
        Metric.REFUSED_STORES: counter("Stores skipped because every chunk was pinned by loads or being stored."),
        Metric.RESETS: counter("Connector cache resets."),
        Metric.LOADED_BLOCKS: counter("Blocks loaded, by the tier their bytes came from (summed over ranks).", ("tier",)),
        Metric.SPILLED_BLOCKS: counter("Blocks moved from host memory to disk (summed over ranks)."),
        Metric.EVICTED_BLOCKS: counter("Blocks the offloader dropped on its own to make room; stays 0 (summed over ranks).", ("tier",)),
        Metric.DISK_BYTES: counter("Bytes read from and written to the disk files (summed over ranks).", ("direction",)),
        Metric.DISK_IO_ERRORS: counter("Disk IO calls that failed (summed over ranks)."),
        Metric.FAILED_JOBS: counter("Jobs reported failed: IO or CUDA errors (summed over ranks).", ("kind",)),
        Metric.STORE_WAITS: counter("Stores that waited for slots held by running transfers (summed over ranks)."),
        Metric.JOB_SECONDS: hist("Seconds from a job's submission to its end, per rank.", ("kind",), _JOB_SECONDS_BUCKETS),
    }


def _new_stats() -> Any:
    # Imported here: the metrics module pulls in vLLM's whole config, which kvoffload.vllm's
    # other users (a spec built by hand, say) need not install.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    return OffloadingConnectorStats()


# -- the spec --------------------------------------------------------------------------------

class KeysSpec(LoadStoreSpec):  # type: ignore[misc]
    """What a worker needs for a job: the chunk keys in order, the reset generation they belong
    to, and (stores) keys the manager evicted, to discard first."""

    def __init__(self, keys: list[OffloadKey], evicted: list[OffloadKey] | None = None, generation: int = 0) -> None:
        self.keys = list(keys)
        self.evicted = list(evicted or ())
        self.generation = generation

    def __repr__(self) -> str:
        return f"KeysSpec({len(self.keys)} keys, {len(self.evicted)} evicted, generation {self.generation})"


class KvoffloadSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM ``OffloadingSpec``: one manager in the scheduler, one worker per rank."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # Any number of KV cache groups (hybrid models): a slot holds a block of any group, as its whole
        # row in every canonical tensor; worker_kv_bytes_per_block is that row (vLLM's CPU spec sizes by it too).
        block_bytes = int(config.worker_kv_bytes_per_block)
        self.slot_bytes = slot_bytes_for(block_bytes)  # the offloader's slot for these blocks
        parsed = parse_extra_config(
            self.extra_config, slot_bytes=self.slot_bytes, world_size=int(config.parallel.world_size),
            blocks_per_chunk=self.blocks_per_chunk,
        )
        self.host_blocks = parsed.host_blocks
        self.disk_blocks = parsed.disk_blocks
        self.disk_path = parsed.disk_path
        self.options = parsed.offloader_options
        if self.options.get("persist") or "remote" in self.options:
            self.options["fingerprint"] = rank_fingerprint(config, self.options.get("fingerprint"))
        self.rank = int(config.parallel.rank)
        self.data_parallel_index = int(config.parallel.data_parallel_index)
        self.ranks = max(1, int(config.parallel.world_size))
        self._manager: KvoffloadManager | None = None

    def get_manager(self) -> KvoffloadManager:
        if self._manager is None:
            self._manager = KvoffloadManager(
                (self.host_blocks + self.disk_blocks) // self.blocks_per_chunk,
                host_capacity=self.host_blocks // self.blocks_per_chunk if self.disk_blocks else None,
                ranks=self.ranks, remote="remote" in self.options,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvoffloadWorker:
        # The worker copies a block of any group as its whole row in every tensor (a block id belongs to
        # one group at a time): right as long as each group's pages lie within the rows it copies.
        if len(kv_caches.group_data_refs) != len(self.config.groups):
            raise ValueError(f"vLLM gave the worker {len(kv_caches.group_data_refs)} KV cache groups, "
                             f"its offloading config {len(self.config.groups)}")
        for group, refs in enumerate(kv_caches.group_data_refs):
            for ref in refs:
                if ref.page_size_bytes > kv_caches.tensors[ref.tensor_idx].page_size_bytes:
                    raise ValueError(f"KV cache group {group}: a page of {ref.page_size_bytes} bytes in tensor "
                                     f"{ref.tensor_idx}, whose blocks have {kv_caches.tensors[ref.tensor_idx].page_size_bytes}")
        stem = disk_file_stem(self.disk_path, self.data_parallel_index, self.rank) if self.disk_path else None
        return KvoffloadWorker(kv_caches, self.blocks_per_chunk, self.host_blocks, self.disk_blocks, stem, self.options,
                               rank=self.rank)


# -- the manager (scheduler process) --------------------------------------------------------

REMOTE_FOUND_S = 30.0
"""How long the manager takes a chunk found on the remote tier as there (a worker's offloader lets a
load name it for a minute after its lookup)."""
REMOTE_MISSING_S = 1.0
"""How long the manager takes a chunk the remote tier did not hold (or failed to load) as missing."""
_MAX_REMOTE_KNOWN = 1 << 16
"""The most remote answers the manager remembers (expired ones go first, then the oldest)."""

class KvoffloadManager(OffloadingManager):  # type: ignore[misc]
    """The scheduler's index of offloaded chunks: states, pins, LRU, capacity in chunks.

    ``host_capacity`` (chunks), given when there is a disk tier too, lets the manager follow
    which chunks the workers keep in host memory (stores land there; the least recently stored
    or loaded ones move to disk), for :meth:`get_load_source` and the metrics. ``ranks``: the
    workers, each reporting what its persistent tier holds at start (:meth:`adopt`) and its part of
    every remote lookup (:meth:`remote_answered`). ``remote``: the workers share a remote tier: a
    chunk the manager does not hold is looked up there (the request waits meanwhile, vLLM's
    ``RETRY``).
    """

    def __init__(self, capacity: int, host_capacity: int | None = None, *, ranks: int = 1, remote: bool = False) -> None:
        self.capacity = capacity
        self.host_capacity = host_capacity
        self.ranks = ranks
        self.remote = remote
        self.asks_workers = False
        """Set by ``KvoffloadConnector``, which carries remote lookups to the workers and their answers
        back: without it (vLLM's plain ``OffloadingConnector``) the manager serves only its own chunks."""
        self.generation = 0
        """Cache resets so far; workers key their blocks by it."""
        self._ready: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()  # LRU first
        self._storing: set[OffloadKey] = set()
        self._pins: collections.Counter[OffloadKey] = collections.Counter()
        self._on_host: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        """With both tiers: chunks (stored or being stored) expected in host memory, in the workers' LRU order."""
        self._step_evictions: dict[OffloadKey, None] = {}
        """Chunks evicted during this scheduler step, in order: every store spec of the step carries
        them, and none of them is stored again before the step ends (a later spec would discard it)."""
        self._failed: set[OffloadKey] = set()
        """Stored chunks a load of failed: never offered again, forgotten once no load pins them."""
        self._failed_stores: set[OffloadKey] = set()
        """Chunks being stored whose store failed on a worker: vLLM completes the store as a success."""
        self._to_discard: dict[OffloadKey, None] = {}
        """Chunks forgotten after a failed job, which workers may still hold: the next store spec
        carries them to the workers, which discard them before it stores."""
        self._adopted = False
        """Whether the workers' persistent tiers were adopted (once, at start)."""
        self._remote_known: dict[OffloadKey, tuple[bool, float]] = {}
        """Chunks the workers looked up on the remote tier: whether every rank found it, and until when
        that answer holds (monotonic seconds)."""
        self._asking: dict[OffloadKey, list[int]] = {}
        """Chunks asked of the workers and not answered by every rank yet: ``[answers, found]``."""
        self._asks: list[OffloadKey] = []
        """Chunks to ask of the workers in the next connector metadata (:meth:`take_remote_asks`)."""
        self._step_claims: set[OffloadKey] = set()
        """Remote hits lookup answered this step: each will take a chunk of room when loaded."""
        self._fetching: set[OffloadKey] = set()
        """Chunks a prepared load fetches from the remote tier (their hits' source), until it completes."""
        self._stats = _new_stats() if _stats_available() else None

    def _free(self) -> int:
        return self.capacity - len(self._ready) - len(self._storing)

    def _tier(self, key: OffloadKey) -> str:
        if self.host_capacity is None:
            return "host"
        return "host" if key in self._on_host else "disk"

    def _count(self, name: str, n: int = 1, labels: tuple[str, ...] = ()) -> None:
        if self._stats is not None and n:
            self._stats.increase_counter(name, n, labels)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._ready:
            # vLLM asks again for a request whose load failed: offering the chunk again would loop
            return LookupResult.MISS if key in self._failed else LookupResult.HIT
        if key in self._storing:
            return LookupResult.HIT_PENDING
        if not (self.remote and self.asks_workers) or key in self._step_evictions or key in self._to_discard:
            return LookupResult.MISS  # (a chunk forgotten after a failure: the workers may still hold its old blocks)
        known = self._remote_known.get(key)
        if known is not None and known[1] > time.monotonic():
            return LookupResult.HIT if known[0] and self._claim_room(key) else LookupResult.MISS
        if key not in self._asking:  # the workers look it up; the request waits meanwhile, never the step
            self._asking[key] = [0, 0]
            self._asks.append(key)
        return LookupResult.RETRY

    def _claim_room(self, key: OffloadKey) -> bool:
        """Whether a remote hit can be loaded: its fetched blocks stay as a stored chunk, so it needs a
        chunk of room, made by evicting an unpinned stored chunk if none is free."""
        if key in self._step_claims:
            return True
        if self.capacity - len(self._storing) - len(self._pins) - len(self._step_claims) <= 0:
            return False
        self._step_claims.add(key)
        return True

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """The tier a hit is expected in: host memory, disk, or (not stored here) the remote tier."""
        if key not in self._ready or key in self._fetching:
            return CacheHitSource.EXTERNAL_UNSPECIFIED  # vLLM's source for a remote store
        return CacheHitSource.HOST if self._tier(key) == "host" else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KeysSpec:
        now = time.monotonic()
        fetched = []
        for k in keys:
            if k in self._ready:
                continue
            known = self._remote_known.get(k)
            if known is None or not known[0] or known[1] <= now:
                raise KeyError(f"prepare_load of a chunk that is neither stored nor found on the remote tier: {k!r}")
            fetched.append(k)
        for k in keys:
            self._count(Metric.LOADED_CHUNKS, 1, (self._tier(k) if k in self._ready else "remote",))
            self._pins[k] += 1
            if k in self._ready:
                self._ready.move_to_end(k)
            if k in self._on_host:
                self._on_host.move_to_end(k)  # a load makes it the most recently used of its tier
        if fetched:  # fetched blocks stay as stored chunks: room for them, as for a store
            self._make_room(len(fetched))
            for k in fetched:
                self._ready[k] = None
                del self._remote_known[k]
                self._fetching.add(k)
            if self.host_capacity:
                self._place_on_host(fetched)
        return KeysSpec(list(keys), list(self._step_evictions) if fetched else None, self.generation)

    def _make_room(self, n: int) -> bool:
        """Evict least recently used unpinned stored chunks until ``n`` chunks are free; the workers
        discard them before their next job (every spec of the step carries them). False when
        everything else is pinned (nothing is evicted then)."""
        shortfall = n - self._free()
        if shortfall <= 0:
            return True
        evicted: list[OffloadKey] = []
        for k in self._ready:  # least recently used first
            if len(evicted) == shortfall:
                break
            if not self._pins[k]:
                evicted.append(k)
        if len(evicted) < shortfall:
            return False
        for k in evicted:
            del self._ready[k]
            self._on_host.pop(k, None)
        self._count(Metric.EVICTED_CHUNKS, len(evicted))
        self._step_evictions.update(dict.fromkeys(evicted))
        return True

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for k in keys:
            if k in self._ready:
                self._ready.move_to_end(k)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for k in keys:
            if self._pins[k] <= 1:
                self._pins.pop(k, None)  # also a load prepared before a reset
                self._fetching.discard(k)
                if k in self._failed:
                    self._forget(k)
            else:
                self._pins[k] -= 1

    def job_failed(self, failure: JobFailure) -> None:
        """A worker could not do a job (``KvoffloadConnector`` passes it on before vLLM completes the
        job). A failed load's chunks are not offered again, and are forgotten once no load pins
        them (another rank may still read them: their slots stay counted until then); a failed
        store's chunks do not become stored. Workers discard their copies before the next store."""
        if failure.generation != self.generation:
            return  # a reset since forgot every chunk of the job
        if failure.kind == "store":
            self._failed_stores.update(k for k in failure.keys if k in self._storing)
            return
        if self.remote:  # not looked up on the remote again for a while: a value gone from it would loop
            until = time.monotonic() + REMOTE_MISSING_S
            self._remote_known.update((k, (False, until)) for k in failure.keys)
        for k in failure.keys:
            if k in self._ready:
                self._failed.add(k)
                if not self._pins[k]:
                    self._forget(k)

    def _forget(self, key: OffloadKey) -> None:
        """Drop a stored chunk a job failed on; the workers discard it before their next store."""
        del self._ready[key]
        self._on_host.pop(key, None)
        self._failed.discard(key)
        self._to_discard[key] = None

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        # A chunk evicted this step waits for the next one: this step's later specs discard it.
        new = [k for k in dict.fromkeys(keys) if k not in self._ready and k not in self._storing and k not in self._step_evictions]
        before = len(self._step_evictions)
        if not self._make_room(len(new)):
            self._count(Metric.REFUSED_STORES)
            return None  # everything else is being stored or loaded: nothing can be stored now
        evicted = list(self._step_evictions)[before:]
        self._storing.update(new)
        for k in new:
            self._remote_known.pop(k, None)
        # Chunks forgotten after failed jobs: this spec discards them (vLLM drops a spec that stores
        # nothing: then a later one does). One it stores again is discarded by this spec alone, first.
        restored: list[OffloadKey] = []
        if new and self._to_discard:
            again = set(new)
            restored = [k for k in self._to_discard if k in again]
            self._step_evictions.update((k, None) for k in self._to_discard if k not in again)
            self._to_discard = {}
        if self.host_capacity:
            self._place_on_host(new)
        spec = KeysSpec(new, [*self._step_evictions, *restored], self.generation)
        return PrepareStoreOutput(keys_to_store=new, store_spec=spec, evicted_keys=evicted)

    def _place_on_host(self, new: list[OffloadKey]) -> None:
        """Follow the workers' host tier: new chunks land there, pushing the least recently used
        stored chunks that no load pins to disk."""
        assert self.host_capacity is not None
        for k in new:
            self._on_host[k] = None
        excess = len(self._on_host) - self.host_capacity
        spilled: list[OffloadKey] = []
        for k in self._on_host:  # least recently used first
            if len(spilled) >= excess:
                break
            if k in self._ready and not self._pins[k]:
                spilled.append(k)
        for k in spilled:
            del self._on_host[k]

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        for k in keys:
            if k in self._storing:
                self._storing.discard(k)
                if success and k not in self._failed_stores:
                    self._ready[k] = None
                else:
                    self._failed_stores.discard(k)
                    self._on_host.pop(k, None)
                    self._to_discard[k] = None  # ranks whose part of the store succeeded hold it

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._step_evictions = {}
        self._step_claims.clear()

    def has_pending_work(self) -> bool:
        """While remote lookups are unanswered, vLLM keeps stepping (their answers come with its steps)."""
        return bool(self._asking)

    # -- what the workers report: persistent tiers at start, remote lookups ----------------

    def adopt(self, ranks: Collection[Collection[OffloadKey]]) -> int:
        """At start (vLLM's handshake, before any request): the chunks each rank's persistent tier found
        again, least recently used first. A chunk every rank holds becomes stored (on disk), up to the
        capacity, the most recently used kept; the workers discard the rest before their first store,
        so no slot is held behind the manager's back. Only the first call, before any store or reset,
        adopts anything; returns how many chunks it adopted."""
        if self._adopted or self.generation or self._ready or self._storing:
            return 0
        self._adopted = True
        listed = [list(chunks) for chunks in ranks]
        held = set().union(*listed) if listed else set()
        common = held.intersection(*listed) if len(listed) == self.ranks else set()
        kept = [k for k in listed[0] if k in common][-self.capacity:] if common and self.capacity else []
        for k in kept:
            self._ready[k] = None
        kept_set = set(kept)
        self._to_discard.update((k, None) for k in held if k not in kept_set)
        return len(kept)

    def found_remote(self) -> list[OffloadKey]:
        """Chunks not stored here that every rank found on the remote tier lately (a lookup of one is a hit)."""
        now = time.monotonic()
        return [k for k, (found, until) in self._remote_known.items() if found and until > now]

    def take_remote_asks(self) -> list[OffloadKey]:
        """Chunks the workers are to look up on the remote tier (``KvoffloadConnector`` sends them with
        the step's connector metadata)."""
        asks, self._asks = self._asks, []
        return asks

    def remote_answered(self, answers: Collection[tuple[int, OffloadKey, bool]]) -> None:
        """Ranks' answers to remote lookups, ``(generation, chunk, found)`` (``KvoffloadConnector``
        passes on the workers' metadata): a chunk is a remote hit once every rank found all its
        blocks; the answer holds for a while. Answers to asks made before a reset are ignored."""
        now = time.monotonic()
        for generation, key, found in answers:
            votes = self._asking.get(key) if generation == self.generation else None
            if votes is None:
                continue
            votes[0] += 1
            votes[1] += bool(found)
            if votes[0] >= self.ranks:
                del self._asking[key]
                hit = votes[1] >= self.ranks
                self._remote_known[key] = (hit, now + (REMOTE_FOUND_S if hit else REMOTE_MISSING_S))
        if len(self._remote_known) > _MAX_REMOTE_KNOWN:
            self._remote_known = {k: v for k, v in self._remote_known.items() if v[1] > now}
            while len(self._remote_known) > _MAX_REMOTE_KNOWN:  # the oldest answers go first
                del self._remote_known[next(iter(self._remote_known))]

    def reset_cache(self) -> None:
        """Forget every chunk (stored, being stored, pinned) and start a new generation: the
        workers never serve a block stored before it, and drop them all."""
        self._ready.clear()
        self._storing.clear()
        self._pins.clear()
        self._on_host.clear()
        self._step_evictions = {}
        self._failed.clear()
        self._failed_stores.clear()
        self._to_discard = {}
        self._remote_known.clear()
        self._fetching.clear()
        self._asking.clear()
        self._asks = []
        self._step_claims.clear()
        self.generation += 1
        self._count(Metric.RESETS)

    def get_stats(self) -> Any:
        """vLLM's ``OffloadingConnectorStats``: counters since the last call, gauges now."""
        if self._stats is None:
            return None
        stats, self._stats = self._stats, _new_stats()
        # Chunks being stored are all expected in host memory (nothing pushes them out).
        if self.host_capacity is None:
            on_host = len(self._ready)
        else:
            on_host = len(self._on_host) - len(self._storing) if self.host_capacity else 0
        stats.set_gauge(Metric.STORED_CHUNKS, on_host, ("host",))
        stats.set_gauge(Metric.STORED_CHUNKS, len(self._ready) - on_host, ("disk",))
        stats.set_gauge(Metric.STORING_CHUNKS, len(self._storing))
        return stats

    def stored_keys(self) -> list[OffloadKey]:
        """Stored chunk keys, least recently used first."""
        return list(self._ready)


def _stats_available() -> bool:
    try:
        _new_stats()
    except ImportError:
        return False
    return True


# -- the worker (one per rank) ----------------------------------------------------------------

_BLOCK_KEY_TAIL = 6
"""Bytes :func:`block_key` adds after the chunk key: the generation (4), the block index in the chunk (2)."""


def block_key(generation: int, chunk: OffloadKey, sub: int) -> bytes:
    """The offloader key of one GPU block: the chunk key, the reset generation it was stored in and
    its index in the chunk. Bytes, as a persistent or shared tier needs, and the same in every engine
    (a restarted one, or another sharing the remote store): a block stored after a reset is never
    found under the weights of an engine that did not make that reset."""
    return bytes(chunk) + generation.to_bytes(4, "big") + sub.to_bytes(2, "big")


def split_block_key(key: bytes) -> tuple[int, OffloadKey, int]:
    """``(generation, chunk key, index in the chunk)`` of a :func:`block_key`."""
    tail = key[-_BLOCK_KEY_TAIL:]
    return int.from_bytes(tail[:4], "big"), OffloadKey(key[:-_BLOCK_KEY_TAIL]), int.from_bytes(tail[4:], "big")


@dataclass(frozen=True)
class JobFailure:
    """A job a worker could not do, as the scheduler side learns of it (``KvoffloadConnector``)."""

    kind: str
    """``"load"`` or ``"store"``."""
    generation: int
    keys: tuple[OffloadKey, ...]
    """Every chunk key of the job: a failed transfer does not say which of its blocks it wrote."""
    block_ids: tuple[int, ...] = ()
    """A load's GPU blocks, any of them possibly unwritten: what vLLM must recompute."""


@dataclass(eq=False)
class _StoreJob:
    """A store job waiting to start: one offloader store of all its blocks (a job larger than host
    memory sends its first blocks on to the disk tier)."""

    job_id: int
    generation: int
    keys: tuple[OffloadKey, ...]
    """The chunk keys it stores (for the manager, should it fail)."""
    blocks: dict[Hashable, int]
    """Offloader key -> GPU block id, in order."""
    evicted: list[Hashable]
    """The blocks of the chunks its spec says the manager evicted: discarded right before it starts."""
    after: Any
    """A CUDA event the copies follow (a store that waits starts from a worker thread), or None."""
    started: float
    waited: bool = False


class KvoffloadWorker(OffloadingWorker):  # type: ignore[misc]
    """One rank's transfers: an :class:`Offloader` over vLLM's canonical KV tensors."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, host_blocks: int, disk_blocks: int,
        disk_file: str | None, options: dict[str, Any], *, rank: int = 0,
    ) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.rank = rank
        tensors = {f"tensor.{i}": t.tensor for i, t in enumerate(kv_caches.tensors)}
        self.cuda = kv_caches.tensors[0].tensor.is_cuda
        self.offloader = _start_offloader(tensors, host_blocks, disk_blocks, disk_file, options)
        self.disk_path = self.offloader.options.disk_path
        """The disk path this rank's offloader was given (None without a disk tier)."""
        self.reports_failures = False
        """Set by ``KvoffloadConnector``: a failed job is then reported to vLLM as ended (``success=True``)
        and handed to :meth:`take_failures`, which the connector turns into vLLM's load errors and
        the manager's knowledge. Otherwise it is reported with ``success=False``, which vLLM 0.33's
        plain ``OffloadingConnector`` asserts on (that ends the engine, rather than serve bad KV)."""
        self._lock = threading.Lock()
        self._finished: list[TransferResult] = []
        self._failures: list[JobFailure] = []
        """Failures of the jobs in ``_finished``: handed over with them, by get_finished."""
        self._handed_failures: list[JobFailure] = []
        """Failures of the jobs get_finished handed over, until take_failures."""
        self._reported: dict[int, threading.Event] = {}
        """Jobs submitted and not yet handed over by get_finished; each event is set once its result is in _finished."""
        self._loads: dict[int, Transfer] = {}
        """Load jobs not yet reported: :meth:`wait` waits on them itself."""
        self._cancelled_loads: set[int] = set()
        """Running loads :meth:`cancel_loads` cancelled (their requests ended): reported done, not failed."""
        self._stores: collections.deque[_StoreJob] = collections.deque()
        """Store jobs not yet handed to the offloader, in submission order."""
        self._running_stores: dict[Transfer, int] = {}
        """Stores running, with their generations."""
        self._unsettled: set[Transfer] = set()
        """Running stores that may still hold slots of chunks the manager evicted (a spill of one of
        them to disk, the slot it goes to free only when it ends): no store starts before they end."""
        self._pumping = False
        self._pump_again = False
        self.generation = 0
        """The newest reset generation seen in a spec."""
        self._chunks: dict[int, set[OffloadKey]] = collections.defaultdict(set)
        """Chunk keys stored (or being stored) per generation: dropped when a newer one begins."""
        self._job_seconds: list[tuple[str, float]] = []
        self._failed = collections.Counter[str]()
        self._store_waits = 0
        self._last_counts: dict[str, int] = {}
        self._stats_read_at = -float("inf")
        self.stats_period_s = 1.0
        """How often :meth:`take_stats` reads the offloader's counters (``stats()`` walks the index)."""
        self.persistent = bool(options.get("persist"))
        self._restored = self._restore() if self.persistent else []
        """The chunks this rank's persistent tier found again at start, least recently used first,
        until :meth:`claim_restored` (or the first job, which drops them: nobody told the manager)."""
        self._remote_answers: list[tuple[int, OffloadKey, bool]] = []
        """Remote lookups answered and not yet taken: ``(generation, chunk, found)``."""
        self._remote_lookups = 0
        self._lookups = WorkerLoop("kvoffload-vllm-lookups") if options.get("remote") is not None else None
        """The loop of this rank's remote lookups: vLLM calls the worker from threads that must never
        wait for the network."""

    # -- what a restart finds, what the remote holds -----------------------------------------

    def _restore(self) -> list[OffloadKey]:
        """The chunks of generation 0 whose every block the persistent tier found again; every other
        block found (of a chunk missing some, or stored after a reset) is discarded."""
        chunks: dict[OffloadKey, set[int]] = {}
        strays: list[Hashable] = []
        for key in self.offloader.keys():  # least recently used first
            if not isinstance(key, bytes) or len(key) <= _BLOCK_KEY_TAIL:
                strays.append(key)
                continue
            generation, chunk, sub = split_block_key(key)
            if generation != 0 or sub >= self.blocks_per_chunk:
                strays.append(key)
                continue
            subs = chunks.pop(chunk, set())
            subs.add(sub)
            chunks[chunk] = subs  # ordered by its most recently used block
        whole = [c for c, subs in chunks.items() if len(subs) == self.blocks_per_chunk]
        strays += [block_key(0, c, sub) for c, subs in chunks.items() if len(subs) < self.blocks_per_chunk for sub in subs]
        if strays:
            self.offloader.discard(strays)
        self._chunks[0].update(whole)
        return whole

    def claim_restored(self) -> list[OffloadKey]:
        """The chunks the persistent tier found again at start, least recently used first, for the
        manager (``KvoffloadConnector`` sends them in vLLM's handshake: :meth:`KvoffloadManager.adopt`)."""
        restored, self._restored = self._restored, []
        return restored

    def _drop_unclaimed(self) -> None:
        """Before the first job: chunks found again that nobody claimed (vLLM's plain
        ``OffloadingConnector`` has no handshake) would hold slots the manager counts as free."""
        with self._lock:
            restored, self._restored = self._restored, []
            self._chunks[0].difference_update(restored)
        if restored:
            log.warning("kvoffload: %d chunks found again in the persistent tier are dropped: the manager learns of "
                        "them only under KvoffloadConnector", len(restored))
            self.offloader.discard(self._blocks_of(0, restored))

    def look_up_remote(self, generation: int, chunks: Collection[OffloadKey]) -> None:
        """Look ``chunks`` up on the remote tier, in the background (never blocking): each answer (all
        its blocks found, or not) is handed to the manager by :meth:`take_remote_answers`. A chunk
        found stays loadable by this rank's offloader for a minute."""
        if self._lookups is None or not chunks:
            return
        with self._lock:
            self._remote_lookups += len(chunks)
        for chunk in chunks:
            asyncio.run_coroutine_threadsafe(self._look_up(generation, chunk), self._lookups.loop)

    async def _look_up(self, generation: int, chunk: OffloadKey) -> None:
        """One chunk's remote lookup, on the lookup loop: found if the remote holds all its blocks."""
        keys = self._blocks_of(generation, [chunk])
        try:
            found = await self.offloader.alookup(keys) == len(keys)
        except Exception:  # a closed offloader, say: nothing found
            found = False
        with self._lock:
            self._remote_answers.append((generation, chunk, found))
            self._remote_lookups -= 1

    @property
    def remote_lookups_running(self) -> int:
        """Remote lookups :meth:`look_up_remote` started that have not answered yet."""
        with self._lock:
            return self._remote_lookups

    def take_remote_answers(self) -> list[tuple[int, OffloadKey, bool]]:
        """Remote lookups answered since the last call: ``(generation, chunk, found)``."""
        with self._lock:
            taken, self._remote_answers = self._remote_answers, []
        return taken

    # -- keys and generations ------------------------------------------------------------

    def _gpu_blocks(self, spec: KeysSpec, gpu: GPULoadStoreSpec) -> dict[Hashable, int]:
        """:func:`block_key` ``-> GPU block id`` for every GPU block of the job.

        As vLLM's CPU worker reads a spec: the blocks come group by group (``gpu.group_sizes``), each
        group's logically consecutive from its block index (``gpu.block_indices``), which may lie inside
        a chunk; a group's chunks are the next keys of ``spec.keys``, which lists them group by group.
        """
        bpc, keys, gen = self.blocks_per_chunk, spec.keys, spec.generation
        block_ids = gpu.block_ids.tolist()
        sizes = [int(n) for n in gpu.group_sizes]
        out: dict[Hashable, int] = {}
        first_block = first_key = 0
        for size, index in zip(sizes, gpu.block_indices):
            if not size:  # a group with nothing to move (its block index means nothing then)
                continue
            skip = int(index) % bpc
            chunks = -(-(skip + size) // bpc)
            if first_key + chunks > len(keys):
                break
            for i, block_id in enumerate(block_ids[first_block:first_block + size]):
                chunk, sub = divmod(skip + i, bpc)
                out[block_key(gen, keys[first_key + chunk], sub)] = int(block_id)
            first_block += size
            first_key += chunks
        if first_block != len(block_ids) or first_key != len(keys):
            raise ValueError(f"a job of {len(keys)} chunk keys and {len(block_ids)} GPU blocks in groups of {sizes} "
                             f"blocks from block {[int(i) for i in gpu.block_indices]}: they do not match")
        return out

    def _blocks_of(self, generation: int, chunks: Collection[OffloadKey]) -> list[Hashable]:
        return [block_key(generation, k, sub) for k in chunks for sub in range(self.blocks_per_chunk)]

    def _enter_generation(self, generation: int) -> None:
        """A spec of ``generation``: if it is new, drop every block of the generations before it
        (also those still being stored: their stores end without publishing them)."""
        with self._lock:
            if generation <= self.generation:
                return
            self.generation = generation
            old = {g: chunks for g, chunks in self._chunks.items() if g < generation}
            for g in old:
                del self._chunks[g]
        for g, chunks in old.items():
            self.offloader.discard(self._blocks_of(g, chunks))

    # -- reports -------------------------------------------------------------------------

    def _begin(self, job_id: int) -> None:
        with self._lock:
            self._reported[job_id] = threading.Event()

    def _report(self, job_id: int, kind: str, ok: bool, started: float, nbytes: int | None = None,
                failure: JobFailure | None = None, timed: bool = True) -> None:
        """Report a job's end; ``failure`` describes it should it have failed (``ok=False``); ``timed``:
        its seconds go to the job latency histogram (not those of a load cancelled half-way)."""
        seconds = time.perf_counter() - started
        with self._lock:
            success = ok
            if not ok:
                self._failed[kind] += 1
                if self.reports_failures and failure is not None:
                    self._failures.append(failure)
                    success = True  # the connector tells vLLM's scheduler instead: vLLM asserts on success=False
            self._finished.append(TransferResult(job_id, success, nbytes, seconds if nbytes is not None else None))
            if timed:
                self._job_seconds.append((kind, seconds))
            reported = self._reported.get(job_id)
        if reported is not None:
            reported.set()

    # -- stores --------------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KeysSpec)
        started = time.perf_counter()
        blocks = self._gpu_blocks(dst_spec, src_spec)  # first: a spec that does not fit raises with nothing begun
        if self._restored:
            self._drop_unclaimed()
        self._begin(job_id)
        self._enter_generation(dst_spec.generation)
        with self._lock:
            if dst_spec.generation == self.generation:  # an older one is fenced off: it stores nothing
                chunks = self._chunks[dst_spec.generation]
                chunks.difference_update(dst_spec.evicted)
                chunks.update(dst_spec.keys)
        # A store that waits starts from a worker thread: it follows the caller's stream through an event.
        after = torch.cuda.Event() if self.cuda else None
        if after is not None:
            after.record()
        job = _StoreJob(job_id, dst_spec.generation, tuple(dst_spec.keys), blocks,
                        self._blocks_of(dst_spec.generation, dst_spec.evicted), after, started)
        with self._lock:
            self._stores.append(job)
        self._pump()
        return True

    def _pump(self) -> None:
        """Start the stores that can start, in order. Called after every submit and every
        transfer's end; a call made while another runs (in any thread, or from a transfer that
        ended inside ``store()``) makes that one go round again instead."""
        with self._lock:
            if self._pumping:
                self._pump_again = True
                return
            self._pumping = True
        try:
            while True:
                with self._lock:
                    self._pump_again = False
                self._start_stores()
                with self._lock:
                    if not self._pump_again:
                        self._pumping = False
                        return
        except BaseException:
            with self._lock:
                self._pumping = False
            raise

    def _start_stores(self) -> None:
        """Start stores in order until one must wait. Only the pump calls it: no two run at once, so
        no store starts between a job's discards and the look at what they left held."""
        while True:
            with self._lock:
                if not self._stores:
                    return
                job = self._stores[0]
                fenced = job.generation < self.generation
                if fenced:
                    self._stores.popleft()
                elif any(g < job.generation for g in self._running_stores.values()):
                    return  # stores from before a reset still hold slots the manager counts as free
                elif self._unsettled:
                    return  # slots of evicted chunks are not free yet: the manager counts them free
            if fenced:  # a reset came since it was prepared: vLLM ignores its report, nothing is stored
                self._report(job.job_id, "store", True, job.started)
                continue
            if job.evicted:  # the manager's evictions, before anything new takes room
                self._discard_evicted(job)
                continue
            try:
                transfer = self.offloader.store(job.blocks, after=job.after)
            except CapacityError as e:
                if e.requested > e.capacity:  # can never fit: a bug of the sizes, not a wait (never expected here)
                    with self._lock:
                        self._stores.popleft()
                    self._report(job.job_id, "store", False, job.started, failure=self._store_failure(job))
                    continue
                # running loads (or stores) hold the slots: wait for one to end
                if not job.waited:
                    job.waited = True
                    with self._lock:
                        self._store_waits += 1
                return
            except Exception:
                with self._lock:
                    self._stores.popleft()
                self._report(job.job_id, "store", False, job.started, failure=self._store_failure(job))
                continue
            with self._lock:
                self._stores.popleft()
                self._running_stores[transfer] = job.generation
            transfer.add_done_callback(functools.partial(self._store_ended, job), on_ending_thread=True)

    def _discard_evicted(self, job: _StoreJob) -> None:
        """Discard the chunks the manager evicted. One that a running store is spilling to disk keeps
        its disk slot until that spill ends: then the stores running now must end before the next
        starts, or the offloader would make room by evicting a chunk the manager still serves."""
        with self._lock:
            running = list(self._running_stores)
        present = self.offloader.discard(job.evicted)
        job.evicted = []
        if present:
            with self._lock:
                self._unsettled.update(t for t in running if t in self._running_stores)

    def _store_ended(self, job: _StoreJob, t: Transfer) -> None:
        ok = not t.cancelled() and t.exception() is None
        with self._lock:
            del self._running_stores[t]
            self._unsettled.discard(t)
        self._report(job.job_id, "store", ok, job.started, t.result().nbytes if ok else None, self._store_failure(job))
        self._pump()

    @staticmethod
    def _store_failure(job: _StoreJob) -> JobFailure:
        return JobFailure("store", job.generation, job.keys)

    # -- loads ---------------------------------------------------------------------------

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        assert isinstance(src_spec, KeysSpec)
        started = time.perf_counter()
        blocks = self._gpu_blocks(src_spec, dst_spec)  # first: a spec that does not fit raises with nothing begun
        if self._restored:
            self._drop_unclaimed()
        self._begin(job_id)
        self._enter_generation(src_spec.generation)
        failure = JobFailure("load", src_spec.generation, tuple(src_spec.keys), tuple(blocks.values()))
        if src_spec.evicted:  # room the manager made for chunks this load fetches from the remote tier
            with self._lock:
                self._chunks[src_spec.generation].difference_update(src_spec.evicted)
                self._chunks[src_spec.generation].update(src_spec.keys)
            self.offloader.discard(self._blocks_of(src_spec.generation, src_spec.evicted))
        try:
            transfer = self.offloader.load(blocks, expedited=expedited)
        except Exception:  # a missing key (MissingKeysError), a closed offloader
            self._report(job_id, "load", False, started, failure=failure)
            return True

        def ended(t: Transfer) -> None:
            ok = not t.cancelled() and t.exception() is None
            with self._lock:
                self._loads.pop(job_id, None)
                abandoned = job_id in self._cancelled_loads
                self._cancelled_loads.discard(job_id)
            if abandoned and t.cancelled():  # its request ended: nothing waits for its blocks, nothing failed
                self._report(job_id, "load", True, started, timed=False)
            else:
                self._report(job_id, "load", ok, started, t.result().nbytes if ok else None, failure)
            self._pump()  # a store may wait for the slots this load held

        with self._lock:
            self._loads[job_id] = transfer
        transfer.add_done_callback(ended, on_ending_thread=True)
        return True

    def cancel_loads(self, job_ids: Collection[int]) -> list[int]:
        """Cancel the running loads among ``job_ids`` (their requests were aborted); returns those it
        cancelled. Returns at once, blocking on nothing: each ends once the copy running now has landed
        (a GPU load within a chunk, its later copy kernels skipping their work), then releases its
        slots and is reported done (``success=True``, no bytes, not a failure), so that vLLM frees its
        GPU blocks and the manager drops its pins. A load that ends before the cancel lands is
        reported as it ended (done, or failed). Only ``KvoffloadConnector`` calls it."""
        with self._lock:
            running = [(j, self._loads[j]) for j in job_ids if j in self._loads]
            self._cancelled_loads.update(j for j, _ in running)
        for _, t in running:  # outside the lock: a transfer that ends at once reports under it
            t.cancel()
        return [j for j, _ in running]

    def has_job(self, job_id: int) -> bool:
        """Whether the job was submitted and :meth:`get_finished` has not handed its result over yet."""
        with self._lock:
            return job_id in self._reported

    # -- vLLM's polling ------------------------------------------------------------------

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            done, self._finished = self._finished, []
            for r in done:
                self._reported.pop(r.job_id, None)
            self._handed_failures += self._failures  # in the same pass as their jobs' results
            self._failures = []
        return done

    def take_failures(self) -> list[JobFailure]:
        """The failures of the jobs :meth:`get_finished` handed over since the last call (only with
        ``reports_failures``: otherwise they were reported with ``success=False``)."""
        with self._lock:
            taken, self._handed_failures = self._handed_failures, []
        return taken

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has ended; ``get_finished`` then reports them."""
        with self._lock:
            events = [self._reported[j] for j in job_ids if j in self._reported]
            loads = [self._loads[j] for j in job_ids if j in self._loads]
        for t in loads:  # waited on here: ended in this thread once its copies land, no worker hop
            with contextlib.suppress(Exception):  # reported as failed by its done callback
                t.result()
        for e in events:
            e.wait()

    def take_stats(self) -> Any:
        """vLLM's ``OffloadingConnectorStats`` of this rank since the last call (vLLM asks every
        step; the offloader's own counters are read at most every ``stats_period_s``)."""
        delta = collections.Counter[str]()
        now = time.monotonic()
        if now - self._stats_read_at >= self.stats_period_s:
            self._stats_read_at = now
            s = self.offloader.stats()
            counts = {
                "host": s.keys_loaded_from_host, "disk": s.keys_loaded_from_disk, "spilled": s.spilled,
                "evicted_host": s.evicted_host, "evicted_disk": s.evicted_disk, "read": s.disk_bytes_read,
                "written": s.disk_bytes_written, "io_errors": s.disk_io_errors,
            }
            delta.update({k: v - self._last_counts.get(k, 0) for k, v in counts.items()})
            self._last_counts = counts
        with self._lock:
            seconds, self._job_seconds = self._job_seconds, []
            failed, self._failed = self._failed, collections.Counter()
            waits, self._store_waits = self._store_waits, 0
        stats = _new_stats()
        for tier in ("host", "disk"):
            if delta[tier]:
                stats.increase_counter(Metric.LOADED_BLOCKS, delta[tier], (tier,))
            if delta[f"evicted_{tier}"]:
                stats.increase_counter(Metric.EVICTED_BLOCKS, delta[f"evicted_{tier}"], (tier,))
        for direction in ("read", "written"):
            if delta[direction]:
                stats.increase_counter(Metric.DISK_BYTES, delta[direction], (direction,))
        if delta["spilled"]:
            stats.increase_counter(Metric.SPILLED_BLOCKS, delta["spilled"])
        if delta["io_errors"]:
            stats.increase_counter(Metric.DISK_IO_ERRORS, delta["io_errors"])
        for kind, n in failed.items():
            stats.increase_counter(Metric.FAILED_JOBS, n, (kind,))
        if waits:
            stats.increase_counter(Metric.STORE_WAITS, waits)
        for kind, secs in seconds:
            stats.observe_histogram(Metric.JOB_SECONDS, secs, (kind,))
        return stats

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.stop(5.0)  # lookups still running are dropped
        self.offloader.close()


def _start_offloader(
    tensors: dict[str, torch.Tensor], host_blocks: int, disk_blocks: int, disk_file: str | None, options: dict[str, Any],
) -> Offloader:
    """A started offloader; with a disk tier, its (nameless) file in ``disk_file``'s directory, made if
    missing; with a persistent one, its file in the directory ``disk_file`` (made if missing)."""
    if disk_file is None:
        return Offloader(tensors, host_blocks=host_blocks, **options).start()
    os.makedirs(disk_file if options.get("persist") else os.path.dirname(os.path.abspath(disk_file)), exist_ok=True)
    return Offloader(tensors, host_blocks=host_blocks, disk_path=disk_file, disk_blocks=disk_blocks, **options).start()


# -- the connector ----------------------------------------------------------------------------

_SPEC_DEFAULTS = {"spec_name": "KvoffloadSpec", "spec_module_path": __name__}


@functools.cache
def _worker_metadata_class() -> type:
    """``KvoffloadWorkerMetadata``, built on first use (as ``KvoffloadConnector``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    @dataclass
    class KvoffloadWorkerMetadata(OffloadingWorkerMetadata):  # type: ignore[misc]
        """vLLM's worker-to-scheduler report of ended jobs, with the jobs that failed."""

        failures: list[JobFailure] = field(default_factory=list)
        remote_answers: list[tuple[int, OffloadKey, bool]] = field(default_factory=list)
        """Each rank's answers to remote lookups: ``(generation, chunk, found)``."""

        def aggregate(self, other: Any) -> Any:  # vLLM merges the ranks' reports of a step
            merged = super().aggregate(other)
            return KvoffloadWorkerMetadata(merged.completed_jobs, merged.transfer_stats,
                                           [*self.failures, *getattr(other, "failures", ())],
                                           [*self.remote_answers, *getattr(other, "remote_answers", ())])

    # pickled by name from the workers to the scheduler: found through the module's __getattr__
    KvoffloadWorkerMetadata.__module__ = __name__
    KvoffloadWorkerMetadata.__qualname__ = "KvoffloadWorkerMetadata"
    return KvoffloadWorkerMetadata


@functools.cache
def _handshake_class() -> type:
    """``KvoffloadHandshake``, built on first use (as ``KvoffloadConnector``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    @dataclass
    class KvoffloadHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
        """What a worker tells the scheduler at start (vLLM's handshake): the chunks its persistent
        tier found again, least recently used first."""

        rank: int
        generation: int
        restored: list[OffloadKey]

    KvoffloadHandshake.__module__ = __name__
    KvoffloadHandshake.__qualname__ = "KvoffloadHandshake"
    return KvoffloadHandshake


def _connector_class() -> type:
    """``KvoffloadConnector``, built on first use: importing vLLM's connector pulls in vLLM's
    whole engine, which a spec built by hand does not need."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    metadata_class = _worker_metadata_class()
    handshake_class: Any = _handshake_class()

    def with_spec(vllm_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        for key, value in _SPEC_DEFAULTS.items():
            extra.setdefault(key, value)

    class KvoffloadConnector(OffloadingConnector):  # type: ignore[misc]
        """vLLM's ``OffloadingConnector`` with kvoffload as its spec (no ``spec_name`` needed),
        adding each rank's figures (tiers, spills, disk IO, job latency) to vLLM's metrics, and
        reporting failed jobs so that they cost the request (``kv_load_failure_policy``), not the
        engine: a failed load's GPU blocks through ``get_block_ids_with_load_errors``, and every
        failure to the manager through the workers' metadata; and cancelling the loads of
        requests aborted while they load, so that vLLM gets their GPU blocks back at once."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            with_spec(vllm_config)
            super().__init__(vllm_config, role, kv_cache_config)
            manager = self._kvoffload_manager()
            if manager is not None:
                manager.asks_workers = True  # remote lookups travel in the step's metadata
            self._load_errors: set[int] = set()
            """GPU blocks of failed loads handed over by get_finished, for get_block_ids_with_load_errors."""
            self._failures: list[JobFailure] = []
            """Failures handed over by get_finished, for the next worker metadata."""
            self._load_reqs: dict[int, str] = {}
            """Async load jobs this worker submitted and has not reported yet -> their request ids."""

        def _kvoffload_worker(self) -> KvoffloadWorker | None:
            worker = self.connector_worker.worker if self.connector_worker is not None else None
            return worker if isinstance(worker, KvoffloadWorker) else None

        def _kvoffload_manager(self) -> KvoffloadManager | None:
            manager = self.connector_scheduler.manager if self.connector_scheduler is not None else None
            return manager if isinstance(manager, KvoffloadManager) else None

        # -- the handshake at start: what the persistent tiers hold --------------------------

        def get_handshake_metadata(self) -> Any:
            worker = self._kvoffload_worker()
            if worker is None or not worker.persistent:
                return super().get_handshake_metadata()
            return handshake_class(int(worker.rank), worker.generation, worker.claim_restored())

        def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
            # every pipeline stage's ranks hold their own layers: a chunk is whole only if all hold it
            self._adopt(metadata.values())

        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
            self._adopt(metadata.values())

        def _adopt(self, reports: Collection[Any]) -> None:
            manager = self._kvoffload_manager()
            ours = [r for r in reports if isinstance(r, handshake_class) and r.generation == 0]
            if manager is not None and ours:
                with manager_lock(manager):
                    manager.adopt([r.restored for r in sorted(ours, key=lambda r: r.rank)])

        # -- remote lookups: asked with the step's metadata, answered with the workers' ----

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            manager = self._kvoffload_manager()
            if manager is not None and manager.remote:
                with manager_lock(manager):
                    meta.kvoffload_remote_asks = (manager.generation, manager.take_remote_asks())
            return meta

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            super().bind_connector_metadata(connector_metadata)
            worker = self._kvoffload_worker()
            asks = getattr(connector_metadata, "kvoffload_remote_asks", None)
            if worker is not None and asks:
                worker.look_up_remote(*asks)

        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            super().register_kv_caches(kv_caches)  # builds the worker
            worker = self._kvoffload_worker()
            if worker is not None:
                worker.reports_failures = True

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            super().start_load_kv(forward_context, **kwargs)
            if self._kvoffload_worker() is not None:
                # a sync load has ended already: its request runs this step
                self._load_reqs.update((j, job.req_id) for j, job in self._connector_metadata.load_jobs.items()
                                       if not is_sync_load(job))

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
            worker = self._kvoffload_worker()
            if worker is not None and finished_req_ids and self._load_reqs:
                # Requests aborted while their loads run (vLLM's scheduler holds their GPU blocks until
                # the loads are reported): stop the loads, so that they are reported at once.
                worker.cancel_loads([j for j, r in self._load_reqs.items() if r in finished_req_ids])
            done: tuple[set[str], set[str]] = super().get_finished(finished_req_ids)
            if worker is not None:
                if self._load_reqs:
                    self._load_reqs = {j: r for j, r in self._load_reqs.items() if worker.has_job(j)}
                # vLLM asks for the load errors right after, in the pass that reports the load ended
                failures = worker.take_failures()
                self._load_errors.update(b for f in failures if f.kind == "load" for b in f.block_ids)
                self._failures += failures
            return done

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors, self._load_errors = self._load_errors, set()
            return errors

        def build_connector_worker_meta(self) -> Any:
            meta = super().build_connector_worker_meta()
            worker = self._kvoffload_worker()
            answers = worker.take_remote_answers() if worker is not None else []
            if meta is None and not self._failures and not answers:
                return None
            failures, self._failures = self._failures, []
            if meta is None:  # remote answers, with no job ended in this step
                return metadata_class(failures=failures, remote_answers=answers)
            return metadata_class(meta.completed_jobs, meta.transfer_stats, failures, answers)

        def update_connector_output(self, connector_output: Any) -> None:
            worker_meta = connector_output.kv_connector_worker_meta
            failures: list[JobFailure] = getattr(worker_meta, "failures", None) or []
            answers: list[tuple[int, OffloadKey, bool]] = getattr(worker_meta, "remote_answers", None) or []
            manager = self._kvoffload_manager()
            if (failures or answers) and manager is not None:
                with manager_lock(manager):  # before vLLM completes the jobs (complete_load / complete_store)
                    for failure in failures:
                        manager.job_failed(failure)
                    manager.remote_answered(answers)
            super().update_connector_output(connector_output)

        def get_kv_connector_stats(self) -> Any:
            worker = self._kvoffload_worker()
            if worker is not None:
                return worker.take_stats()
            return super().get_kv_connector_stats()

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
            with_spec(vllm_config)
            return super().build_prom_metrics(vllm_config, *args, **kwargs)

    KvoffloadConnector.__module__ = __name__
    return KvoffloadConnector


_LAZY_CLASSES: dict[str, Callable[[], type]] = {"KvoffloadConnector": _connector_class, "KvoffloadWorkerMetadata": _worker_metadata_class,
                 "KvoffloadHandshake": _handshake_class}


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        cls = _LAZY_CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
