"""What ``start()`` creates (host slab, disk file, worker loops) and how it is released.

A :class:`Runtime` may be closed from any thread, any number of times. Every
runtime of the process that is not yet fully closed is registered here, so that
the exit handler can close it (the disk file holds user prompts and must not
outlive the process), and so that a forked child leaves its parent's alone.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # noqa: F401  registers its exit hook before ours (see _close_all_at_exit)
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base.deadline import Deadline
from .base.errors import CloseError
from .base.helper_threads import PROCESS, HelperThread, on_worker_thread
from .workers.copy_submission import CopyCalls
from .workers.copy_worker import CopyWorker, CopyWorkers
from .base.layout import BlockLayout
from .workers.worker_loop import WorkerLoop
from .workers.copier import make_block_copier
from .base.diskfile import check_free_space, disk_file_path
from .tiers.holds import Holds
from .base.cache_identity import CacheIdentity
from .base.sealing import Sealer
from .base.options import Options, TierSlots, format_size
from .tiers.stats import TierCounts, TransferCounters
from .tiers.disk import DiskTier
from .tiers.remote_tier import RemoteCounts, RemoteTier
from .tiers.tiered_storage import TieredStorage

__all__ = [
    "BOOKKEEPING_BYTES_PER_SLOT", "MAX_SLOTS_PER_TIER", "Footprint", "HoldExpiry", "Runtime", "finalize_runtime", "PROCESS",
]

log = logging.getLogger("kvoffload")


# -- process-wide bookkeeping -----------------------------------------------------------
#
# _live holds every runtime of this process not yet fully closed, by strong reference: a runtime
# whose close() failed (a stuck thread) stays here, so that the exit handler can finish it, or at
# least remove its disk file (it holds user prompts). A forked child inherits copies of the
# parent's runtimes; they move to _inherited, are never closed nor collected there (their file,
# pinning and threads are the parent's), and every offloader made before the fork refuses use.

_EXIT_TIMEOUT_S = 5.0
_live: set[Runtime] = set()
_live_lock = threading.Lock()
_inherited: list[Runtime] = []


def _after_fork_in_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # another thread may have held it at fork time
    for rt in _live:
        rt.inherit()
    _inherited.extend(_live)
    _live.clear()


_exit_tried: set[Runtime] = set()
"""The runtimes an exit pass has closed or tried to: the second pass never waits for them again."""


def _close_all_at_exit() -> None:
    """Close every live runtime (``_EXIT_TIMEOUT_S`` each) that no exit pass has tried yet. Never
    raises: in threading's shutdown that would skip the hooks after it and the join of the threads."""
    with _live_lock:
        runtimes = [rt for rt in _live if rt not in _exit_tried]
        _exit_tried.update(runtimes)
    for i, rt in enumerate(runtimes):
        try:
            rt.close(_EXIT_TIMEOUT_S)
        except Exception as e:  # a thread is stuck: at least the user's data must not outlive us
            log.warning("kvoffload: closing an offloader at exit failed (%s); removing its disk file", e)
            _remove_disk_file_quietly(rt)
        except BaseException:  # an interrupt while exiting: wait no longer, but leave no user data behind
            log.warning("kvoffload: closing offloaders at exit was interrupted; removing their disk files")
            for left in runtimes[i:]:
                _remove_disk_file_quietly(left)
            return


def _remove_disk_file_quietly(rt: Runtime) -> None:
    try:
        rt.remove_disk_file()
    except Exception:
        log.exception("kvoffload: removing a disk file at exit failed")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# threading's shutdown (when the main thread ends) runs the hooks registered with
# threading._register_atexit, newest first, then waits for the non-daemon threads; atexit runs after
# that. concurrent.futures' hook (registered when it is imported, above) makes every thread pool
# refuse work: the disk tier's IO threads, asyncio's getaddrinfo for the remote tier's connections.
# Ours, registered after it, runs before it: a persistent tier can still write its host entries and
# checkpoint, write-through can still reach the remote store.
# The atexit pass (a no-op when nothing is left) is for Pythons without that hook, and for runtimes
# started after it ran (by a non-daemon thread threading then waits for, or an atexit handler): their
# pools refuse work, but their threads must still stop and their disk file go.
_register_threading_atexit = getattr(threading, "_register_atexit", None)
if _register_threading_atexit is not None:
    try:
        _register_threading_atexit(_close_all_at_exit)
    except RuntimeError:  # imported during threading's shutdown: only the atexit pass is left
        pass
atexit.register(_close_all_at_exit)


BOOKKEEPING_BYTES_PER_SLOT = 64
"""Host memory the slot index takes per slot of either tier, made at ``start()``: its per-slot lists
(owner, readers, free slot numbers) take 56 bytes a slot in CPython, rounded up."""
MAX_SLOTS_PER_TIER = 1 << 26
"""The most slots a tier may have (its bookkeeping alone: 4 GiB); bigger tiers need bigger blocks."""


@dataclass(frozen=True)
class Footprint:
    """The memory an offloader takes once started, in bytes, by what holds it."""

    host_slab: int
    """The host tier: ``host slots * slot_bytes``, pinned for GPU caches."""
    disk_bounce: int
    """The disk tier's bounce buffers: two halves of ``chunk_bytes`` (rounded down to whole slots, at
    least one) for loads, and as many for stores when there is no host tier; pinned for GPU caches."""
    bookkeeping: int
    """The slot index: about :data:`BOOKKEEPING_BYTES_PER_SLOT` per slot of either tier."""
    gpu_staging: int
    """GPU caches with ``copy_engine="kernel"``: two staging buffers of ``chunk_bytes`` (whole slots)
    for stores and two for loads, on the GPU (512 MiB at the default ``chunk_bytes``)."""
    disk_file: int
    """The disk file: ``disk slots * slot_bytes``, reserved on its file system."""
    remote_staging: int = 0
    """A remote tier writing disk copies through (``remote_write="through"`` with a disk tier) or
    evicted blocks (``"evict"``): one half of a bounce buffer (``bounce_bytes``), not pinned."""

    @property
    def host_memory(self) -> int:
        """All host memory: slab, bounce buffers, the remote tier's staging and bookkeeping."""
        return self.host_slab + self.disk_bounce + self.remote_staging + self.bookkeeping

    @classmethod
    def of(cls, layout: BlockLayout, opts: Options, slots: TierSlots) -> Footprint:
        """What an offloader of ``layout``, ``opts`` and ``slots`` takes."""
        chunk = layout.blocks_per_chunk(opts.chunk_bytes) * layout.slot_bytes
        bounce = layout.blocks_per_chunk(opts.bounce_bytes or opts.chunk_bytes) * layout.slot_bytes
        bounce_directions = (2 if not slots.host else 1) if slots.disk else 0
        return cls(
            host_slab=slots.host * layout.slot_bytes,
            disk_bounce=bounce_directions * 2 * bounce,
            bookkeeping=(slots.host + slots.disk) * BOOKKEEPING_BYTES_PER_SLOT,
            gpu_staging=2 * 2 * chunk if layout.is_cuda and opts.copy_engine == "kernel" else 0,
            disk_file=slots.disk * layout.slot_bytes,
            remote_staging=bounce if opts.remote is not None and (opts.remote_write == "evict" or (opts.remote_write == "through" and slots.disk)) else 0,
        )


def _host_memory_limits() -> list[tuple[str, int]]:
    """``(what, bytes)`` of each limit on host memory known here: physical memory, memory available now."""
    limits = []
    try:
        limits.append(("this machine's memory", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(("the memory available now (MemAvailable)", int(line.split()[1]) * 1024))
    except (OSError, ValueError, IndexError):
        pass
    return [(what, n) for what, n in limits if n > 0]


def check_sizes(layout: BlockLayout, opts: Options, slots: TierSlots, disk_path: str | None) -> None:
    """Fail at once, before anything is allocated, when the tiers cannot fit: not after minutes of
    paging, an OOM kill or a bare ``MemoryError``. The message names the size, the option and the limit.
    ``disk_path``: where the disk file goes (:func:`~.base.diskfile.disk_file_path`)."""
    for given, n in ((slots.host_given, slots.host), (slots.disk_given, slots.disk)):
        if n > MAX_SLOTS_PER_TIER:
            raise MemoryError(
                f"{given} is {n} slots of {format_size(layout.slot_bytes)}, more than the {MAX_SLOTS_PER_TIER} slots a tier "
                f"may have (its bookkeeping alone would take {format_size(n * BOOKKEEPING_BYTES_PER_SLOT)} of host memory); "
                "use fewer slots, or bigger blocks"
            )
    need = Footprint.of(layout, opts, slots)
    for what, limit in _host_memory_limits():
        if need.host_memory > limit:
            raise MemoryError(
                f"{slots.host_given} with {slots.disk_given} needs {format_size(need.host_memory)} of host memory "
                f"({format_size(need.host_slab)} host slab, {format_size(need.disk_bounce)} disk bounce buffers, "
                f"{format_size(need.bookkeeping)} slot bookkeeping), more than {what}: {format_size(limit)}"
            )
    if disk_path is not None and need.disk_file:
        check_free_space(disk_path, need.disk_file, slots.disk_given)


class HoldExpiry:
    """Gives the index's expired holds (leases) back at their deadline, on a worker loop, even when
    nothing calls the offloader: a store waiting for a held slot must not wait for a later call.

    One wake-up at most is pending, for the earliest deadline of ``holds`` (:meth:`follow` after
    every hold); it runs on the loop, never in the caller's thread, and none is armed once
    :meth:`close` was called.
    """

    def __init__(self, holds: Holds, worker: WorkerLoop) -> None:
        self._holds = holds
        self._worker = worker
        self._lock = threading.Lock()
        self._due = math.inf
        """The deadline the wake-up is armed (or being armed) for; inf: none."""
        self._handle: asyncio.TimerHandle | None = None
        """The pending wake-up (the loop's thread alone touches it)."""
        self._closed = False
        worker.add_stop_hook(self._cancel)

    def follow(self) -> None:
        """After a hold: make sure a wake-up is due by the earliest deadline. From any thread; a look
        without a lock while one is."""
        deadline = self._holds.next_expiry
        if deadline >= self._due:
            return
        try:
            with self._lock:
                if self._closed or deadline >= self._due:
                    return
                self._due = deadline
            self._worker.mailbox.post(self._arm)
        except RuntimeError:  # the loop has stopped: the offloader is closing
            pass
        except BaseException:  # an interrupt: the next hold arms it (the loop reads the deadline from the holds)
            with self._lock:
                self._due = math.inf
            raise

    def _arm(self) -> None:
        """On the loop: (re)arm the one wake-up for the earliest deadline now."""
        deadline = self._holds.next_expiry
        with self._lock:
            if self._closed:
                return
            self._due = deadline
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if deadline < math.inf:
            self._handle = self._worker.loop.call_later(max(0.0, deadline - time.monotonic()), self._wake)

    def _wake(self) -> None:
        """On the loop, at the deadline: give back the expired holds, then arm for the next deadline."""
        self._handle = None
        try:
            self._holds.expire()
        except Exception:  # the next call on the index gives them back, the next hold arms again
            log.exception("kvoffload: giving back expired leases failed")
            with self._lock:
                self._due = math.inf
            return
        self._arm()

    def close(self) -> None:
        """Arm nothing more (the loop's stop cancels the pending wake-up); idempotent."""
        with self._lock:
            self._closed = True

    def _cancel(self) -> None:
        self.close()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Runtime:
    """Everything ``start()`` creates; closed by ``close()``, when the offloader is collected, or at exit.

    ``close()`` may be called from any thread, any number of times: on a worker thread it hands the
    shutdown to a ``kvoffload-close`` thread; after a timeout a later call finishes the job.
    """

    def __init__(
        self, layout: BlockLayout, caches: dict[str, torch.Tensor], opts: Options, slots: TierSlots, metrics: TransferCounters,
    ) -> None:
        self.pid = os.getpid()
        self.generation = PROCESS.generation
        self.layout = layout
        self.storage: TieredStorage | None = None
        self.final_counts: TierCounts | None = None
        """The tiers' counts as they closed: set before :attr:`storage` is dropped."""
        self.footprint = Footprint.of(layout, opts, slots)
        """The memory this runtime takes (docs/how-to/sizing.md)."""
        self.remote: RemoteTier | None = None
        """The remote tier, if any (made with :attr:`storage`; closed after the copy workers stop)."""
        self.remote_counts_closed = RemoteCounts()
        """The remote tier's counters as it closed."""
        self.hold_expiry: HoldExpiry | None = None
        """Gives expired leases back at their deadline (made with :attr:`storage`)."""
        self.workers: list[CopyWorker] = []
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
            sealer = Sealer(opts.remote_secret, opts.encryption_key)
            identity = CacheIdentity.of(caches, layout, opts.fingerprint, namespace=opts.namespace) if opts.persist else None
            disk_path = disk_file_path(opts.disk_path, identity.digest if identity else None) if opts.disk_path else None
            check_sizes(layout, opts, slots, disk_path)
            expedited = opts.expedited_loads and layout.is_cuda  # see Options.expedited_loads
            for name in ("store", "load", "expedited") if expedited else ("store", "load"):
                copier = make_block_copier(layout, caches, opts, expedited=name == "expedited")
                self.workers.append(CopyWorker(
                    "store" if name == "store" else "load", f"kvoffload-{name}", copier, self.copy_calls, gpu=layout.is_cuda,
                    on_thread_start=_init_worker_thread(layout.device),
                ))
            self.storage = TieredStorage(
                layout, slots.host, disk_path, slots.disk, CopyWorkers(self.workers[0], self.workers[1], self.workers[2] if expedited else None), metrics,
                chunk_blocks=layout.blocks_per_chunk(opts.chunk_bytes),
                bounce_blocks=layout.blocks_per_chunk(opts.bounce_bytes or opts.chunk_bytes),
                io_threads=opts.io_threads, use_page_cache=opts.use_page_cache, promote=opts.promote,
                identity=identity, verify=opts.verify, sealer=sealer,
            )
            self.hold_expiry = HoldExpiry(self.storage.index.holds, self.workers[1].loop)
            if opts.remote is not None:
                identity = CacheIdentity.of(caches, layout, opts.fingerprint, opts.remote_shard, opts.namespace)
                self.remote = RemoteTier(opts.remote, identity, self.storage.index, opts.remote_write, sealer)
                self.storage.attach_remote(self.remote)
                self.remote.start()  # StartError if the remote refuses this offloader for good
        except BaseException:
            try:
                self._close_now(Deadline(5.0), failed_start=True)
            except BaseException:  # stays in _live: the exit handler tries again
                log.exception("kvoffload: cleaning up after a failed start did not finish")
            raise

    def tier_counts(self) -> TierCounts:
        """The tiers' counts: live while running, as they closed afterwards (never less)."""
        storage = self.storage
        if storage is not None:
            return storage.counts()
        return self.final_counts if self.final_counts is not None else TierCounts()

    def close(self, timeout: float | None) -> None:
        """Release everything within ``timeout`` seconds in all (None: no limit); from any thread.
        Raises CloseError if a thread did not stop in time."""
        if self.closed or self.inherited or self.generation != PROCESS.generation:
            return
        if on_worker_thread():
            self._close_in_background(timeout)
            return
        deadline = Deadline(timeout)
        if not self._close_lock.acquire(timeout=deadline.lock_timeout()):
            raise CloseError(f"another close() of this offloader did not finish within {timeout} s")
        try:
            if not self.closed:
                self._close_now(deadline)
        finally:
            self._close_lock.release()
        closer = self._closer  # a handed-off close that found the work done: let it end too
        if closer is not None and closer is not threading.current_thread():
            closer.join(deadline.left())

    def _close_in_background(self, timeout: float | None) -> None:
        with self._closer_lock:
            if self._closer is not None and self._closer.is_alive():
                return
            self._closer = HelperThread(target=self._close_logged, args=(timeout,), name="kvoffload-close")
            try:
                self._closer.start()
            except RuntimeError as e:  # interpreter shutting down: the exit handler closes it
                log.warning("kvoffload: could not start a thread to close the offloader (%s)", e)

    def _close_logged(self, timeout: float | None) -> None:
        try:
            self.close(timeout)
        except Exception:
            log.exception("kvoffload: closing the offloader failed; call close() again to finish")

    def _close_now(self, deadline: Deadline, *, failed_start: bool = False) -> None:
        timeout = deadline.timeout
        if self.hold_expiry is not None:
            self.hold_expiry.close()
        stuck = [worker.name for worker in self.workers if not worker.stop(deadline.left())]
        if stuck:  # never free memory a live thread may still copy into
            raise CloseError(
                f"worker thread(s) {stuck} did not stop within {timeout} s; memory and disk file kept: call close() again"
            )
        for worker in self.workers:
            try:  # on a failed device this raises; its memory is freed with the rest all the same
                worker.close()
            except Exception:
                log.exception("kvoffload: %s: releasing the copier failed; going on with the close", worker.name)
        self.workers = []
        remote = self.remote
        if remote is not None:  # its writes read host slots: done or dropped before the memory goes
            if not remote.close(deadline):
                raise CloseError(f"the remote tier's thread did not stop within {timeout} s; memory kept: call close() again")
            self.remote_counts_closed = remote.counts()
            self.remote = None
        storage = self.storage
        if storage is not None:
            # The workers have stopped: no IO runs any more. Kept before the storage goes: stats() never sees less.
            self.final_counts = storage.counts().retired()
            self.storage = None
            disk = storage.disk
            if not storage.close(deadline.left(), failed_start=failed_start):
                self._disk_left = disk
                raise CloseError(f"disk IO thread did not stop within {timeout} s; disk file kept: call close() again")
        elif self._disk_left is not None:
            if not self._disk_left.close(deadline.left()):
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
        if disk is not None:
            disk.file.unlink()


def finalize_runtime(rt: Runtime) -> None:
    """weakref.finalize callback of an unclosed offloader (may run on any thread, a worker's included)."""
    try:
        rt.close(_EXIT_TIMEOUT_S)
    except Exception as e:
        log.warning("kvoffload: closing a collected offloader failed (%s); it is retried at exit", e)


def _init_worker_thread(device: torch.device) -> Callable[[], None]:
    def init() -> None:
        # What torch runs here (gathers without the copy kernel, disk-tier copies) is memory
        # bound; an OpenMP team per worker thread only contends with the caller's (measured on
        # 2 cores: 64 KiB slice copies 6x slower with the default team). The setting is per thread.
        torch.set_num_threads(1)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    return init
