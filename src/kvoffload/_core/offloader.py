"""The :class:`Offloader` facade: validation, lifecycle, and handing transfers to the lanes."""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .cuda.events import make_bridge
from .errors import ClosedError, OffloadError, TransferError
from .lane import CopyCalls, Lane
from .layout import BlockLayout, check_block_mapping
from .loops import LoopThread
from .movers import make_mover
from .options import Options
from .tiers.storage import Storage
from .transfer import Transfer, TransferResult

__all__ = ["Offloader", "OffloaderStats"]


@dataclass(frozen=True)
class OffloaderStats:
    """A snapshot of the offloader's state (``Offloader.stats()``)."""

    host_slots: int
    host_free: int
    """Host slots neither holding an entry nor reserved by a running store."""
    disk_slots: int
    disk_free: int
    ready: int
    """Stored keys visible to ``lookup`` (both tiers)."""
    host_ready: int
    disk_ready: int
    pending: int
    """Keys being written by running stores (not visible)."""
    pinned: int
    """Stored keys in use by running loads (never evicted)."""
    spilling: int
    """Host entries being written to disk to make room (still visible)."""
    evicted: int
    """Entries dropped to make room, since start."""
    spilled: int
    """Entries moved from host memory to disk, since start."""
    in_flight: int
    """Transfers started and not yet finished."""
    stores: int
    loads: int
    failed: int
    cancelled: int
    bytes_stored: int
    bytes_loaded: int


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.stores = self.loads = self.failed = self.cancelled = 0
        self.bytes_stored = self.bytes_loaded = 0

    def started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def ended(self, t: Transfer) -> None:
        with self.lock:
            self.in_flight -= 1
            if t.cancelled():
                self.cancelled += 1
            elif t.exception() is not None:
                self.failed += 1
            else:
                r = t.result()
                if r.kind == "store":
                    self.stores += 1
                    self.bytes_stored += r.nbytes
                else:
                    self.loads += 1
                    self.bytes_loaded += r.nbytes


class _Runtime:
    """Everything ``start()`` creates; closed by ``close()`` or when the offloader is collected."""

    def __init__(self, layout: BlockLayout, caches: dict[str, torch.Tensor], opts: Options) -> None:
        self.layout = layout
        self.storage: Storage | None = None
        self.lanes: list[Lane] = []
        self.copy_calls = CopyCalls()
        try:
            self.storage = Storage(
                layout, opts.host_blocks, opts.disk_path, opts.disk_blocks,
                chunk_blocks=max(1, opts.chunk_bytes // layout.slot_bytes),
                io_threads=opts.io_threads, use_page_cache=opts.use_page_cache,
            )
            for name in ("store", "load"):
                thread = LoopThread(f"kvoffload-{name}", on_thread_start=_init_worker_thread(layout.device))
                try:
                    mover = make_mover(layout, caches, chunk_bytes=opts.chunk_bytes, use_batch_copy=opts.use_batch_copy)
                    bridge = make_bridge(opts.completion, thread.loop, f"kvoffload-{name}-events") if layout.is_cuda else None
                except BaseException:
                    thread.stop(5.0)
                    raise
                self.lanes.append(Lane(thread, mover, bridge, self.copy_calls))
        except BaseException:
            self.close(timeout=5.0)
            raise

    def close(self, timeout: float) -> None:
        stuck = [lane.thread.name for lane in self.lanes if not lane.thread.stop(timeout)]
        if stuck:  # never free memory a live thread may still copy into
            raise OffloadError(f"worker thread(s) {stuck} did not stop within {timeout} s; memory left allocated")
        for lane in self.lanes:
            if lane.bridge is not None:
                lane.bridge.close()
            lane.mover.close()
        self.lanes = []
        if self.storage is not None:
            ok = self.storage.close(timeout)
            self.storage = None
            if not ok:
                raise OffloadError(f"disk IO thread did not stop within {timeout} s; its fd was left open")


def _init_worker_thread(device: torch.device) -> Any:
    def init() -> None:
        # Copies here are memory bound; an OpenMP team per worker thread only
        # contends with the caller's (measured on 2 cores: 64 KiB slice copies
        # 6x slower with the default team). The setting is per thread.
        torch.set_num_threads(1)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    return init


class Offloader:
    """Offload KV-cache blocks to pinned host memory and load them back, asynchronously.

    ``kv_caches`` maps names to tensors whose dim 0 indexes blocks; all have the
    same number of blocks and live on one device (``cuda`` or ``cpu``). A block's
    bytes across all tensors go into one slot of ``host_blocks`` host slots.

    Use it as ``async with`` / ``with`` context manager, or call :meth:`start`
    and :meth:`close`. ``store`` and ``load`` validate their arguments at once
    and return a running :class:`Transfer`.

    Keyword options: ``chunk_bytes`` (bytes per copy chunk, the unit of
    pipelining and of cancellation; a GPU cache gets two staging buffers of
    this size per direction, 512 MiB of GPU memory in all at the default
    of 128 MiB; smaller chunks save GPU memory and cost throughput when
    stores and loads run at once), ``completion`` (how CUDA
    completion reaches the worker loops: ``"poll"``, the default, or
    ``"thread"``; see docs/design.md for the measurements), ``use_batch_copy``
    (False forces one ``cuMemcpyAsync`` per copy instead of ``cuMemcpyBatchAsync``),
    ``io_threads`` (disk IO threads, default 4) and ``use_page_cache`` (buffered
    disk IO instead of O_DIRECT). ``disk_path`` and ``disk_blocks`` add the disk
    tier: see the README's section on it.
    """

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        host_blocks: int = 4096,
        disk_path: str | os.PathLike[str] | None = None,
        disk_blocks: int = 0,
        chunk_bytes: int = 128 << 20,
        completion: Literal["poll", "thread"] = "poll",
        use_batch_copy: bool = True,
        io_threads: int = 4,
        use_page_cache: bool = False,
    ) -> None:
        self._layout = BlockLayout.of(kv_caches)
        self._cuda = self._layout.is_cuda
        self._caches = dict(kv_caches)
        self._options = Options(
            host_blocks=host_blocks, disk_path=disk_path,  # type: ignore[arg-type]  # Options normalizes to str
            disk_blocks=disk_blocks, chunk_bytes=chunk_bytes, completion=completion,
            use_batch_copy=use_batch_copy, io_threads=io_threads, use_page_cache=use_page_cache,
        )
        self._lock = threading.Lock()
        self._runtime: _Runtime | None = None
        self._closed = False
        self._counters = _Counters()
        self._finalizer: weakref.finalize | None = None

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
        """Allocate the host slab, start the worker loops; returns self. Idempotent."""
        with self._lock:
            if self._closed:
                raise ClosedError("the offloader was closed; create a new one")
            if self._runtime is None:
                self._runtime = _Runtime(self._layout, self._caches, self._options)
                self._finalizer = weakref.finalize(self, self._runtime.close, 5.0)
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Cancel in-flight transfers, wait for their queued copies, join the threads, free memory.

        Transfers still running end cancelled (their waiters get
        ``CancelledError``), having published none of their unfinished keys.
        Idempotent. Raises :class:`OffloadError` if a worker thread does not
        stop within ``timeout`` seconds (its memory is then left allocated).
        """
        with self._lock:
            self._closed = True
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            assert self._finalizer is not None
            self._finalizer.detach()
            runtime.close(timeout)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> Offloader:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Offloader:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def _running_runtime(self) -> _Runtime:
        rt = self._runtime
        if rt is None or rt.storage is None:
            raise ClosedError("the offloader is closed" if self._closed else "the offloader is not started: use 'async with', 'with' or start()")
        return rt

    def _running_storage(self) -> Storage:
        storage = self._running_runtime().storage
        assert storage is not None
        return storage

    def _lane(self, i: int) -> Lane:
        assert self._runtime is not None
        return self._runtime.lanes[i]

    # -- transfers ----------------------------------------------------------------

    def store(self, blocks: Mapping[Hashable, int], *, after: Any = None) -> Transfer:
        """Copy cache blocks into the host tier under their keys; returns a running :class:`Transfer`.

        ``blocks`` maps key -> cache block id. Keys already stored (or being
        stored) are skipped and reported in ``TransferResult.skipped``. For a
        GPU cache the copy waits for the work queued so far on the caller's
        current stream (or for ``after``, a ``torch.cuda.Event``). Raises
        ``TypeError``/``ValueError`` on bad arguments and :class:`CapacityError`
        when no room can be made; then nothing is queued.
        """
        checked = check_block_mapping(blocks, self._layout.num_blocks, unique_ids=False)
        self._check_after(after)
        with self._lock:
            storage = self._running_storage()
            plan = storage.plan_store(checked)
            if not plan.reservation.entries:
                t = Transfer("store")
                t._finish(result=TransferResult("store", (), tuple(plan.reservation.skipped), 0, 0.0))
                return t
            return self._launch(
                self._lane(0), "store", lambda lane, ev: storage.run_store(lane, plan, ev), lambda: storage.end_store(plan), after
            )

    def load(self, blocks: Mapping[Hashable, int], *, after: Any = None) -> Transfer:
        """Copy stored blocks into cache blocks; returns a running :class:`Transfer`.

        ``blocks`` maps key -> destination cache block id (distinct ids). For a
        GPU cache the copy does not write the blocks before the work queued so
        far on the caller's current stream (or ``after``) has completed. Raises
        :class:`MissingKeysError` if a key is not stored, ``TypeError`` /
        ``ValueError`` on bad arguments; then nothing is queued.
        """
        checked = check_block_mapping(blocks, self._layout.num_blocks, unique_ids=True)
        self._check_after(after)
        with self._lock:
            storage = self._running_storage()
            if not checked:
                t = Transfer("load")
                t._finish(result=TransferResult("load", (), (), 0, 0.0))
                return t
            plan = storage.plan_load(checked)
            return self._launch(
                self._lane(1), "load", lambda lane, ev: storage.run_load(lane, plan, ev), lambda: storage.end_load(plan), after
            )

    def _check_after(self, after: Any) -> None:
        if after is None:
            return
        if not self._cuda:
            raise ValueError("after= is only meaningful for CUDA caches")
        if not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be a torch.cuda.Event, got {type(after).__name__}")

    def _launch(self, lane: Lane, kind: Literal["store", "load"], run: Any, cleanup: Any, after: Any) -> Transfer:
        """Record the ordering event and start the worker task (called under the lock)."""
        if self._cuda and after is None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._layout.device))
        transfer = Transfer(kind)
        self._counters.started()
        transfer.add_done_callback(self._counters.ended)

        async def guarded() -> TransferResult:
            try:
                return await run(lane, after)
            except (asyncio.CancelledError, OffloadError):
                raise
            except Exception as e:
                raise TransferError(f"{kind} failed: {e}") from e

        lane.thread.start_transfer(transfer, guarded, cleanup)
        return transfer

    # -- index ----------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading ``keys`` are stored, in either tier (a prefix-cache hit length)."""
        return self._running_storage().index.lookup(keys)

    def __contains__(self, key: Hashable) -> bool:
        rt = self._runtime
        return rt is not None and rt.storage is not None and key in rt.storage.index

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget stored keys; returns how many were present. Running loads of them finish normally."""
        return self._running_storage().index.discard(keys)

    def stats(self) -> OffloaderStats:
        """A snapshot of slot use and transfer counters."""
        rt = self._runtime
        c = rt.storage.index.counts() if rt is not None and rt.storage is not None else {}
        k = self._counters
        with k.lock:
            return OffloaderStats(
                host_slots=self._options.host_blocks,
                host_free=c.get("host_free", 0),
                disk_slots=self._options.disk_blocks,
                disk_free=c.get("disk_free", 0),
                ready=c.get("host_ready", 0) + c.get("disk_ready", 0),
                host_ready=c.get("host_ready", 0),
                disk_ready=c.get("disk_ready", 0),
                pending=c.get("pending", 0),
                pinned=c.get("pinned", 0),
                spilling=c.get("spilling", 0),
                evicted=c.get("evicted", 0),
                spilled=c.get("spilled", 0),
                in_flight=k.in_flight,
                stores=k.stores,
                loads=k.loads,
                failed=k.failed,
                cancelled=k.cancelled,
                bytes_stored=k.bytes_stored,
                bytes_loaded=k.bytes_loaded,
            )

