"""The disk tier's file: opened safely, space reserved up front, O_DIRECT vectored IO.

Blocks encode user prompts, so the file is created fresh and private: any old
file or planted symlink at the path is unlinked, then the file is opened with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, and it is unlinked on close.

IO goes through :attr:`DiskFile.io` (``pwritev`` / ``preadv``), the one seam
tests use to inject faults. A short read or write is an ``OSError`` (EIO),
never a silent success.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import OffloadError
from .layout import SLOT_ALIGN, runs

__all__ = ["DiskFile", "IoCalls", "IoBatch", "io_jobs"]

log = logging.getLogger("kvoffload")

O_DIRECT = getattr(os, "O_DIRECT", 0)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


@dataclass
class IoCalls:
    """The system calls the disk tier makes; replace them to inject faults in tests."""

    pwritev: Callable[[int, Sequence[Any], int], int] = os.pwritev
    preadv: Callable[[int, Sequence[Any], int], int] = os.preadv


class DiskFile:
    """A private file of ``nbytes`` for block slots, O_DIRECT unless ``use_page_cache``."""

    def __init__(self, path: str | os.PathLike[str], nbytes: int, *, use_page_cache: bool = False) -> None:
        self.path = os.fspath(path)
        self.nbytes = nbytes
        self.io = IoCalls()
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "directory of disk_path does not exist", parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # an old file keeps its own mode; a planted symlink would be followed
        want_direct = not use_page_cache and O_DIRECT != 0
        self.fd, self.direct = self._open(want_direct)
        try:
            if self.direct and not self._direct_io_works():
                log.warning("%s: the file system rejects O_DIRECT IO; using buffered IO (page cache)", self.path)
                import fcntl

                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
            self._reserve()
        except BaseException:
            self.close()
            raise

    def _open(self, direct: bool) -> tuple[int, bool]:
        """Create the file; returns ``(fd, O_DIRECT in use)``."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(self.path, flags | (O_DIRECT if direct else 0), 0o600), direct
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
        log.warning("%s: the file system does not support O_DIRECT; using buffered IO (page cache)", self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        return os.open(self.path, flags, 0o600), False

    def _direct_io_works(self) -> bool:
        import mmap

        buf = mmap.mmap(-1, SLOT_ALIGN)  # page aligned
        try:
            os.pwritev(self.fd, [buf], 0)
            os.preadv(self.fd, [buf], 0)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        finally:
            buf.close()

    def _reserve(self) -> None:
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise OffloadError(
                    f"cannot reserve {self.nbytes / 2**30:.2f} GiB for the disk tier at {self.path}: {e.strerror}; "
                    "free space or use fewer disk_blocks"
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, self.nbytes)  # no preallocation here: ENOSPC can still come at write time

    def write(self, buffers: Sequence[Any], offset: int) -> None:
        """Write all of ``buffers`` at ``offset``; a short write raises ``OSError(EIO)``."""
        want = sum(memoryview(b).nbytes for b in buffers)
        done = self.io.pwritev(self.fd, buffers, offset)
        if done != want:
            raise OSError(errno.EIO, f"short write to disk tier: {done} of {want} bytes at offset {offset}")

    def read(self, buffers: Sequence[Any], offset: int) -> None:
        """Fill all of ``buffers`` from ``offset``; a short read raises ``OSError(EIO)``."""
        want = sum(memoryview(b).nbytes for b in buffers)
        done = self.io.preadv(self.fd, buffers, offset)
        if done != want:
            raise OSError(errno.EIO, f"short read from disk tier: {done} of {want} bytes at offset {offset}")

    def close(self) -> None:
        """Unlink the file and close the fd. Only call once no IO thread can use the fd."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def io_jobs(host: np.ndarray, row_ids: Sequence[int], slots: Sequence[int], job_bytes: int) -> list[tuple[int, list[Any]]]:
    """Group copies between rows of ``host`` (``uint8[rows, slot_bytes]``) and disk slots into vectored calls.

    Consecutive disk slots become one call whose iovec holds one buffer per run
    of consecutive rows; calls are cut at ``job_bytes`` (so several IO threads
    share a large run) and at IOV_MAX buffers. Returns ``(file offset, buffers)``.
    """
    slot_bytes = host.shape[1]
    per_job = max(1, min(job_bytes // slot_bytes, IOV_MAX))
    jobs: list[tuple[int, list[Any]]] = []
    starts, lengths = runs(slots)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        for j in range(s, s + n, per_job):
            ids = row_ids[j : j + min(per_job, s + n - j)]
            r_starts, r_lengths = runs(ids)
            bufs = [host[ids[a] : ids[a] + k].reshape(-1) for a, k in zip(r_starts.tolist(), r_lengths.tolist())]
            jobs.append((slots[j] * slot_bytes, bufs))
    return jobs


def _contained(call: Callable[[], None]) -> None:
    """Run ``call``; a ``BaseException`` that is not an ``Exception`` (SystemExit, KeyboardInterrupt
    raised inside the IO call) becomes a ``RuntimeError``, which fails the transfer instead of
    escaping into the worker loop and stopping it."""
    try:
        call()
    except Exception:
        raise
    except BaseException as e:
        raise RuntimeError(f"disk IO call raised {e!r}") from e


class IoBatch:
    """IO calls submitted to the pool at once; await :meth:`wait` for all of them.

    Submitting is synchronous, so the calls are running on the IO threads
    while the event loop goes on to the next chunk's copy.
    """

    def __init__(self, pool: concurrent.futures.Executor, calls: Sequence[Callable[[], None]]) -> None:
        self._futures = [pool.submit(_contained, c) for c in calls]

    def done(self) -> bool:
        """True when every call has ended."""
        return all(f.done() for f in self._futures)

    async def wait(self) -> None:
        """Return when every call succeeded.

        On cancellation or the first error, calls not yet started are cancelled
        and running ones are waited for (a ``pwritev`` cannot be recalled)
        before the exception propagates: no IO on the buffers is left behind.
        """
        try:
            for f in self._futures:
                await asyncio.wrap_future(f)
        except BaseException:
            await self.settle()
            raise

    async def settle(self) -> None:
        """Cancel what has not started, wait for what runs; never raises."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            while not f.done():
                try:
                    await asyncio.shield(asyncio.wrap_future(f))
                except BaseException:
                    pass
