"""GPU <-> host block copies through double-buffered GPU staging and batched DMA.

Host slots hold each block's pieces of every tensor back to back, so one
(layer, block) piece is often only 16-64 KiB. Copying such pieces one
descriptor each is slow host->GPU (3-5 GB/s measured at 16 KiB on an H200).
So a chunk of blocks is gathered on the GPU into a staging buffer laid out
exactly like host slots, and moved with ``cuMemcpyBatchAsync``, one descriptor
per run of consecutive host slots. Loads run the same way backwards and scatter.
The gather and the scatter are one launch of a kernel compiled at run time with
NVRTC (``kernels.py``); where NVRTC is unavailable, one torch ``index_select`` /
``index_copy_`` per tensor. The DMA descriptors are built and handed to the driver in C
(``base/piece_copies.c``), one call per chunk.

Copies are submitted from the callers' threads (host-tier transfers are enqueued
whole at call time) or from a worker loop (disk tier, spills), one at a time under
the worker's submit lock. Every driver call on that path is made without releasing
the GIL (``driver.EnqueueCalls``): with another thread of the process busy in
Python, each release could cost the 5 ms switch interval.

Two streams per direction overlap the two halves: a kernel stream gathers or
scatters chunk N while the copy stream DMAs chunk N-1, through two staging
buffers used in turn. Events order each buffer's reuse. Small chunks (at most
``direct_max_copies`` pieces, e.g. one block of a single-tensor cache) are copied
directly, one batched descriptor per (tensor, block): the driver takes about half a
microsecond per descriptor, so beyond a few pieces one gather launch and one descriptor per
run of host rows is cheaper (measured on an H200: one block of 32 pieces, 23 us staged against
34 us direct; four blocks, 24 against 83 us).

A load consumed tensor by tensor (``to_device_by_tensor``) skips staging: one
launch per tensor scatters its pieces straight from the host slots, which the
SMs read through the slab's device mapping.

A load enqueued inside ``stops_on(flag)`` is always staged, so that every chunk's writes
to the cache are made by a kernel that reads its cancel flag (``cancel_flags.py``).

Completion events: a store chunk completes on the copy stream, a load chunk on
the kernel stream, so each direction's completions arrive in submission order.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..base.cross_thread import WakeSemaphore
from ..base.layout import BlockLayout
from ..base.piece_copies import ChunkCopies, context_status, enqueue_pieces, enqueue_ring, enqueue_runs
from .cancel_flags import CancelFlag, CancelFlags
from .driver import CopyEntryPoints, DriverEvent, enqueue_calls, host_device_address
from .kernels import HostScatter, piece_kernel

__all__ = ["CudaBlockCopier"]


def _current_stream_by_torch(device_index: int) -> int:
    return int(torch.cuda.current_stream(device_index).cuda_stream)


_current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream_by_torch
"""The calling thread's current stream on a device, as a ``CUstream`` handle.

``torch.cuda.current_stream()`` builds a Stream object (5 us measured on the H200, a tenth of a
one-block transfer's Python); torch's private getter returns the handle, at C speed."""


def _event_handle(event: Any) -> int:
    """The raw ``CUevent`` of a :class:`DriverEvent` or a ``torch.cuda.Event`` (0: never recorded)."""
    return event.handle if isinstance(event, DriverEvent) else int(event.cuda_event)


class CudaBlockCopier:
    """One direction's streams, staging buffers and batched copy."""

    def __init__(
        self, layout: BlockLayout, kv_caches: Mapping[str, torch.Tensor], *, chunk_bytes: int, use_batch_copy: bool = True,
        gather_ctas: int = 0, priority: int = 0, copy_engine: str = "kernel",
        loads_by_sm: bool = False,
    ) -> None:
        self._layout = layout
        self._device_index = layout.device.index if layout.device.index is not None else torch.cuda.current_device()
        self._pieces = layout.pieces
        self._rows = layout.block_rows(kv_caches)
        self.chunk_blocks = layout.blocks_per_chunk(chunk_bytes)
        # Priority 0 is the lowest: compute kernels go first. Expedited loads ask for a higher one.
        self.kernel_stream = torch.cuda.Stream(device=layout.device, priority=priority)
        self.copy_stream = torch.cuda.Stream(device=layout.device, priority=priority)
        self._kstream, self._cstream = self.kernel_stream.cuda_stream, self.copy_stream.cuda_stream
        # Rings for threads asleep until a copy lands: host functions wait on streams of their own,
        # delaying no copy. A stream runs its rings in order, so rings for events in completion order
        # share one (the landing watcher's); the others (a cancel flag's raise, a copy before one already
        # rung for) get the second; a thread asleep in ``result()`` rings from the third, since it may
        # wait for a later copy than the watcher's next ring: queued behind a ring for a later copy, a
        # ring would come only once that one landed.
        self._ring_streams = tuple(torch.cuda.Stream(device=layout.device) for _ in range(3))
        self._ring_lock = threading.Lock()
        self._staging_free: list[DriverEvent | None] = [None, None]  # without the copy kernel: last use of each buffer
        self._after_caller: int | None = None
        """The caller's stream that :meth:`wait_for` (None) left for the next chunk to wait for (0: none)."""
        self._turn = 0
        self._calls = enqueue_calls()
        self._no_context: Callable[[], int] = functools.partial(context_status, self._calls.addresses["cuCtxGetCurrent"])
        """Non-zero when the calling thread has no current context (``ensure_context`` makes it): asked
        before every call, at C speed (a call fewer than ``ensure_context``'s)."""
        # (cuStreamWaitEvent, cuLaunchHostFunc, a ring stream): how enqueue_ring rings a semaphore, in order and not
        self._ring_calls = tuple(
            (self._calls.addresses["cuStreamWaitEvent"], self._calls.addresses["cuLaunchHostFunc"], stream.cuda_stream)
            for stream in self._ring_streams
        )
        self._copies = CopyEntryPoints(use_batch=use_batch_copy)
        # copy_engine="dma": no kernel at all; every piece is a DMA descriptor (no SM time)
        self._kernel = piece_kernel(self._device_index) if copy_engine == "kernel" else None
        # Loads by the SMs straight from host slots: what overtakes a bulk load, whose DMAs fill the
        # copy engines' queue (stream priorities order kernels, not copy engines).
        self._loads_by_sm = loads_by_sm and self._kernel is not None
        # No staging (copy_engine="dma", SM loads): every chunk is copied direct, one descriptor per piece.
        staged = copy_engine == "kernel" and not self._loads_by_sm
        shape = (self.chunk_blocks, layout.slot_bytes)
        self._staging = [torch.empty(shape, dtype=torch.uint8, device=layout.device) for _ in range(2)] if staged else []
        self._max_ctas = gather_ctas
        self._tensor_spans = self._tensor_pieces()
        self._host_addresses: dict[int, int] = {}  # host slab address -> its device mapping
        self._flags = CancelFlags(layout.device) if self._kernel is not None else None
        self._cancel = (0, 0)  # the cancel flag of the copies being enqueued (address, generation), see stops_on
        self.direct_max_copies = 8 if self._kernel is not None else 128  # torch's gather: a launch per tensor
        # Per piece: cache address of block 0, stride, offset in a slot and bytes, for the DMA descriptors
        # built in C; the same on the GPU for the kernel.
        self._piece_table = layout.piece_table(self._rows)
        bases, strides, offsets, nbytes = self._piece_table.T
        self._tables = torch.tensor(np.stack([bases, nbytes, offsets, strides]).astype(np.int64), device=layout.device)
        self._kernel_parameters = (  # kept alive here: ChunkCopies writes into them by address
            self._kernel.parameters(self._tables, len(self._pieces), layout.slot_bytes) if self._kernel is not None else None
        )
        # Every chunk's driver calls in one C call (the torch gather, without the kernel, aside).
        self._between = DriverEvent(self._device_index)  # recorded and waited for within one call, under the submit lock
        self._chunks = ChunkCopies(
            self._copies.functions, self._calls.addresses["cuEventRecord"], self._calls.addresses["cuStreamWaitEvent"],
            self._kstream, self._cstream, self._between.handle, layout.slot_bytes, self._piece_table,
            (self._staging[0].data_ptr(), self._staging[1].data_ptr()) if self._staging else (0, 0),
            self._kernel_parameters.for_chunk_copies(gather_ctas) if self._kernel_parameters is not None else None,
            event_type=DriverEvent, device=self._device_index, direct_max_copies=self.direct_max_copies, chunk_blocks=self.chunk_blocks,
        )

    def caller_event(self) -> DriverEvent:
        """An event recorded now on the calling thread's current stream (what its work so far ends with)."""
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        return DriverEvent(self._device_index).record(_current_raw_stream(self._device_index))

    def wait_for(self, event: Any) -> None:
        """Every later copy waits for ``event`` (a :class:`DriverEvent` or a ``torch.cuda.Event``), or, if
        None, for the work enqueued so far on the calling thread's current stream. That wait is left to
        the next copy's call (callers hold the submit lock from here to their copies): a chunk enqueued
        by :class:`~..base.piece_copies.ChunkCopies` records an event of the copier's own there and has
        the one stream it starts on wait for it, in the same C call (a small transfer moves on one
        stream: a driver call fewer than both waiting); any other copy has both streams wait first."""
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        if event is None:
            self._after_caller = _current_raw_stream(self._device_index)
            return
        handle = _event_handle(event)
        if not handle:  # a torch event never recorded: nothing to wait for, as torch's own wait
            return
        self._copies.check(self._chunks.wait(handle))  # both streams: kernels touch cache blocks when staged, DMA when direct

    def ring_when_complete(self, event: Any, semaphore: WakeSemaphore, in_order: bool = True, for_thread: bool = False) -> None:
        """Have the driver ring ``semaphore`` once ``event`` (a :class:`DriverEvent` or a ``torch.cuda.Event``)
        completes: a stream of its own waits for the event, then calls libc's ``sem_post`` as a host
        function (no Python, no GIL). ``in_order=False``: ``event`` may complete before events rung for
        earlier (a cancel flag's raise, an earlier copy): its ring goes on the second ring stream;
        ``for_thread``: a waiting thread's own ring, on the third."""
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        handle = event.handle if isinstance(event, DriverEvent) else _event_handle(event)  # the usual case inlined
        calls = self._ring_calls[2 if for_thread else 0 if in_order else 1]
        with self._ring_lock:  # one waiting thread's wait and ring at a time: each ring after its event
            failed = enqueue_ring(*calls, handle, WakeSemaphore.RING_FUNCTION, semaphore.address)
        if failed is not None:
            self._copies.check(failed)

    def _take_caller(self) -> int | None:
        """The caller's stream a :meth:`wait_for` left for this copy to wait for (None: none; 0 is the
        legacy default stream, torch's usual current stream), left no more."""
        caller, self._after_caller = self._after_caller, None
        return caller

    def _both_wait_for(self, caller: int | None) -> None:
        """Before a copy enqueued other than by ``ChunkCopies.chunk``: both streams wait for the work
        enqueued so far on ``caller`` (None: nothing)."""
        if caller is not None:
            failed = self._chunks.wait_for_stream(caller)
            if failed is not None:
                self._copies.check(failed)

    def _record(self, stream: int) -> DriverEvent:
        return DriverEvent(self._device_index).record(stream)

    def take_cancel_flag(self) -> CancelFlag | None:
        """A flag for one load's copies (:meth:`stops_on`); None without the copy kernel or when all are in use."""
        return self._flags.take() if self._flags is not None else None

    @contextmanager
    def stops_on(self, flag: CancelFlag) -> Iterator[None]:
        """Loads enqueued inside skip their writes to the cache once ``flag`` is raised: each chunk is
        scattered by the kernel (never direct DMA), which reads the flag before each piece.
        Callers hold the worker's submit lock."""
        self._cancel = (flag.address, flag.generation)
        try:
            yield
        finally:
            self._cancel = (0, 0)

    def _chunk(self, to_host: bool, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> DriverEvent:
        """One chunk's copies, enqueued by one C call (:meth:`~..base.piece_copies.ChunkCopies.chunk`,
        which chooses as it enqueues); its completion event (on the copy stream for a store, the kernel
        stream for a load). A full chunk moves on both streams, so that its gather or scatter overlaps
        the next chunk's DMA; a shorter one (a small transfer, or a large one's last chunk) and a
        direct one (at most ``direct_max_copies`` pieces and no cancel flag) on the stream its end is
        recorded on, with no event between the streams: two driver calls fewer. Without the copy
        kernel, a staged chunk is gathered or scattered by torch (:meth:`_chunk_by_torch`)."""
        if self._kernel is None and self._staging and (len(block_ids) * len(self._pieces) > self.direct_max_copies or self._cancel[0]):
            return self._chunk_by_torch(to_host, block_ids, host, rows)
        caller, self._after_caller = self._after_caller, None  # :meth:`_take_caller`, inlined: a call fewer per chunk
        done = self._chunks.chunk(to_host, host.data_ptr(), rows, block_ids, caller, *self._cancel)
        if done.__class__ is tuple:
            self._copies.check(done)  # what failed
        return done  # type: ignore[return-value]

    def _chunk_by_torch(self, to_host: bool, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> DriverEvent:
        """A staged chunk without the copy kernel: torch gathers or scatters (a launch per tensor),
        the DMA of runs of host rows as with it, through the staging buffers in turn (this path's
        own turn and last uses: ``ChunkCopies`` keeps the copy kernel's)."""
        self._both_wait_for(self._take_caller())
        done = DriverEvent(self._device_index)
        b = self._turn
        self._turn ^= 1
        free = self._staging_free[b]
        first, second = (self._kstream, self._cstream) if to_host else (self._cstream, self._kstream)
        if free is not None:
            self._calls.wait(first, free.handle)
        staging = self._staging[b]
        if to_host:
            self._torch_gather_or_scatter(staging, block_ids, gather=True)
        else:
            self._copies.check(enqueue_runs(self._copies.functions, first, False, host.data_ptr(), staging.data_ptr(), self._layout.slot_bytes, rows))
        between = self._record(first)
        self._calls.wait(second, between.handle)
        if to_host:
            self._copies.check(enqueue_runs(self._copies.functions, second, True, host.data_ptr(), staging.data_ptr(), self._layout.slot_bytes, rows))
        else:
            self._torch_gather_or_scatter(staging, block_ids, gather=False)
        done.record(second)
        self._staging_free[b] = done
        return done

    def _torch_gather_or_scatter(self, staging: torch.Tensor, block_ids: Sequence[int], gather: bool) -> None:
        """Cache blocks <-> staging rows 0..n-1 by torch, on the kernel stream."""
        n = len(block_ids)
        with torch.cuda.device(self._layout.device), torch.cuda.stream(self.kernel_stream):
            idx = torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(self._layout.device, non_blocking=True)
            stage = staging[:n]
            for p, cache_rows in zip(self._pieces, self._rows):
                column = stage[:, p.offset : p.offset + p.nbytes]
                if gather:
                    torch.index_select(cache_rows, 0, idx, out=column)
                else:
                    cache_rows.index_copy_(0, idx, column)

    def to_host(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int]) -> DriverEvent:
        """Copy cache blocks into host rows; returns the completion event (on the copy stream)."""
        assert len(block_ids) <= self.chunk_blocks
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        return self._chunk(True, block_ids, host, rows)

    def to_device(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> DriverEvent:
        """Copy host rows into cache blocks; returns the completion event (on the kernel stream)."""
        assert len(block_ids) <= self.chunk_blocks
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        if self._loads_by_sm:
            self._both_wait_for(self._take_caller())
            self._scatter_from_host(host, rows, block_ids).launch(self._kstream, range(len(self._pieces)))
            return self._record(self._kstream)
        return self._chunk(False, block_ids, host, rows)

    def to_device_by_tensor(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> list[DriverEvent]:
        """Copy host rows into cache blocks tensor by tensor, in ``kv_caches`` order, then an event
        per tensor, so that layer ``i`` can be used while later ones load.

        With the NVRTC kernel, each tensor is one launch whose SMs read the host slots through
        their device mapping: enqueueing costs microseconds per tensor, so the first tensor starts
        moving at once. Without it, one batched DMA of every piece of the tensor (the driver takes
        about a microsecond per piece to enqueue, so later tensors wait on the enqueueing)."""
        if self._no_context():
            self._calls.ensure_context(self._device_index)
        self._both_wait_for(self._take_caller())
        if self._kernel is not None:
            return self._scatter_by_tensor(host, rows, block_ids)
        events: list[DriverEvent] = []
        for pieces in self._tensor_spans:
            self._copies.check(enqueue_pieces(
                self._copies.functions, self._cstream, False, host.data_ptr(), self._layout.slot_bytes, block_ids, rows,
                self._piece_table, pieces.start, pieces.stop,
            ))
            events.append(self._record(self._cstream))
        return events

    def _scatter_by_tensor(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> list[DriverEvent]:
        scatter = self._scatter_from_host(host, rows, block_ids)
        events: list[DriverEvent] = []
        for pieces in self._tensor_spans:
            scatter.launch(self._kstream, pieces)
            events.append(self._record(self._kstream))
        return events

    def _scatter_from_host(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int]) -> HostScatter:
        """The kernel's copies of host rows into cache blocks, ready to launch per range of pieces."""
        assert self._kernel is not None
        address = self._host_addresses.get(host.data_ptr())
        if address is None:
            address = self._host_addresses[host.data_ptr()] = host_device_address(host.data_ptr(), self._device_index)
        return self._kernel.scatter_from_host(
            self._tables, address, self._layout.slot_bytes, block_ids, rows, self._max_ctas, self._cancel,
        )

    def _tensor_pieces(self) -> list[range]:
        """Each tensor's pieces (consecutive columns of the tables), in ``kv_caches`` order."""
        spans: list[range] = []
        i = 0
        while i < len(self._pieces):
            j = i
            while j < len(self._pieces) and self._pieces[j].name == self._pieces[i].name:
                j += 1
            spans.append(range(i, j))
            i = j
        return spans

    def close(self) -> None:
        self.kernel_stream.synchronize()
        self.copy_stream.synchronize()
        self._staging = []
        self._staging_free = [None, None]
        self._rows = []
        if self._flags is not None:
            self._flags.close()
            self._flags = None
