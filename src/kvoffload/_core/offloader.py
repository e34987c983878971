"""The :class:`Offloader` facade: validation, lifecycle, and handing transfers to the tiers."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import torch

from .base.deadline import Deadline, check_seconds, check_timeout
from .base.errors import ClosedError, CloseError, StartError
from .base.helper_threads import HelperThread, run_off_loop
from .tiers.index import BlockIndex, Pin
from .base.keys import check_key, key_list
from .base.layout import BlockLayout, check_block_mapping
from .base.options import Options, TierSlots, format_size
from .runtime import PROCESS, Runtime, finalize_runtime
from .tiers.stats import OffloaderStats, TierCounts, TransferCounters
from .base.cache_identity import encode_key
from .tiers.remote_tier import RemoteCounts
from .tiers.tiered_storage import TieredStorage
from .workers.transfer import Transfer

__all__ = ["Offloader", "OffloaderStats", "Lease"]

log = logging.getLogger("kvoffload")


class Lease:
    """The leading hits of ``Offloader.lookup(keys, hold=True)``, held until a load takes them.

    While the lease holds them, no store evicts or spills the hits' copies, and ``discard`` forgets
    them (they are no longer found) without taking their bytes from the lease's load. Pass the lease
    to ``Offloader.load(blocks, lease=lease)``: the load takes over the holds of the keys it loads and
    the lease releases the others. A lease not loaded is released by :meth:`release`, by leaving its
    ``with`` block, when it is garbage-collected (at the next call on the offloader), or ``hold_s``
    seconds after the lookup (then a worker thread gives them back, whether or not anything calls the
    offloader; ``hold_s=float("inf")``: never). Held hits count in ``stats().pinned``.
    """

    __slots__ = ("count", "keys", "_index", "_pins", "__weakref__")

    def __init__(self, index: BlockIndex) -> None:
        self._index = index
        self._pins: list[Pin] = []
        """Filled by :meth:`BlockIndex.hold` pin by pin; the pin of ``keys[i]`` is ``_pins[i]``."""
        # Collected (maybe by the cycle collector, while this thread is inside the index): released at the next call.
        weakref.finalize(self, index.holds.release_later, self._pins).atexit = False
        self.count = 0
        """How many leading keys were stored at the lookup (what ``lookup(keys)`` returns)."""
        self.keys: tuple[Hashable, ...] = ()
        """Those keys, as the lookup was given them."""

    def release(self) -> None:
        """Give back the holds not taken by a load (idempotent, from any thread: each pin goes back once)."""
        self._index.unpin(self._pins)

    def _taking(self, keys: Iterable[Hashable]) -> list[Pin | None]:
        """The lease's pin of each of ``keys`` (None where it has none)."""
        mine = dict(zip(self.keys, self._pins))
        return [mine.get(k) for k in keys]

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<kvoffload.Lease of {self.count} hits>"


class Offloader:
    """Offload KV-cache blocks to pinned host memory and load them back, asynchronously.

    ``kv_caches`` maps names to tensors whose dim 0 indexes blocks; all have the
    same number of blocks and live on one device (``cuda`` or ``cpu``). A block's
    bytes across all tensors go into one slot (``layout.slot_bytes``) of the host tier.
    Size each tier in slots (``host_blocks``, ``disk_blocks``) or in bytes (``host_bytes``,
    ``disk_bytes``: an int or a string such as ``"64GiB"``; ``bytes // slot_bytes`` slots), not
    both. With neither host size the host tier holds 1 GiB worth of slots (logged at INFO).
    Tensors may be strided views, without a copy: blocks any stride apart, or blocks
    split along dim 1 into contiguous pieces (``t.transpose(0, 1)`` of a
    ``(2, num_blocks, ...)`` K/V tensor); the last dimension must be contiguous.
    ``num_blocks``, if given, is checked against dim 0 of every tensor, with a hint
    when the blocks sit along another dimension.

    Use it as ``async with`` / ``with`` context manager, or call :meth:`start`
    and :meth:`close`. ``store`` and ``load`` validate their arguments at once
    and return a running :class:`Transfer`.

    Keys are ``bytes``, ``str`` or ``int`` (``True`` is the key ``1``), or tuples of keys, nested
    tuples too: exactly these types, not subclasses. Every call that takes keys refuses any other
    with a ``TypeError`` before it does anything: convert a numpy integer or an enum member with
    ``int()``, encode other keys' parts into bytes or a str.

    Keyword options: ``chunk_bytes`` (bytes per copy chunk, the unit of
    pipelining and of cancellation; a GPU cache gets two staging buffers of
    this size per direction, 512 MiB of GPU memory in all at the default
    of 128 MiB; smaller chunks save GPU memory and cost throughput when
    stores and loads run at once), ``use_batch_copy``
    (False forces one ``cuMemcpyAsync`` per copy instead of ``cuMemcpyBatchAsync``),
    ``bounce_bytes`` (the disk tier's IO unit through its pinned bounce buffers, default
    ``chunk_bytes``), ``io_threads`` (disk IO threads, default 4) and ``use_page_cache`` (buffered
    disk IO instead of O_DIRECT). ``disk_path`` and ``disk_blocks`` or ``disk_bytes`` add
    the disk tier: see docs/how-to/disk-tier.md; with both tiers, loads of disk-resident keys
    leave a copy in free host slots (``promote``, default True). ``persist=True`` keeps the disk
    tier across restarts for caches of one identity (the tensors' geometry and ``fingerprint``;
    ``verify=True`` checks every slot's CRC32C when read): see docs/how-to/persistence.md. ``remote`` (a Redis URL or a ``redis.asyncio``
    client) adds a tier shared by many serving nodes, for caches of one identity (the tensors'
    geometry, ``fingerprint``, ``remote_shard``): :meth:`alookup` counts its hits, ``load()`` reads
    them, and blocks are written to it in the background as their stores complete
    (``remote_write="through"``), as they are evicted (``"evict"``), or never (``"none"``); see docs/how-to/remote.md.
    ``remote_secret`` (authenticated remote values and persistent slots), ``namespace`` (the tenant,
    part of the cache identity) and ``encryption_key`` (AES-256-GCM of disk slots and remote values)
    are described in docs/security.md; ``start()`` raises :class:`StartError` when the remote
    refuses this offloader for good (a wrong password, a missing ACL permission, no such database, a
    TLS failure, an unknown host). Every memory taken is listed in
    docs/how-to/sizing.md; ``start()`` refuses sizes that cannot fit before allocating.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        host_blocks: int | None = Options.host_blocks,
        host_bytes: int | str | None = Options.host_bytes,
        num_blocks: int | None = None,
        disk_path: str | os.PathLike[str] | None = Options.disk_path,
        disk_blocks: int | None = Options.disk_blocks,
        disk_bytes: int | str | None = Options.disk_bytes,
        chunk_bytes: int = Options.chunk_bytes,
        bounce_bytes: int | str | None = Options.bounce_bytes,
        gather_ctas: int = Options.gather_ctas,
        copy_engine: Literal["kernel", "dma"] = Options.copy_engine,
        use_batch_copy: bool = Options.use_batch_copy,
        io_threads: int = Options.io_threads,
        use_page_cache: bool = Options.use_page_cache,
        expedited_loads: bool = Options.expedited_loads,
        promote: bool = Options.promote,
        persist: bool = Options.persist,
        fingerprint: str | bytes | None = Options.fingerprint,
        verify: bool = Options.verify,
        remote: str | Any = Options.remote,
        remote_shard: str = Options.remote_shard,
        remote_write: Literal["through", "evict", "none"] = Options.remote_write,
        remote_secret: bytes | str | Sequence[bytes | str] | None = Options.remote_secret,
        namespace: str = Options.namespace,
        encryption_key: bytes | str | None = Options.encryption_key,
    ) -> None:
        self._layout = BlockLayout.of(kv_caches, num_blocks)
        self._cuda = self._layout.is_cuda
        self._caches = dict(kv_caches)
        self._options = Options(
            host_blocks=host_blocks, host_bytes=host_bytes,  # type: ignore[arg-type]  # Options parses sizes to int
            disk_path=disk_path,  # type: ignore[arg-type]  # Options normalizes to str
            disk_blocks=disk_blocks, disk_bytes=disk_bytes,  # type: ignore[arg-type]  # Options parses sizes to int
            chunk_bytes=chunk_bytes, bounce_bytes=bounce_bytes,  # type: ignore[arg-type]  # Options parses sizes to int
            gather_ctas=gather_ctas, copy_engine=copy_engine, use_batch_copy=use_batch_copy, io_threads=io_threads, use_page_cache=use_page_cache,
            expedited_loads=expedited_loads, promote=promote, persist=persist, fingerprint=fingerprint, verify=verify,
            remote=remote, remote_shard=remote_shard, remote_write=remote_write,
            remote_secret=remote_secret, namespace=namespace, encryption_key=encryption_key,
        )
        if isinstance(self._options.remote, str):  # now, not at start(): before any disk file is made
            from .tiers.remote.redis_store import check_url  # redis-py is optional: imported only for a remote tier

            check_url(self._options.remote)
        self._slots: TierSlots = self._options.tier_slots(self._layout.slot_bytes)
        if self._options.host_blocks is None and self._options.host_bytes is None:
            log.info(
                "kvoffload: %s: %d host slots of %s (%s); give host_bytes or host_blocks to size the host tier",
                self._slots.host_given, self._slots.host, format_size(self._layout.slot_bytes),
                format_size(self._slots.host * self._layout.slot_bytes),
            )
        self._lock = threading.Lock()
        """Guards the lifecycle state below; held briefly, never across caller code or a copy."""
        self._calls_ended = threading.Condition(self._lock)
        self._calls: dict[object, int] = {}
        """The store()/load() calls running now (a token each) and their threads' idents: close() waits for them."""
        self._runtime: Runtime | None = None
        self._closed = False
        self._counters = TransferCounters()
        self._tier_counts_closed = TierCounts()
        """The tiers' counters as they closed: ``stats()`` never counts less after close."""
        self._remote_counts_closed = RemoteCounts()
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pid = os.getpid()
        self._generation = PROCESS.generation

    # -- lifecycle ----------------------------------------------------------------

    @property
    def options(self) -> Options:
        """The options this offloader was made with."""
        return self._options

    @property
    def layout(self) -> BlockLayout:
        """Block geometry: block count, bytes per block, slot size, device."""
        return self._layout

    def start(self) -> Offloader:
        """Allocate the host slab (and the disk file), start the worker threads; returns self. Idempotent.

        May be called from any thread; it blocks while memory is allocated and pinned (seconds
        for a large slab), so on an event loop use ``async with``. Raises :class:`StartError`
        (the original error as ``__cause__``) when setup fails, and then nothing stays
        allocated; :class:`ClosedError` after :meth:`close` or in a forked child.
        """
        self._check_process()
        with self._lock:
            if self._closed:
                raise ClosedError("the offloader was closed; create a new one")
            if self._runtime is None:
                try:
                    rt = Runtime(self._layout, self._caches, self._options, self._slots, self._counters)
                except (StartError, TypeError, ValueError):
                    raise
                except Exception as e:
                    raise StartError(f"could not start the offloader: {type(e).__name__}: {e}") from e
                self._runtime = rt
                self._finalizer = weakref.finalize(self, finalize_runtime, rt)
                self._finalizer.atexit = False  # the exit handler closes every live runtime
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel in-flight transfers, wait for their queued copies, join the threads, free memory, remove the disk file.

        Transfers still running end cancelled (their waiters get :class:`TransferCancelled`),
        having published none of their unfinished keys. ``timeout`` bounds the whole close, in
        seconds (None: no limit); a ``store()`` or ``load()`` call running in another thread is
        waited for within it. May be called from any thread: where it cannot wait for what it
        closes (on one of the offloader's own threads, in a done callback, say, or inside a
        ``store()``/``load()`` call of this thread, from a signal handler) it hands the shutdown
        to a thread named ``kvoffload-close`` and returns at once. Idempotent. Raises
        :class:`CloseError` if a thread or call does not end within ``timeout``; memory and the
        disk file are then kept, and a later ``close()`` finishes the job. ``TypeError`` /
        ``ValueError`` for a ``timeout`` that is not a number >= 0 or None, before anything is done.
        In a forked child it only drops the offloader's references: the parent's memory and file
        are left alone.
        """
        timeout = check_timeout(timeout)
        if self._generation != PROCESS.generation:  # a forked child: nothing here is ours to release
            self._closed = True
            self._runtime = None
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        deadline = Deadline(timeout)
        if not self._lock.acquire(timeout=deadline.lock_timeout()):  # held only briefly, or by a starting offloader
            raise CloseError(f"the offloader was busy starting for more than {timeout} s; call close() again")
        try:
            self._closed = True
            rt = self._runtime
            if rt is None:
                return
            if threading.get_ident() in self._calls.values():  # our own store()/load() call is below us
                HelperThread(target=self._close_logged, args=(timeout,), name="kvoffload-close").start()
                return
            if not self._calls_ended.wait_for(lambda: not self._calls, deadline.left()):
                raise CloseError(
                    f"a store() or load() call in another thread did not return within {timeout} s; call close() again"
                )
        finally:
            self._lock.release()
        rt.close(deadline.left())
        if rt.closed:
            with self._lock:
                if self._runtime is rt:
                    if rt.final_counts is not None:
                        self._tier_counts_closed = rt.final_counts
                    self._remote_counts_closed = rt.remote_counts_closed
                    self._runtime = None
            if self._finalizer is not None:
                self._finalizer.detach()

    def _close_logged(self, timeout: float | None) -> None:
        try:
            self.close(timeout)
        except Exception:
            log.exception("kvoffload: closing the offloader failed; call close() again to finish")

    async def aclose(self, timeout: float | None = 30.0) -> None:
        """:meth:`close` on a thread of its own (``kvoffload-close``): the event loop keeps running.

        Shielded: if the awaiting task is cancelled, the close still completes, then the
        task's cancellation is raised. Raises :class:`CloseError` as ``close()`` does.
        Works under asyncio, trio and anyio.
        """
        timeout = check_timeout(timeout)
        if self._closed and self._runtime is None:
            return
        closed, cancelled = await run_off_loop(lambda: self.close(timeout), "kvoffload-close")
        if cancelled is not None:
            if closed.exception() is not None:
                log.warning("kvoffload: aclose() was cancelled and the close failed: %s", closed.exception())
            raise cancelled
        closed.result()

    @property
    def disk_file(self) -> str | None:
        """The path of the persistent disk tier's file (``persist=True``; with a directory as
        ``disk_path``, the file in it for this cache identity), once started; else None (a disk
        file without persistence has no name)."""
        runtime = self._runtime
        storage = runtime.storage if runtime is not None else None
        disk = storage.disk if storage is not None else None
        return disk.file.path if disk is not None and disk.persistent is not None else None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Offloader:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Offloader:
        """:meth:`start` on a thread of its own (``kvoffload-start``): the event loop keeps running.

        If the awaiting task is cancelled meanwhile, waits for ``start()`` to end,
        closes the offloader, then raises the task's cancellation: nothing stays allocated.
        Works under asyncio, trio and anyio.
        """
        started, cancelled = await run_off_loop(self.start, "kvoffload-start")
        if cancelled is not None:
            closed, _ = await run_off_loop(self.close, "kvoffload-close")
            if closed.exception() is not None:
                log.warning("kvoffload: closing after a cancelled start failed: %s", closed.exception())
            raise cancelled
        return started.result()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_process(self) -> None:
        if self._generation != PROCESS.generation:
            raise ClosedError(
                f"this offloader belongs to process {self._pid}; create a new one in the child (process {os.getpid()})"
            )

    def _running_runtime(self) -> Runtime:
        self._check_process()
        rt = self._runtime
        if self._closed or rt is None or rt.storage is None:
            raise ClosedError("the offloader is closed" if self._closed else "the offloader is not started: use 'async with', 'with' or start()")
        return rt

    def _running_storage(self) -> TieredStorage:
        storage = self._running_runtime().storage
        if storage is None:
            raise ClosedError("the offloader is closed")
        return storage

    def _call_started(self, token: object) -> TieredStorage:
        """The running storage, for one ``store()``/``load()`` call, counted under ``token``: close()
        waits until the call has returned (the lock is held only to count it, never across its work).
        The caller's ``finally``, which covers this call too, uncounts it with
        ``self._calls.pop(token, None)`` (one C call: an interrupt cannot land between the call's end
        and the uncounting), then :meth:`_wake_close` if it was the last and close() has begun (it sets
        ``_closed`` under the lock before it looks at the count)."""
        if self._generation != PROCESS.generation:
            self._check_process()
        with self._lock:
            rt = self._runtime
            storage = rt.storage if rt is not None and not self._closed else None
            if storage is None:
                storage = self._running_storage()  # raises: closed, or not started
            self._calls[token] = threading.get_ident()
        return storage

    def _wake_close(self) -> None:
        """The last call in progress has returned: wake a close() waiting for it."""
        with self._lock:
            self._calls_ended.notify_all()

    # -- transfers ----------------------------------------------------------------

    def store(self, blocks: Mapping[Hashable, int], *, after: torch.cuda.Event | None = None) -> Transfer:
        """Copy cache blocks into the host tier under their keys; returns a running :class:`Transfer`.

        ``blocks`` maps key -> cache block id. Keys already stored (or being
        stored) are skipped and reported in ``TransferResult.skipped``. For a
        GPU cache the copy waits for the work queued so far on the caller's
        current stream (or for ``after``, a ``torch.cuda.Event``). Raises
        ``TypeError``/``ValueError`` on bad arguments (a key of another type than the
        class docstring lists, say) and :class:`CapacityError` when no room can be made;
        then nothing is queued.
        """
        checked = check_block_mapping(blocks, self._layout.num_blocks, unique_ids=False, call="store()")
        if after is not None:
            self._check_after(after)
        token = object()
        try:
            return self._call_started(token).store(checked, after)
        finally:
            if self._calls.pop(token, None) is not None and not self._calls and self._closed:
                self._wake_close()

    def load(
        self, blocks: Mapping[Hashable, int], *, after: torch.cuda.Event | None = None, per_tensor: bool = False,
        expedited: bool = False, lease: Lease | None = None,
    ) -> Transfer:
        """Copy stored blocks into cache blocks; returns a running :class:`Transfer`.

        ``blocks`` maps key -> destination cache block id (distinct ids). For a
        GPU cache the copy does not write the blocks before the work queued so
        far on the caller's current stream (or ``after``) has completed.
        ``per_tensor=True`` copies tensor by tensor in ``kv_caches`` order and reports
        each one (``Transfer.wait_tensor``, ``Transfer.stream_wait``), so a model can run
        layer ``i`` while later layers load (GPU caches with every key in host memory;
        elsewhere each tensor is ready with the whole load). ``expedited=True`` (every key
        in host memory, and the offloader made with ``expedited_loads=True``) runs the load on
        a worker and streams of its own, at a higher priority, so a small load the caller waits
        for does not queue behind bulk loads; otherwise it runs as any load. ``lease`` (from
        ``lookup(keys, hold=True)``): the load reads the copies the lease holds (even of keys
        discarded since) and releases the lease's other keys; keys it does not hold (or no longer:
        released or expired) are pinned as usual. Raises :class:`MissingKeysError` if a key is not
        stored, ``TypeError`` / ``ValueError`` on bad arguments; then nothing is queued and the
        lease is kept.
        """
        checked = check_block_mapping(blocks, self._layout.num_blocks, unique_ids=True, call="load()")
        if after is not None:
            self._check_after(after)
        if lease is not None and not isinstance(lease, Lease):
            raise TypeError(f"lease must be a kvoffload.Lease from lookup(keys, hold=True), got {type(lease).__name__}")
        token = object()
        try:
            storage = self._call_started(token)
            if lease is None:
                return storage.load(checked, after, per_tensor, expedited)
            if lease._index is not storage.index:
                raise ValueError("the lease is from another offloader")
            transfer = storage.load(checked, after, per_tensor, expedited, lease._taking(checked))
        finally:
            if self._calls.pop(token, None) is not None and not self._calls and self._closed:
                self._wake_close()
        lease.release()  # its keys not loaded
        return transfer

    def _check_after(self, after: object) -> None:
        if after is None:
            return
        if not self._cuda:
            raise ValueError("after= is only meaningful for CUDA caches")
        if not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be a torch.cuda.Event, got {type(after).__name__}")

    # -- index ----------------------------------------------------------------------

    @overload
    def lookup(self, keys: Iterable[Hashable], *, hold: Literal[False] = False, hold_s: float = 30.0) -> int: ...

    @overload
    def lookup(self, keys: Iterable[Hashable], *, hold: Literal[True], hold_s: float = 30.0) -> Lease: ...

    def lookup(self, keys: Iterable[Hashable], *, hold: bool = False, hold_s: float = 30.0) -> int | Lease:
        """How many leading ``keys`` are stored, in either tier (a prefix-cache hit length). A lookup
        is a use: the hits become the most recently used, the last evicted.

        ``hold=True`` returns a :class:`Lease` on those hits instead (``.count`` is the hit length):
        they stay, neither evicted nor spilled, until a ``load(..., lease=lease)`` takes them, the
        lease is released, or ``hold_s`` seconds have passed (``inf``: no deadline). ``TypeError`` for a key
        of another type than the class docstring lists, and for a ``str``, ``bytes``,
        ``bytearray`` or ``memoryview``: one key, not an iterable of keys (``lookup([key])``);
        ``ValueError`` for a ``hold_s`` that is not a number >= 0 (NaN, negative)."""
        keys = key_list("lookup()", keys)
        index = self._running_storage().index
        if not hold:
            hits = index.lookup(keys)
            self._counters.looked_up(hits)
            return hits
        hold_s = check_seconds("hold_s", hold_s, infinite=True)
        lease = Lease(index)  # first: an interrupt in hold() leaves pins that the lease gives back
        try:
            lease.count = index.hold(keys, lease._pins, hold_s)
        finally:  # also after an interrupt: a hold it took expires at its deadline
            self._follow_holds()
        lease.keys = tuple(keys[: lease.count])
        self._counters.looked_up(lease.count)
        return lease

    async def alookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading ``keys`` are stored here or on the remote store (``remote=``): the local
        leading hits (as :meth:`lookup`), then one round trip to the remote for the keys after them
        (a key found missing there is not asked again for a second). ``load()`` may then name the
        remote hits: they are read into host slots, copied to the cache and kept as host entries.
        A remote that cannot be reached counts as holding nothing (``stats().remote_unavailable``).
        Without a remote tier it is :meth:`lookup`. ``TypeError`` / ``ValueError`` for a key that
        is not ``bytes``, ``str`` or ``int`` (or too long) when there is a remote tier; ``TypeError``
        for a ``str`` or ``bytes`` given as the keys, as :meth:`lookup`."""
        keys = key_list("alookup()", keys)
        rt = self._running_runtime()
        remote = rt.remote
        encoded = [encode_key(k) for k in keys] if remote is not None else []  # before anything: the call's errors
        index = self._running_storage().index
        local = index.lookup(keys)
        hits = local
        if remote is not None and local < len(keys):
            hits += await remote.lookup(keys[local:], encoded[local:])
        self._counters.looked_up(hits)
        return hits

    def _follow_holds(self) -> None:
        """After a hold: a worker gives it back at its deadline, whether or not anything calls us."""
        rt = self._runtime
        if rt is not None and rt.hold_expiry is not None:
            rt.hold_expiry.follow()

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is stored (a load may name it now). ``TypeError`` for a key that is not
        native, as every call that takes keys."""
        check_key("'in'", key)
        self._check_process()
        rt = self._runtime
        storage = rt.storage if rt is not None and not self._closed else None
        return storage is not None and key in storage.index

    def keys(self) -> list[Hashable]:
        """Every stored key a load may name now, least recently used first: those on disk, then those in
        host memory. With ``persist=True`` it lists, from ``start()`` on, the keys found again in the
        disk file (how a restarted server rebuilds its own index). A snapshot: a store or discard
        running meanwhile may or may not be in it."""
        return self._running_storage().index.ready_keys()

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget stored keys; returns how many were present. Running loads of them finish normally.

        ``TypeError`` for a key of another type than the class docstring lists, and for a ``str``,
        ``bytes``, ``bytearray`` or ``memoryview``, as :meth:`lookup`."""
        keys = key_list("discard()", keys)
        return self._running_storage().discard(keys)

    def stats(self) -> OffloaderStats:
        """A snapshot of slot use and transfer counters. Counters never go down, also across ``close()``."""
        self._check_process()
        rt = self._runtime
        tiers = self._tier_counts_closed if rt is None else rt.tier_counts()
        ix, io, persistent = tiers.index, tiers.disk_io, tiers.persistent
        gpu_staging_bytes = rt.footprint.gpu_staging if rt is not None and rt.storage is not None else 0
        remote = self._remote_counts_closed if rt is None else rt.remote.counts() if rt.remote is not None else rt.remote_counts_closed
        k = self._counters
        with k.lock:
            k.fold()
            ends = k.totals
            return OffloaderStats(
                host_slots=self._slots.host,
                host_free=ix.host_free,
                disk_slots=self._slots.disk,
                disk_free=ix.disk_free,
                ready=ix.host_ready + ix.disk_ready,
                host_ready=ix.host_ready,
                disk_ready=ix.disk_ready,
                pending=ix.pending,
                pinned=ix.pinned,
                spilling=ix.spilling,
                evicted=ix.evicted_host + ix.evicted_disk,
                spilled=ix.spilled,
                in_flight=k.in_flight,
                stores=ends.stores,
                loads=ends.loads,
                failed=ends.failed,
                cancelled=ends.cancelled,
                bytes_stored=ends.bytes_stored,
                bytes_loaded=ends.bytes_loaded,
                lookups=k.lookups,
                lookup_hits=k.lookup_hits,
                keys_loaded_from_host=ends.keys_loaded_from_host,
                keys_loaded_from_disk=ends.keys_loaded_from_disk,
                evicted_host=ix.evicted_host,
                evicted_disk=ix.evicted_disk,
                disk_bytes_written=io.bytes_written,
                disk_bytes_read=io.bytes_read,
                disk_io_errors=io.errors,
                bytes_stored_partially=ends.bytes_stored_partially,
                host_pending=ix.host_pending,
                disk_pending=ix.disk_pending,
                promoted=ix.promoted,
                disk_clean=ix.disk_clean,
                recovered=persistent.recovered,
                dropped_at_open=persistent.dropped_at_open,
                checksum_failures=persistent.checksum_failures,
                gpu_staging_bytes=gpu_staging_bytes,
                remote_lookup_hits=remote.lookup_hits,
                remote_hits=remote.hits,
                remote_misses=remote.misses,
                remote_bad_values=remote.bad_values,
                remote_unavailable=remote.unavailable,
                remote_writes=remote.writes,
                remote_write_failures=remote.write_failures,
                remote_writes_dropped=remote.writes_dropped,
                remote_writes_pending=remote.writes_pending,
                latency=k.latency(),
            )
