"""The disk tier beside raw multi-threaded O_DIRECT IO (the ceiling) and the seed-style baseline:
store, load, spill, a busy thread beside it; the persistent tier beside the plain one."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Hashable
from types import ModuleType
from typing import Any

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .measure import best_gbps, rounds_gbps
from .report import Report

__all__ = ["RawDirectIo", "disk_scenarios", "persistence_scenarios"]


class RawDirectIo:
    """The disk ceiling: ``threads`` threads doing O_DIRECT pwritev / preadv of ``nbytes`` in 8 MiB calls."""

    def __init__(self, path: str, nbytes: int, threads: int, job_bytes: int = 8 << 20) -> None:
        import mmap

        self.path, self.nbytes, self.threads = path, nbytes, threads
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.bufs = [mmap.mmap(-1, job_bytes) for _ in range(threads)]
        for b in self.bufs:
            b.write(os.urandom(job_bytes))
        self.offsets = list(range(0, nbytes - job_bytes + 1, job_bytes)) or [0]

    def _run(self, op: Any) -> float:
        from concurrent.futures import ThreadPoolExecutor

        def worker(i: int) -> None:
            for off in self.offsets[i :: self.threads]:
                op(self.fd, [self.bufs[i]], off)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(worker, range(self.threads)))
        return len(self.offsets) * len(self.bufs[0]) / (time.perf_counter() - t0) / 1e9

    def write(self) -> float:
        """GB/s of one pass of writes."""
        return self._run(os.pwritev)

    def read(self) -> float:
        """GB/s of one pass of reads."""
        return self._run(os.preadv)

    def close(self) -> None:
        """Free the buffers, close and remove the file."""
        for b in self.bufs:
            b.close()
        os.close(self.fd)
        os.unlink(self.path)


def disk_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: ModuleType, disk_dir: str | None,
                   io_threads: int, rounds: int = 3) -> None:
    """Disk store/load with no host tier, and spill, beside raw O_DIRECT and the baseline.

    Rounds alternate ceiling and kvoffload so that both see the same disk weather.
    """
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"disk tier: {nbytes / 2**30:.2f} GiB per transfer, {io_threads} IO threads, ceiling = raw O_DIRECT")
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=disk_dir)
    raw = None
    try:
        raw = RawDirectIo(os.path.join(tmp, "raw"), nbytes, io_threads)
        caches = lay.cache(n, dev)
        perm = torch.randperm(n).tolist()
        cw, cr, st, ld, sp = [], [], [], [], []
        with Offloader(caches, host_blocks=0, disk_path=os.path.join(tmp, "kv"), disk_blocks=n, io_threads=io_threads) as off:
            for _ in range(rounds):
                off.discard(range(n))
                cw.append(raw.write())
                st.append(off.store({i: perm[i] for i in range(n)}).result().gbps)
                cr.append(raw.read())
                ld.append(off.load({i: perm[i] for i in range(n)}).result().gbps)
        # spill: a full host tier of a quarter of the data; every new store first spills as many
        # entries to disk. The figure is the disk write rate of the spilling: bytes spilled / time.
        quarter = max(1, n // 4)
        with Offloader(caches, host_blocks=quarter, disk_path=os.path.join(tmp, "kv"), disk_blocks=n, io_threads=io_threads) as off:
            off.store({("warm", i): perm[i] for i in range(quarter)}).result()
            for r in range(rounds):
                before = off.stats().spilled
                t0 = time.perf_counter()
                for j in range(0, n - quarter, quarter):
                    off.store({(r, i): perm[i] for i in range(j, min(j + quarter, n - quarter))}).result()
                moved = (off.stats().spilled - before) * lay.block_bytes
                sp.append(moved / (time.perf_counter() - t0) / 1e9)
                off.discard([(r, i) for i in range(n)])
            spilled = off.stats().spilled
        b: dict[str, float] = {}
        dbase = base.DiskBaseline(caches, os.path.join(tmp, "base"), n)
        try:
            b["store"] = best_gbps(nbytes, lambda: dbase.wait(dbase.store([(perm[i], i) for i in range(n)])), dev, reps=1)
            b["load"] = best_gbps(nbytes, lambda: dbase.wait(dbase.load([(i, perm[i]) for i in range(n)])), dev, reps=1)
        finally:
            dbase.close()
        # The same store+load round trips while another thread of the process runs Python: every
        # step of the disk pipeline between chunks needs the GIL.
        with Offloader(caches, host_blocks=0, disk_path=os.path.join(tmp, "kv"), disk_blocks=n, io_threads=io_threads) as off:

            def disk_round() -> int:
                off.store({i: perm[i] for i in range(n)}).result()
                off.load({i: perm[i] for i in range(n)}).result()
                off.discard(range(n))
                return 2 * nbytes

            disk_idle, _ = rounds_gbps(disk_round, 1.0, busy_other=False)
            disk_busy, _ = rounds_gbps(disk_round, 1.0, busy_other=True)
        rep.extra["disk_busy"] = {"idle": disk_idle, "other_busy": disk_busy}
        rep.row("disk store (no host tier)", "GB/s", max(st), max(cw), b["store"])
        rep.row("disk load (no host tier)", "GB/s", max(ld), max(cr), b["load"])
        rep.row("spill host -> disk under new stores", "GB/s", max(sp), max(cw), None, note=f"{spilled} entries spilled")
        rep.row("disk store+load, another thread busy", "GB/s", disk_busy, disk_idle, None, note="ceiling = the same, all threads idle")
    finally:
        if raw is not None:
            raw.close()
        shutil.rmtree(tmp, ignore_errors=True)


def persistence_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, disk_dir: str | None,
                          io_threads: int, rounds: int = 3) -> None:
    """The persistent disk tier beside the plain one: store and load GB/s (headers and CRC32C on the
    IO threads; ``verify=True`` checks every slot read), the reopen of a full tier (after a clean
    close, and after a crash with no checkpoint, when every slot's CRC is read and checked), and a
    store larger than the host tier beside one straight to disk."""
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"persistent disk tier: {nbytes / 2**30:.2f} GiB per transfer, {io_threads} IO threads, ceiling = the plain disk tier")
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=disk_dir)
    try:
        caches = lay.cache(n, dev)
        perm = torch.randperm(n).tolist()
        blocks: dict[Hashable, int] = {i: perm[i] for i in range(n)}
        figures: dict[str, list[float]] = {k: [] for k in ("plain_store", "plain_load", "store", "load", "verify_load", "large", "direct")}
        kw: dict[str, Any] = {"host_blocks": 0, "disk_blocks": n, "io_threads": io_threads}
        persistent = os.path.join(tmp, "persistent")
        with Offloader(caches, disk_path=os.path.join(tmp, "plain"), **kw) as plain, \
                Offloader(caches, disk_path=persistent, persist=True, **kw) as pers:
            for _ in range(rounds):  # alternating, so that both see the same disk weather
                for off, store, load in ((plain, "plain_store", "plain_load"), (pers, "store", "load")):
                    off.discard(range(n))
                    figures[store].append(off.store(blocks).result().gbps)
                    figures[load].append(off.load(blocks).result().gbps)
            pers.discard(range(n))
            pers.store(blocks).result()
        with Offloader(caches, disk_path=persistent, persist=True, verify=True, **kw) as pers:
            for _ in range(rounds):
                figures["verify_load"].append(pers.load(blocks).result().gbps)
        t0 = time.perf_counter()
        with Offloader(caches, disk_path=persistent, persist=True, **kw) as pers:
            reopen_s = time.perf_counter() - t0
            found = pers.stats().recovered
        os.unlink(persistent + ".checkpoint")  # as after a crash before the first checkpoint
        t0 = time.perf_counter()
        with Offloader(caches, disk_path=persistent, persist=True, **kw) as pers:
            crash_s = time.perf_counter() - t0
            found_after_crash = pers.stats().recovered
        quarter = max(1, n // 4)
        with Offloader(caches, host_blocks=quarter, disk_path=os.path.join(tmp, "large"), disk_blocks=n, io_threads=io_threads) as large, \
                Offloader(caches, disk_path=os.path.join(tmp, "direct"), **kw) as direct:
            for _ in range(rounds):
                for off, name in ((direct, "direct"), (large, "large")):
                    off.discard(range(n))
                    figures[name].append(off.store(blocks).result().gbps)
        best = {k: max(v) for k, v in figures.items()}
        rep.row("persistent disk store (headers, CRC32C)", "GB/s", best["store"], best["plain_store"], None)
        rep.row("persistent disk load", "GB/s", best["load"], best["plain_load"], None)
        rep.row("persistent disk load, verify=True", "GB/s", best["verify_load"], best["plain_load"], None)
        rep.row("reopen of a full tier (clean close)", "entries/s", found / reopen_s, None, None,
                note=f"{found} entries in {reopen_s * 1e3:.0f} ms, start() included")
        rep.row("reopen after a crash (every CRC checked)", "entries/s", found_after_crash / crash_s, None, None,
                note=f"{found_after_crash} entries in {crash_s * 1e3:.0f} ms: {nbytes / crash_s / 1e9:.2f} GB/s read")
        rep.row("store 4x larger than the host tier", "GB/s", best["large"], best["direct"], None,
                note="ceiling = the same store with no host tier")
        sealed_rows(rep, caches, blocks, tmp, kw, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sealed_rows(rep: Report, caches: dict[str, torch.Tensor], blocks: dict[Hashable, int], tmp: str, kw: dict[str, Any], rounds: int) -> None:
    """What sealing costs the disk tier (docs/security.md), each beside the same tier unsealed, in
    alternating rounds: a persistent tier signed (``remote_secret``: HMAC-SHA256 on the IO threads),
    signed and encrypted (``encryption_key``: AES-256-GCM), and a non-persistent tier encrypted."""
    import secrets as random_bytes

    if importlib.util.find_spec("cryptography") is None:
        rep.skip("disk tier sealed", "the cryptography package is not installed (pip install 'kvoffload[crypto]')")
        return
    secret, key = random_bytes.token_bytes(32), random_bytes.token_bytes(32)
    configs: dict[str, dict[str, Any]] = {
        "persistent": {"persist": True},
        "signed": {"persist": True, "remote_secret": secret},
        "sealed": {"persist": True, "remote_secret": secret, "encryption_key": key},
        "plain": {},
        "encrypted": {"encryption_key": key},
    }
    figures: dict[str, list[float]] = {f"{c}_{d}": [] for c in configs for d in ("store", "load")}
    with contextlib.ExitStack() as stack:
        offs = {c: stack.enter_context(Offloader(caches, disk_path=os.path.join(tmp, f"sealed-{c}"), **kw, **extra)) for c, extra in configs.items()}
        for _ in range(rounds):
            for c, off in offs.items():
                off.discard(list(blocks))
                figures[f"{c}_store"].append(off.store(blocks).result().gbps)
                figures[f"{c}_load"].append(off.load(blocks).result().gbps)
    best = {k: max(v) for k, v in figures.items()}
    for c, what, ceiling in (
        ("signed", "persistent disk {}, signed (remote_secret)", "persistent"),
        ("sealed", "persistent disk {}, signed + AES-256-GCM", "persistent"),
        ("encrypted", "disk {} (not persistent), AES-256-GCM", "plain"),
    ):
        for d in ("store", "load"):
            rep.row(what.format(d), "GB/s", best[f"{c}_{d}"], best[f"{ceiling}_{d}"], None, note="ceiling = the same tier unsealed")

