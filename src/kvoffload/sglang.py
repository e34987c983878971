"""kvoffload as an SGLang HiCache L3 storage backend (SGLang 0.5.23), loaded without a fork.

Enable it with::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvoffload", "module_path": "kvoffload.sglang", "class_name": "KvoffloadStorage",
          "interface_v1": 1, "disk_path": "/mnt/nvme/sglang-kv", "disk_bytes": "400GiB", "persist": true}'

SGLang's backend factory builds :class:`KvoffloadStorage` from ``--hicache-storage-backend-extra-config``
(every kvoffload setting comes from there, checked at construction: an unknown key or a malformed
value is a ``ValueError`` naming it), then hands it its host pool (``register_mem_pool_host``). The
pool's tensors become the caches of one :class:`kvoffload.Offloader` per rank, a block being one
SGLang page: ``batch_set_v1`` / ``batch_get_v1`` move pages between the host pool and the disk tier
(and the remote tier) through the disk tier's bounce buffers only.

How it maps onto SGLang's contract:

* One config serves every rank. Sizes are per rank. Each rank's offloader is keyed by SGLang's page
  hashes under a cache identity that adds the model name, the host pool layout and the rank's place
  (TP rank and size, PP, attention context parallel; MLA models, whose ranks hold the same KV, drop
  the TP rank): ranks and models never read each other's pages. A persistent tier's files live in
  a directory per rank under ``disk_path`` (:func:`rank_directory`), one file per identity in it.
* Nothing on the data path raises: SGLang calls it from its backup and prefetch threads, where an
  exception disables L3 for the life of the process (or is logged and dropped). Every failure (an IO
  error, a checksum, a remote that is down, no room, a call past ``io_timeout_s``) is a ``False`` per
  page (or a shorter hit count), counted by cause (:meth:`KvoffloadStorage.failures`) and logged at
  WARNING the first time for each cause.
* A call that runs past ``io_timeout_s`` is cancelled, and returns only once the transfer no longer
  touches the pages it was given (SGLang may reuse them at once).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from . import Lease, Offloader, OffloaderStats, Options, Transfer, TransferResult
from . import _WorkerLoop as WorkerLoop
from . import _check_remote_url as check_remote_url
from . import _parse_size as parse_size
from . import _refuse_unknown_keys as refuse_unknown_keys

log = logging.getLogger("kvoffload")

__all__ = ["KvoffloadStorage", "StorageSettings", "parse_extra_config", "rank_fingerprint", "rank_directory", "pool_caches",
           "BATCH_PAGES"]

BATCH_PAGES = 128
"""The most pages SGLang 0.5.23 hands one storage call (``STORAGE_BATCH_SIZE``): the tiers must hold a batch."""

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""The host pool layouts served (MHA and MLA pools alike)."""

# -- configuration ----------------------------------------------------------------------------

_SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1",
    # read (and normally removed) by SGLang before the backend sees the config
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
"""Keys of ``--hicache-storage-backend-extra-config`` that SGLang itself reads."""
_SIZE_KEYS = ("disk_bytes", "host_bytes", "bounce_bytes")
_BOOL_KEYS = ("persist", "verify", "use_page_cache")
_SECURITY_KEYS = ("remote_secret", "namespace", "encryption_key")
"""Passed to the offloader as given (strings: ``"env:NAME"``, ``"file:PATH"``; a list of secrets for a
rotation), checked by it (docs/security.md)."""
_KVOFFLOAD_KEYS = frozenset({*_SIZE_KEYS, *_BOOL_KEYS, *_SECURITY_KEYS, "disk_path", "disk_pages", "fingerprint", "remote",
                             "remote_write", "io_threads", "io_timeout_s"})
_REMOTE_WRITES = ("through", "evict", "none")


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"hicache-storage-backend-extra-config[{key!r}]: {message}")


@dataclasses.dataclass(frozen=True)
class StorageSettings:
    """The kvoffload part of the extra config, checked: one rank's tiers and options."""

    disk_path: str | None = None
    """The directory of the disk tier (per-rank files in it), or None without one."""
    disk_bytes: int | None = None
    """Disk bytes per rank (or ``disk_pages``)."""
    disk_pages: int | None = None
    """Disk slots per rank, in SGLang pages (or ``disk_bytes``)."""
    host_bytes: int = 0
    """kvoffload's own host tier per rank: none by default (SGLang's host pool is the host tier); a
    remote tier without a disk tier needs one, for the pages it fetches."""
    persist: bool = False
    verify: bool = False
    fingerprint: str | None = None
    """The weights' identity (a revision, a hash), added to SGLang's model name."""
    remote: str | None = None
    remote_write: str = "through"
    io_threads: int = 4
    use_page_cache: bool = False
    bounce_bytes: int | None = None
    io_timeout_s: float = 60.0
    """How long one storage call may take before it is cancelled and answers False."""
    interface_v1: bool = False
    remote_secret: str | list[str] | None = None
    """Authenticates remote values and persistent slots (``"env:NAME"``, or a list: the first signs)."""
    namespace: str = ""
    """The tenant, part of the cache identity: backends of different namespaces share no page."""
    encryption_key: str | None = None
    """AES-256-GCM of disk slots and remote values (``"env:NAME"`` or ``"file:PATH"``)."""

    def offloader_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`kvoffload.Offloader` these settings give (but the caches)."""
        options: dict[str, Any] = {"host_bytes": self.host_bytes, "io_threads": self.io_threads,
                                   "use_page_cache": self.use_page_cache, "promote": False}
        if self.disk_path is not None:
            options["disk_path"] = self.disk_path
            if self.disk_pages is not None:
                options["disk_blocks"] = self.disk_pages
            else:
                options["disk_bytes"] = self.disk_bytes
        if self.bounce_bytes is not None:
            options["bounce_bytes"] = self.bounce_bytes
        if self.persist:
            options["persist"] = True
            options["verify"] = self.verify
        if self.remote is not None:
            options["remote"] = self.remote
            options["remote_write"] = self.remote_write
        for key in _SECURITY_KEYS:
            if getattr(self, key):
                options[key] = getattr(self, key)
        return options


def parse_extra_config(extra: Mapping[str, Any] | None) -> StorageSettings:
    """Check ``extra`` (``HiCacheStorageConfig.extra_config``) and return kvoffload's settings.

    ``ValueError`` naming the key and what was given for an unknown key (listing the accepted ones,
    with the closest), a malformed value, or settings that leave no tier: give ``disk_path`` with
    ``disk_bytes`` (or ``disk_pages``), or ``remote`` with ``host_bytes``.
    """
    extra = dict(extra or {})
    refuse_unknown_keys("hicache-storage-backend-extra-config", extra, _KVOFFLOAD_KEYS, "SGLang", _SGLANG_KEYS)
    values: dict[str, Any] = {}
    for key in _SIZE_KEYS:
        if key in extra:
            try:
                values[key] = parse_size(key, extra[key])
            except (TypeError, ValueError) as e:
                raise _error(key, str(e).removeprefix(f"{key}=")) from None
    for key in _BOOL_KEYS:
        if key in extra:
            if not isinstance(extra[key], bool):
                raise _error(key, f"{extra[key]!r} ({type(extra[key]).__name__}) is not a boolean: give true or false")
            values[key] = extra[key]
    for key, minimum in (("disk_pages", 1), ("io_threads", 1)):
        if key in extra:
            value = extra[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise _error(key, f"{value!r} ({type(value).__name__}) is not an integer")
            if value < minimum:
                raise _error(key, f"{value!r} is less than {minimum}")
            values[key] = value
    for key in ("disk_path", "fingerprint", "remote"):
        if key in extra:
            value = extra[key]
            if not isinstance(value, str) or not value or "\0" in value:
                raise _error(key, f"{value!r} is not a non-empty string")
            values[key] = value
    for key in _SECURITY_KEYS:
        if key in extra:
            value = extra[key]
            items = value if isinstance(value, list) and key == "remote_secret" else [value]
            if not items or not all(isinstance(v, str) and v for v in items):
                raise _error(key, f"{value!r} is not a non-empty string" + (" or a list of them" if key == "remote_secret" else ""))
            values[key] = value
    if "remote_write" in extra:
        if extra["remote_write"] not in _REMOTE_WRITES:
            raise _error("remote_write", f"{extra['remote_write']!r} is not one of {', '.join(map(repr, _REMOTE_WRITES))}")
        values["remote_write"] = extra["remote_write"]
    if "io_timeout_s" in extra:
        value = extra["io_timeout_s"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _error("io_timeout_s", f"{value!r} is not a number of seconds > 0")
        values["io_timeout_s"] = float(value)
    interface_v1 = extra.get("interface_v1", 0)
    if isinstance(interface_v1, bool) or interface_v1 not in (0, 1):
        raise _error("interface_v1", f"{interface_v1!r} is not 0 or 1")
    values["interface_v1"] = bool(interface_v1)

    if "disk_bytes" in values and "disk_pages" in values:
        raise _error("disk_pages", "give disk_bytes or disk_pages, not both")
    disk_size = "disk_bytes" if "disk_bytes" in values else "disk_pages" if "disk_pages" in values else None
    if "disk_path" in values and disk_size is None:
        raise _error("disk_path", "the disk tier needs its size too: disk_bytes (such as '400GiB', per rank) or disk_pages")
    if disk_size is not None and "disk_path" not in values:
        raise _error(disk_size, "the disk tier needs disk_path too (a directory)")
    if disk_size is not None and values[disk_size] == 0:
        raise _error(disk_size, "is 0: give the disk tier's size per rank, such as '400GiB'")
    if "disk_path" not in values and ("remote" not in values or not values.get("host_bytes")):
        raise ValueError(
            "hicache-storage-backend-extra-config gives kvoffload no tier: give disk_path with disk_bytes (such as "
            "'400GiB', per rank) or disk_pages, and optionally remote; or remote with host_bytes (kvoffload's own host "
            "memory per rank, for the pages it fetches)"
        )
    if values.get("persist") and "disk_path" not in values:
        raise _error("persist", "persist needs a disk tier: give disk_path and disk_bytes")
    if values.get("verify") and not values.get("persist"):
        raise _error("verify", "verify checks the persistent disk tier's slots: it needs persist true")
    if "fingerprint" in values and not (values.get("persist") or "remote" in values):
        raise _error("fingerprint", "the fingerprint names the weights of a persistent or remote tier: it needs persist "
                                    "true or remote")
    if "remote_write" in values and "remote" not in values:
        raise _error("remote_write", "needs remote")
    if "remote" in values:
        try:
            check_remote_url(values["remote"])
        except ImportError as e:
            raise _error("remote", f"the remote tier needs redis-py: pip install 'kvoffload[redis]' ({e})") from None
        except (TypeError, ValueError) as e:
            raise _error("remote", str(e)) from None
    settings = StorageSettings(**values)
    if any(key in values for key in _SECURITY_KEYS):
        try:  # the offloader's own checks (an unset variable, a short secret, a key file others can read), now
            Options(**settings.offloader_options())
        except (TypeError, ValueError, ImportError) as e:
            raise ValueError(f"hicache-storage-backend-extra-config: {e}") from None
    return settings


def _rank_parts(config: HiCacheStorageConfig, *, shared: bool) -> list[str]:
    """The rank's place in the parallel layout; ``shared``: what a rank shares with the same rank of
    other engines (MLA ranks hold the same KV, and data-parallel replicas compute the same KV)."""
    parts = [f"tp={'*' if shared and config.is_mla_model else config.tp_rank}/{config.tp_size}",
             f"pp={config.pp_rank}/{config.pp_size}", f"cp={config.attn_cp_rank}/{config.attn_cp_size}"]
    if not shared:
        parts.append(f"dp={config.dp_rank}")
    return parts


def rank_fingerprint(config: HiCacheStorageConfig, layout: str, page_size: int, given: str | None) -> str:
    """The fingerprint of one rank's persistent or remote tier: SGLang's model name, the host pool's
    layout and page size, the rank's place (TP rank and size, PP rank and size, attention CP; an
    MLA model drops the TP rank, as its ranks hold the same KV; data-parallel replicas share), and
    the one given (the weights' identity). The tier's cache identity adds the tensors' shapes and dtypes."""
    return "; ".join((
        f"sglang model={config.model_name or ''} layout={layout} page_size={page_size} mla={bool(config.is_mla_model)}",
        " ".join(_rank_parts(config, shared=True)),
        f"fingerprint={given or ''}",
    ))


def rank_directory(disk_path: str, config: HiCacheStorageConfig) -> str:
    """Where one rank's persistent files go: ``<disk_path>/rank-tp<R>of<S>-pp<R>of<S>-cp<R>of<S>-dp<D>``
    (a file per cache identity in it: another model gets its own). One process holds a file at a
    time, so every rank, data-parallel replicas included, has a directory of its own."""
    name = (f"rank-tp{config.tp_rank}of{config.tp_size}-pp{config.pp_rank}of{config.pp_size}"
            f"-cp{config.attn_cp_rank}of{config.attn_cp_size}-dp{config.dp_rank}")
    return os.path.join(disk_path, name)


def _check_config(config: HiCacheStorageConfig, settings: StorageSettings) -> None:
    if not isinstance(config, HiCacheStorageConfig):
        raise TypeError(f"storage_config must be SGLang's HiCacheStorageConfig, got {type(config).__name__}")
    if config.dcp_size > 1:
        raise ValueError(f"kvoffload does not serve decode context parallel storage (dcp_size={config.dcp_size})")
    if config.should_split_heads:
        raise ValueError("kvoffload does not serve heterogeneous TP (tp_lcm_size with the page_head layout)")
    if config.is_mla_model and config.tp_size > 1 and settings.remote is None:
        raise ValueError(
            f"an MLA model with tp_size={config.tp_size}: SGLang stores its pages from the first rank only, so the "
            "other ranks find them only in a shared tier: give remote (each rank's disk tier is its own)"
        )


# -- the host pool as caches -------------------------------------------------------------------

def pool_caches(pool: Any) -> dict[str, torch.Tensor]:
    """The host pool's tensors as kvoffload caches, dim 0 indexing SGLang pages (views, no copy).

    A page's bytes in tensor order are exactly its flat data page (``pool.get_data_page(i, flat=True)``):
    layer_first (MHA ``(2, L, tokens, H, D)``; MLA ``(L, tokens, 1, dim)``): one tensor per K/V and
    layer, a page its ``page_size`` rows; page_first (``(2, tokens, L, H, D)`` / ``(tokens, L, 1, dim)``)
    and page_first_direct (``(2, pages, L, page_size, H, D)`` / ``(pages, L, page_size, 1, dim)``): one
    tensor per K/V, a page one contiguous run. ``ValueError`` for any other pool or layout.
    """
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kind = type(pool)
    if kind not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
        raise ValueError(f"kvoffload serves SGLang's MHATokenToKVPoolHost and MLATokenToKVPoolHost, got {kind.__name__}")
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS:
        raise ValueError(f"kvoffload serves the host pool layouts {', '.join(LAYOUTS)}, got {layout!r}")
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{kind.__name__} has no kv_buffer tensor (an allocator-only pool): nothing to store")
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"{kind.__name__}.kv_buffer must be a contiguous CPU tensor, got {buffer.device} "
                         f"(contiguous={buffer.is_contiguous()})")
    page_size, tokens = int(pool.page_size), int(pool.size)
    if page_size < 1 or tokens % page_size:
        raise ValueError(f"{kind.__name__}: {tokens} tokens do not divide into pages of {page_size}")
    pages, layers = tokens // page_size, int(pool.layer_num)
    mha = kind is MHATokenToKVPoolHost
    row = (pool.head_num, pool.head_dim) if mha else (1, pool.kv_cache_dim)
    halves = (("k", 0), ("v", 1)) if mha else (("kv", None),)
    expected = {
        "layer_first": (layers, tokens, *row),
        "page_first": (tokens, layers, *row),
        "page_first_direct": (pages, layers, page_size, *row),
    }[layout]
    if tuple(buffer.shape) != ((2, *expected) if mha else expected):
        raise ValueError(f"{kind.__name__}.kv_buffer has shape {tuple(buffer.shape)}, not the {layout} shape "
                         f"{(2, *expected) if mha else expected}")
    caches: dict[str, torch.Tensor] = {}
    for name, half in halves:
        part = buffer[half] if half is not None else buffer
        if layout == "layer_first":
            for layer in range(layers):
                caches[f"{name}.{layer}"] = part[layer].view(pages, -1)
        else:
            caches[name] = part.view(pages, -1)
    return caches


# -- the backend -------------------------------------------------------------------------------

_T = TypeVar("_T")


@dataclasses.dataclass
class _Metrics:
    """What SGLang's storage metrics take, since its last ``get_stats()``."""

    prefetch_pgs: list[int] = dataclasses.field(default_factory=list)
    backup_pgs: list[int] = dataclasses.field(default_factory=list)
    prefetch_bandwidth: list[float] = dataclasses.field(default_factory=list)
    backup_bandwidth: list[float] = dataclasses.field(default_factory=list)


class KvoffloadStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 storage over one :class:`kvoffload.Offloader` per rank.

    Built by SGLang's ``StorageBackendFactory`` as ``KvoffloadStorage(storage_config, kwargs)``;
    the offloader starts in :meth:`register_mem_pool_host`, over the host pool's tensors.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        if kwargs:
            raise TypeError(f"KvoffloadStorage takes its settings from storage_config.extra_config, got keyword "
                            f"arguments {sorted(kwargs)}")
        self.settings = parse_extra_config(getattr(storage_config, "extra_config", None))
        _check_config(storage_config, self.settings)
        if not self.settings.interface_v1:
            log.warning("kvoffload: interface_v1 is not set in hicache-storage-backend-extra-config: SGLang takes its "
                        "generic path (every page copied through a staging tensor); set \"interface_v1\": 1")
        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self.offloader: Offloader | None = None
        self._page_size = 0
        self._page_bytes = 0
        self._lookups: WorkerLoop | None = None
        """The loop of remote lookups (``alookup`` is a coroutine; SGLang's threads are plain threads)."""
        self._lock = threading.Lock()
        self._failures: collections.Counter[str] = collections.Counter()
        self._metrics = _Metrics()
        self._closed = False

    # -- setup ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Start this rank's offloader over ``mem_pool_host``'s tensors. Raises (``ValueError`` for an
        unsupported pool or tiers too small for one batch, ``kvoffload.StartError``), which fails
        SGLang's attach: this is setup, not the data path."""
        if self.offloader is not None:
            if mem_pool_host is self.mem_pool_host:
                return
            raise ValueError("KvoffloadStorage already serves another host pool: SGLang builds a backend per attach")
        caches = pool_caches(mem_pool_host)
        settings = self.settings
        page_size = int(mem_pool_host.page_size)
        options = settings.offloader_options()
        config = self.storage_config
        if settings.persist or settings.remote is not None:
            options["fingerprint"] = rank_fingerprint(config, mem_pool_host.layout, page_size, settings.fingerprint)
        if settings.disk_path is not None:
            directory = rank_directory(settings.disk_path, config) if settings.persist else settings.disk_path
            os.makedirs(directory, exist_ok=True)
            options["disk_path"] = directory
        offloader = Offloader(caches, **options)
        slots = offloader.options.tier_slots(offloader.layout.slot_bytes)
        if slots.host + slots.disk < BATCH_PAGES:
            given = "disk_pages" if settings.disk_pages is not None else "disk_bytes" if settings.disk_path else "host_bytes"
            raise _error(given, f"holds {slots.host + slots.disk} pages of {offloader.layout.slot_bytes} bytes per rank, fewer "
                                f"than one SGLang batch of {BATCH_PAGES} pages: give at least "
                                f"{BATCH_PAGES * offloader.layout.slot_bytes} bytes")
        offloader.start()
        try:
            if settings.remote is not None:
                self._lookups = WorkerLoop("kvoffload-sglang-lookups")
        except BaseException:
            offloader.close()
            raise
        super().register_mem_pool_host(mem_pool_host)
        self._page_size = page_size
        self._page_bytes = offloader.layout.block_bytes
        self.offloader = offloader
        if settings.persist:
            log.info("kvoffload: SGLang L3 on %s: %d pages found again", offloader.disk_file, offloader.stats().recovered)

    def close(self) -> None:
        """Close the offloader (SGLang calls this at detach); in-flight calls answer False."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._lookups is not None:
            self._lookups.stop(5.0)
        if self.offloader is not None:
            self.offloader.close()

    # -- the one boundary: nothing on the data path raises --------------------------------------

    def _failed(self, op: str, cause: str, detail: object) -> None:
        key = f"{op}: {cause}"
        with self._lock:
            self._failures[key] += 1
            first = self._failures[key] == 1
        if first:
            log.warning("kvoffload: SGLang %s failed (%s: %s); counted in failures(), logged once per cause", op, cause, detail)
        else:
            log.debug("kvoffload: SGLang %s failed (%s: %s)", op, cause, detail)

    def _guard(self, op: str, default: _T, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except Exception as e:  # the data path's one boundary: whatever went wrong is a False, counted
            self._failed(op, type(e).__name__, e)
            return default

    def failures(self) -> dict[str, int]:
        """Failed calls so far by ``"<call>: <cause>"`` (the exception's class: ``TransferError``,
        ``CapacityError``, ``TimeoutError``, ``ClosedError``, ...)."""
        with self._lock:
            return dict(self._failures)

    def _running(self) -> Offloader:
        off = self.offloader
        if off is None:
            raise RuntimeError("no host pool registered yet (register_mem_pool_host)")
        return off

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int]:
        """The host pool page of each key: ``host_indices`` holds ``page_size`` token indices per key."""
        ps = self._page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
            raise TypeError(f"host_indices must be a 1-D tensor of token indices, got {type(host_indices).__name__}")
        if host_indices.numel() != len(keys) * ps:
            raise ValueError(f"{len(keys)} keys need {len(keys) * ps} host indices (page size {ps}), got {host_indices.numel()}")
        starts = host_indices[::ps].tolist()
        if any(s % ps for s in starts):
            raise ValueError(f"host indices do not start pages (page size {ps}): {starts[:4]}...")
        return [s // ps for s in starts]

    def _wait(self, t: Transfer) -> TransferResult:
        """The transfer's result within ``io_timeout_s``; past it, cancelled, and waited for until it no
        longer touches its pages (then ``TimeoutError``)."""
        try:
            return t.result(self.settings.io_timeout_s)
        except TimeoutError:
            t.cancel()
            try:
                t.result()
            except Exception:
                pass
            raise

    def _remote_hits(self, off: Offloader, keys: list[str]) -> int:
        """Leading hits over the local tiers and the remote one (one round trip, within ``io_timeout_s``)."""
        assert self._lookups is not None
        future = asyncio.run_coroutine_threadsafe(off.alookup(keys), self._lookups.loop)
        try:
            return future.result(self.settings.io_timeout_s)
        except BaseException:
            future.cancel()
            raise

    # -- the zero-copy path (interface_v1) -------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` are stored on this rank's tiers or the remote one. Never raises: 0
        (or the local hits) on failure, counted."""
        keys = list(keys)

        def count() -> int:
            off = self._running()
            hits = off.lookup(keys)
            if hits < len(keys) and self._lookups is not None:
                local = hits
                hits = self._guard("batch_exists", local, lambda: max(local, self._remote_hits(off, keys)))
            return hits

        return self._guard("batch_exists", 0, count)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages ``host_indices`` names under ``keys`` (pages already stored are left alone):
        host pool -> bounce buffer -> disk (and the remote, as ``remote_write`` says). One bool per
        page; every one False if the store failed, counted."""
        keys = list(keys)
        if not keys:
            return []

        def store() -> list[bool]:
            off = self._running()
            pages = self._pages(keys, host_indices)
            started = time.perf_counter()
            result = self._wait(off.store(dict(zip(keys, pages))))
            self._measured(self._metrics.backup_pgs, self._metrics.backup_bandwidth, len(result.keys), result.nbytes, started)
            return [True] * len(keys)

        return self._guard("batch_set_v1", [False] * len(keys), store)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the leading stored ``keys`` into the pages ``host_indices`` names: disk (or remote) ->
        bounce buffer -> host pool. One bool per page: True for the leading hits loaded, False after
        them; every one False if the load failed, counted (its pages' bytes are then unspecified)."""
        keys = list(keys)
        if not keys:
            return []

        def load() -> list[bool]:
            off = self._running()
            pages = self._pages(keys, host_indices)
            started = time.perf_counter()
            lease: Lease = off.lookup(keys, hold=True, hold_s=self.settings.io_timeout_s)
            with lease:
                hits = lease.count
                if hits < len(keys) and self._lookups is not None:
                    hits = max(hits, self._remote_hits(off, keys))
                if hits == 0:
                    return [False] * len(keys)
                result = self._wait(off.load(dict(zip(keys[:hits], pages[:hits])), lease=lease))
            self._measured(self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth, hits, result.nbytes, started)
            return [True] * hits + [False] * (len(keys) - hits)

        return self._guard("batch_get_v1", [False] * len(keys), load)

    def _measured(self, pages: list[int], bandwidth: list[float], count: int, nbytes: int, started: float) -> None:
        if not getattr(self.storage_config, "enable_storage_metrics", False) or not count:
            return
        seconds = time.perf_counter() - started
        with self._lock:
            pages.append(count)
            bandwidth.append(nbytes / seconds / 1e9 if seconds > 0 else 0.0)

    # -- the generic path: each page staged through a page of SGLang's own host pool ---------------

    def _staged(self, op: str, count: int, default: _T, work: Callable[[list[int]], _T]) -> _T:
        """Run ``work`` on ``count`` pages taken from the host pool's allocator, given back after."""
        def run() -> _T:
            pool = self.mem_pool_host
            if pool is None:
                raise RuntimeError("no host pool registered yet (register_mem_pool_host)")
            indices = pool.alloc(count * self._page_size)
            if indices is None:
                raise MemoryError(f"the host pool has no {count} free pages to stage through")
            try:
                return work(indices.tolist()[:: self._page_size])
            finally:
                pool.free(indices)

        return self._guard(op, default, run)

    def _indices(self, starts: list[int]) -> torch.Tensor:
        return torch.tensor([s + i for s in starts for i in range(self._page_size)], dtype=torch.int64)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """SGLang's generic path: store flat data pages (``get_data_page(i, flat=True)``) under ``keys``."""
        keys, values = list(keys), list(values or ())
        if not keys:
            return True
        if len(values) != len(keys):
            self._failed("batch_set", "ValueError", f"{len(keys)} keys, {len(values)} values")
            return False

        def work(starts: list[int]) -> bool:
            for start, value in zip(starts, values):
                self.mem_pool_host.set_from_flat_data_page(start, value)
            return all(self.batch_set_v1(keys, self._indices(starts)))

        return self._staged("batch_set", len(keys), False, work)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        """SGLang's generic path: load the leading stored ``keys`` into flat data pages (``target_locations``,
        such as ``get_dummy_flat_data_page()``; new tensors when None): one tensor or None per key."""
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if not keys:
            return []
        if len(targets) != len(keys):
            self._failed("batch_get", "ValueError", f"{len(keys)} keys, {len(targets)} target locations")
            return [None] * len(keys)

        def work(starts: list[int]) -> list[torch.Tensor | None]:
            loaded = self.batch_get_v1(keys, self._indices(starts))
            out: list[torch.Tensor | None] = []
            for ok, start, target in zip(loaded, starts, targets):
                if not ok:
                    out.append(None)
                    continue
                page = self.mem_pool_host.get_data_page(start, flat=True)
                if target is None:
                    out.append(page.clone())
                else:
                    target.view(-1).copy_(page.view(-1))
                    out.append(target)
            return out

        return self._staged("batch_get", len(keys), [None] * len(keys), work)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    # -- management --------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every page this rank's local tiers hold (a persistent tier's files included). Pages on
        the remote tier stay: other engines share them. Never raises."""
        def run() -> None:
            off = self._running()
            off.discard(off.keys())

        self._guard("clear", None, run)

    def stats(self) -> OffloaderStats | None:
        """This rank's offloader's figures (None before the host pool is registered or after close)."""
        return self._guard("stats", None, lambda: self._running().stats())

    def get_stats(self) -> Any:
        """SGLang's storage metrics since the last call (pages and GB/s per call, with
        ``enable_storage_metrics``), with kvoffload's figures attached: ``.kvoffload`` (the offloader's
        :class:`kvoffload.OffloaderStats`) and ``.failures`` (:meth:`failures`)."""
        def run() -> Any:
            from sglang.srt.observability.metrics_collector import StorageMetrics

            with self._lock:
                taken, self._metrics = self._metrics, _Metrics()
            metrics = StorageMetrics()
            metrics.prefetch_pgs.extend(taken.prefetch_pgs)
            metrics.backup_pgs.extend(taken.backup_pgs)
            metrics.prefetch_bandwidth.extend(taken.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(taken.backup_bandwidth)
            metrics.kvoffload = self.stats()
            metrics.failures = self.failures()
            return metrics

        return self._guard("get_stats", None, run)
