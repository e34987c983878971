"""Page-aligned host memory, pinned for DMA when the cache is on a GPU.

Allocated with an anonymous ``mmap`` (page aligned, no power-of-two rounding as
torch's pinned allocator does) and page-locked with ``cuMemHostRegister``. If
pinning fails the error says so: a silently pageable slab would copy at a few
GB/s instead of tens.
"""

from __future__ import annotations

import mmap

import torch

try:
    import resource
except ImportError:  # not a POSIX system
    resource = None  # type: ignore[assignment]

from ..base.errors import OffloadError

__all__ = ["HostBuffer"]

# No MAP_POPULATE: mmap() holds the GIL while it faults pages in (about 0.3 s per GiB), which would
# stall every other thread of the process, the caller's event loop included. The pages are faulted
# in by a torch fill instead, which releases the GIL (pinning would fault them in anyway).
_MMAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class HostBuffer:
    """``nbytes`` of page-aligned host memory as a ``uint8`` tensor; pinned for ``pin`` (a CUDA device) if given."""

    def __init__(self, nbytes: int, *, pin: torch.device | None) -> None:
        self.nbytes = nbytes
        self.pinned = False
        self._device_index = 0 if pin is None or pin.index is None else pin.index
        self._mmap: mmap.mmap | None = mmap.mmap(-1, max(nbytes, 1), flags=_MMAP_FLAGS)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.tensor.zero_()  # fault the pages in now, not in the first copy; releases the GIL
        self.address = self.tensor.data_ptr() if nbytes else 0
        if pin is not None and nbytes:
            from ..cuda.driver import CudaError, host_register

            try:
                host_register(self.address, nbytes, self._device_index)
            except CudaError as e:
                self.close()
                raise OffloadError(
                    f"could not pin {nbytes / 2**30:.2f} GiB of host memory ({e}); {_memlock_limit()}; "
                    "raise the limit (ulimit -l, or the container's memlock limit) or free memory, "
                    "or give a smaller host_bytes or host_blocks (chunk_bytes, for the disk tier's bounce buffers)"
                ) from e
            self.pinned = True

    def close(self) -> None:
        """Unpin the memory and let it go.

        The pages are unmapped when the last view of them is gone, not here:
        a caller may still hold one (a numpy view in an exception's traceback,
        say), and unmapping under it would turn a read into a crash.
        """
        if self._mmap is None:
            return
        if self.pinned:
            from ..cuda.driver import host_unregister

            host_unregister(self.address, self._device_index)
            self.pinned = False
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._mmap = None  # munmap happens when the last tensor or array over it is freed

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass




def _memlock_limit() -> str:
    """RLIMIT_MEMLOCK, the most bytes this process may lock, in words (drivers may pin past it as root)."""
    if resource is None:
        return "RLIMIT_MEMLOCK unknown"
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return "RLIMIT_MEMLOCK (ulimit -l) is unlimited"
    return f"RLIMIT_MEMLOCK (ulimit -l) is {soft} bytes ({soft / 2**30:.2f} GiB)"
