"""The :class:`Offloader` facade: validation, lifecycle, and handing transfers to the lanes."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from .cuda.events import make_bridge
from .errors import ClosedError, CloseError, OffloadError, StartError, TransferError
from .lane import CopyCalls, Lane
from .layout import BlockLayout, check_block_mapping
from .loops import LoopThread
from .movers import make_mover
from .options import Options
from .tiers.disk import DiskTier
from .tiers.storage import Storage
from .transfer import Transfer, TransferResult

__all__ = ["Offloader", "OffloaderStats"]

log = logging.getLogger("kvoffload")

T = TypeVar("T")


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

    def ended(self, t: Transfer, result: TransferResult | None, exc: BaseException | None, cancelled: bool) -> None:
        """Count a transfer's end; runs before the transfer is finished (``LoopThread.start_transfer``'s
        ``on_end``), so a waiter that wakes already sees it counted."""
        with self.lock:
            self.in_flight -= 1
            if cancelled:
                self.cancelled += 1
            elif exc is not None or result is None:
                self.failed += 1
            elif result.kind == "store":
                self.stores += 1
                self.bytes_stored += result.nbytes
            else:
                self.loads += 1
                self.bytes_loaded += result.nbytes


# -- process-wide bookkeeping -----------------------------------------------------------
#
# _live holds every runtime of this process not yet fully closed, by strong reference: a runtime
# whose close() failed (a stuck thread) stays here, so that the exit handler can finish it, or at
# least remove its disk file (it holds user prompts). A forked child inherits copies of the
# parent's runtimes; they move to _inherited, are never closed nor collected there (their file,
# pinning and threads are the parent's), and every offloader made before the fork refuses use.

_EXIT_TIMEOUT_S = 5.0
_live: set[_Runtime] = set()
_live_lock = threading.Lock()
_inherited: list[_Runtime] = []
_generation = 0
"""Bumped in every forked child: objects made under another generation belong to an ancestor process."""


def _after_fork_in_child() -> None:
    global _generation, _live_lock
    _generation += 1
    _live_lock = threading.Lock()  # another thread may have held it at fork time
    for rt in _live:
        rt.inherit()
    _inherited.extend(_live)
    _live.clear()


def _close_all_at_exit() -> None:
    with _live_lock:
        runtimes = list(_live)
    for rt in runtimes:
        try:
            rt.close(_EXIT_TIMEOUT_S)
        except Exception as e:  # a thread is stuck: at least the user's data must not outlive us
            log.warning("kvoffload: closing an offloader at exit failed (%s); removing its disk file", e)
            rt.remove_disk_file()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


class _HelperThread(threading.Thread):
    """A short-lived thread of ours that may block on a close: aclose(), __aenter__, a handed-off close."""


def _on_worker_thread() -> bool:
    """True on a thread of kvoffload's that must never wait for a close: a worker loop (done
    callbacks run there), a completion bridge or a disk IO thread (garbage collection may run there)."""
    t = threading.current_thread()
    return t.name.startswith("kvoffload") and not isinstance(t, _HelperThread)


def _run_in_thread(fn: Callable[[], T], name: str) -> tuple[concurrent.futures.Future[T], threading.Thread]:
    """Run ``fn()`` on a new non-daemon thread named ``name`` (interpreter exit waits for it)."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn()
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)

    thread = _HelperThread(target=run, name=name)
    thread.start()
    return fut, thread


async def _off_loop(fn: Callable[[], T], name: str) -> tuple[asyncio.Future[T], asyncio.CancelledError | None]:
    """Run ``fn()`` on a thread named ``name`` and wait for it to end, even if the awaiting task is
    cancelled meanwhile. Returns the finished future and the ``CancelledError`` held back (to be
    raised by the caller), or None. The thread has ended when this returns."""
    thread_fut, thread = _run_in_thread(fn, name)
    fut = asyncio.wrap_future(thread_fut)
    held: asyncio.CancelledError | None = None
    while not fut.done():
        try:
            await asyncio.wait([fut])  # unlike await or shield, never cancels fut
        except asyncio.CancelledError as e:
            held = e
    thread.join()  # the result is set just before the thread returns: wait out that instant
    return fut, held


def _check_host_memory(nbytes: int) -> None:
    """Fail at once, not after minutes of paging or an OOM kill, when the slab cannot fit in RAM."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if phys > 0 and nbytes > phys:
        raise MemoryError(f"the host tier needs {nbytes / 2**30:.2f} GiB, more than this machine's {phys / 2**30:.2f} GiB of memory")


class _Runtime:
    """Everything ``start()`` creates; closed by ``close()``, when the offloader is collected, or at exit.

    ``close()`` may be called from any thread, any number of times: on a worker thread it hands the
    shutdown to a ``kvoffload-close`` thread; after a timeout a later call finishes the job.
    """

    def __init__(self, layout: BlockLayout, caches: dict[str, torch.Tensor], opts: Options) -> None:
        self.pid = os.getpid()
        self.generation = _generation
        self.layout = layout
        self.storage: Storage | None = None
        self.lanes: list[Lane] = []
        self.copy_calls = CopyCalls()
        self.closed = False
        """True once everything is released (threads joined, memory freed, file removed)."""
        self.inherited = False
        self._disk_left: DiskTier | None = None  # a disk tier whose IO threads did not stop in time
        self._close_lock = threading.Lock()
        self._closer_lock = threading.Lock()
        self._closer: threading.Thread | None = None
        with _live_lock:
            _live.add(self)
        try:
            _check_host_memory(opts.host_blocks * layout.slot_bytes)
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
            try:
                self._close_now(5.0)
            except BaseException:  # stays in _live: the exit handler tries again
                log.exception("kvoffload: cleaning up after a failed start did not finish")
            raise

    def close(self, timeout: float) -> None:
        """Release everything; from any thread. Raises CloseError if a thread did not stop in time."""
        if self.closed or self.inherited or self.generation != _generation:
            return
        if _on_worker_thread():
            self._close_in_background(timeout)
            return
        if not self._close_lock.acquire(timeout=max(timeout, 0.0)):
            raise CloseError(f"another close() of this offloader did not finish within {timeout} s")
        try:
            if not self.closed:
                self._close_now(timeout)
        finally:
            self._close_lock.release()
        closer = self._closer  # a handed-off close that found the work done: let it end too
        if closer is not None and closer is not threading.current_thread():
            closer.join(timeout)

    def _close_in_background(self, timeout: float) -> None:
        with self._closer_lock:
            if self._closer is not None and self._closer.is_alive():
                return
            self._closer = _HelperThread(target=self._close_logged, args=(timeout,), name="kvoffload-close")
            try:
                self._closer.start()
            except RuntimeError as e:  # interpreter shutting down: the exit handler closes it
                log.warning("kvoffload: could not start a thread to close the offloader (%s)", e)

    def _close_logged(self, timeout: float) -> None:
        try:
            self.close(timeout)
        except Exception:
            log.exception("kvoffload: closing the offloader failed; call close() again to finish")

    def _close_now(self, timeout: float) -> None:
        stuck = [lane.thread.name for lane in self.lanes if not lane.thread.stop(timeout)]
        if stuck:  # never free memory a live thread may still copy into
            raise CloseError(
                f"worker thread(s) {stuck} did not stop within {timeout} s; memory and disk file kept: call close() again"
            )
        for lane in self.lanes:
            if lane.bridge is not None:
                lane.bridge.close()
            lane.mover.close()
        self.lanes = []
        storage, self.storage = self.storage, None
        if storage is not None:
            disk = storage.disk
            if not storage.close(timeout):
                self._disk_left = disk
                raise CloseError(f"disk IO thread did not stop within {timeout} s; disk file kept: call close() again")
        elif self._disk_left is not None:
            if not self._disk_left.close(timeout):
                raise CloseError(f"disk IO thread did not stop within {timeout} s; disk file kept: call close() again")
            self._disk_left = None
        self.closed = True
        with _live_lock:
            _live.discard(self)

    def inherit(self) -> None:
        """In a forked child: this runtime is the parent's. Never close it nor unpin its memory here."""
        self.inherited = True
        buffers = self.storage.host_buffers() if self.storage is not None else []
        buffers += self._disk_left.bounce_buffers() if self._disk_left is not None else []
        for b in buffers:
            b.pinned = False  # HostBuffer.close() would unregister the parent's pinning

    def remove_disk_file(self) -> None:
        """Last resort at exit after a failed close: unlink the disk file if the path is still ours."""
        disk = self.storage.disk if self.storage is not None else self._disk_left
        if disk is None or disk.file.fd < 0:
            return
        try:
            ours, there = os.fstat(disk.file.fd), os.stat(disk.file.path, follow_symlinks=False)
            if (ours.st_dev, ours.st_ino) == (there.st_dev, there.st_ino):
                os.unlink(disk.file.path)
        except OSError:
            pass


def _finalize(rt: _Runtime) -> None:
    """weakref.finalize callback of an unclosed offloader (may run on any thread, a worker's included)."""
    try:
        rt.close(_EXIT_TIMEOUT_S)
    except Exception as e:
        log.warning("kvoffload: closing a collected offloader failed (%s); it is retried at exit", e)


def _init_worker_thread(device: torch.device) -> Callable[[], None]:
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
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pid = os.getpid()
        self._generation = _generation

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
                    rt = _Runtime(self._layout, self._caches, self._options)
                except (StartError, TypeError, ValueError):
                    raise
                except Exception as e:
                    raise StartError(f"could not start the offloader: {type(e).__name__}: {e}") from e
                self._runtime = rt
                self._finalizer = weakref.finalize(self, _finalize, rt)
                self._finalizer.atexit = False  # the exit handler closes every live runtime
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Cancel in-flight transfers, wait for their queued copies, join the threads, free memory, remove the disk file.

        Transfers still running end cancelled (their waiters get ``CancelledError``),
        having published none of their unfinished keys. May be called from any thread:
        on one of the offloader's own threads (in a done callback, say) it cannot wait
        for itself, so it hands the shutdown to a thread named ``kvoffload-close`` and
        returns at once. Idempotent. Raises :class:`CloseError` if a thread does not
        stop within ``timeout`` seconds; memory and the disk file are then kept, and a
        later ``close()`` finishes the job. In a forked child it only drops the
        offloader's references: the parent's memory and file are left alone.
        """
        if self._generation != _generation:  # a forked child: nothing here is ours to release
            self._closed = True
            self._runtime = None
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        with self._lock:
            self._closed = True
            rt = self._runtime
        if rt is None:
            return
        rt.close(timeout)
        if rt.closed:
            with self._lock:
                if self._runtime is rt:
                    self._runtime = None
            if self._finalizer is not None:
                self._finalizer.detach()

    async def aclose(self, timeout: float = 30.0) -> None:
        """:meth:`close` on a thread of its own (``kvoffload-close``): the event loop keeps running.

        Shielded: if the awaiting task is cancelled, the close still completes, then
        ``CancelledError`` is raised. Raises :class:`CloseError` as ``close()`` does.
        """
        if self._closed and self._runtime is None:
            return
        fut, held = await _off_loop(lambda: self.close(timeout), "kvoffload-close")
        if held is not None:
            if fut.exception() is not None:
                log.warning("kvoffload: aclose() was cancelled and the close failed: %s", fut.exception())
            raise held
        fut.result()

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
        closes the offloader, then raises ``CancelledError``: nothing stays allocated.
        """
        fut, held = await _off_loop(self.start, "kvoffload-start")
        if held is not None:
            closing, _ = await _off_loop(self.close, "kvoffload-close")
            if closing.exception() is not None:
                log.warning("kvoffload: closing after a cancelled start failed: %s", closing.exception())
            raise held
        return fut.result()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check_process(self) -> None:
        if self._generation != _generation:
            raise ClosedError(
                f"this offloader belongs to process {self._pid}; create a new one in the child (process {os.getpid()})"
            )

    def _running_runtime(self) -> _Runtime:
        self._check_process()
        rt = self._runtime
        if self._closed or rt is None or rt.storage is None:
            raise ClosedError("the offloader is closed" if self._closed else "the offloader is not started: use 'async with', 'with' or start()")
        return rt

    def _running_storage(self) -> Storage:
        storage = self._running_runtime().storage
        if storage is None:
            raise ClosedError("the offloader is closed")
        return storage

    def _lane(self, i: int) -> Lane:
        assert self._runtime is not None
        return self._runtime.lanes[i]

    # -- transfers ----------------------------------------------------------------

    def store(self, blocks: Mapping[Hashable, int], *, after: torch.cuda.Event | None = None) -> Transfer:
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
        self._check_process()
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

    def load(self, blocks: Mapping[Hashable, int], *, after: torch.cuda.Event | None = None) -> Transfer:
        """Copy stored blocks into cache blocks; returns a running :class:`Transfer`.

        ``blocks`` maps key -> destination cache block id (distinct ids). For a
        GPU cache the copy does not write the blocks before the work queued so
        far on the caller's current stream (or ``after``) has completed. Raises
        :class:`MissingKeysError` if a key is not stored, ``TypeError`` /
        ``ValueError`` on bad arguments; then nothing is queued.
        """
        checked = check_block_mapping(blocks, self._layout.num_blocks, unique_ids=True)
        self._check_after(after)
        self._check_process()
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

    def _check_after(self, after: object) -> None:
        if after is None:
            return
        if not self._cuda:
            raise ValueError("after= is only meaningful for CUDA caches")
        if not isinstance(after, torch.cuda.Event):
            raise TypeError(f"after must be a torch.cuda.Event, got {type(after).__name__}")

    def _launch(
        self,
        lane: Lane,
        kind: Literal["store", "load"],
        run: Callable[[Lane, torch.cuda.Event | None], Awaitable[TransferResult]],
        cleanup: Callable[[], None],
        after: torch.cuda.Event | None,
    ) -> Transfer:
        """Record the ordering event and start the worker task (called under the lock)."""
        if self._cuda and after is None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._layout.device))
        transfer = Transfer(kind)
        self._counters.started()

        async def guarded() -> TransferResult:
            try:
                return await run(lane, after)
            except (asyncio.CancelledError, OffloadError, GeneratorExit):
                raise
            except BaseException as e:  # SystemExit & co. too: out of a task they would stop the worker loop
                raise TransferError(f"{kind} failed: {e if isinstance(e, Exception) else repr(e)}") from e

        lane.thread.start_transfer(transfer, guarded, cleanup, on_end=self._counters.ended)
        return transfer

    # -- index ----------------------------------------------------------------------

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many leading ``keys`` are stored, in either tier (a prefix-cache hit length)."""
        return self._running_storage().index.lookup(keys)

    def __contains__(self, key: Hashable) -> bool:
        self._check_process()
        rt = self._runtime
        storage = rt.storage if rt is not None and not self._closed else None
        return storage is not None and key in storage.index

    def discard(self, keys: Iterable[Hashable]) -> int:
        """Forget stored keys; returns how many were present. Running loads of them finish normally."""
        return self._running_storage().index.discard(keys)

    def stats(self) -> OffloaderStats:
        """A snapshot of slot use and transfer counters."""
        self._check_process()
        rt = self._runtime
        storage = rt.storage if rt is not None else None
        c = storage.index.counts() if storage is not None else {}
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

