"""Lifecycle and asyncio edges: close() from anywhere (done callbacks, garbage collection on a worker
thread), a close that times out and a later one that finishes, the disk file (which has no name)
closed only once no copy can use it and never outliving the process, fork(), ``async with`` /
``aclose()`` off the event loop and their cancellation, start failures, callbacks that raise
SystemExit, stats consistent with a transfer's end, typing, thread names.

Tests that could hang or leave threads or files behind when the behaviour regresses run in a fresh
interpreter (``run_script``) with a timeout.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import time
import typing

import pytest
import torch

import kvoffload
from kvoffload._core import runtime as runtime_module
from kvoffload._core.tiers.hostmem import HostBuffer
from kvoffload._testing import copy_calls, disk_file_stat, disk_io
from support.caches import random_caches
from support.process import kvoffload_threads


def disk_file_identity(off: kvoffload.Offloader) -> tuple[int, int]:
    """``(device, inode)`` of ``off``'s disk file, which has no name to look it up by."""
    st = disk_file_stat(off)
    return st.st_dev, st.st_ino


def disk_file_open(identity: tuple[int, int]) -> bool:
    """True while a file descriptor of this process is open on the file ``identity`` names."""
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:  # the descriptor listdir itself used, closed since
            continue
        if (st.st_dev, st.st_ino) == identity:
            return True
    return False


SCRIPT_PRELUDE = """
import asyncio, gc, os, sys, threading, time
import kvoffload
from kvoffload._testing import copy_calls, disk_file_stat, disk_io
from support.caches import random_caches
""" + inspect.getsource(disk_file_identity) + inspect.getsource(disk_file_open) + """

def kv_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvoffload"))

def gate_copies(off, direction="to_host"):
    '''Make every copy in ``direction`` wait for the returned event; returns (entered, release).'''
    calls = copy_calls(off)
    real = getattr(calls, direction)
    entered, release = threading.Event(), threading.Event()

    def gated(*args):
        entered.set()
        release.wait(60)
        return real(*args)

    setattr(calls, direction, gated)
    return entered, release
"""


def run_script(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``SCRIPT_PRELUDE + code`` in a fresh interpreter (tests/support importable)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", SCRIPT_PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-3000:]}"


def slot_bytes(caches) -> int:
    return kvoffload.BlockLayout.of(caches).slot_bytes


# -- 1. close() from anywhere ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close() in a done callback", "last reference dropped in a done callback"])
@pytest.mark.slow
def test_close_on_a_worker_thread_hands_off_and_releases_everything(tmp_path, how):
    path = tmp_path / "kv"
    proc = run_script(f"""
        path = {str(path)!r}
        how = {how!r}
        off = kvoffload.Offloader(random_caches(16, seed=1), host_blocks=4, disk_path=path, disk_blocks=8).start()
        disk = disk_file_identity(off)
        entered, release = gate_copies(off)
        t = off.store({{"a": 0}})
        assert entered.wait(10)
        ran, errors, where = threading.Event(), [], []
        holder = [off]

        def callback(_):
            where.append(threading.current_thread().name)
            try:
                if how.startswith("close()"):
                    holder[0].close()
                else:
                    holder.clear()  # the offloader's last reference: collected here, on the worker thread
                    gc.collect()
            except BaseException as e:
                errors.append(repr(e))
            ran.set()

        t.add_done_callback(callback)  # registered while the copy is held: it runs on the worker thread
        if how.startswith("last"):
            del off
        release.set()
        assert ran.wait(10), "the done callback never ran"
        print("callback ran on:", where)
        print("errors:", errors)
        for th in threading.enumerate():
            if th.name.startswith("kvoffload-close"):
                th.join(10)
        print("disk file open:", disk_file_open(disk))
        print("files left:", os.listdir(os.path.dirname(path)))
        print("threads left:", kv_threads())
        if holder:
            print("closed:", holder[0].closed)
            try:
                holder[0].store({{"b": 1}})
            except kvoffload.ClosedError:
                print("store refused")
        sys.stdout.flush()
        os._exit(0)  # do not wait for a leaked worker thread
    """)
    out = proc.stdout
    assert "callback ran on: ['kvoffload-store']" in out, explain(proc)
    for line in ("errors: []", "disk file open: False", "files left: []", "threads left: []"):
        assert line in out, f"missing {line!r}\n" + explain(proc)
    if how.startswith("close()"):
        assert "closed: True" in out and "store refused" in out, explain(proc)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, explain(proc)
    assert list(tmp_path.iterdir()) == []


def test_close_from_a_worker_thread_returns_at_once_and_a_later_close_waits_for_it(tmp_path, make_offloader, caches):
    off = make_offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=8)
    disk = disk_file_identity(off)
    off.store({"a": 0}).result(10)
    returned = threading.Event()
    calls = copy_calls(off)
    real = calls.to_host

    def close_inside_a_copy(copier, ids, host, rows):  # runs on the store loop's thread
        off.close()
        returned.set()
        return real(copier, ids, host, rows)

    calls.to_host = close_inside_a_copy
    t = off.store({"b": 1})
    assert returned.wait(10), "close() on the worker thread did not return"
    off.close()  # from this thread: waits for the handed-off shutdown
    assert t.done() and not disk_file_open(disk) and list(tmp_path.iterdir()) == [] and not kvoffload_threads()


# -- 2. a failed close, then a close that finishes -----------------------------------------------


@pytest.mark.slow
def test_close_timeout_raises_close_error_and_a_later_close_finishes(tmp_path):
    path = tmp_path / "kv"
    proc = run_script(f"""
        path = {str(path)!r}
        off = kvoffload.Offloader(random_caches(16, seed=2), host_blocks=4, disk_path=path, disk_blocks=8).start()
        disk = disk_file_identity(off)
        off.store({{"old": 3}}).result(10)
        entered, release = gate_copies(off)
        t = off.store({{"a": 0}})
        assert entered.wait(10)
        t0 = time.monotonic()
        try:
            off.close(timeout=0.2)
            print("first close: returned")
        except kvoffload.CloseError as e:
            print("first close: CloseError", isinstance(e, kvoffload.OffloadError))
        except BaseException as e:
            print("first close:", type(e).__name__, e)
        print("first close took < 2 s:", time.monotonic() - t0 < 2)
        print("disk file open while the copy runs:", disk_file_open(disk))
        print("closed:", off.closed)
        try:
            off.store({{"b": 1}})
        except kvoffload.ClosedError:
            print("store refused")
        release.set()
        try:
            off.close()
            print("second close: returned")
        except BaseException as e:
            print("second close:", type(e).__name__, e)
        print("transfer ended:", t.done())
        print("disk file open after close:", disk_file_open(disk))
        print("files left:", os.listdir(os.path.dirname(path)))
        print("threads left:", kv_threads())
        off.close()
        print("third close: returned")
        sys.stdout.flush()
        os._exit(0)
    """)
    out = proc.stdout
    for line in (
        "first close: CloseError True", "first close took < 2 s: True", "disk file open while the copy runs: True",
        "closed: True", "store refused", "second close: returned", "transfer ended: True",
        "disk file open after close: False", "files left: []", "threads left: []", "third close: returned",
    ):
        assert line in out, f"missing {line!r}\n" + explain(proc)
    assert list(tmp_path.iterdir()) == []


# -- 3. the disk file never outlives the process: it never has a name -------------------------------

EXITS = {
    "close": "off.close()",
    "garbage collection": "del off\ngc.collect()",
    "interpreter exit with the offloader open": "pass",
    "unhandled exception": "raise RuntimeError('boom: unhandled')",
    "exit while transfers run": """
io = disk_io(off)
real = io.pwritev
def slow(fd, bufs, offset):
    time.sleep(0.005)
    return real(fd, bufs, offset)
io.pwritev = slow
ts = [off.store({("late", i): i % 16}) for i in range(8)]
""",
    "exit after a close that timed out": """
entered, release = gate_copies(off)  # never released: the store loop stays stuck
t = off.store({"stuck": 1})
assert entered.wait(10)
try:
    off.close(timeout=0.2)
except kvoffload.CloseError:
    print("close timed out")
""",
}


@pytest.mark.parametrize("how", list(EXITS))
@pytest.mark.slow
def test_the_disk_file_has_no_name_and_no_exit_leaves_a_file(tmp_path, how):
    path = tmp_path / "kv"
    proc = run_script(
        f"""
path = {str(path)!r}
off = kvoffload.Offloader(random_caches(16, seed=3), host_blocks=8, disk_path=path, disk_blocks=16).start()
for i in range(4):
    off.store({{("k", i): i}}).result(10)
assert disk_file_stat(off).st_nlink == 0 and os.listdir(os.path.dirname(path)) == []
print("started")
sys.stdout.flush()
"""
        + EXITS[how],
        timeout=60,
    )
    assert "started" in proc.stdout, explain(proc)
    assert list(tmp_path.iterdir()) == [], f"a file survived {how}\n" + explain(proc)
    if how == "unhandled exception":
        assert "boom: unhandled" in proc.stderr and proc.returncode == 1, explain(proc)
    else:
        assert proc.returncode == 0, explain(proc)
    if how == "exit after a close that timed out":
        assert "close timed out" in proc.stdout, explain(proc)


# -- 4. fork() -------------------------------------------------------------------------------------


@pytest.mark.parametrize("child_ends", ["close() then exit", "garbage collection then exit", "exit", "os._exit"])
@pytest.mark.slow
def test_forked_child_refuses_the_parents_offloader_and_leaves_it_alone(tmp_path, child_ends):
    path = tmp_path / "kv"
    proc = run_script(f"""
        import warnings
        warnings.simplefilter("ignore", DeprecationWarning)  # "use of fork() may lead to deadlocks"
        path = {str(path)!r}
        child_ends = {child_ends!r}
        caches = random_caches(16, seed=4)
        off = kvoffload.Offloader(caches, host_blocks=2, disk_path=path, disk_blocks=8).start()
        disk = disk_file_identity(off)
        for i in range(4):
            off.store({{("k", i): i}}).result(10)
        pid = os.fork()
        if pid == 0:
            problems = []
            for name, call in [
                ("store", lambda: off.store({{"c": 1}})),
                ("load", lambda: off.load({{("k", 0): 9}})),
                ("lookup", lambda: off.lookup([("k", 0)])),
                ("discard", lambda: off.discard([("k", 0)])),
                ("start", off.start),
            ]:
                t0 = time.monotonic()
                try:
                    call()
                    problems.append(name + " did not raise")
                except kvoffload.OffloadError as e:
                    if "belongs to process" not in str(e):
                        problems.append(name + ": unclear error " + repr(e))
                if time.monotonic() - t0 > 1:
                    problems.append(name + " took too long")
            if child_ends == "close() then exit":
                off.close()
            elif child_ends == "garbage collection then exit":
                del off
                gc.collect()
            print("child problems:", problems)
            sys.stdout.flush()
            if child_ends == "os._exit":
                os._exit(3 if problems else 0)
            sys.exit(3 if problems else 0)  # runs the exit handlers in the child
        _, status = os.waitpid(pid, 0)
        print("child exit code:", os.waitstatus_to_exitcode(status))
        print("disk file open after the child:", disk_file_open(disk))
        off.store({{"parent": 5}}).result(10)
        off.load({{("k", 0): 10, "parent": 11}}).result(10)
        print("parent lookup:", off.lookup([("k", 0), "parent"]))
        off.close()
        print("disk file open after close:", disk_file_open(disk))
        print("files left:", os.listdir(os.path.dirname(path)))
        print("threads left:", kv_threads())
    """)
    out = proc.stdout
    for line in ("child problems: []", "child exit code: 0", "disk file open after the child: True", "parent lookup: 2",
                 "disk file open after close: False", "files left: []", "threads left: []"):
        assert line in out, f"missing {line!r}\n" + explain(proc)
    assert proc.returncode == 0, explain(proc)


# -- 5. async with / aclose off the event loop ---------------------------------------------------


async def _max_loop_gap_while(body) -> float:
    """Run ``await body()`` beside a task ticking every 5 ms; returns the longest gap between ticks."""
    stop, ticking = asyncio.Event(), asyncio.Event()
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            ticking.set()

    task = asyncio.create_task(ticker())
    await ticking.wait()
    try:
        await body()
    finally:
        stop.set()
        await task
    return max(gaps)


@pytest.mark.asyncio
async def test_async_with_keeps_the_event_loop_responsive_while_start_and_close_block(tmp_path, monkeypatch):
    real_storage = runtime_module.TieredStorage

    def slow_storage(*args, **kw):  # allocating and pinning a large slab: long, and off the GIL
        time.sleep(0.3)
        return real_storage(*args, **kw)

    monkeypatch.setattr(runtime_module, "TieredStorage", slow_storage)
    path = tmp_path / "kv"
    off = kvoffload.Offloader(random_caches(16, seed=5), host_blocks=4, disk_path=path, disk_blocks=8, chunk_bytes=64 << 10)

    async def body() -> None:
        async with off:
            await off.store({"a": 0})
            assert off.lookup(["a"]) == 1
            calls = copy_calls(off)
            real = calls.to_host
            calls.to_host = lambda *args: (time.sleep(0.3), real(*args))[1]  # close() waits for this copy
            off.store({"b": 1})

    gap = await _max_loop_gap_while(body)
    assert off.closed and list(tmp_path.iterdir()) == [] and not kvoffload_threads()
    assert gap < 0.1, f"the event loop stalled {gap * 1000:.0f} ms"


@pytest.mark.asyncio
async def test_async_with_a_1_gib_host_tier_keeps_the_event_loop_responsive():
    caches = random_caches(16, seed=5)
    host_blocks = (1 << 30) // slot_bytes(caches)
    if os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 4 * host_blocks * slot_bytes(caches):
        pytest.skip("needs a few GiB of memory")
    off = kvoffload.Offloader(caches, host_blocks=host_blocks)

    async def body() -> None:
        async with off:
            await off.store({"a": 0})
            assert off.lookup(["a"]) == 1

    gap = await _max_loop_gap_while(body)
    assert off.closed and not kvoffload_threads()
    assert gap < 0.1, f"the event loop stalled {gap * 1000:.0f} ms"


@pytest.mark.asyncio
async def test_cancelling_async_with_during_start_leaves_nothing_allocated(tmp_path, monkeypatch):
    loop = asyncio.get_running_loop()
    in_start = asyncio.Event()
    release = threading.Event()
    real_storage = runtime_module.TieredStorage

    def slow_storage(*args, **kw):  # start() blocks here until released
        loop.call_soon_threadsafe(in_start.set)
        release.wait(3)
        return real_storage(*args, **kw)

    monkeypatch.setattr(runtime_module, "TieredStorage", slow_storage)
    off = kvoffload.Offloader(random_caches(16, seed=6), host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=8)
    body_ran = False

    async def use() -> None:
        nonlocal body_ran
        async with off:
            body_ran = True

    task = asyncio.create_task(use())
    await asyncio.wait_for(in_start.wait(), 2)  # the loop runs while start() is blocked
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done(), "CancelledError came before start() ended: its resources would be left behind"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not body_ran and off.closed
    assert not kvoffload_threads() and list(tmp_path.iterdir()) == []
    with pytest.raises(kvoffload.ClosedError):
        off.store({"a": 0})


@pytest.mark.asyncio
async def test_aclose_completes_even_if_its_task_is_cancelled(tmp_path, faults):
    path = tmp_path / "kv"
    off = kvoffload.Offloader(random_caches(16, seed=7), host_blocks=4, disk_path=path, disk_blocks=8)
    await off.__aenter__()
    gate = faults.gate(off, "to_host")
    t = off.store({"a": 0})
    try:
        await gate.entered_async()
        closing = asyncio.create_task(off.aclose())
        await asyncio.sleep(0.05)  # aclose() is now waiting for the held copy
        closing.cancel()
        await asyncio.sleep(0.05)
        assert not closing.done(), "aclose() gave up when cancelled: the close would be left half done"
    finally:
        gate.open()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert t.done() and off.closed and list(tmp_path.iterdir()) == [] and not kvoffload_threads()
    await off.aclose()  # idempotent


@pytest.mark.asyncio
async def test_aclose_raises_close_error_and_can_be_retried(tmp_path, faults):
    path = tmp_path / "kv"
    off = kvoffload.Offloader(random_caches(16, seed=8), host_blocks=4, disk_path=path, disk_blocks=8)
    await off.__aenter__()
    disk = disk_file_identity(off)
    gate = faults.gate(off, "to_host")
    off.store({"a": 0})
    try:
        await gate.entered_async()
        with pytest.raises(kvoffload.CloseError):
            await off.aclose(timeout=0.1)
        assert disk_file_open(disk), "the disk file was closed while a copy was still running"
    finally:
        gate.open()
    await off.aclose()
    assert not disk_file_open(disk) and list(tmp_path.iterdir()) == [] and not kvoffload_threads()


# -- 6. start failures -----------------------------------------------------------------------------


def _fail_second_host_buffer(monkeypatch) -> None:
    """The second HostBuffer (the disk tier's bounce buffer, after the host slab) fails to pin."""
    real_init = HostBuffer.__init__
    made = [0]

    def init(self, nbytes, *, pin):
        made[0] += 1
        if made[0] == 2:
            raise kvoffload.OffloadError("could not pin 0.01 GiB of host memory (injected)")
        real_init(self, nbytes, pin=pin)

    monkeypatch.setattr(HostBuffer, "__init__", init)


START_FAILURES = {
    # name: (offloader keyword arguments given tmp_path, expected cause type)
    "missing directory": (lambda tmp: dict(disk_path=tmp / "nope" / "kv", disk_blocks=8), FileNotFoundError),
    "read-only file system": (lambda tmp: dict(disk_path="/proc/kvoffload-test", disk_blocks=8), OSError),
    # the persistent file this start created goes with it, its checkpoint too
    "pinning fails, persistent": (lambda tmp: dict(disk_path=tmp / "kv", disk_blocks=8, persist=True), kvoffload.OffloadError),
    "no memory for the host tier": (lambda tmp: dict(host_blocks=(1 << 40) // 4096), (MemoryError, OSError)),
    "pinning fails": (lambda tmp: dict(disk_path=tmp / "kv", disk_blocks=8), kvoffload.OffloadError),
}


@pytest.mark.parametrize("what", list(START_FAILURES))
def test_start_failures_raise_start_error_and_leave_nothing(tmp_path, monkeypatch, what):
    kwargs, cause = START_FAILURES[what]
    (tmp_path / "dir").mkdir()
    if what.startswith("pinning fails"):
        _fail_second_host_buffer(monkeypatch)
    caches = random_caches(16, seed=9)
    assert slot_bytes(caches) == 4096
    before = set(tmp_path.iterdir())
    off = kvoffload.Offloader(caches, **{"host_blocks": 4, **kwargs(tmp_path)})
    try:
        t0 = time.monotonic()
        with pytest.raises(kvoffload.StartError) as info:
            off.start()
        assert time.monotonic() - t0 < 5, "start() took long to fail"
        assert isinstance(info.value, kvoffload.OffloadError)
        assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
        assert set(tmp_path.iterdir()) == before and (tmp_path / "dir").is_dir()
        assert not kvoffload_threads()
        with pytest.raises(kvoffload.ClosedError):
            off.store({"a": 0})
    finally:
        off.close()  # also when start() wrongly succeeded: its threads would upset the next tests


def test_start_error_from_os_error_keeps_errno_reachable(tmp_path):
    off = kvoffload.Offloader(random_caches(8), host_blocks=4, disk_path=tmp_path / "nope" / "kv", disk_blocks=8)
    with pytest.raises(kvoffload.StartError, match="does not exist") as info:
        off.start()
    assert info.value.__cause__.errno == errno.ENOENT


# -- 7. callbacks never stop a worker ------------------------------------------------------------


@pytest.mark.parametrize("exc", ["SystemExit", "KeyboardInterrupt"])
@pytest.mark.slow
def test_done_callback_raising_a_base_exception_does_not_stop_the_worker(exc):
    proc = run_script(f"""
        import logging
        logging.disable(logging.CRITICAL)  # the library logs the callback's error; keep stderr for real trouble
        caches = random_caches(32, seed=10)
        off = kvoffload.Offloader(caches, host_blocks=32).start()
        calls = copy_calls(off)
        real = calls.to_host
        entered, release = gate_copies(off)

        def bad(_):
            raise {exc}()

        async def main():
            t = off.store({{"first": 0}})
            assert entered.wait(10)
            t.add_done_callback(bad)  # registered on this loop: runs on it (the ones below, from a plain thread, on the worker)
            async def wait_for_t():
                return await t

            waiter = asyncio.create_task(asyncio.wait_for(wait_for_t(), 5))
            await asyncio.sleep(0)
            release.set()
            try:
                await waiter
                print("awaiter woke")
            except BaseException as e:
                print("awaiter:", type(e).__name__)

        asyncio.run(main())
        calls.to_host = real
        ok = 0
        for i in range(20):
            try:
                t = off.store({{("k", i): i % 16}})
                t.add_done_callback(bad)
                t.result(2)
                off.load({{("k", i): 20 + i % 8}}).result(2)
                ok += 1
            except BaseException as e:
                print("round trip", i, "failed:", type(e).__name__, e)
                break
        print("round trips:", ok)
        entered, release = gate_copies(off)
        t = off.store({{"to cancel": 1}})
        entered.wait(5)
        t.cancel()
        release.set()
        try:
            t.result(2)
            print("cancel: completed first")
        except kvoffload.TransferCancelled:
            print("cancel: cancelled")
        except BaseException as e:
            print("cancel:", type(e).__name__)
        t0 = time.monotonic()
        try:
            off.close(timeout=5)
            print("close prompt:", time.monotonic() - t0 < 2)
        except BaseException as e:
            print("close:", type(e).__name__, e)
        print("threads left:", kv_threads())
        sys.stdout.flush()
        os._exit(0)
    """)
    out = proc.stdout
    for line in ("awaiter woke", "round trips: 20", "close prompt: True", "threads left: []"):
        assert line in out, f"missing {line!r}\n" + explain(proc)
    assert "cancel: cancelled" in out or "cancel: completed first" in out, explain(proc)


# -- 8. stats agree with what a waiter sees --------------------------------------------------------


@pytest.mark.slow
def test_stats_count_a_transfer_as_ended_when_result_returns(make_offloader):
    caches = random_caches(32, seed=11)
    off = make_offloader(caches, host_blocks=32)
    stop = threading.Event()

    def metrics() -> None:  # threads polling stats() meanwhile, as a metrics exporter would
        while not stop.is_set():
            off.stats()

    pollers = [threading.Thread(target=metrics, name=f"metrics-{i}") for i in range(2)]
    for p in pollers:
        p.start()
    try:
        for i in range(1000):
            off.store({("k", i): i % 32}).result(10)
            s = off.stats()
            assert (s.in_flight, s.stores) == (0, i + 1), f"round {i}: {s}"
            off.load({("k", i): (i + 1) % 32}).result(10)
            s = off.stats()
            assert (s.in_flight, s.loads) == (0, i + 1), f"round {i}: {s}"
    finally:
        stop.set()
        for p in pollers:
            p.join()
    assert off.stats().bytes_stored == 1000 * off.layout.block_bytes


@pytest.mark.asyncio
async def test_stats_count_a_transfer_as_ended_when_await_returns(make_offloader):
    caches = random_caches(32, seed=12)
    off = make_offloader(caches, host_blocks=32)
    for i in range(200):
        await off.store({("k", i): i % 32})
        s = off.stats()
        assert (s.in_flight, s.stores) == (0, i + 1), f"round {i}: {s}"
        await off.load({("k", i): (i + 1) % 32})
        s = off.stats()
        assert (s.in_flight, s.loads) == (0, i + 1), f"round {i}: {s}"


def test_stats_count_a_cancelled_transfer_when_its_waiter_wakes(make_offloader, faults):
    off = make_offloader(random_caches(16, seed=13), host_blocks=8)
    gate = faults.gate(off, "to_host")
    t = off.store({"a": 0, "b": 1})
    gate.wait_entered()
    t.cancel()
    gate.open()
    try:
        t.result(10)
    except kvoffload.TransferCancelled:
        pass
    s = off.stats()
    assert s.in_flight == 0 and (s.cancelled, s.stores) == ((1, 0) if t.cancelled() else (0, 1)), s


# -- 9. typing -------------------------------------------------------------------------------------


def test_after_is_typed_as_an_optional_cuda_event(make_offloader, caches):
    for method in (kvoffload.Offloader.store, kvoffload.Offloader.load):
        hints = typing.get_type_hints(method)
        assert hints["after"] == typing.Optional[torch.cuda.Event], hints["after"]
    assert typing.get_type_hints(kvoffload.Offloader.aclose)["timeout"] == typing.Optional[float]
    off = make_offloader(caches, host_blocks=4)
    with pytest.raises((TypeError, ValueError)):
        off.store({"a": 0}, after=object())  # CPU caches: after= is refused whatever it is


# -- 10. thread names ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_thread_kvoffload_starts_is_named_kvoffload(tmp_path, monkeypatch):
    started: list[str] = []
    real_start = threading.Thread.start

    def recording_start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    before = set(threading.enumerate())
    alive_during: set[str] = set()

    def sample() -> None:
        alive_during.update(t.name for t in threading.enumerate() if t not in before)

    caches = random_caches(64, seed=14)
    async with kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=32, io_threads=2) as off:
        io = disk_io(off)
        real_w = io.pwritev

        def pwritev(fd, bufs, offset):
            sample()
            return real_w(fd, bufs, offset)

        io.pwritev = pwritev
        for i in range(16):  # past the host tier: spills to disk
            await off.store({("k", i): i})
        await off.load({("k", 0): 40, ("k", 15): 41})
        sample()
        # a close handed off from a worker thread
        done = threading.Event()
        t = off.store({"last": 50})
        t.add_done_callback(lambda _: (off.close(), done.set()))
        await t
        assert done.wait(5)
        sample()
    sample()
    for th in threading.enumerate():
        if th.name.startswith("kvoffload-close"):
            th.join(10)
    started_here = [n for n in started if n not in {t.name for t in before}]
    assert started_here, "nothing recorded"
    bad = sorted({n for n in started_here + sorted(alive_during) if not n.startswith("kvoffload")})
    assert not bad, f"threads started by kvoffload without a kvoffload name: {bad}"
    assert not kvoffload_threads() and list(tmp_path.iterdir()) == []
