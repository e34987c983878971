"""The "seed-style" baseline that kvoffload's benchmark compares against.

A re-implementation of the *shape* of vLLM's simple CPU-offload backends (its
CPU offloading connector's host copy and its disk backend), written from their
description, not their code:

- :class:`HostBaseline`: a host copy of the cache laid out per tensor, one
  background thread per direction fed by a ``queue.SimpleQueue``. On CUDA each job
  is one ``cuMemcpyBatchAsync`` call with one descriptor per (tensor, block) on a
  dedicated stream; the thread records an event and appends ``(job_id, event)`` to a
  shared list, which :meth:`wait` polls with ``event.query()``.
- :class:`DiskBaseline`: one store and one load thread, each with two bounce slots;
  per block, strictly in turn, a copy cache <-> bounce slot and one O_DIRECT
  ``pwritev`` / ``preadv`` of that slot, the two slots alternating.

Both work on CPU tensors too (torch copies, and an "event" that is always ready), so
the tests can check that the baseline moves the right bytes.

Unlike the originals, a copy that fails does not kill its thread silently: the
error is recorded in place of the event and :meth:`wait` raises it, so a
benchmark never polls forever. Nothing else is added (no cancellation, no keys,
no pipelining beyond what the originals do).

Only ``kvoffload.BlockLayout`` is used from the library, for geometry.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvoffload import BlockLayout

__all__ = ["DiskBaseline", "HostBaseline"]

log = logging.getLogger(__name__)

ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
_BATCH_ABI = 12080  # the CUDA 12.8 signature of cuMemcpyBatchAsync (with failIdx)


# --------------------------------------------------------------------------- events


class _Ready:
    """The "event" of a CPU job: the copy already happened on the worker thread."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Failed:
    """Stands in for the event of a job whose copy raised; polling it re-raises."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def query(self) -> bool:
        raise RuntimeError(f"baseline transfer failed: {self.exc!r}") from self.exc

    def synchronize(self) -> None:
        self.query()


# --------------------------------------------------------------------------- CUDA


def _cu_check(what: str, result: Any) -> Any:
    """Unpack a cuda-bindings return tuple, raising on a non-success CUresult."""
    from cuda.bindings import driver

    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        try:
            _, name = driver.cuGetErrorName(driver.CUresult(int(err)))
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            name = "?"
        raise RuntimeError(f"{what} failed: {name} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class _BatchCopy:
    """``cuMemcpyBatchAsync`` (12.8 ABI) called through ctypes with numpy address arrays.

    Every copy of a call shares one attribute: source access order STREAM (the
    copy reads its source only after the work queued before it on the stream).
    """

    _resolved = None  # the ctypes function, shared by every instance
    _resolve_lock = threading.Lock()

    def __init__(self) -> None:
        from cuda.bindings import driver

        self._fn = self._resolve()
        self._attrs = driver.CUmemcpyAttributes()
        self._attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attrs_idx = np.zeros(1, dtype=np.uint64)  # attribute 0 applies from copy 0 on
        self._fail_idx = ctypes.c_size_t(0)

    @classmethod
    def _resolve(cls) -> Any:
        with cls._resolve_lock:
            if cls._resolved is None:
                from cuda.bindings import driver

                pfn, status = _cu_check(
                    "cuGetProcAddress(cuMemcpyBatchAsync)",
                    driver.cuGetProcAddress(b"cuMemcpyBatchAsync", _BATCH_ABI, driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT),
                )
                if int(status) != int(driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS) or not int(pfn):
                    raise RuntimeError(f"cuMemcpyBatchAsync is not available from this driver ({status!r}); it needs CUDA 12.8+")
                proto = ctypes.CFUNCTYPE(
                    ctypes.c_int,  # CUresult
                    ctypes.c_void_p,  # CUdeviceptr* dsts
                    ctypes.c_void_p,  # CUdeviceptr* srcs
                    ctypes.c_void_p,  # size_t* sizes
                    ctypes.c_size_t,  # count
                    ctypes.c_void_p,  # CUmemcpyAttributes* attrs
                    ctypes.c_void_p,  # size_t* attrsIdxs
                    ctypes.c_size_t,  # numAttrs
                    ctypes.c_void_p,  # size_t* failIdx
                    ctypes.c_void_p,  # CUstream
                )
                cls._resolved = proto(int(pfn))
            return cls._resolved

    def __call__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> None:
        n = len(dsts)
        if n == 0:
            return
        dsts = np.ascontiguousarray(dsts, dtype=np.uint64)
        srcs = np.ascontiguousarray(srcs, dtype=np.uint64)
        sizes = np.ascontiguousarray(sizes, dtype=np.uint64)
        assert len(srcs) == n and len(sizes) == n
        err = self._fn(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            n,
            self._attrs.getPtr(),
            self._attrs_idx.ctypes.data,
            1,
            ctypes.addressof(self._fail_idx),
            stream.cuda_stream,
        )
        if err != 0:
            _cu_check(f"cuMemcpyBatchAsync (copy {self._fail_idx.value} of {n})", (err,))


def _bind_device(device: torch.device) -> None:
    """Make ``device`` current on this thread for torch *and* the driver API.

    ``torch.cuda.set_device`` can skip ``cudaSetDevice`` when the ordinal already
    matches, which leaves a fresh thread with no driver context; the batched copy
    is a driver call, so the primary context is bound explicitly.
    """
    from cuda.bindings import driver

    torch.cuda.set_device(device)
    dev = _cu_check("cuDeviceGet", driver.cuDeviceGet(device.index))
    ctx = _cu_check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(dev))
    # The runtime holds the primary context for the life of the process; the
    # extra reference taken here is dropped again right away.
    try:
        _cu_check("cuCtxSetCurrent", driver.cuCtxSetCurrent(ctx))
    finally:
        _cu_check("cuDevicePrimaryCtxRelease", driver.cuDevicePrimaryCtxRelease(dev))


# --------------------------------------------------------------------------- common


def _check_pairs(pairs: Sequence[tuple[int, int]], first_limit: int, second_limit: int, names: tuple[str, str]) -> np.ndarray:
    """``pairs`` as an ``int64[n, 2]`` array, every id in range (ValueError otherwise)."""
    arr = np.asarray(list(pairs), dtype=np.int64).reshape(-1, 2)
    for col, limit, name in ((0, first_limit, names[0]), (1, second_limit, names[1])):
        bad = (arr[:, col] < 0) | (arr[:, col] >= limit)
        if bad.any():
            raise ValueError(f"{name} {int(arr[bad.argmax(), col])} is out of range [0, {limit})")
    return arr


class _Base:
    """Threads, queues, job ids and the shared ``(job_id, event)`` list the caller polls."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.layout = BlockLayout.of(kv_caches)
        self.kv_caches = dict(kv_caches)
        self.is_cuda = self.layout.is_cuda
        self.device = self.layout.device
        self.events: list[tuple[int, Any]] = []  # appended by the threads, polled by wait()
        self._events_lock = threading.Lock()  # between callers removing entries
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._store_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        if self.is_cuda:
            # Bases and sizes of each tensor's block rows, for descriptor arrays.
            self._cache_base = np.array([kv_caches[p.name].data_ptr() for p in self.layout.pieces], dtype=np.uint64)
            self._piece = np.array([p.nbytes for p in self.layout.pieces], dtype=np.uint64)
            self._store_stream = torch.cuda.Stream(device=self.device)
            self._load_stream = torch.cuda.Stream(device=self.device)

    def _start(self, name: str) -> None:
        for direction, q in (("store", self._store_q), ("load", self._load_q)):
            t = threading.Thread(target=self._thread_main, args=(direction, q), name=f"{name}-{direction}", daemon=True)
            t.start()
            self._threads.append(t)

    def _submit(self, q: queue.SimpleQueue[Any], arr: np.ndarray) -> int:
        if self._closed:
            raise RuntimeError("baseline is closed")
        with self._ids_lock:
            job_id = next(self._ids)
        after = None
        if self.is_cuda:
            # Like vLLM's wait_event: the copy waits for the caller's queued work.
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        q.put((job_id, arr, after))
        return job_id

    def _thread_main(self, direction: str, q: queue.SimpleQueue[Any]) -> None:
        if self.is_cuda:
            _bind_device(self.device)
            stream = self._store_stream if direction == "store" else self._load_stream
            ctx: Any = torch.cuda.stream(stream)
            batch = _BatchCopy()
        else:
            # One OpenMP team per worker thread contends for the cores; the library's
            # workers do the same, so the comparison stays fair.
            torch.set_num_threads(1)
            stream = None
            ctx = contextlib.nullcontext()
            batch = None
        run = self._run_store if direction == "store" else self._run_load
        with ctx:
            while True:
                item = q.get()
                if item is None:
                    return
                job_id, arr, after = item
                try:
                    if stream is not None:
                        stream.wait_event(after)
                    run(arr, stream, batch)
                    event: Any
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    else:
                        event = _Ready()
                except BaseException as e:  # noqa: BLE001 - reported through wait()
                    if stream is not None:
                        with contextlib.suppress(Exception):
                            stream.synchronize()  # nothing of this job may still be in flight
                    event = _Failed(e)
                self.events.append((job_id, event))

    def _run_store(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: _BatchCopy | None) -> None:
        raise NotImplementedError

    def _run_load(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: _BatchCopy | None) -> None:
        raise NotImplementedError

    def wait(self, job_id: int, timeout: float | None = None) -> None:
        """Block until job ``job_id`` has finished, polling like vLLM's worker does.

        Scans the shared list for the job's entry, then spins on ``event.query()``
        with ``time.sleep(0)``. Raises ``RuntimeError`` if the job's copy failed,
        ``TimeoutError`` after ``timeout`` seconds. Each job can be waited for once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            event = None
            with self._events_lock:
                for jid, ev in self.events:
                    if jid == job_id:
                        event = ev
                        break
            if event is not None:
                try:
                    while not event.query():
                        if deadline is not None and time.monotonic() > deadline:
                            raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
                        time.sleep(0)
                finally:
                    with self._events_lock:
                        for i, (jid, _) in enumerate(self.events):
                            if jid == job_id:
                                del self.events[i]
                                break
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
            time.sleep(0)

    def _stop_threads(self, timeout: float) -> bool:
        """Ask both threads to stop after their queued jobs; True if both did."""
        self._store_q.put(None)
        self._load_q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("seed baseline: threads %s still running after %.1f s", alive, timeout)
            return False
        if self.is_cuda:
            # The threads only queued their last copies; host memory must outlive them.
            self._store_stream.synchronize()
            self._load_stream.synchronize()
        return True

    def __enter__(self) -> _Base:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 30.0) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------- host


class HostBaseline(_Base):
    """GPU (or CPU) cache <-> a per-tensor host copy of ``host_blocks`` blocks.

    ``host_caches[name]`` is ``[host_blocks, *shape[1:]]`` of the tensor's dtype,
    pinned when the cache is on CUDA.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], host_blocks: int) -> None:
        super().__init__(kv_caches)
        if host_blocks <= 0:
            raise ValueError(f"host_blocks must be positive, got {host_blocks}")
        self.host_blocks = int(host_blocks)
        pin = self.is_cuda
        self.host_caches = {
            name: torch.empty((self.host_blocks, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin) for name, t in self.kv_caches.items()
        }
        if self.is_cuda:
            self._host_base = np.array([self.host_caches[p.name].data_ptr() for p in self.layout.pieces], dtype=np.uint64)
        self._start("seed-host")

    def store(self, pairs: list[tuple[int, int]]) -> int:
        """Queue copies of cache block -> host block for each ``(gpu_block, host_block)``; returns the job id."""
        return self._submit(self._store_q, _check_pairs(pairs, self.layout.num_blocks, self.host_blocks, ("gpu block", "host block")))

    def load(self, pairs: list[tuple[int, int]]) -> int:
        """Queue copies of host block -> cache block for each ``(host_block, gpu_block)``; returns the job id."""
        return self._submit(self._load_q, _check_pairs(pairs, self.host_blocks, self.layout.num_blocks, ("host block", "gpu block")))

    def _descriptors(self, dst_base: np.ndarray, dst_ids: np.ndarray, src_base: np.ndarray,
                     src_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One copy per (tensor, block): flat uint64 dst, src and size arrays."""
        piece = self._piece[:, None]
        dsts = dst_base[:, None] + dst_ids.astype(np.uint64)[None, :] * piece
        srcs = src_base[:, None] + src_ids.astype(np.uint64)[None, :] * piece
        sizes = np.broadcast_to(piece, dsts.shape)
        return dsts.ravel(), srcs.ravel(), np.ascontiguousarray(sizes).ravel()

    def _run_store(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: Any) -> None:
        gpu, host = arr[:, 0], arr[:, 1]
        if stream is not None:
            batch(*self._descriptors(self._host_base, host, self._cache_base, gpu), stream)
            return
        for name, src in self.kv_caches.items():
            dst = self.host_caches[name]
            for g, h in zip(gpu.tolist(), host.tolist()):
                dst[h].copy_(src[g])

    def _run_load(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: Any) -> None:
        host, gpu = arr[:, 0], arr[:, 1]
        if stream is not None:
            batch(*self._descriptors(self._cache_base, gpu, self._host_base, host), stream)
            return
        for name, dst in self.kv_caches.items():
            src = self.host_caches[name]
            for h, g in zip(host.tolist(), gpu.tolist()):
                dst[g].copy_(src[h])

    def close(self, timeout: float = 30.0) -> None:
        """Stop the threads (after their queued jobs) and drop the host copy."""
        if self._closed:
            return
        self._closed = True
        if self._stop_threads(timeout):
            self.host_caches = {}
        # else: a thread may still copy into the host tensors; keep them alive.


# --------------------------------------------------------------------------- disk


def _aligned_buffer(nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, view)``: ``view`` is ``nbytes`` of uint8 host memory starting on a 4096 boundary."""
    owner = torch.zeros(nbytes + ALIGN, dtype=torch.uint8, device="cpu", pin_memory=pin)
    skip = (-owner.data_ptr()) % ALIGN
    view = owner[skip : skip + nbytes]
    assert view.data_ptr() % ALIGN == 0
    return owner, view


class DiskBaseline(_Base):
    """Cache <-> a private file of ``slots`` block slots, through two bounce slots per direction.

    A slot holds one block's pieces of all tensors back to back, padded to a
    multiple of 4096 (``layout.slot_bytes``); slot ``s`` sits at ``s * slot_bytes``.
    The file is created fresh and private (unlink, then ``O_CREAT | O_EXCL |
    O_NOFOLLOW``, mode 0600), opened with O_DIRECT unless ``use_page_cache`` or the
    file system rejects it (``self.direct`` says which), and unlinked on close.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], path: str, slots: int, *, use_page_cache: bool = False) -> None:
        super().__init__(kv_caches)
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        self.slots = int(slots)
        self.slot_bytes = self.layout.slot_bytes
        self.path = os.fspath(path)
        self.fd = -1
        self.direct = False
        self._open(not use_page_cache and O_DIRECT != 0)
        try:
            # Two bounce slots per direction, pinned for DMA on CUDA.
            self._bounce = {}
            self._bounce_owner = {}
            for direction in ("store", "load"):
                owner, view = _aligned_buffer(2 * self.slot_bytes, pin=self.is_cuda)
                self._bounce_owner[direction] = owner
                self._bounce[direction] = view
            self._bounce_views = {  # one Python buffer per bounce slot, for the IO calls
                d: [memoryview(v[s * self.slot_bytes : (s + 1) * self.slot_bytes].numpy()) for s in range(2)]  # type: ignore[arg-type]
                for d, v in self._bounce.items()
            }
            self._rows = self.layout.block_rows(self.kv_caches)  # uint8 [num_blocks, piece] per tensor
            self._offset = np.array([p.offset for p in self.layout.pieces], dtype=np.uint64)
            self._start("seed-disk")
        except BaseException:
            self._close_file()
            raise

    # -- the file

    def _open(self, direct: bool) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(self.path, flags | (O_DIRECT if direct else 0), 0o600)
            self.direct = direct
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            log.warning("%s: no O_DIRECT on this file system; buffered IO", self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.fd = os.open(self.path, flags, 0o600)
            self.direct = False
        try:
            os.ftruncate(self.fd, self.slots * self.slot_bytes)
            if self.direct and not self._direct_io_works():
                import fcntl

                log.warning("%s: O_DIRECT IO rejected by the file system; buffered IO", self.path)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
        except BaseException:
            self._close_file()
            raise

    def _direct_io_works(self) -> bool:
        import mmap

        page = mmap.mmap(-1, ALIGN)  # page aligned
        try:
            os.pwrite(self.fd, page, 0)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            page.close()
        return True

    def _close_file(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _write_slot(self, bounce_slot: int, file_offset: int) -> None:
        done = os.pwritev(self.fd, [self._bounce_views["store"][bounce_slot]], file_offset)
        if done != self.slot_bytes:
            raise OSError(errno.EIO, f"short write: {done} of {self.slot_bytes} bytes at {file_offset}")

    def _read_slot(self, bounce_slot: int, file_offset: int) -> None:
        done = os.preadv(self.fd, [self._bounce_views["load"][bounce_slot]], file_offset)
        if done != self.slot_bytes:
            raise OSError(errno.EIO, f"short read: {done} of {self.slot_bytes} bytes at {file_offset}")

    # -- the API

    def store(self, pairs: list[tuple[int, int]]) -> int:
        """Queue cache block -> disk slot for each ``(gpu_block, disk_slot)``; returns the job id."""
        return self._submit(self._store_q, _check_pairs(pairs, self.layout.num_blocks, self.slots, ("gpu block", "disk slot")))

    def load(self, pairs: list[tuple[int, int]]) -> int:
        """Queue disk slot -> cache block for each ``(disk_slot, gpu_block)``; returns the job id."""
        return self._submit(self._load_q, _check_pairs(pairs, self.slots, self.layout.num_blocks, ("disk slot", "gpu block")))

    # -- one block between the cache and a bounce slot

    def _to_bounce(self, block: int, bounce_slot: int, stream: torch.cuda.Stream | None, batch: Any) -> Any:
        """Copy cache block -> store bounce slot; returns the event to synchronize (or None)."""
        buf = self._bounce["store"]
        base = bounce_slot * self.slot_bytes
        if stream is None:
            for p, rows in zip(self.layout.pieces, self._rows):
                buf[base + p.offset : base + p.offset + p.nbytes].copy_(rows[block])
            return None
        dsts = np.uint64(buf.data_ptr() + base) + self._offset
        srcs = self._cache_base + np.uint64(block) * self._piece
        batch(dsts, srcs, self._piece, stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _from_bounce(self, bounce_slot: int, block: int, stream: torch.cuda.Stream | None, batch: Any) -> Any:
        """Copy load bounce slot -> cache block; returns the event to synchronize (or None)."""
        buf = self._bounce["load"]
        base = bounce_slot * self.slot_bytes
        if stream is None:
            for p, rows in zip(self.layout.pieces, self._rows):
                rows[block].copy_(buf[base + p.offset : base + p.offset + p.nbytes])
            return None
        dsts = self._cache_base + np.uint64(block) * self._piece
        srcs = np.uint64(buf.data_ptr() + base) + self._offset
        batch(dsts, srcs, self._piece, stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _run_store(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: Any) -> None:
        # pending[s]: (DMA event or None, file offset) of the block staged in bounce slot s
        pending: list[tuple[Any, int] | None] = [None, None]

        def flush(s: int) -> None:
            ev, offset = pending[s]  # type: ignore[misc]  # flushed only where a block is staged
            if ev is not None:
                ev.synchronize()
            self._write_slot(s, offset)
            pending[s] = None

        n = len(arr)
        for i, (block, slot) in enumerate(arr.tolist()):
            s = i % 2
            if pending[s] is not None:
                flush(s)  # the block staged here two steps ago goes to disk first
            pending[s] = (self._to_bounce(block, s, stream, batch), slot * self.slot_bytes)
        for s in (n % 2, (n - 1) % 2):  # older block first, so a repeated slot ends with the later one
            if pending[s] is not None:
                flush(s)

    def _run_load(self, arr: np.ndarray, stream: torch.cuda.Stream | None, batch: Any) -> None:
        dma: list[Any] = [None, None]  # the copy still reading bounce slot s
        for i, (slot, block) in enumerate(arr.tolist()):
            s = i % 2
            if dma[s] is not None:
                dma[s].synchronize()
                dma[s] = None
            self._read_slot(s, slot * self.slot_bytes)
            dma[s] = self._from_bounce(s, block, stream, batch)
        # the job event that _thread_main records on the stream after this returns covers the last copies

    def close(self, timeout: float = 30.0) -> None:
        """Stop the threads, unlink the file, close the fd (only once no thread can use it)."""
        if self._closed:
            return
        self._closed = True
        stopped = self._stop_threads(timeout)
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # the name goes now in every case: blocks encode prompts
        if not stopped:
            # Closing under a live IO thread could let the fd number be reused by an
            # unrelated open() and receive this thread's next write; leak it instead.
            log.warning("seed baseline: leaking fd %d of %s", self.fd, self.path)
            return
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._bounce_views = {}
        self._bounce = {}
        self._bounce_owner = {}
