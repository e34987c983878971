"""Shutdown and resources: close(), leaving ``with``/``async with`` and garbage collection of an
unclosed offloader while stores (spilling to disk) and loads (reading from disk) are in flight;
open/close cycles; host memory.

Each shutdown must return within a bounded time; every transfer then has ended, cancelled or done
(never failed, never left running); every waiter (asyncio tasks, a loop in another thread and a plain
thread) has returned; no ``kvoffload*`` thread is left; the disk file (which never has a name) is
closed and nothing is left in its directory; no file descriptor is left open. Twenty open/close
cycles under load must not grow file descriptors, threads or RSS, and host memory is the configured
slots plus a constant.

The disk is slowed (a few ms per IO call: a fault, injected through the ``faults`` fixture) so that
transfers are really in flight when shutdown comes; shutdown starts once a disk read has begun.

A process that exits with an offloader open (also through an unhandled exception) closes it before
Python stops its thread pools: a persistent disk tier keeps its host entries, write-through reaches
the remote store.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import kvoffload
import torch

from support.caches import block_bytes, random_caches

from support.figures import report_figure

from support.process import kvoffload_threads, open_fds, rss_bytes

from support.redis_servers import binaries, redis_server  # binaries: a fixture

SHUTDOWN_BOUND_S = 10.0
SLOW_IO_S = 0.003
FIGURES = {"transfers": 0, "ended cancelled": 0, "ended done": 0, "cycles": 0}


def slow(real, *args):
    time.sleep(SLOW_IO_S)  # a slow disk is the fault here, not a wait
    return real(*args)


def open_loaded(caches, path, faults) -> tuple[kvoffload.Offloader, list[kvoffload.Transfer]]:
    """An offloader with 32 keys in host memory and 64 on disk, then, on a slow disk, 6 stores (each
    spilling 4 entries) and 24 loads from disk in flight; returns once a disk read has begun."""
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    off = kvoffload.Offloader(caches, host_blocks=32, disk_path=path, disk_blocks=128, chunk_bytes=slot, io_threads=2).start()
    for lo in range(0, 96, 32):
        off.store({("seed", i): i for i in range(lo, lo + 32)}).result(30)
    faults.fail(off, "pwritev", slow)
    reads = faults.fail(off, "preadv", slow)
    transfers = []
    for i in range(24):
        if i % 4 == 0:
            transfers.append(off.store({("new", i, j): 96 + (i + j) % 32 for j in range(4)}))
        transfers.append(off.load({("seed", (2 * i + j) % 64): 128 + (2 * i + j) % 128 for j in range(2)}))
    reads.wait_entered()
    return off, transfers


def thread_waiter(transfers, outcomes: list) -> threading.Thread:
    """A plain thread blocking on ``result()`` of each transfer."""

    def run() -> None:
        for t in transfers:
            try:
                t.result(timeout=60)
                outcomes.append("done")
            except kvoffload.TransferCancelled:
                outcomes.append("cancelled")
            except Exception as e:
                outcomes.append(repr(e))

    th = threading.Thread(target=run, name="waiter")
    th.start()
    return th


async def task_outcome(t) -> str:
    try:
        await t
        return "done"
    except kvoffload.TransferCancelled:  # close() cancelled it: never the waiting task's own CancelledError
        return "cancelled"
    except Exception as e:
        return repr(e)


def check_ended(transfers, outcomes) -> None:
    assert outcomes and all(o in ("done", "cancelled") for o in outcomes), [o for o in outcomes if o not in ("done", "cancelled")]
    for t in transfers:
        assert t.done(), f"{t!r} still running after shutdown"
        assert t.cancelled() or t.exception() is None, f"{t!r} failed: {t.exception()!r}"
    FIGURES["transfers"] += len(transfers)
    FIGURES["ended cancelled"] += sum(t.cancelled() for t in transfers)
    FIGURES["ended done"] += sum(not t.cancelled() for t in transfers)


def check_released(path, fds: int) -> None:
    assert not kvoffload_threads(), f"threads left: {kvoffload_threads()}"
    assert os.listdir(os.path.dirname(path)) == [], "a file outlived shutdown"
    assert open_fds() <= fds, f"{open_fds() - fds} file descriptor(s) left open (the disk file's among them?)"


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["close", "async-with"])
async def test_shutdown_under_load_from_a_loop(tmp_path, faults, how):
    caches = random_caches(256, seed=81)
    path = str(tmp_path / "kv")
    gc.collect()
    fds = open_fds()
    off, transfers = open_loaded(caches, path, faults)
    outcomes: list = []
    waiter_thread = thread_waiter(transfers[1::2], outcomes)
    tasks = [asyncio.ensure_future(task_outcome(t)) for t in transfers[::2]]
    assert off.stats().in_flight > 0, "nothing was in flight at shutdown: the test means nothing"
    t0 = time.perf_counter()
    if how == "close":
        await asyncio.to_thread(off.close, SHUTDOWN_BOUND_S)
    else:
        async with off:  # started above (entering again is a no-op); leaving it closes the offloader
            pass
    took = time.perf_counter() - t0
    assert took < SHUTDOWN_BOUND_S, f"shutdown took {took:.1f} s"
    _, pending = await asyncio.wait(tasks, timeout=5)
    assert not pending, f"{len(pending)} awaiting task(s) never woke up"
    outcomes += [t.result() for t in tasks]
    await asyncio.to_thread(waiter_thread.join, 5)
    assert not waiter_thread.is_alive(), "a thread blocked in result() never woke up"
    check_ended(transfers, outcomes)
    assert any(t.cancelled() for t in transfers), "shutdown cancelled nothing: it came too late to mean anything"
    del off
    gc.collect()
    check_released(path, fds)


@pytest.mark.parametrize("how", ["close", "with", "gc"])
def test_shutdown_under_load_from_a_thread(tmp_path, faults, how):
    caches = random_caches(256, seed=82)
    path = str(tmp_path / "kv")
    gc.collect()
    fds = open_fds()
    off, transfers = open_loaded(caches, path, faults)
    outcomes: list = []
    waiter_thread = thread_waiter(transfers, outcomes)
    # an asyncio loop in another thread awaits them too
    loop_outcomes: list = []

    async def await_all() -> None:
        loop_outcomes.extend(await asyncio.gather(*(task_outcome(t) for t in transfers)))

    loop_thread = threading.Thread(target=asyncio.run, args=(await_all(),), name="waiter-loop")
    loop_thread.start()
    assert off.stats().in_flight > 0
    t0 = time.perf_counter()
    if how == "close":
        off.close(SHUTDOWN_BOUND_S)
    elif how == "with":
        with off:  # started above (entering again is a no-op); leaving it closes the offloader
            pass
    else:
        del off  # the last reference: the finalizer closes it
        gc.collect()
    took = time.perf_counter() - t0
    assert took < SHUTDOWN_BOUND_S, f"shutdown ({how}) took {took:.1f} s"
    for th in (waiter_thread, loop_thread):
        th.join(5)
        assert not th.is_alive(), f"{th.name} never woke up"
    check_ended(transfers, outcomes + loop_outcomes)
    assert any(t.cancelled() for t in transfers), "shutdown cancelled nothing: it came too late to mean anything"
    if how != "gc":
        del off
        gc.collect()
    check_released(path, fds)


@pytest.mark.slow
def test_open_close_cycles_under_load_do_not_leak(tmp_path, faults):
    caches = random_caches(256, seed=83)

    def cycle(i: int) -> None:
        path = str(tmp_path / f"kv{i}")
        off, transfers = open_loaded(caches, path, faults)
        outcomes: list = []
        th = thread_waiter(transfers, outcomes)
        off.close(SHUTDOWN_BOUND_S)
        faults.restore()
        th.join(10)
        check_ended(transfers, outcomes)
        assert os.listdir(tmp_path) == []
        FIGURES["cycles"] += 1

    cycle(0)  # warm up (allocator pools, lazy imports)
    gc.collect()
    fds, threads, rss = open_fds(), threading.active_count(), rss_bytes()
    for i in range(1, 21):
        cycle(i)
    gc.collect()
    assert open_fds() <= fds, f"{open_fds() - fds} file descriptors leaked over 20 cycles"
    assert threading.active_count() <= threads, [t.name for t in threading.enumerate()]
    grown = rss_bytes() - rss
    # each cycle maps a 64 KiB slab and 8 KiB of bounce buffers: 20 leaked cycles would still be small,
    # so this bound only catches gross leaks (e.g. a cache-sized copy kept per cycle)
    assert grown < 64 << 20, f"RSS grew {grown >> 20} MiB over 20 cycles"
    assert not kvoffload_threads() and not list(tmp_path.iterdir())


def test_host_memory_is_the_configured_slots_plus_constant():
    caches = {"kv": torch.randint(0, 255, (64, 256 << 10), dtype=torch.uint8)}  # 256 KiB blocks
    before = rss_bytes()
    with kvoffload.Offloader(caches, host_blocks=128, chunk_bytes=8 << 20) as off:
        off.store({i: i for i in range(64)}).result(30)
        grown = rss_bytes() - before
    slab = 128 * (256 << 10)
    assert slab <= grown < slab + (48 << 20), f"RSS grew {grown >> 20} MiB for a {slab >> 20} MiB slab"


# -- close() from a thread that runs an event loop -------------------------------------------------

# (a bug these tests found, fixed: close() there raised RuntimeError and left a worker thread and the disk file)


@pytest.mark.parametrize("how", ["close()", "with", "gc"])
@pytest.mark.slow
def test_close_from_a_coroutine_releases_everything(tmp_path, how):
    # In a fresh interpreter: the bug leaves a worker thread running, which would upset the other tests.
    code = f"""
import asyncio, gc, os, threading
import kvoffload
from kvoffload._testing import disk_file_stat
from support.caches import random_caches

def open_on(st):
    '''True while a file descriptor of this process is open on the file ``st`` describes.'''
    def same(fd):
        try:
            now = os.fstat(int(fd))
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
    return any(same(fd) for fd in os.listdir("/proc/self/fd"))

async def main():
    caches = random_caches(16, seed=84)
    path = {str(tmp_path / "kv")!r}
    how = {how!r}
    try:
        if how == "with":
            with kvoffload.Offloader(caches, host_blocks=4, disk_path=path, disk_blocks=8) as off:
                disk = disk_file_stat(off)
                await off.store({{"a": 0}})
        else:
            off = kvoffload.Offloader(caches, host_blocks=4, disk_path=path, disk_blocks=8).start()
            disk = disk_file_stat(off)
            await off.store({{"a": 0}})
            if how == "close()":
                off.close()  # blocking, but the documented way to close; nothing says not from a coroutine
            else:
                del off
                gc.collect()
    except Exception as e:
        print("raised", repr(e))
    print("disk file open:", open_on(disk))
    print("files left:", os.listdir(os.path.dirname(path)))
    print("threads left:", sorted(t.name for t in threading.enumerate() if t.name.startswith("kvoffload")))

asyncio.run(main())
os._exit(0)  # do not wait for a leaked worker thread
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=False)
    out = proc.stdout
    for line in ("disk file open: False", "files left: []", "threads left: []"):
        assert line in out, f"missing {line!r}\n" + out + proc.stderr[-1500:]
    assert "raised" not in out, out + proc.stderr[-1500:]


# -- exit with an offloader open: closed before Python stops its thread pools ----------------------

# (a bug these tests found, fixed: the exit close ran after concurrent.futures had stopped every thread
# pool, so a persistent tier lost the entries it held only in host memory, and write-through never
# reached the remote store)

EXIT_BLOCKS = 16

# The child stores keys from random_caches(EXIT_BLOCKS, seed=EXIT_SEED), prints "stored" once they
# all completed, then leaves with the offloader open: the exit close alone must keep them.
EXIT_SEED = 85
PERSIST_CHILD = textwrap.dedent("""
    import sys, threading
    import kvoffload
    from kvoffload._core import runtime
    from support.caches import random_caches

    path, how = sys.argv[1], sys.argv[2]
    off = kvoffload.Offloader(random_caches(16, seed=85), host_blocks=16, disk_path=path, disk_blocks=32, persist=True,
                              fingerprint="model-a").start()
    off.store({f"k{i}": i for i in range(8)}).result(30)  # 8 keys, 16 host slots: none on disk yet
    print("stored", flush=True)
    if how == "unhandled exception":
        raise RuntimeError("boom: unhandled")
    if how == "close running in another thread":  # a non-daemon thread is inside close() as the main thread ends
        entered = threading.Event()
        real_close_now = runtime.Runtime._close_now

        def close_now(*args, **kwargs):
            entered.set()
            real_close_now(*args, **kwargs)

        runtime.Runtime._close_now = close_now
        threading.Thread(target=off.close, name="closer").start()
        assert entered.wait(30)
""")
REMOTE_CHILD = textwrap.dedent("""
    import sys
    import kvoffload
    from support.caches import random_caches

    off = kvoffload.Offloader(random_caches(16, seed=85), host_blocks=16, remote=sys.argv[1], fingerprint="model-a").start()
    off.store({f"p{i}": i for i in range(16)}).result(30)  # write-through starts as the store completes
    print("stored", flush=True)
""")


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (tests/support importable), run to its end."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env, check=False)


def check_loads_byte_exact(off: kvoffload.Offloader, caches: dict[str, torch.Tensor], keys: list[str]) -> None:
    """Load ``keys`` into blocks 0.. and compare with the blocks the child stored them from."""
    off.load({k: i for i, k in enumerate(keys)}).result(30)
    want = random_caches(EXIT_BLOCKS, seed=EXIT_SEED)
    for i, k in enumerate(keys):
        assert block_bytes(caches, i) == block_bytes(want, i), k


@pytest.mark.parametrize("how", ["exit", "unhandled exception", "close running in another thread"])
@pytest.mark.slow
def test_a_persistent_tier_keeps_its_host_entries_when_the_process_exits_without_close(tmp_path, how):
    path = tmp_path / "kv"
    proc = run_child(PERSIST_CHILD, str(path), how)
    explain = f"exit {proc.returncode}\n{proc.stdout}{proc.stderr[-3000:]}"
    assert "stored" in proc.stdout, explain
    if how == "unhandled exception":
        assert proc.returncode == 1 and "boom: unhandled" in proc.stderr, explain
    else:
        assert proc.returncode == 0, explain
    caches = random_caches(EXIT_BLOCKS, seed=99)  # other bytes: every loaded block must be overwritten
    keys = [f"k{i}" for i in range(8)]
    off = kvoffload.Offloader(caches, host_blocks=0, disk_path=path, disk_blocks=32, persist=True, fingerprint="model-a").start()
    try:
        assert off.lookup(keys) == len(keys), f"{off.stats().recovered} of {len(keys)} entries kept\n{explain}"
        check_loads_byte_exact(off, caches, keys)
    finally:
        off.close()


@pytest.mark.asyncio
@pytest.mark.slow
async def test_write_through_reaches_the_remote_when_the_process_exits_without_close(binaries):
    with redis_server(binaries) as server:
        proc = await asyncio.to_thread(run_child, REMOTE_CHILD, server.url)
        assert proc.returncode == 0 and "stored" in proc.stdout, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr[-3000:]}"
        caches = random_caches(EXIT_BLOCKS, seed=99)
        keys = [f"p{i}" for i in range(EXIT_BLOCKS)]
        off = kvoffload.Offloader(caches, host_blocks=EXIT_BLOCKS, remote=server.url, remote_write="none", fingerprint="model-a").start()
        try:
            assert await off.alookup(keys) == len(keys)
            await off.load({k: i for i, k in enumerate(keys)})
            want = random_caches(EXIT_BLOCKS, seed=EXIT_SEED)
            assert all(block_bytes(caches, i) == block_bytes(want, i) for i in range(EXIT_BLOCKS))
        finally:
            await off.aclose()


def test_zz_shutdown_figures():
    """Runs last in this file: records what the shutdown tests did."""
    if FIGURES["transfers"]:
        report_figure(
            f"test_shutdown: {FIGURES['transfers']} transfers in flight at shutdown "
            f"({FIGURES['ended cancelled']} ended cancelled, {FIGURES['ended done']} done, none failed or left running); "
            f"{FIGURES['cycles']} open/close cycles under load"
        )
