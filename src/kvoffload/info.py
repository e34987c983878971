"""``kvoffload info``: the environment report to paste into a bug report.

Versions (kvoffload, Python, torch, cuda-bindings, redis-py, hiredis and the other packages
kvoffload may use), the CUDA driver and runtime, the GPUs, whether the driver has
``cuMemcpyBatchAsync`` and whether NVRTC loads (the copy kernel), the compiled extensions, host
memory and the page-lock limit, and what the file system of a directory offers a disk tier
(O_DIRECT, O_TMPFILE, flock, free space). Every probe is guarded: one that cannot answer prints
``unavailable (the reason)`` and the report goes on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.metadata
import mmap
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import kvoffload

__all__ = ["PACKAGES", "report", "run_info"]

PACKAGES = ("torch", "numpy", "cuda-bindings", "cuda-python", "anyio", "crc32c", "redis", "hiredis",
            "prometheus-client", "vllm", "trio", "transformers")
"""The distributions whose versions the report lists (kvoffload's dependencies and its optional ones)."""

BATCH_ABI_VERSION = 12080
"""The ``cuMemcpyBatchAsync`` ABI kvoffload resolves (CUDA 12.8's; CUDA 13 changed its signature)."""

EXTENSIONS = ("piece_copies", "convoy_free_lock")
"""kvoffload's compiled extensions (in ``kvoffload/_core/base``)."""


def _unavailable(e: Exception) -> str:
    reason = " ".join(str(e).split()) or "no message"
    return f"unavailable ({type(e).__name__}: {reason})"


def _guard(probe: Callable[[], str]) -> str:
    """``probe()``, or ``unavailable (reason)`` when it raises."""
    try:
        return probe()
    except Exception as e:
        return _unavailable(e)


def _guard_lines(probe: Callable[[], list[str]]) -> list[str]:
    """``probe()``, or one ``unavailable (reason)`` when it raises."""
    try:
        return probe()
    except Exception as e:
        return [_unavailable(e)]


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _python() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"


def _system() -> str:
    libc = " ".join(x for x in platform.libc_ver() if x)
    return f"{platform.system()} {platform.release()} {platform.machine()}" + (f", {libc}" if libc else "")


def _cpus() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return f"{os.cpu_count()}" + (f" ({usable} usable by this process)" if usable is not None else "")


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                out[key] = int(fields[0]) * 1024
    return out


def _memory() -> str:
    info = _meminfo()
    return f"{_gib(info['MemTotal'])} total, {_gib(info['MemAvailable'])} available (MemAvailable)"


def _memlock() -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def say(n: int) -> str:
        return "unlimited" if n == resource.RLIM_INFINITY else _gib(n)

    who = "this process runs as root, which may pin past it" if os.geteuid() == 0 else "pinning more host memory than this fails"
    return f"{say(soft)} (hard {say(hard)}); {who}"


def _torch() -> str:
    import torch

    built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build (no CUDA)"
    return f"{torch.__version__}, {built}"


def _gpus() -> list[str]:
    import torch

    if torch.version.cuda is None:
        return ["none (this torch is a CPU build)"]
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return ["none visible to torch" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")]
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append(f"cuda:{i} {p.name}, compute capability {p.major}.{p.minor}, {_gib(total)} ({_gib(free)} free)")
    return out


def _cuda_driver() -> object:
    """``cuda.bindings.driver``, initialised (``cuInit``)."""
    from cuda.bindings import driver as cu

    (err,) = cu.cuInit(0)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"cuInit: {(name or b'?').decode()} ({int(err)})")
    return cu


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _driver() -> str:
    cu: object = _cuda_driver()
    err, v = cu.cuDriverGetVersion()  # type: ignore[attr-defined]
    if int(err) != 0:
        raise RuntimeError(f"cuDriverGetVersion: error {int(err)}")
    return f"supports CUDA {_cuda_version(int(v))} ({int(v)})"


def _runtime() -> str:
    import torch

    torch_cuda = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "torch: a CPU build"
    return f"{torch_cuda}; cudart {_guard(_cudart)}"


def _cudart() -> str:
    from cuda.bindings import runtime as cudart

    err, v = cudart.cudaRuntimeGetVersion()
    if int(err) != 0:
        raise RuntimeError(f"cudaRuntimeGetVersion: error {int(err)}")
    return _cuda_version(int(v))


def _batch_copies() -> str:
    cu: object = _cuda_driver()
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT  # type: ignore[attr-defined]
    err, pfn, _status = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", BATCH_ABI_VERSION, flags)  # type: ignore[attr-defined]
    if int(err) == 0 and int(pfn):
        return "available (one driver call per transfer's copies)"
    return "unavailable (this driver has no CUDA 12.8 cuMemcpyBatchAsync: copies go one cuMemcpyAsync each)"


def _nvrtc() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion: {nvrtc.nvrtcGetErrorString(err)[1]!r}")
    return f"{major}.{minor} (the copy kernel can be compiled)"


def _extensions() -> list[str]:
    folder = Path(kvoffload.__file__).parent / "_core" / "base"
    out = []
    for name in EXTENSIONS:
        module = sys.modules.get(f"kvoffload._core.base.{name}")
        if module is not None and getattr(module, "__file__", None):
            out.append(f"{name}: loaded ({module.__file__})")
            continue
        files = sorted(folder.glob(f"{name}.*.so")) + sorted(folder.glob(f"{name}.*.pyd"))
        out.append(f"{name}: " + (f"built, not loaded ({files[0]})" if files else
                                  "missing (pip install builds it; it needs a C compiler and the Python headers)"))
    return out


def _mount(path: str) -> str:
    """The file system type and mount point holding ``path`` (the longest matching mount)."""
    real = os.path.realpath(path)
    best = ("", "?")
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1].replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fields[2])
    memory = "; it keeps files in memory: a disk tier there saves none" if best[1] in ("tmpfs", "ramfs") else ""
    return f"{best[1]} (mounted at {best[0] or '?'}){memory}"


def _free(path: str) -> str:
    usage = shutil.disk_usage(path)
    return f"{_gib(usage.free)} free of {_gib(usage.total)}"


@contextlib.contextmanager
def _scratch_file(path: str) -> Iterator[str]:
    """The name of a new empty file in ``path``, removed afterwards."""
    fd, name = tempfile.mkstemp(prefix=".kvoffload-info-", dir=path)
    os.close(fd)
    try:
        yield name
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _o_direct(path: str) -> str:
    if not hasattr(os, "O_DIRECT"):
        return "unavailable (this system has no O_DIRECT)"
    with _scratch_file(path) as name:
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return "not supported (EINVAL): the disk tier falls back to buffered IO through the page cache"
            raise
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
            try:
                buf.write(os.urandom(4096))
                os.pwritev(fd, [buf], 0)
                back = mmap.mmap(-1, 4096)
                try:
                    os.preadv(fd, [back], 0)
                    same = back[:] == buf[:]
                finally:
                    back.close()
            finally:
                buf.close()
        except OSError as e:
            if e.errno == errno.EINVAL:
                return "not supported (EINVAL on an aligned write): the disk tier falls back to buffered IO"
            raise
        finally:
            os.close(fd)
    return "supported (4 KiB aligned write and read back)" if same else "unavailable (the 4 KiB read back differs)"


def _o_tmpfile(path: str) -> str:
    if not hasattr(os, "O_TMPFILE"):
        return "unavailable (this system has no O_TMPFILE)"
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return f"not supported ({errno.errorcode[e.errno]}): the disk file gets a temporary name, unlinked at start"
        raise
    os.close(fd)
    return "supported"


def _flock(path: str) -> str:
    with _scratch_file(path) as name:
        fd = os.open(name, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                return f"not supported ({errno.errorcode[e.errno]}): a file with a name is used unlocked"
            raise
        finally:
            os.close(fd)
    return "supported"


def _redis_server() -> str:
    for exe in ("redis-server", "valkey-server"):
        found = shutil.which(exe)
        if found:
            out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
            return f"{found}: {out or 'no --version output'}"
    return "not found on PATH (the remote tier's tests start one)"


def report(path: str | None = None) -> list[tuple[str, str]]:
    """The report as ``(what, answer)`` pairs; ``path``: the directory whose file system is probed
    (default: the temporary directory)."""
    folder = os.path.abspath(path if path is not None else tempfile.gettempdir())
    rows: list[tuple[str, str]] = [
        ("kvoffload", f"{kvoffload.__version__} ({Path(kvoffload.__file__).parent})"),
        ("python", _guard(_python)),
        ("system", _guard(_system)),
        ("cpus", _guard(_cpus)),
        ("host memory", _guard(_memory)),
        ("RLIMIT_MEMLOCK", _guard(_memlock)),
        ("torch", _guard(_torch)),
    ]
    rows += [(dist, _guard(functools.partial(_version, dist))) for dist in PACKAGES if dist != "torch"]
    rows += [
        ("CUDA driver", _guard(_driver)),
        ("CUDA runtime", _guard(_runtime)),
    ]
    gpus = _guard_lines(_gpus)
    rows += [("GPU" if len(gpus) == 1 else f"GPU {i}", g) for i, g in enumerate(gpus)]
    rows += [
        ("cuMemcpyBatchAsync", _guard(_batch_copies)),
        ("NVRTC", _guard(_nvrtc)),
    ]
    rows += [("extension", e) for e in _guard_lines(_extensions)]
    rows += [
        ("path", folder),
        ("file system", _guard(lambda: _mount(folder))),
        ("free space", _guard(lambda: _free(folder))),
        ("O_DIRECT", _guard(lambda: _o_direct(folder))),
        ("O_TMPFILE", _guard(lambda: _o_tmpfile(folder))),
        ("flock", _guard(lambda: _flock(folder))),
        ("redis-server", _guard(_redis_server)),
    ]
    return rows


def run_info(path: str | None = None) -> int:
    """Print the report (one ``what: answer`` line each); returns the exit code, 0."""
    rows = report(path)
    width = max(len(what) for what, _ in rows)
    for what, answer in rows:
        print(f"{what + ':':{width + 1}s} {answer}", flush=True)
    return 0
