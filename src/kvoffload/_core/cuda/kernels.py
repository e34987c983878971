"""Copy kernels compiled at run time with NVRTC: one launch gathers a chunk's pieces into a
staging buffer laid out like host slots, or scatters them back; another scatters one
tensor's pieces straight from host slots (per-tensor and expedited loads).

torch needs one launch per tensor per chunk (a 32-layer cache: 32 launches, each releasing
and retaking the GIL). This kernel moves every (block, tensor) piece of up to
:data:`MAX_BLOCKS` blocks in one launch, made through :class:`~.driver.EnqueueCalls` without
releasing the GIL. Block ids travel by value in the kernel's parameters, so nothing needs
to live until the kernel has run. A CTA copies one piece at a time (one CTA per piece unless
capped), in 16-byte words where the piece, its source and its destination allow it, bytes
otherwise (any piece size works). Both kernels read a transfer's cancel flag before each piece
and stop once it is raised (``cancel_flags.py``).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch

from .driver import check, context_for, driver, enqueue_calls

__all__ = ["MAX_BLOCKS", "MAX_PAIRS", "HostScatter", "MovePiecesParameters", "PieceKernel", "piece_kernel"]

log = logging.getLogger("kvoffload")

MAX_BLOCKS = 960
"""Block ids per launch: they travel in the kernel's parameters (4 KiB at most)."""
MAX_PAIRS = 480
"""(block id, host row) pairs per launch of the host-to-cache scatter (both arrays in the parameters)."""
THREADS = 256

SOURCE = r"""
struct Blocks { int n; int first; int ids[%(max_blocks)d]; };
struct Pairs { int n; int ids[%(max_pairs)d]; int rows[%(max_pairs)d]; };
struct __align__(16) Word { unsigned long long lo, hi; };

// One CTA copies one piece: 16-byte words where the piece, its source and its destination allow, bytes otherwise.
__device__ void copy_piece(unsigned long long src, unsigned long long dst, unsigned long long len)
{
    if (((src | dst | len) & 15ull) == 0) {
        const Word* s = (const Word*)src;
        Word* d = (Word*)dst;
        for (unsigned long long k = threadIdx.x; k < len / 16; k += blockDim.x) d[k] = s[k];
    } else {
        const unsigned char* s = (const unsigned char*)src;
        unsigned char* d = (unsigned char*)dst;
        for (unsigned long long k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
    }
}

// True once the transfer's cancel flag (device memory; 0: none) holds its generation. Thread 0
// reads it and tells the CTA, so all threads leave the loop together.
__device__ bool stop_requested(const volatile int* cancel, int generation)
{
    __shared__ int stop;
    __syncthreads();
    if (threadIdx.x == 0) stop = cancel != 0 && *cancel == generation;
    __syncthreads();
    return stop != 0;
}

// Cache blocks <-> staging rows first..first+n-1, every tensor's piece.
extern "C" __global__ void move_pieces(
    const unsigned long long* __restrict__ bases,    // per tensor: address of block 0 in the cache
    const unsigned long long* __restrict__ sizes,    // per tensor: bytes per block
    const unsigned long long* __restrict__ offsets,  // per tensor: offset of its piece in a slot
    const unsigned long long* __restrict__ strides,  // per tensor: bytes from one block's piece to the next
    int tensors, unsigned long long staging, unsigned long long slot_bytes, int gather,
    const volatile int* cancel, int generation, Blocks blocks)
{
    for (int piece = blockIdx.x; piece < blocks.n * tensors; piece += gridDim.x) {
        if (stop_requested(cancel, generation)) return;
        int i = piece / tensors, t = piece - i * tensors;
        unsigned long long cache = bases[t] + (unsigned long long)blocks.ids[i] * strides[t];
        unsigned long long slot = staging + (unsigned long long)(blocks.first + i) * slot_bytes + offsets[t];
        copy_piece(gather ? cache : slot, gather ? slot : cache, sizes[t]);
    }
}

// Host slots (read through their device mapping) -> cache blocks, pieces first_piece..first_piece+pieces-1 only.
extern "C" __global__ void scatter_from_host(
    const unsigned long long* __restrict__ bases, const unsigned long long* __restrict__ sizes,
    const unsigned long long* __restrict__ offsets, const unsigned long long* __restrict__ strides,
    int first_piece, int pieces, unsigned long long host, unsigned long long slot_bytes,
    const volatile int* cancel, int generation, Pairs pairs)
{
    for (int k = blockIdx.x; k < pairs.n * pieces; k += gridDim.x) {
        if (stop_requested(cancel, generation)) return;
        int i = k / pieces, t = first_piece + (k - i * pieces);
        unsigned long long cache = bases[t] + (unsigned long long)pairs.ids[i] * strides[t];
        unsigned long long slot = host + (unsigned long long)pairs.rows[i] * slot_bytes + offsets[t];
        copy_piece(slot, cache, sizes[t]);
    }
}
""" % {"max_blocks": MAX_BLOCKS, "max_pairs": MAX_PAIRS}


class _Blocks(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("first", ctypes.c_int), ("ids", ctypes.c_int * MAX_BLOCKS)]


class _Pairs(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int), ("ids", ctypes.c_int * MAX_PAIRS), ("rows", ctypes.c_int * MAX_PAIRS)]


def _table_rows(tables: torch.Tensor) -> list[ctypes.c_uint64]:
    """The kernels' first four parameters: the addresses of the rows of ``tables``
    (``uint64[4, pieces]``: base addresses, bytes per block, offsets in a slot, strides)."""
    base, row = tables.data_ptr(), 8 * tables.shape[1]
    return [ctypes.c_uint64(base + i * row) for i in range(4)]


class PieceKernel:
    """The compiled ``move_pieces`` of one device."""

    def __init__(self, device_index: int) -> None:
        cu = driver()
        err, dev = cu.cuDeviceGet(device_index)
        check("cuDeviceGet", err)
        err, major = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        check("cuDeviceGetAttribute", err)
        err, minor = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        check("cuDeviceGetAttribute", err)
        cubin = _compile(SOURCE, f"sm_{major}{minor}")
        with context_for(device_index):
            err, self._module = cu.cuModuleLoadData(cubin)
            check("cuModuleLoadData", err)
            err, func = cu.cuModuleGetFunction(self._module, b"move_pieces")
            check("cuModuleGetFunction", err)
            err, scatter = cu.cuModuleGetFunction(self._module, b"scatter_from_host")
            check("cuModuleGetFunction", err)
        self._func, self._scatter = int(func), int(scatter)
        self._calls = enqueue_calls()

    def parameters(self, tables: torch.Tensor, tensors: int, slot_bytes: int) -> MovePiecesParameters:
        """The parameters of ``move_pieces`` for one copier's launches: cache blocks <-> staging rows.

        ``tables`` is a CUDA ``uint64[4, pieces]`` tensor: base addresses, bytes per block,
        offsets in a slot, bytes between blocks (``tensors`` columns).
        """
        return MovePiecesParameters(self._func, self._calls, tables, tensors, slot_bytes)

    def scatter_from_host(
        self, tables: torch.Tensor, host: int, slot_bytes: int, block_ids: Sequence[int], rows: Sequence[int],
        max_ctas: int = 0, cancel: tuple[int, int] = (0, 0),
    ) -> HostScatter:
        """Prepare copies from host slots ``rows`` (``host``: the slab's device-mapped address) into
        cache blocks ``block_ids``, to be launched tensor by tensor (:meth:`HostScatter.launch`).

        The SMs read host memory over the bus: no staging buffer and no copy descriptor per piece,
        so a tensor of a large load costs one launch (or one per :data:`MAX_PAIRS` blocks).
        ``tables`` as for :meth:`parameters`; ``max_ctas`` caps the CTAs of a launch (0: one per piece);
        ``cancel``: a cancel flag's device address and generation (0: none), read before each piece.
        """
        return HostScatter(self._scatter, self._calls, tables, host, slot_bytes, block_ids, rows, max_ctas, cancel)


class MovePiecesParameters:
    """One copier's parameters of ``move_pieces``, built once: :class:`~..base.piece_copies.ChunkCopies`
    writes each launch's into them in place (building them costs more than the launch itself), so
    they serve one thread at a time: a copier's calls hold its worker's submit lock."""

    def __init__(self, func: int, calls: Any, tables: torch.Tensor, tensors: int, slot_bytes: int) -> None:
        self._staging, self._gather = ctypes.c_uint64(0), ctypes.c_int(0)
        self._cancel, self._generation = ctypes.c_uint64(0), ctypes.c_int(0)
        self._blocks = _Blocks()
        self._args: list[Any] = [
            *_table_rows(tables), ctypes.c_int(tensors), self._staging, ctypes.c_uint64(slot_bytes), self._gather,
            self._cancel, self._generation, self._blocks,
        ]
        self._params = (ctypes.c_void_p * len(self._args))(*[ctypes.addressof(a) for a in self._args])
        self._launch, self._func, self._tensors = calls.addresses["cuLaunchKernel"], func, tensors

    def for_chunk_copies(self, max_ctas: int) -> tuple[int, ...]:
        """What :class:`~..base.piece_copies.ChunkCopies` takes as ``kernel``: the launch function, the
        kernel, its parameters' addresses and counts (``max_ctas``: see ``Offloader(gather_ctas=)``)."""
        address = ctypes.addressof
        return (
            self._launch, self._func, address(self._params), address(self._blocks), MAX_BLOCKS, self._tensors, THREADS,
            max_ctas, address(self._staging), address(self._gather), address(self._cancel), address(self._generation),
        )


class HostScatter:
    """One load's host-to-cache scatter, its parameters built once and launched per tensor."""

    def __init__(
        self, func: int, calls: Any, tables: torch.Tensor, host: int, slot_bytes: int, block_ids: Sequence[int],
        rows: Sequence[int], max_ctas: int, cancel: tuple[int, int],
    ) -> None:
        self._func, self._calls, self._max_ctas = func, calls, max_ctas
        self._first_piece, self._pieces = ctypes.c_int(0), ctypes.c_int(0)
        self._params = []
        for first in range(0, len(block_ids), MAX_PAIRS):  # one parameter set per launch of a tensor
            n = min(MAX_PAIRS, len(block_ids) - first)
            pairs = _Pairs()
            pairs.n = n
            pairs.ids[:n] = block_ids[first : first + n]
            pairs.rows[:n] = rows[first : first + n]
            args: list[Any] = [
                *_table_rows(tables), self._first_piece, self._pieces,
                ctypes.c_uint64(host), ctypes.c_uint64(slot_bytes), ctypes.c_uint64(cancel[0]), ctypes.c_int(cancel[1]), pairs,
            ]
            self._params.append((n, args, (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])))

    def launch(self, stream: int, pieces: range) -> None:
        """Enqueue the copies of ``pieces`` (columns of the tables: one tensor's) on ``stream``."""
        self._first_piece.value, self._pieces.value = pieces.start, len(pieces)
        for n, _args, params in self._params:
            err = self._calls.launch_kernel(self._func, _grid(n * len(pieces), self._max_ctas), 1, 1, THREADS, 1, 1, 0, stream, params, None)
            if err:
                check("cuLaunchKernel(scatter_from_host)", err)


def _grid(pieces: int, max_ctas: int) -> int:
    """CTAs for a launch of ``pieces`` pieces: one each, at most ``max_ctas`` when that is positive."""
    return pieces if max_ctas <= 0 else min(max_ctas, pieces)


def _compile(source: str, arch: str) -> bytes:
    from cuda.bindings import nvrtc

    def ok(call: str, err: Any) -> None:
        if int(err) != 0:
            raise RuntimeError(f"{call} failed: {nvrtc.nvrtcGetErrorString(err)[1]!r}")

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"kvoffload_move_pieces.cu", 0, [], [])
    ok("nvrtcCreateProgram", err)
    try:
        opts = [f"-arch={arch}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err) != 0:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            text = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, text)
            raise RuntimeError(f"NVRTC could not compile the copy kernel: {text.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        ok("nvrtcGetCUBINSize", err)
        cubin: bytes = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        ok("nvrtcGetCUBIN", err)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@lru_cache(maxsize=None)
def piece_kernel(device_index: int) -> PieceKernel | None:
    """The device's copy kernel, compiled on first use; None (logged) where NVRTC is unavailable."""
    try:
        return PieceKernel(device_index)
    except Exception as e:  # no NVRTC library, an old driver: the torch gather/scatter serves instead
        log.warning("kvoffload: the NVRTC copy kernel is unavailable (%s); using torch gather/scatter", e)
        return None
