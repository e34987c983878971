"""The disk tier's file: opened safely, space reserved up front, O_DIRECT vectored IO.

Blocks encode user prompts, so the file is private. Without persistence it never has a
name (``O_TMPFILE``; or created, locked and unlinked at once): it cannot outlive the
process, whatever ends it. A persistent file is reopened only if it is a regular file of
this user, mode 0600, that no live offloader holds; else it is created with ``O_CREAT |
O_EXCL | O_NOFOLLOW`` and mode 0600. Either is locked with ``flock`` at once.

IO goes through :attr:`DiskFile.io` (``pwritev`` / ``preadv``), the one seam
tests use to inject faults, called through :func:`~.foreign.call_foreign`.
Any return but the requested byte count is an ``OSError`` (EIO), never a
silent success.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cross_thread import resolve_from_any_thread
from .errors import OffloadError
from .async_backends import settled
from .foreign import call_foreign
from .file_systems import ram_backed_fs
from .layout import SLOT_ALIGN, runs
from .options import format_size

__all__ = ["DiskFile", "DiskIoCounts", "IoBatch", "IoCalls", "check_free_space", "clear_path", "disk_file_path", "io_jobs"]

log = logging.getLogger("kvoffload")

O_DIRECT = getattr(os, "O_DIRECT", 0)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


@dataclass
class IoCalls:
    """The system calls the disk tier makes; replace them to inject faults in tests."""

    pwritev: Callable[[int, Sequence[Any], int], int] = os.pwritev
    preadv: Callable[[int, Sequence[Any], int], int] = os.preadv


@dataclass(frozen=True, slots=True)
class DiskIoCounts:
    """What :meth:`DiskFile.io_counts` reports: bytes moved, and IO calls that failed."""

    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0
    """IO calls that raised or moved fewer bytes than asked."""


class DiskFile:
    """A private file of ``nbytes`` for block slots, O_DIRECT unless ``use_page_cache``.

    Without ``persistent`` the file never has a name: it is created with ``O_TMPFILE`` in the
    directory of ``path`` (where the file system has no ``O_TMPFILE``: created at ``path``, locked
    and unlinked at once), so it is gone with the process however the process ends, and nothing
    at ``path`` is read, reused or removed. With ``persistent`` the file at ``path`` is opened if
    it is there (refused unless a regular file of this user with no permission for others, that
    no live offloader holds: :func:`open_existing`) and created otherwise (``O_EXCL |
    O_NOFOLLOW``, mode 0600); it is locked with ``flock`` and kept on close. :attr:`existed` says
    which. A new file's ``nbytes`` are reserved at once; a file found is left as it is (its size in
    :attr:`found_bytes`) until its user accepts its contents and calls :meth:`resize`.
    """

    def __init__(
        self, path: str | os.PathLike[str], nbytes: int, *, use_page_cache: bool = False, persistent: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.name = self.path
        """The file's name while it has one: ``path``, or a temporary name beside it (see above)."""
        self.nbytes = nbytes
        self.persistent = persistent
        self.existed = False
        """A persistent file that was there already (its contents are the caller's to check)."""
        self.named = persistent
        """The file has a name (``path``) while open: persistent files only."""
        self.io = IoCalls()
        self.fd = -1
        self.found_bytes = 0
        """The size of a persistent file that was there already, as found (before any resize)."""
        self._counts_lock = threading.Lock()
        self._bytes_written = self._bytes_read = self._errors = 0
        """What :meth:`io_counts` reports; under ``_counts_lock``."""
        self._locked = False
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(errno.ENOENT, "directory of disk_path does not exist", parent)
        want_direct = not use_page_cache and O_DIRECT != 0
        if persistent:
            self.fd, self.direct = self._open_named(want_direct)
        else:
            self.fd, self.direct = self._open_unnamed(parent, want_direct)
        try:
            if self.named:
                self._lock()
            if self.existed:
                self.found_bytes = os.fstat(self.fd).st_size
            if self.direct and not self._direct_io_works():
                log.warning("%s: the file system rejects O_DIRECT IO; using buffered IO (page cache)", self.path)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False
            if not self.existed:  # a file found is resized once its contents were accepted (:meth:`resize`)
                self._reserve()
            if not persistent and self.named:
                self.unlink()  # reserved, now nameless: nothing is left behind however the process ends
                self.named = False
        except BaseException:
            if persistent:  # removed with this start only if it created the file and it is still its own
                self.persistent = self.existed or not self._locked
            self.close()
            raise
        ram = ram_backed_fs(self.name)
        if ram is not None:
            log.warning(
                "%s: the disk tier's file system is %s, which keeps its files in memory: the disk tier saves no memory "
                "there; put disk_path on a local disk", self.path, ram,
            )

    def _open_named(self, direct: bool) -> tuple[int, bool]:
        """The persistent file at :attr:`path`: opened if it is there (:func:`open_existing`), else
        created; another process creating it at the same moment makes this one open theirs."""
        for _ in range(8):
            opened = open_existing(self.path, direct)
            if opened is not None:
                self.existed = True
                return opened
            try:
                return self._open(direct)
            except FileExistsError:  # created since we looked: open that one (whoever locks it first uses it)
                continue
        raise OffloadError(f"disk_path {self.path!r} keeps appearing and disappearing; is another program replacing it?")

    def _open_unnamed(self, directory: str, direct: bool) -> tuple[int, bool]:
        """A file with no name in ``directory`` (``O_TMPFILE``); else one created under a fresh
        temporary name beside :attr:`path`, named until it is reserved."""
        tmpfile = getattr(os, "O_TMPFILE", 0)
        if tmpfile:
            flags = os.O_RDWR | os.O_CLOEXEC | tmpfile
            for d in ((True, False) if direct else (False,)):
                try:
                    return os.open(directory, flags | (O_DIRECT if d else 0), 0o600), d
                except OSError as e:
                    if e.errno == errno.EINVAL and d:
                        log.warning("%s: the file system does not support O_DIRECT; using buffered IO (page cache)", self.path)
                        continue  # perhaps O_DIRECT: try without it
                    if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                        raise
                    break
        self.name = f"{self.path}.tmp-{secrets.token_hex(8)}"
        self.named = True
        return self._open(direct)

    def _open(self, direct: bool) -> tuple[int, bool]:
        """Create the file; returns ``(fd, O_DIRECT in use)``."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self.name, flags | (O_DIRECT if direct else 0), 0o600), direct
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
        log.warning("%s: the file system does not support O_DIRECT; using buffered IO (page cache)", self.path)
        clear_path(self.name)  # the refused open may have created the file
        return os.open(self.name, flags, 0o600), False

    def _lock(self) -> None:
        """Mark the file as ours (``flock``) before anything else is done with it: see :func:`clear_path`."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._locked = True
        except BlockingIOError as e:  # another offloader holds it, or is replacing what it found at the path
            raise OffloadError(f"disk_path {self.path!r} is in use by another kvoffload offloader; close it or choose another path") from e
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            self._locked = True  # as far as this file system can tell
            log.warning("%s: the file system has no flock(); another offloader could replace this file", self.path)

    def _direct_io_works(self) -> bool:
        buf = mmap.mmap(-1, SLOT_ALIGN)  # page aligned
        try:
            if not self.existed:  # a file with contents is only read
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
        if os.fstat(self.fd).st_blocks * 512 >= self.nbytes:
            return  # reserved already (a reopened file, or a resize to the same size)
        try:
            os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                free = _free_bytes(os.path.dirname(os.path.abspath(self.path)))
                raise OffloadError(
                    f"cannot reserve {format_size(self.nbytes)} for the disk tier at {self.path}: {e.strerror}"
                    f"{'' if free is None else f' ({format_size(free)} free there)'}; "
                    "free space or give a smaller disk_bytes or disk_blocks"
                ) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(self.fd, self.nbytes)  # no preallocation here: ENOSPC can still come at write time

    def write(self, buffers: Sequence[Any], offset: int) -> None:
        """Write all of ``buffers`` at ``offset``; any other outcome raises (short write: ``OSError(EIO)``)."""
        self._io("write", "disk write (pwritev)", self.io.pwritev, buffers, offset)

    def read(self, buffers: Sequence[Any], offset: int) -> None:
        """Fill all of ``buffers`` from ``offset``; any other outcome raises (short read: ``OSError(EIO)``)."""
        self._io("read", "disk read (preadv)", self.io.preadv, buffers, offset)

    def _io(self, what: str, call: str, fn: Any, buffers: Sequence[Any], offset: int) -> None:
        want = sum(memoryview(b).nbytes for b in buffers)
        try:
            done = call_foreign(call, fn, self.fd, buffers, offset)
            _check_count(what, done, want, offset)
        except BaseException:
            with self._counts_lock:
                self._errors += 1
            raise
        with self._counts_lock:
            if what == "write":
                self._bytes_written += want
            else:
                self._bytes_read += want

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` at ``offset`` (both multiples of 4096) through an aligned buffer: bytes past the
        end of the file read as zeros. For headers and start-up reads, not the hot path."""
        buf = mmap.mmap(-1, max(nbytes, SLOT_ALIGN))  # page aligned
        try:
            done = call_foreign("disk read (preadv)", self.io.preadv, self.fd, [memoryview(buf)[:nbytes]], offset)
            return bytes(buf[:done]).ljust(nbytes, b"\0")
        finally:
            buf.close()

    def write_bytes(self, data: bytes, offset: int) -> None:
        """Write ``data`` (a multiple of 4096 bytes) at ``offset`` through an aligned buffer."""
        buf = mmap.mmap(-1, len(data))
        try:
            buf[:] = data
            self.write([buf], offset)
        finally:
            buf.close()

    def resize(self, nbytes: int) -> None:
        """Make the file exactly ``nbytes`` long (space reserved when growing)."""
        if os.fstat(self.fd).st_size > nbytes:
            os.ftruncate(self.fd, nbytes)
        self.nbytes = nbytes
        self._reserve()

    def io_counts(self) -> DiskIoCounts:
        """Bytes written and read, and IO calls that failed, since the file was opened."""
        with self._counts_lock:
            return DiskIoCounts(self._bytes_written, self._bytes_read, self._errors)

    def unlink(self) -> None:
        """Remove the file from its directory if the path still names it (the fd stays open);
        a persistent file stays."""
        if self.fd >= 0 and self.named and not self.persistent:
            with contextlib.suppress(OSError):
                _unlink_if_same(self.name, os.fstat(self.fd))

    def close(self) -> None:
        """Unlink the file (if it has a name, the path still names it and it is not persistent) and
        close the fd. Only call once no IO thread can use the fd."""
        if self.fd < 0:
            return
        self.unlink()
        os.close(self.fd)
        self.fd = -1


def disk_file_path(disk_path: str, identity_digest: bytes | None) -> str:
    """Where the disk tier's file goes for ``disk_path``: that path, or, when it names a directory,
    a file in it: ``kvoffload-<16 hex digits of the cache identity's digest>.cache`` for a persistent
    tier (``identity_digest`` given: each cache identity a file of its own), else an unnamed one."""
    if not os.path.isdir(disk_path):
        return disk_path
    if identity_digest is None:
        log.info("kvoffload: disk_path %s is a directory: the disk tier's file is an unnamed file in it", disk_path)
        return os.path.join(disk_path, "kvoffload-disk-tier")  # never created under this name (see DiskFile)
    path = os.path.join(disk_path, f"kvoffload-{identity_digest.hex()[:16]}.cache")
    log.info("kvoffload: disk_path %s is a directory: the persistent disk tier's file is %s", disk_path, path)
    return path


def _free_bytes(directory: str) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``directory``; None if unknown
    (no such directory, a pseudo file system that reports no blocks, a read-only one: opening says why)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    if st.f_blocks == 0 or st.f_flag & getattr(os, "ST_RDONLY", 0):
        return None
    return st.f_bavail * st.f_frsize


def check_free_space(path: str, nbytes: int, given: str) -> None:
    """Refuse, before anything is created, a disk file of ``nbytes`` at ``path`` that its file system
    has no room for (``OffloadError`` naming ``given``, the option, the size and the free space). A
    stale file at ``path``, which the new one replaces, counts as free. Nothing is refused when the
    free space cannot be known (the directory missing, say: creating the file reports that)."""
    directory = os.path.dirname(os.path.abspath(path))
    free = _free_bytes(directory)
    if free is None:
        return
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            free += st.st_blocks * 512
    if nbytes > free:
        raise OffloadError(
            f"{given} needs {format_size(nbytes)} for the disk file at {path}, but its file system has {format_size(free)} free; "
            "free space, choose another disk_path, or give a smaller disk_bytes or disk_blocks"
        )


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a fifo (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


def clear_path(path: str) -> None:
    """Make room for a new disk file at ``path``, or refuse.

    Nothing there: done. A symlink is unlinked, never followed. A regular file is
    unlinked unless a live offloader holds its ``flock`` (then ``OffloadError``).
    Anything else (directory, fifo, socket, device) is refused with ``OffloadError``
    and left alone; it is never opened, so a fifo cannot block.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(path, st)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since lstat; O_NONBLOCK kept a fifo from blocking
            raise _not_a_file(path, st)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise OffloadError(
                f"disk_path {path!r} is in use by another kvoffload offloader; close it or choose another path"
            ) from e
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
        _unlink_if_same(path, st)  # holding the lock, so no offloader can be taking the file meanwhile
    finally:
        os.close(fd)


def open_existing(path: str, direct: bool) -> tuple[int, bool] | None:
    """Open the persistent disk file at ``path``: ``(fd, O_DIRECT in use)``, or None if nothing is
    there. Refused with ``OffloadError``, leaving it as it is: a symlink (never followed), anything
    but a regular file, a file of another user, or one that others may read or write (mode wider
    than 0600: blocks encode prompts)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise OffloadError(
            f"disk_path {path!r} is a symlink; a persistent disk file is never opened through one: give the path it points to"
        )
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_file(path, st)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | (O_DIRECT if direct else 0))
    except OSError as e:
        if not (direct and e.errno == errno.EINVAL):
            raise
        fd, direct = os.open(path, flags), False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(path, st)
        if st.st_uid != os.geteuid():
            raise OffloadError(
                f"disk_path {path!r} belongs to user {st.st_uid}, not to this process's user {os.geteuid()}; "
                "kvoffload only reopens its own files: remove it or choose another path"
            )
        if st.st_mode & 0o077:
            raise OffloadError(
                f"disk_path {path!r} has mode {stat.S_IMODE(st.st_mode):04o}, open to other users; kvoffload only "
                "reopens files of mode 0600 (blocks encode prompts): check who could have read or changed it, "
                "then chmod 600 it or remove it"
            )
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, direct


def _not_a_file(path: str, st: os.stat_result) -> OffloadError:
    what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
    return OffloadError(
        f"disk_path {path!r} is {what}; kvoffload only replaces a regular file or a symlink there, "
        "so it left it alone: remove it or choose another path"
    )


def _unlink_if_same(path: str, st: os.stat_result) -> None:
    """Unlink ``path`` if it still names the file ``st`` describes (not one put there since)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
        os.unlink(path)


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


def _check_count(op: str, done: object, want: int, offset: int) -> None:
    """``OSError(EIO)`` unless the IO call returned the int ``want``; nothing of ``done`` is called."""
    if type(done) is int and done == want:
        return
    if type(done) is int and 0 <= done < want:
        raise OSError(errno.EIO, f"short {op} on the disk tier: {done} of {want} bytes at offset {offset}")
    shown = str(done) if type(done) is int else f"{type(done).__name__} {_safe_repr(done)}"
    raise OSError(errno.EIO, f"disk {op} returned {shown} instead of {want} (bytes at offset {offset})")


def _safe_repr(x: object) -> str:
    try:
        return repr(x)[:80]
    except BaseException:
        return "?"


class IoBatch:
    """IO calls submitted to the pool at once; await :meth:`wait` for all of them.

    Submitting is synchronous, so the calls are running on the IO threads
    while the event loop goes on to the next chunk's copy.
    """

    def __init__(self, pool: concurrent.futures.Executor, calls: Sequence[Callable[[], None]]) -> None:
        self._futures = [pool.submit(c) for c in calls]
        self._lock = threading.Lock()
        self._left = len(self._futures)
        self._failed = False
        self._waiters: list[Callable[[], None]] = []
        for f in self._futures:
            f.add_done_callback(self._call_ended)

    def _call_ended(self, f: concurrent.futures.Future[None]) -> None:
        """On an IO thread: count the end; the last call (or the first failure) wakes the waiter once."""
        with self._lock:
            self._left -= 1
            failed = not f.cancelled() and f.exception() is not None
            wake = self._left == 0 or (failed and not self._failed)
            self._failed = self._failed or failed
            waiters = self._waiters if wake else []
            if wake:
                self._waiters = []
        for w in waiters:
            w()

    def done(self) -> bool:
        """True when every call has ended."""
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None) -> None:
        """From a thread that runs no event loop: wait up to ``timeout`` seconds for every call; raise
        the first error, or ``TimeoutError`` (the calls not started are cancelled then)."""
        done, pending = concurrent.futures.wait(self._futures, timeout)
        if pending:
            for f in pending:
                f.cancel()
            raise TimeoutError(f"{len(pending)} disk IO calls did not end within {timeout} s")
        for f in self._futures:
            exc = f.exception()
            if exc is not None:
                raise exc

    async def wait(self) -> None:
        """Return when every call succeeded.

        The waiting loop is woken once, when the last call ends (or at the first
        failure), not once per call: behind a thread busy in Python each wake-up
        may wait a whole switch interval for the GIL. On cancellation or the first
        error, calls not yet started are cancelled and running ones are waited for
        (a ``pwritev`` cannot be recalled) before the exception propagates: no IO
        on the buffers is left behind.
        """
        try:
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()
            with self._lock:
                pending = self._left > 0 and not self._failed
                if pending:
                    self._waiters.append(functools.partial(resolve_from_any_thread, loop, ended))
            if pending:
                await ended
            for f in self._futures:
                exc = f.exception() if f.done() and not f.cancelled() else None
                if exc is not None:
                    raise exc
        except BaseException:
            await self.settle()
            raise

    async def settle(self) -> None:
        """Cancel what has not started, wait for what runs; never raises."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.done():
                await settled(asyncio.wrap_future(f))
