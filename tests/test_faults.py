"""Fault matrix: every failure point x every kind of transfer.

Failure points: a copy error in the copier, a short write, a short read, ENOSPC, EIO, an IO thread
failing with an exception that is not an OSError, a slow disk; each from the first call, and some
from the second call (so that part of the transfer landed before the failure).

Transfers: a store and a load on a disk-only offloader (bounce buffer <-> disk), and on a two-tier
offloader a store into host memory, a store that must spill least-recently-used entries to disk,
a load from host memory and a load of spilled entries from disk. Every transfer spans several
chunks (one block per chunk).

For each pair the transfer either does not touch the faulty path and succeeds, or it fails with
``kvoffload.TransferError`` (the injected error as ``__cause__``), and then: nothing else is lost
(every key stored before loads its bytes), no torn key is visible (the store's new keys that are
visible are a prefix of them and load their bytes; none when the fault hits the first call), a
failed spill leaves its entries in host memory, slots add up and nothing stays pending, pinned or
spilling, and the next transfers succeed. A slow disk only makes transfers slower.

Then regressions for what the matrix found: SystemExit/KeyboardInterrupt raised inside an IO call
(it used to stop the store loop for good), a TransferError kept after close() (its traceback views
host memory that close() used to unmap: touching it crashed the process), and disk loads failing or
cancelled mid-read twice in a row (each leaked a bounce-buffer half; then every disk load hung).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import textwrap
import time
import zlib
from collections import Counter

import pytest

import kvoffload
from support.caches import random_caches, same_bytes
from support.figures import report_figure
from support.process import kvoffload_threads

SLOW_S = 0.01


class InjectedCopyError(RuntimeError):
    """What the broken copier raises (a CUDA error, in real life)."""


# fault name -> paths it breaks (slow-disk breaks nothing: it is only slow)
FAULT_PATHS = {
    "copy-error": {"to_host", "to_device"},
    "short-write": {"pwritev"},
    "short-read": {"preadv"},
    "ENOSPC": {"pwritev"},
    "EIO": {"pwritev", "preadv"},
    "io-thread-error": {"pwritev", "preadv"},
    "slow-disk": set(),
}
SLOWED_PATHS = {"slow-disk": {"pwritev", "preadv"}}
CAUSE = {
    "copy-error": InjectedCopyError,
    "short-write": OSError,
    "short-read": OSError,
    "ENOSPC": OSError,
    "EIO": OSError,
    "io-thread-error": RuntimeError,
}
CAUSE_ERRNO = {"short-write": errno.EIO, "short-read": errno.EIO, "ENOSPC": errno.ENOSPC, "EIO": errno.EIO}

# operation -> (configuration, paths it uses)
OPS = {
    "store-disk": ("disk-only", {"to_host", "pwritev"}),
    "load-disk": ("disk-only", {"preadv", "to_device"}),
    "store-host": ("two-tier", {"to_host"}),
    "spill": ("two-tier", {"pwritev", "to_host"}),
    "load-host": ("two-tier", {"to_device"}),
    "load-spilled": ("two-tier", {"preadv", "to_device"}),
}

FIGURES: Counter[str] = Counter()


def install(off: kvoffload.Offloader, faults, name: str, from_call: int) -> list:
    """Break (or slow) the paths fault ``name`` touches, from call ``from_call`` of each on."""

    def short_write(real, fd, bufs, offset):
        return real(fd, bufs, offset) - 4096  # the device took less than asked

    def short_read(real, fd, bufs, offset):
        return real(fd, bufs, offset) - 1

    def slow(real, *args):
        time.sleep(SLOW_S)  # a slow disk is the fault here, not a wait
        return real(*args)

    what = {
        "copy-error": {p: InjectedCopyError(f"injected copy failure ({p})") for p in ("to_host", "to_device")},
        "short-write": {"pwritev": short_write},
        "short-read": {"preadv": short_read},
        "ENOSPC": {"pwritev": OSError(errno.ENOSPC, "No space left on device")},
        "EIO": {p: OSError(errno.EIO, "Input/output error") for p in ("pwritev", "preadv")},
        "io-thread-error": {p: RuntimeError("injected: the IO thread failed") for p in ("pwritev", "preadv")},
        "slow-disk": {p: slow for p in ("pwritev", "preadv")},
    }[name]
    return [faults.fail(off, path, w, from_call) for path, w in what.items()]


async def check_keys(off, caches, want: dict, dest_from: int = 48) -> None:
    """Every key in ``want`` (key -> {tensor: bytes}) is visible and loads exactly its bytes."""
    keys = list(want)
    assert off.lookup(keys) == len(keys), [k for k in keys if k not in off]
    dests = list(range(dest_from, dest_from + len(keys)))
    for t in caches.values():
        t[dests].zero_()
    await off.load(dict(zip(keys, dests)))
    for k, b in zip(keys, dests):
        for n, t in caches.items():
            assert same_bytes(t[b], want[k][n]), f"key {k!r} lost its bytes ({n})"


def block(caches, b):
    return {n: t[b].clone() for n, t in caches.items()}


CASES = [(f, op, 1) for f in FAULT_PATHS for op in OPS] + [
    (f, op, 2) for f in ("copy-error", "ENOSPC", "short-read") for op in OPS
]


@pytest.mark.asyncio
@pytest.mark.parametrize("fault, op, from_call", CASES, ids=[f"{f}-{op}" + ("-from-2nd-call" if c == 2 else "") for f, op, c in CASES])
async def test_fault_fails_only_its_transfer(tmp_path, faults, fault, op, from_call):
    config, uses = OPS[op]
    expect_failure = bool(FAULT_PATHS[fault] & uses)
    caches = random_caches(64, seed=zlib.crc32(f"{fault}-{op}".encode()) % 1000)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    host_blocks = 0 if config == "disk-only" else 4
    path = tmp_path / "kv.bin"
    async with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=path, disk_blocks=16,
                                   chunk_bytes=slot, io_threads=2) as off:
        # Entries stored before the fault: disk-only: 8 on disk; two-tier: 4 on disk (spilled), 4 in host memory.
        stored = {}
        for lo in (0, 4):
            blocks = {("old", i): i for i in range(lo, lo + 4)}
            await off.store(blocks)
            stored.update({k: block(caches, b) for k, b in blocks.items()})
        if op == "store-host":
            off.discard([("old", 6), ("old", 7)])  # room in host memory: no spill needed
            del stored[("old", 6)], stored[("old", 7)]
        on_disk = [("old", i) for i in range(4)]
        in_host = [k for k in stored if k not in on_disk]
        new = {("new", i): 20 + i for i in range(4 if op in ("store-disk",) else 2)}
        if op.startswith("load"):
            src = on_disk if op in ("load-disk", "load-spilled") else in_host
            transfer_args = ("load", {k: 30 + i for i, k in enumerate(src)})
        else:
            transfer_args = ("store", new)
        if op == "spill":
            assert off.stats().host_free == 0  # the store must spill
        before = off.stats()

        injected = install(off, faults, fault, from_call)
        kind, blocks = transfer_args
        t0 = time.perf_counter()
        t = off.store(blocks) if kind == "store" else off.load(blocks)
        if expect_failure:
            with pytest.raises(kvoffload.TransferError) as ei:
                await asyncio.wait_for(t, 30)
            cause = ei.value.__cause__
            assert isinstance(cause, CAUSE[fault]), repr(cause)
            if fault in CAUSE_ERRNO:
                assert cause.errno == CAUSE_ERRNO[fault], cause
            assert isinstance(t.exception(), kvoffload.TransferError)
            FIGURES["failed as expected"] += 1
        else:
            r = await asyncio.wait_for(t, 30)
            assert list(r.keys) == list(blocks)
            if fault == "slow-disk" and SLOWED_PATHS[fault] & uses:
                assert time.perf_counter() - t0 >= SLOW_S
            FIGURES["unaffected, succeeded"] += 1
        elapsed = time.perf_counter() - t0
        assert elapsed < 10, f"the transfer took {elapsed:.1f} s to end"
        n_injected = sum(f.injected for f in injected)
        assert n_injected > 0 or not (expect_failure or (SLOWED_PATHS.get(fault, set()) & uses)), "the fault never fired"
        FIGURES["faults injected"] += n_injected
        faults.restore()  # the disk and the copier work again

        s = off.stats()
        assert (s.pending, s.pinned, s.spilling, s.in_flight) == (0, 0, 0, 0), s
        assert s.host_free + s.host_ready == s.host_slots and s.disk_free + s.disk_ready + s.disk_clean == s.disk_slots, s
        assert s.failed == before.failed + expect_failure
        assert s.evicted == before.evicted == 0

        if expect_failure and kind == "store":
            # no torn key: what is visible of the new keys is a prefix of them, and none if the first call failed
            visible = [k in off for k in new]
            n = sum(visible)
            assert visible == [True] * n + [False] * (len(new) - n), visible
            if from_call == 1:
                assert n == 0, f"{n} key(s) of a store whose first copy failed are visible"
            if op == "spill" and "pwritev" in FAULT_PATHS[fault] and from_call == 1:
                # a failed spill leaves its entries in host memory
                assert (s.host_ready, s.disk_ready) == (before.host_ready, before.disk_ready), s
            stored.update({k: block(caches, new[k]) for k in list(new)[:n]})
        elif kind == "store":
            stored.update({k: block(caches, b) for k, b in new.items()})
        assert s.ready == len(stored), (s, len(stored))

        # nothing else is lost: every key stored before (and whatever landed) loads its bytes
        await check_keys(off, caches, stored)
        # the next transfers succeed: the same transfer again, then another store and a full check
        if kind == "store":
            r = await off.store(blocks)
            stored.update({k: block(caches, blocks[k]) for k in r.keys})
        else:
            await off.load(blocks)
        await off.store({("after", 0): 40})
        stored[("after", 0)] = block(caches, 40)
        stored = {k: v for k, v in stored.items() if k in off}  # the last stores may have evicted (disk full)
        assert off.stats().ready == len(stored)
        await check_keys(off, caches, stored)
    assert os.listdir(tmp_path) == [] and not kvoffload_threads()


def run_script(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (regressions here hung a worker loop or crashed the process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=env, check=False)


@pytest.mark.parametrize("exc", ["SystemExit('an IO thread exits')", "KeyboardInterrupt()"])
@pytest.mark.slow
def test_io_thread_dying_with_a_base_exception_fails_only_its_transfer(tmp_path, exc):
    proc = run_script(f"""
        import kvoffload
        from support.caches import random_caches
        from support.faults import Faults

        caches = random_caches(16, seed=5)
        faults = Faults()
        with kvoffload.Offloader(caches, host_blocks=0, disk_path={str(tmp_path / "kv")!r}, disk_blocks=8) as off:
            off.store({{"old": 0}}).result(10)
            faults.fail(off, "pwritev", {exc})
            t = off.store({{"new": 1}})
            try:
                t.result(timeout=2)
            except kvoffload.TransferError:
                print("failed with TransferError")
            except TimeoutError:
                print("HUNG: the transfer did not end")
            faults.restore()
            try:
                print("next store:", off.store({{"next": 2}}).result(timeout=2).keys)
            except TimeoutError:
                print("HUNG: the next store did not end")
    """)
    assert "failed with TransferError" in proc.stdout and "next store: ('next',)" in proc.stdout, proc.stdout + proc.stderr[-2000:]


@pytest.mark.slow
def test_a_kept_transfer_error_stays_safe_after_close(tmp_path):
    proc = run_script(f"""
        import errno, torch, kvoffload
        from support.faults import Faults

        caches = {{"kv": torch.randint(0, 255, (16, 4096), dtype=torch.uint8)}}
        off = kvoffload.Offloader(caches, host_blocks=0, disk_path={str(tmp_path / "kv")!r}, disk_blocks=8).start()
        Faults().fail(off, "pwritev", OSError(errno.EIO, "Input/output error"))
        try:
            off.store({{"a": 0}}).result(10)
        except kvoffload.TransferError as e:
            err = e
        off.close()
        tb = err.__cause__.__traceback__  # the caller still holds the error (pytest, a log handler, a retry loop)
        while "buffers" not in tb.tb_frame.f_locals:  # the frame of DiskFile.write(self, buffers, offset)
            tb = tb.tb_next
        print("sum", int(tb.tb_frame.f_locals["buffers"][0].sum()))
    """)
    assert proc.returncode == 0 and "sum" in proc.stdout, f"exit status {proc.returncode}: {proc.stderr[-2000:]}"


@pytest.mark.parametrize("how", ["EIO", "short-read", "cancel-mid-read"])
@pytest.mark.parametrize("host_blocks", [0, 2], ids=["disk-only", "spilled"])
def test_failed_and_cancelled_disk_loads_leave_later_loads_working(tmp_path, faults, how, host_blocks):
    caches = random_caches(32, seed=61)
    orig = {n: t.clone() for n, t in caches.items()}
    with kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=tmp_path / "kv", disk_blocks=8,
                             chunk_bytes=kvoffload.BlockLayout.of(caches).slot_bytes) as off:
        for i in range(0, 4, 2):  # with 2 host slots the second store spills keys 0 and 1 to disk
            off.store({i: i, i + 1: i + 1}).result(10)
        disk_keys = [0, 1] if host_blocks else [0, 1, 2, 3]
        if how == "EIO":
            faults.fail(off, "preadv", OSError(errno.EIO, "Input/output error"))
        elif how == "short-read":
            faults.fail(off, "preadv", lambda real, fd, bufs, offset: real(fd, bufs, offset) - 4096)
        for attempt in range(2):  # each attempt fails (or is cancelled) while its read is in flight
            gate = faults.gate(off, "preadv") if how == "cancel-mid-read" else None
            t = off.load({k: 16 + j for j, k in enumerate(disk_keys)})
            if gate is not None:
                gate.wait_entered()
                t.cancel()
                gate.open()
                with pytest.raises(kvoffload.TransferCancelled):
                    t.result(timeout=5)
                gate.remove()
            else:
                with pytest.raises(kvoffload.TransferError):
                    t.result(timeout=5)
        faults.restore()  # the disk is healthy again
        for t_ in caches.values():
            t_[16:24].zero_()
        off.load({k: 16 + j for j, k in enumerate(disk_keys)}).result(timeout=2)  # hung before the fix
        for j, k in enumerate(disk_keys):
            for n in caches:
                assert same_bytes(caches[n][16 + j], orig[n][k])


def test_zz_fault_figures():
    """Runs last in this file: records what the matrix did."""
    if FIGURES:
        report_figure(
            f"test_faults: {len(CASES)} fault x transfer cases, {FIGURES['faults injected']} faults injected; "
            f"{FIGURES['failed as expected']} transfers failed with TransferError as expected, "
            f"{FIGURES['unaffected, succeeded']} not on the faulty path (or only slowed) succeeded"
        )
