"""Thin access to the CUDA driver API through cuda-bindings (cuda-python).

cuda-bindings serves here for what it is good at: resolving entry points
(``cuGetProcAddress``), host registration, error names, and the layout of
``CUmemcpyAttributes``. The calls that enqueue work are made through ctypes
(:class:`EnqueueCalls`) or from C (:mod:`..base.piece_copies`, given the entry
points' addresses): the bindings' argument conversion costs microseconds per call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from ..base.piece_copies import Event, EventCalls, context_status, set_event_calls_loader, use_event_calls

__all__ = [
    "CudaError", "driver", "check", "primary_context", "context_for", "host_register", "host_unregister", "CopyEntryPoints",
    "enqueue_calls", "EnqueueCalls", "DriverEvent",
]

log = logging.getLogger("kvoffload")

# cuMemcpyBatchAsync appeared in CUDA 12.8 with a trailing ``failIdx`` argument
# that CUDA 13 removed. Asking cuGetProcAddress for the 12.8 ABI gets a
# function with the 12.8 signature on every driver that has one.
BATCH_ABI_VERSION = 12080


class CudaError(RuntimeError):
    """A CUDA driver call failed."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({code}): {text}")
        self.code = code


@lru_cache(maxsize=1)
def driver() -> Any:
    """The ``cuda.bindings.driver`` module, imported on first use."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("CUDA caches need cuda-bindings: pip install 'cuda-bindings>=12.8'") from e
    (err,) = cu.cuInit(0)
    check("cuInit", err)
    return cu


def check(call: str, err: Any) -> None:
    """Raise :class:`CudaError` unless ``err`` is CUDA_SUCCESS."""
    code = int(err)
    if code == 0:
        return
    name, text = _error_names(err)
    raise CudaError(call, code, name, text)


def _error_names(err: Any) -> tuple[str, str]:
    """The driver's name and description of error ``err`` ("?" where it cannot tell: an error
    while describing an error must not hide it)."""
    try:
        cu = driver()
        code = cu.CUresult(int(err))  # the bindings take their enum; the calls made through ctypes return ints
        _, name = cu.cuGetErrorName(code)
        _, text = cu.cuGetErrorString(code)
        return (name or b"?").decode(), (text or b"?").decode()
    except Exception:
        return "?", "?"


def primary_context(device_index: int) -> Any:
    """The device's primary context (the one torch uses too), retained for good."""
    cu = driver()
    err, dev = cu.cuDeviceGet(device_index)
    check("cuDeviceGet", err)
    err, primary = cu.cuDevicePrimaryCtxRetain(dev)
    check("cuDevicePrimaryCtxRetain", err)
    return primary


@contextlib.contextmanager
def context_for(device_index: int) -> Iterator[None]:
    """Make sure a CUDA context is current: the calling thread's, else the device's primary one.

    Driver calls such as ``cuMemHostRegister`` need a current context, which a
    thread that has not run any CUDA work yet does not have.
    """
    cu = driver()
    err, ctx = cu.cuCtxGetCurrent()
    check("cuCtxGetCurrent", err)
    if int(ctx):
        yield
        return
    (err,) = cu.cuCtxPushCurrent(primary_context(device_index))
    check("cuCtxPushCurrent", err)
    try:
        yield
    finally:
        cu.cuCtxPopCurrent()


def host_register(ptr: int, nbytes: int, device_index: int) -> None:
    """Page-lock ``[ptr, ptr + nbytes)`` for DMA (portable across contexts), and map it into the
    device's address space so that kernels can read it (:func:`host_device_address`)."""
    cu = driver()
    with context_for(device_index):
        (err,) = cu.cuMemHostRegister(ptr, nbytes, cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP)
    check("cuMemHostRegister", err)


def host_device_address(ptr: int, device_index: int) -> int:
    """The address through which kernels on ``device_index`` reach registered host memory at ``ptr``."""
    cu = driver()
    with context_for(device_index):
        err, dptr = cu.cuMemHostGetDevicePointer(ptr, 0)
    check("cuMemHostGetDevicePointer", err)
    return int(dptr)


def host_unregister(ptr: int, device_index: int) -> None:
    """Undo :func:`host_register`."""
    cu = driver()
    with context_for(device_index):
        (err,) = cu.cuMemHostUnregister(ptr)
    check("cuMemHostUnregister", err)


def driver_version() -> int:
    """The driver's CUDA version, e.g. 13000."""
    cu = driver()
    err, v = cu.cuDriverGetVersion()
    check("cuDriverGetVersion", err)
    return int(v)


class CopyEntryPoints:
    """The driver functions that enqueue pointer-to-pointer copies, for :mod:`..base.piece_copies`,
    which builds the descriptors and calls them in C.

    ``cuMemcpyBatchAsync`` (12.8 ABI) takes a transfer's copies in one call where the driver has
    it, else ``cuMemcpyAsync`` runs once per copy; ``use_batch=False`` forces the latter (tests).
    The stream must not be the legacy default stream.
    """

    def __init__(self, use_batch: bool = True) -> None:
        cu = driver()
        batch = self._resolve_batch(cu) if use_batch else 0
        attrs = cu.CUmemcpyAttributes()
        attrs.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.flags = 0
        self._attrs = attrs  # kept alive: C reads it by address
        self.functions: tuple[int, int, int] = (batch, _proc_address(cu, "cuMemcpyAsync"), int(attrs.getPtr()))
        """(``cuMemcpyBatchAsync`` or 0, ``cuMemcpyAsync``, the copies' ``CUmemcpyAttributes``), as addresses."""

    @property
    def batched(self) -> bool:
        """True when copies go through cuMemcpyBatchAsync."""
        return self.functions[0] != 0

    @staticmethod
    def _resolve_batch(cu: Any) -> int:
        if driver_version() < BATCH_ABI_VERSION:
            log.info("driver older than CUDA 12.8: using cuMemcpyAsync per copy")
            return 0
        err, pfn, _status = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", BATCH_ABI_VERSION, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        if int(err) != 0 or not int(pfn):
            log.info("cuMemcpyBatchAsync not available: using cuMemcpyAsync per copy")
            return 0
        return int(pfn)

    def check(self, failed: tuple[int, str, int] | None) -> None:
        """Raise :class:`CudaError` for what a :mod:`..base.piece_copies` call reports failed (None: nothing)."""
        if failed is None:
            return
        err, call, index = failed
        if call == "copy":
            call = f"{'cuMemcpyBatchAsync' if self.batched else 'cuMemcpyAsync'} (copy {index})"
        check(call, err)


def _proc_address(cu: Any, name: str, version: int = 12000) -> int:
    """The address of driver function ``name`` as of CUDA ``version``'s ABI."""
    err, pfn, _status = cu.cuGetProcAddress(name.encode(), version, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
    check(f"cuGetProcAddress({name})", err)
    if not int(pfn):
        raise CudaError(f"cuGetProcAddress({name})", 500, "CUDA_ERROR_NOT_FOUND", "no such driver entry point")
    return int(pfn)


# -- calls that enqueue work, made without releasing the GIL --------------------------------
#
# ctypes.CFUNCTYPE, torch and cuda-bindings release the GIL around each C call. When another
# thread of the process runs Python, getting it back can take the whole switch interval (5 ms):
# a transfer made of a few hundred such calls then crawls. The calls below only put work on a
# stream or ask about it and return in microseconds, so they are made through ctypes.PYFUNCTYPE,
# which keeps the GIL: a transfer is enqueued whole without handing the GIL to anyone.
# cuEventSynchronize, which sleeps, releases it: once, where cuda-bindings would release it at
# each of its calls (making the context current, waiting, restoring the context).

_VOID_P = ctypes.c_void_p


class EnqueueCalls:
    """Driver entry points (``cuGetProcAddress``) called while holding the GIL (but the one that sleeps)."""

    def __init__(self) -> None:
        cu = driver()

        self.addresses: dict[str, int] = {}
        """Each entry point's address, by name, for C callers (:class:`..base.piece_copies.ChunkCopies`)."""

        def resolve(name: str, *argtypes: Any, releasing_gil: bool = False) -> Any:
            prototype = ctypes.CFUNCTYPE if releasing_gil else ctypes.PYFUNCTYPE  # only calls that sleep release it
            address = self.addresses[name] = _proc_address(cu, name)
            return prototype(ctypes.c_int, *argtypes)(address)

        self._ctx_get_current = self.addresses["cuCtxGetCurrent"] = _proc_address(cu, "cuCtxGetCurrent")
        self.event_synchronize = resolve("cuEventSynchronize", _VOID_P, releasing_gil=True)
        self.stream_wait_event = resolve("cuStreamWaitEvent", _VOID_P, _VOID_P, ctypes.c_uint)
        self.launch_kernel = resolve(
            "cuLaunchKernel", _VOID_P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, _VOID_P, _VOID_P, _VOID_P,
        )
        for name in ("cuLaunchHostFunc", "cuEventCreate", "cuEventDestroy", "cuEventRecord", "cuEventQuery"):  # called from C only
            self.addresses[name] = _proc_address(cu, name)
        self.memset_d32 = resolve("cuMemsetD32Async", ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, _VOID_P)
        # Blocking sync, though nothing of kvoffload's sleeps in cuEventSynchronize on a transfer's way: without
        # it the driver's event thread spent less CPU (measured on an H200: 3-14 us per engine step against
        # 40-110), but the host functions that ring waiting threads ran late (another thread busy: 0.56-0.60
        # of idle against 0.96; a one-block store's call to resume 162 us against 111).
        self.blocking_sync = int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC) | int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        a = self.addresses
        self.event_calls = EventCalls(
            a["cuEventCreate"], a["cuEventDestroy"], a["cuEventRecord"], a["cuEventQuery"], self.blocking_sync, MAX_POOLED_EVENTS,
            check, None,
        )
        """What :class:`DriverEvent` s are made, recorded and queried with, and their pool of handles."""

    def ensure_context(self, device_index: int) -> None:
        """Make the device's primary context current in this thread if none is (once per thread)."""
        status = context_status(self._ctx_get_current)  # asked per transfer: in C, a fraction of a ctypes call
        if status == 0:
            return
        if status > 0:
            check("cuCtxGetCurrent", status)
        cu = driver()
        (err,) = cu.cuCtxSetCurrent(primary_context(device_index))
        check("cuCtxSetCurrent", err)

    def wait(self, stream: int, event_handle: int) -> None:
        """Make ``stream`` wait for the event (a raw ``CUevent``)."""
        err = self.stream_wait_event(stream, event_handle, 0)
        if err:
            check("cuStreamWaitEvent", err)


@lru_cache(maxsize=1)
def enqueue_calls() -> EnqueueCalls:
    """The process's :class:`EnqueueCalls`, resolved on first use."""
    return EnqueueCalls()


MAX_POOLED_EVENTS = 4096
"""The most event handles kept per device for reuse (the rest are destroyed)."""


class DriverEvent(Event):
    """A blocking-sync CUDA event made, recorded and queried in C, without releasing the GIL
    (:class:`~..base.piece_copies.Event`: ``DriverEvent(device_index)``, ``record(stream)``,
    ``query()``, ``handle``; the driver's functions are :func:`enqueue_calls`' ``event_calls``).

    Quacks like the ``torch.cuda.Event`` the landing watcher asks about: ``query()`` (True once the
    work recorded before it has completed; :class:`CudaError` if that work failed, an asynchronous
    fault such as an illegal address, which leaves the context unusable: the event is settled,
    nothing more is written, and what it covers did not land) and ``synchronize()`` (which does
    release the GIL: it is what a waiting thread does).

    Handles are pooled: a gone event's handle is kept for the next one on its device instead of
    destroyed, saving a ``cuEventCreate`` and a ``cuEventDestroy`` per event (every transfer
    records two or three). Reuse is safe once nothing holds the old event: a stream wait or a
    ring enqueued on it uses the state it captured when enqueued, which a later record does not
    change. Made, recorded, queried and given back in C, these cost no Python call of their own
    (each a few microseconds through ctypes and Python before, on every transfer's way).
    """

    __slots__ = ()

    def wait_on(self, stream: int) -> None:
        """Make ``stream`` (a raw ``CUstream``) wait for the event, without the host waiting."""
        calls = enqueue_calls()
        calls.ensure_context(self.device)
        calls.wait(stream, self.handle)

    def synchronize(self) -> None:
        """Block (asleep, the GIL released once: behind a thread busy in Python, each take of
        the GIL may wait a switch interval) until the event has completed.

        Raises :class:`CudaError` if the work recorded before it failed, as :meth:`query` does."""
        calls = enqueue_calls()
        calls.ensure_context(self.device)
        err = calls.event_synchronize(self.handle)
        if err:
            check("cuEventSynchronize", err)


def _use_the_drivers_event_calls() -> None:
    """The first :class:`DriverEvent` made with none in use: the driver's (:func:`enqueue_calls`)."""
    use_event_calls(enqueue_calls().event_calls)


set_event_calls_loader(_use_the_drivers_event_calls)
