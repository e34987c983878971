"""``kvoffload bench``: kvoffload beside the ceiling and the seed-style baseline, in one run.

Every scenario runs the ceiling (what the hardware does with one large copy, or
raw multi-threaded O_DIRECT IO), the seed-style baseline (``benchmarks/seed_baseline.py``:
a background thread per direction fed by a queue, one descriptor per layer per
block, completion by polling a shared list of events; disk one block at a time)
and kvoffload, on the same data, and reports GB/s and ratios. On a machine
without CUDA the scenarios that need no GPU run on CPU tensors.

Usage: ``kvoffload bench [--gib 2] [--layout 32x2x16x8x128:bf16] [--json out.json] [--plot out.png]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ._core.worker_loop import WorkerLoop
from ._core.errors import TransferCancelled
from ._core.offloader import Offloader

__all__ = ["main", "Layout"]

# ---------------------------------------------------------------------------------------------
# set-up


class Layout:
    """A KV layout: ``layers`` tensors of ``[blocks, *block_shape]`` in ``dtype``."""

    def __init__(self, spec: str = "32x2x16x8x128:bf16") -> None:
        dims, _, dt = spec.partition(":")
        parts = [int(x) for x in dims.split("x")]
        if len(parts) < 2 or any(p <= 0 for p in parts):
            raise ValueError(f"layout {spec!r}: want LAYERSxD1x...:dtype, e.g. 32x2x16x8x128:bf16")
        self.spec = spec
        self.layers, self.block_shape = parts[0], tuple(parts[1:])
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}[dt or "bf16"]
        elems = 1
        for d in self.block_shape:
            elems *= d
        self.piece_bytes = elems * torch.empty(0, dtype=self.dtype).element_size()
        self.block_bytes = self.piece_bytes * self.layers

    def blocks_for(self, gib: float) -> int:
        return max(2, int(gib * 2**30) // self.block_bytes)

    def cache(self, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Random cache (random bits, never zeros)."""
        out = {}
        for i in range(self.layers):
            raw = torch.randint(-(2**31), 2**31 - 1, (num_blocks * self.piece_bytes // 4,), dtype=torch.int32, device=device)
            out[f"layer.{i}"] = raw.view(torch.uint8).view(self.dtype).view(num_blocks, *self.block_shape)
        return out


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Collect, then keep what exists out of the garbage collector's full passes (``gc.freeze()``,
    as serving engines do once started), for the scenarios that time many small transfers: with
    torch's objects on the heap a full pass takes 40-80 ms, and one landing in a 5,000-transfer
    measurement halved its rate (26,000 against 47,000 one-block stores/s on CPU tensors)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best_gbps(nbytes: int, fn: Callable[[], Any], dev: torch.device, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _lat(xs: list[float]) -> dict[str, float]:
    return {"p50_us": _pct(xs, 0.5) * 1e6, "p99_us": _pct(xs, 0.99) * 1e6, "mean_us": statistics.fmean(xs) * 1e6}


def _checkout_module(relative: str, path: str | None = None) -> Any:
    """Import the checkout's file ``relative`` (from ``path``, the checkout, or the cwd); None if absent."""
    candidates = [Path(path)] if path else [Path(__file__).resolve().parents[2] / relative, Path.cwd() / relative]
    for p in candidates:
        if p.is_file():
            spec = importlib.util.spec_from_file_location(p.stem, p)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[p.stem] = mod  # dataclasses of the module look themselves up there
            spec.loader.exec_module(mod)
            return mod
    return None


def load_baseline(path: str | None) -> Any:
    """Import ``benchmarks/seed_baseline.py`` (from ``path``, the checkout, or the cwd); None if absent."""
    return _checkout_module("benchmarks/seed_baseline.py", path)


class Report:
    """Rows of the summary table, printed as they come (the progress display)."""

    def __init__(self, steps: int) -> None:
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.steps = steps
        self.step = 0
        self.t0 = time.perf_counter()

    def begin(self, what: str) -> None:
        self.step += 1
        print(f"[{self.step}/{self.steps} {time.perf_counter() - self.t0:6.1f}s] {what} ...", flush=True)

    def row(self, scenario: str, unit: str, kvoffload: float, ceiling: float | None = None,
            baseline: float | None = None, note: str = "") -> None:
        r = {"scenario": scenario, "unit": unit, "kvoffload": kvoffload, "ceiling": ceiling, "baseline": baseline,
             "vs_ceiling": kvoffload / ceiling if ceiling else None, "vs_baseline": kvoffload / baseline if baseline else None,
             "note": note}
        self.rows.append(r)
        print("    " + _fmt_row(r), flush=True)

    def table(self) -> str:
        head = f"{'scenario':38s} {'unit':>10s} {'kvoffload':>10s} {'ceiling':>10s} {'baseline':>10s} {'/ceil':>7s} {'/base':>7s}"
        return "\n".join([head, "-" * len(head)] + [_fmt_row(r) for r in self.rows])


def _fmt_row(r: dict[str, Any]) -> str:
    def num(x: float | None, fmt: str = "10.2f") -> str:
        return format(x, fmt) if x is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"

    return (f"{r['scenario']:38s} {r['unit']:>10s} {num(r['kvoffload'])} {num(r['ceiling'])} {num(r['baseline'])} "
            f"{num(r['vs_ceiling'], '7.2f')} {num(r['vs_baseline'], '7.2f')}")


# ---------------------------------------------------------------------------------------------
# scenarios


def _host_ceilings(nbytes: int, dev: torch.device) -> tuple[float, float, float | None]:
    """One large copy GPU->host, host->GPU, and both at once (GPU only), in GB/s."""
    from ._core.hostmem import HostBuffer

    hb = HostBuffer(2 * nbytes, pin=dev if dev.type == "cuda" else None)
    try:
        dbuf = torch.empty(2 * nbytes, dtype=torch.uint8, device=dev)
        h1, h2 = hb.tensor[:nbytes], hb.tensor[nbytes:]
        d1, d2 = dbuf[:nbytes], dbuf[nbytes:]
        ceil_d2h = _best_gbps(nbytes, lambda: h1.copy_(d1, non_blocking=True), dev)
        ceil_h2d = _best_gbps(nbytes, lambda: d1.copy_(h1, non_blocking=True), dev)
        if dev.type != "cuda":
            return ceil_d2h, ceil_h2d, None
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both() -> None:
            with torch.cuda.stream(s1):
                h1.copy_(d1, non_blocking=True)
            with torch.cuda.stream(s2):
                d2.copy_(h2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()

        return ceil_d2h, ceil_h2d, _best_gbps(2 * nbytes, both, dev)
    finally:
        hb.close()


def host_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: Any) -> None:
    """Host store/load, contiguous and random ids; both directions at once."""
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"host tier: {nbytes / 2**30:.2f} GiB per transfer, ceiling = one large copy")
    ceil_d2h, ceil_h2d, ceil_both = _host_ceilings(nbytes, dev)  # its buffers are freed before the cache is built

    caches = lay.cache(2 * n, dev)
    ids = {"contiguous": list(range(n)), "random": torch.randperm(2 * n).tolist()[:n]}
    results: dict[str, float] = {}
    with Offloader(caches, host_blocks=2 * n) as off:
        for order, blocks in ids.items():
            st, ld = [], []
            for _ in range(3):
                off.discard(range(n))
                st.append(off.store({i: blocks[i] for i in range(n)}).result().gbps)
                ld.append(off.load({i: blocks[i] for i in range(n)}).result().gbps)
            results[f"store_{order}"], results[f"load_{order}"] = max(st), max(ld)
        # both directions at once: store blocks [n, 2n) while loading keys 0..n-1 into blocks [0, n)
        best = 0.0
        for _ in range(3):
            off.discard(range(n, 2 * n))
            _sync(dev)
            t0 = time.perf_counter()
            a = off.store({i: i for i in range(n, 2 * n)})
            b = off.load({i: i for i in range(n)})
            a.result()
            b.result()
            best = max(best, 2 * nbytes / (time.perf_counter() - t0) / 1e9)
        results["both"] = best
    bres: dict[str, float] = {}
    if base is not None:
        hbase = base.HostBaseline(caches, 2 * n)
        try:
            for order, blocks in ids.items():
                bres[f"store_{order}"] = _best_gbps(nbytes, lambda: hbase.wait(hbase.store([(blocks[i], i) for i in range(n)])), dev)
                bres[f"load_{order}"] = _best_gbps(nbytes, lambda: hbase.wait(hbase.load([(i, blocks[i]) for i in range(n)])), dev)

            def both_base() -> None:
                j1 = hbase.store([(i, i) for i in range(n, 2 * n)])
                j2 = hbase.load([(i, i) for i in range(n)])
                hbase.wait(j1)
                hbase.wait(j2)

            bres["both"] = _best_gbps(2 * nbytes, both_base, dev)
        finally:
            hbase.close()
    for order in ("contiguous", "random"):
        rep.row(f"host store, {order} ids", "GB/s", results[f"store_{order}"], ceil_d2h, bres.get(f"store_{order}"))
        rep.row(f"host load, {order} ids", "GB/s", results[f"load_{order}"], ceil_h2d, bres.get(f"load_{order}"))
    rep.row("host store + load at once", "GB/s", results["both"], ceil_both, bres.get("both"))


def _python_work(seconds: float, until: Callable[[], bool] | None = None) -> float:
    """A pure-Python loop (what a serving engine's thread does between kernel launches) for
    ``seconds`` or until ``until()``; returns its iterations per second."""
    n, d = 0, {}
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end and not (until is not None and until()):
        for i in range(1000):
            d[i & 63] = i * 3
        n += 1
    return n / max(time.perf_counter() - t0, 1e-9)


def _rounds_gbps(round_trip: Callable[[], int], seconds: float, busy_other: bool) -> tuple[float, float]:
    """GB/s of store+load round trips run back to back on a thread of their own for ``seconds``,
    with the main thread idle (sleeping) or busy in Python; returns (GB/s, Python it/s meanwhile)."""
    stop = threading.Event()
    moved = [0]
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            while not stop.is_set():
                moved[0] += round_trip()
        except BaseException as e:  # reported below
            errors.append(e)

    round_trip()  # warm up
    th = threading.Thread(target=drive, name="bench-driver")
    t0 = time.perf_counter()
    th.start()
    rate = 0.0
    if busy_other:
        rate = _python_work(seconds)
    else:
        time.sleep(seconds)
    stop.set()
    th.join()
    if errors:
        raise errors[0]
    return moved[0] / (time.perf_counter() - t0) / 1e9, rate


def busy_caller_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: Any, seconds: float = 2.0) -> None:
    """Bulk store+load GB/s while the process's Python is busy, against the same with it idle.

    *another thread busy*: a pure-Python loop runs on the main thread while a second thread drives
    round trips (store, load, discard). *caller busy*: the thread that calls ``store()``/``load()``
    runs the Python loop until each transfer is done. The baseline runs the first variant.
    """
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"busy caller: {nbytes / 2**30:.2f} GiB store+load round trips, Python busy vs idle")
    caches = lay.cache(2 * n, dev)
    ids = torch.randperm(2 * n).tolist()[:n]
    alone = _python_work(min(seconds, 1.0))
    with Offloader(caches, host_blocks=n) as off:

        def kvo_round() -> int:
            off.store({i: ids[i] for i in range(n)}).result()
            off.load({i: 2 * n - 1 - i for i in range(n)}).result()
            off.discard(range(n))
            return 2 * nbytes

        def kvo_round_busy_caller() -> int:
            store = off.store({i: ids[i] for i in range(n)})
            _python_work(60.0, until=store.done)
            store.result()
            load = off.load({i: 2 * n - 1 - i for i in range(n)})
            _python_work(60.0, until=load.done)
            load.result()
            off.discard(range(n))
            return 2 * nbytes

        idle, _ = _rounds_gbps(kvo_round, seconds, busy_other=False)
        busy, rate = _rounds_gbps(kvo_round, seconds, busy_other=True)
        caller, _ = _rounds_gbps(kvo_round_busy_caller, seconds, busy_other=False)
    b_idle = b_busy = None
    if base is not None:
        hbase = base.HostBaseline(caches, n)
        try:

            def base_round() -> int:
                hbase.wait(hbase.store([(ids[i], i) for i in range(n)]))
                hbase.wait(hbase.load([(i, 2 * n - 1 - i) for i in range(n)]))
                return 2 * nbytes

            b_idle, _ = _rounds_gbps(base_round, seconds, busy_other=False)
            b_busy, _ = _rounds_gbps(base_round, seconds, busy_other=True)
        finally:
            hbase.close()
    rep.extra["busy_caller"] = {"idle": idle, "other_busy": busy, "caller_busy": caller, "baseline_idle": b_idle,
                                "baseline_other_busy": b_busy, "python_alone_its": alone, "python_beside_kvoffload_its": rate}
    rep.row("store+load, all threads idle", "GB/s", idle, None, b_idle)
    rep.row("store+load, another thread busy", "GB/s", busy, idle, b_busy,
            note=f"ceiling = idle; the busy loop ran at {rate / alone:.2f} of alone")
    rep.row("store+load, calling thread busy", "GB/s", caller, idle, None, note="ceiling = idle")


PIECE_LAYOUTS = {4: "32x2x16x8x8:bf16", 16: "32x2x16x8x32:bf16", 32: "32x2x16x8x64:bf16", 64: "32x2x16x8x128:bf16"}
"""Piece size in KiB -> a 32-layer layout with pieces of that size."""


def layout_scenarios(rep: Report, gib: float, dev: torch.device, base: Any) -> None:
    """Host store and load of random block ids, and both at once, for 4, 16, 32 and 64 KiB pieces."""
    rep.begin(f"layouts: {gib:.2f} GiB per transfer, 32 layers, pieces of 4-64 KiB, random ids")
    for kib, spec in PIECE_LAYOUTS.items():
        lay = Layout(spec)
        n = lay.blocks_for(gib)
        nbytes = n * lay.block_bytes
        ceil_d2h, ceil_h2d, ceil_both = _host_ceilings(nbytes, dev)
        caches = lay.cache(2 * n, dev)
        ids = torch.randperm(2 * n).tolist()
        src, dst = ids[:n], ids[n:]
        def both_at_once(off: Offloader) -> float:
            """GB/s of storing keys n.. from ``dst`` while loading keys 0.. (stored) into ``src``."""
            _sync(dev)
            t0 = time.perf_counter()
            a = off.store({n + i: dst[i] for i in range(n)})
            b = off.load({i: src[i] for i in range(n)})
            a.result()
            b.result()
            return 2 * nbytes / (time.perf_counter() - t0) / 1e9

        st, ld, both, both_high = [], [], [], []
        with Offloader(caches, host_blocks=2 * n) as off:
            for _ in range(3):
                off.discard(range(2 * n))
                st.append(off.store({i: src[i] for i in range(n)}).result().gbps)
                ld.append(off.load({i: dst[i] for i in range(n)}).result().gbps)
                both.append(both_at_once(off))
        with Offloader(caches, host_blocks=2 * n, gather_priority="high") as off:  # gathers ahead of other kernels
            off.store({i: src[i] for i in range(n)}).result()
            for _ in range(3):
                both_high.append(both_at_once(off))
                off.discard(range(n, 2 * n))
        bst = bld = None
        if base is not None:
            hbase = base.HostBaseline(caches, n)
            try:
                bst = _best_gbps(nbytes, lambda: hbase.wait(hbase.store([(src[i], i) for i in range(n)])), dev)
                bld = _best_gbps(nbytes, lambda: hbase.wait(hbase.load([(i, dst[i]) for i in range(n)])), dev)
            finally:
                hbase.close()
        del caches
        rep.row(f"store, {kib} KiB pieces", "GB/s", max(st), ceil_d2h, bst)
        rep.row(f"load, {kib} KiB pieces", "GB/s", max(ld), ceil_h2d, bld)
        rep.row(f"store + load at once, {kib} KiB pieces", "GB/s", max(both), ceil_both, None)
        rep.row(f"store + load at once, {kib} KiB pieces, gather_priority=high", "GB/s", max(both_high), ceil_both, None)


def under_compute_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, seconds: float = 2.0) -> None:
    """Store+load round trips while a bf16 8192x8192 matmul loop keeps the GPU busy on the default
    stream: copy GB/s against the idle GPU, and the matmul's GPU time against the matmul alone.
    The copies are called on a stream of their own, so they do not wait for the matmuls."""
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"under compute: {nbytes / 2**30:.2f} GiB store+load round trips beside a bf16 matmul loop")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def matmul_loop(stop: Callable[[], bool], times: list[float], count: int = 20) -> None:
        """Batches of ``count`` matmuls kept queued back to back, each timed on the GPU by events:
        what the copies cost the GPU, not the gaps of a launching thread waiting for the GIL."""
        prev = None
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                torch.matmul(a, b)
            end.record()
            if prev is not None:
                prev[1].synchronize()  # one batch stays queued while this one is timed
                times.append(prev[0].elapsed_time(prev[1]) / count / 1e3)
            prev = (start, end)
            if stop():
                end.synchronize()
                return

    warm: list[float] = []
    matmul_loop(lambda: len(warm) >= 2, warm)
    alone_times: list[float] = []
    matmul_loop(lambda: len(alone_times) >= 4, alone_times)
    alone = statistics.median(alone_times)
    caches = lay.cache(2 * n, dev)
    ids = torch.randperm(2 * n).tolist()[:n]
    side = torch.cuda.Stream(device=dev)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("gather_ctas=0 (default)", {}), ("gather_ctas=32", {"gather_ctas": 32}), ("gather_ctas=8", {"gather_ctas": 8}),
        ("gather_priority=high", {"gather_priority": "high"}), ("copy_engine=dma", {"copy_engine": "dma"}),
    ]
    for label, options in variants:
        with Offloader(caches, host_blocks=n, **options) as off:

            def round_trip() -> int:
                # called on a stream of its own: ordered after the matmuls, the copies would measure their queue
                with torch.cuda.stream(side):
                    off.store({i: ids[i] for i in range(n)}).result()
                    off.load({i: 2 * n - 1 - i for i in range(n)}).result()
                off.discard(range(n))
                return 2 * nbytes

            idle, _ = _rounds_gbps(round_trip, seconds, busy_other=False)
            stop = threading.Event()
            times: list[float] = []

            def compute() -> None:
                matmul_loop(stop.is_set, times)

            th = threading.Thread(target=compute, name="bench-matmul")
            th.start()
            try:
                busy, _ = _rounds_gbps(round_trip, seconds, busy_other=False)
            finally:
                stop.set()
                th.join()
        shared = statistics.median(times) if times else float("nan")
        rep.extra[f"under_compute_{label.split(' ')[0]}"] = {
            "copy_idle_gbps": idle, "copy_under_matmul_gbps": busy, "matmul_alone_s": alone, "matmul_beside_copies_s": shared,
        }
        rep.row(f"store+load beside a matmul, {label}", "GB/s", busy, idle, None, note="ceiling = the same on an idle GPU")
        rep.row(f"matmul time beside store+load, {label}", "x alone", shared / alone, None, None,
                note=f"{alone * 1e3:.1f} ms per matmul alone")


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
        for b in self.bufs:
            b.close()
        os.close(self.fd)
        os.unlink(self.path)


def disk_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: Any, disk_dir: str | None,
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
        if base is not None:
            dbase = base.DiskBaseline(caches, os.path.join(tmp, "base"), n)
            try:
                b["store"] = _best_gbps(nbytes, lambda: dbase.wait(dbase.store([(perm[i], i) for i in range(n)])), dev, reps=1)
                b["load"] = _best_gbps(nbytes, lambda: dbase.wait(dbase.load([(i, perm[i]) for i in range(n)])), dev, reps=1)
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

            disk_idle, _ = _rounds_gbps(disk_round, 1.0, busy_other=False)
            disk_busy, _ = _rounds_gbps(disk_round, 1.0, busy_other=True)
        rep.extra["disk_busy"] = {"idle": disk_idle, "other_busy": disk_busy}
        rep.row("disk store (no host tier)", "GB/s", max(st), max(cw), b.get("store"))
        rep.row("disk load (no host tier)", "GB/s", max(ld), max(cr), b.get("load"))
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remote_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, rounds: int = 3) -> None:
    """The remote tier on a redis-server on loopback (started here if one is on PATH, else skipped):
    a store's background write-through until every block is on the server, and ``alookup`` + ``load``
    of those blocks into another offloader, beside redis-py's own pipelined SET and GET of the same
    bytes (one value per block, windows of 4 MiB) in the same run."""
    server = shutil.which("redis-server")
    if server is None:
        print("  remote: skipped (no redis-server on PATH)", flush=True)
        return
    import socket
    import subprocess

    import redis

    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"remote tier: {nbytes / 2**30:.2f} GiB per transfer to a redis-server on loopback, ceiling = redis-py pipelined SET/GET")
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-redis-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        raw = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                raw.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.01)
        url = f"redis://127.0.0.1:{port}/0"
        figures: dict[str, list[float]] = {k: [] for k in ("store", "load", "set", "get")}
        caches = lay.cache(n, dev)
        slab = bytearray(os.urandom(lay.block_bytes))
        values = [bytes(slab) for _ in range(n)]
        window = max(1, (4 << 20) // lay.block_bytes)
        with Offloader(caches, host_blocks=n, remote=url) as writer, Offloader(lay.cache(n, dev), host_blocks=n, remote=url) as reader:
            for r in range(rounds):
                keys = [f"bench-{r}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                writer.store({k: i for i, k in enumerate(keys)}).result()
                while writer.stats().remote_writes_pending:
                    time.sleep(0.001)
                figures["store"].append(nbytes / (time.perf_counter() - t0) / 1e9)

                async def fetch() -> None:
                    assert await reader.alookup(keys) == n
                    await reader.load({k: i for i, k in enumerate(keys)})

                t0 = time.perf_counter()
                asyncio.run(fetch())
                figures["load"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                reader.discard(keys)
                writer.discard(keys)
                raw.flushall()
                t0 = time.perf_counter()
                for first in range(0, n, window):
                    pipe = raw.pipeline(transaction=False)
                    for i in range(first, min(n, first + window)):
                        pipe.set(f"raw-{i}", values[i])
                    pipe.execute()
                figures["set"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for first in range(0, n, window):
                    pipe = raw.pipeline(transaction=False)
                    for i in range(first, min(n, first + window)):
                        pipe.get(f"raw-{i}")
                    pipe.execute()
                figures["get"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                raw.flushall()
        raw.close()
        best = {k: max(v) for k, v in figures.items()}
        rep.row("remote store (background write-through)", "GB/s", best["store"], best["set"], None,
                note="from store() until every block is on the server")
        rep.row("remote load (alookup + load)", "GB/s", best["load"], best["get"], None)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def ttft_scenarios(rep: Report, dev: torch.device, lengths: list[int], disk_dir: str | None) -> None:
    """Time to first token of a transformers Llama (the checkout's examples/prefix_cache_transformers.py):
    recompute, reload from host memory, reload from disk, a 90% hit; Llama-3-8B's shape in bfloat16
    on a GPU, a tiny model on CPU."""
    cuda = dev.type == "cuda"
    rep.begin(f"time to first token: {'Llama-3-8B shape, bf16' if cuda else 'tiny Llama, float32'}, prompts of {lengths} tokens")
    if importlib.util.find_spec("transformers") is None:
        print("    skipped: needs transformers", flush=True)
        return
    pc = _checkout_module("examples/prefix_cache_transformers.py")
    if pc is None:
        print("    skipped: examples/prefix_cache_transformers.py not found (run from a checkout)", flush=True)
        return
    model = pc.build_model("8b" if cuda else "tiny", device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    try:
        rows = pc.measure_ttft(model, lengths, repeat=2, disk_dir=disk_dir)
    finally:
        del model
        if cuda:
            torch.cuda.empty_cache()
    recompute = {r["tokens"]: r["ttft_s"] for r in rows if r["case"] == "recompute"}
    for r in rows:
        first = r["case"] == "recompute"
        rep.row(f"TTFT {r['tokens']} tokens, {r['case']}", "ms", r["ttft_s"] * 1e3, None if first else recompute[r["tokens"]] * 1e3, None,
                note="ceiling = recompute" if not first else f"{r['recomputed_tokens']} tokens computed")


async def _in_flight_rate(op: Callable[[int], Awaitable[Any]], count: int, in_flight: int = 64) -> float:
    """``op(i)`` for ``count`` values of i, ``in_flight`` at a time from this loop; returns ops per second."""

    async def one_lane(lane: int) -> None:
        for i in range(lane, count, in_flight):
            await op(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one_lane(j) for j in range(in_flight)))
    return count / (time.perf_counter() - t0)


def _two_hop_rate(count: int) -> float:
    """The harness of :func:`small_transfers` doing nothing per op but a hop into another thread's
    loop and a hop back: the ceiling of any cross-thread transfer API."""
    lt = WorkerLoop("kvoffload-bench-hop")

    async def run() -> float:
        loop = asyncio.get_running_loop()

        async def op(i: int) -> None:
            fut = loop.create_future()
            lt.loop.call_soon_threadsafe(loop.call_soon_threadsafe, fut.set_result, None)
            await fut

        await _in_flight_rate(op, count // 10)
        return await _in_flight_rate(op, count)

    try:
        return asyncio.run(run())
    finally:
        lt.stop(5)


def small_transfers(rep: Report, dev: torch.device, base: Any, count: int = 5000) -> None:
    """One-block transfers: 64 in flight from one loop against the two-hop harness; all at once
    against the baseline; CPU per transfer."""
    rep.begin(f"one-block transfers (64 KiB blocks): {count} at once, and 64 in flight vs a bare two-hop")
    caches = {"kv": torch.randint(0, 255, (4096, 64 << 10), dtype=torch.uint8, device=dev)}

    async def run() -> tuple[float, float, float, float]:
        async with Offloader(caches, host_blocks=count + 8) as off:
            await asyncio.gather(*(off.store({("w", i): i}) for i in range(8)))
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(off.store({i: i % 4096}) for i in range(count)))
            all_at_once, cpu = count / (time.perf_counter() - t0), (time.process_time() - c0) / count
            off.discard(range(count))
            stores = await _in_flight_rate(lambda i: off.store({i: i % 4096}), count)
            loads = await _in_flight_rate(lambda i: off.load({i: i % 4096}), count)
            return all_at_once, cpu, stores, loads

    with _frozen_heap():
        rate, cpu, stores, loads = asyncio.run(run())
    with _frozen_heap():
        hop = _two_hop_rate(count)
    brate = None
    if base is not None:
        hb = base.HostBaseline(caches, count + 8)
        try:
            t0 = time.perf_counter()
            jobs = [hb.store([(i % 4096, i)]) for i in range(count)]
            for j in jobs:
                hb.wait(j)
            brate = count / (time.perf_counter() - t0)
        finally:
            hb.close()
    rep.row("one-block stores, all at once", "per s", rate, None, brate, note=f"{cpu * 1e6:.0f} us CPU per transfer")
    rep.row("one-block stores, 64 in flight", "per s", stores, hop, None, note="ceiling = a bare hop there and back")
    rep.row("one-block loads, 64 in flight", "per s", loads, hop, None, note="ceiling = a bare hop there and back")
    rep.extra["small"] = {"all_at_once": rate, "cpu_us_per_transfer": cpu * 1e6, "stores_64": stores, "loads_64": loads,
                          "two_hop_64": hop}


def first_layer_scenario(rep: Report, lay: Layout, gib: float, dev: torch.device) -> None:
    """A load with per-tensor completion: time until the first layer is in place against the whole
    load, and its GB/s against a bulk load of the same blocks (GPU only)."""
    n = lay.blocks_for(gib)
    rep.begin(f"per-layer loads: {n * lay.block_bytes / 2**30:.2f} GiB, {lay.layers} layers")
    caches = lay.cache(n, dev)
    first = next(iter(caches))

    async def run() -> tuple[float, float, float]:
        async with Offloader(caches, host_blocks=n) as off:
            await off.store({i: i for i in range(n)})
            bulk, first_s, whole = float("inf"), float("inf"), float("inf")
            for _ in range(3):
                _sync(dev)
                t0 = time.perf_counter()
                await off.load({i: n - 1 - i for i in range(n)})
                bulk = min(bulk, time.perf_counter() - t0)
                _sync(dev)
                t0 = time.perf_counter()
                t = off.load({i: n - 1 - i for i in range(n)}, per_tensor=True)
                await t.wait_tensor(first)
                first_s = min(first_s, time.perf_counter() - t0)
                await t
                whole = min(whole, time.perf_counter() - t0)
            return bulk, first_s, whole

    bulk, first_s, whole = asyncio.run(run())
    nbytes = n * lay.block_bytes
    rep.extra["per_layer"] = {"bulk_s": bulk, "first_layer_s": first_s, "whole_s": whole}
    rep.row("per-layer load: first layer in place", "ms", first_s * 1e3, whole * 1e3, None,
            note="ceiling = the whole per-layer load")
    rep.row("per-layer load vs bulk load", "GB/s", nbytes / whole / 1e9, nbytes / bulk / 1e9, None,
            note="ceiling = the bulk load of the same blocks")


def expedited_scenario(rep: Report, lay: Layout, gib: float, dev: torch.device) -> None:
    """A one-block load issued right behind a bulk load: how long it takes, expedited or not."""
    n = lay.blocks_for(gib)
    rep.begin(f"expedited loads: one block behind a {n * lay.block_bytes / 2**30:.2f} GiB load")
    caches = lay.cache(n + 1, dev)

    async def run() -> tuple[float, float]:
        async with Offloader(caches, host_blocks=n + 1, expedited_loads=True) as off:
            await off.store({i: i for i in range(n + 1)})
            best = {True: float("inf"), False: float("inf")}
            for _ in range(3):
                for expedited in (False, True):
                    _sync(dev)
                    bulk = off.load({i: i for i in range(n)})
                    t0 = time.perf_counter()
                    await off.load({n: n}, expedited=expedited)
                    best[expedited] = min(best[expedited], time.perf_counter() - t0)
                    await bulk
            return best[True], best[False]

    fast, slow = asyncio.run(run())
    rep.extra["expedited"] = {"expedited_s": fast, "regular_s": slow}
    rep.row("one-block load behind a bulk load, expedited", "ms", fast * 1e3, slow * 1e3, None,
            note="ceiling = the same load not expedited")


def cancel_scenario(rep: Report, lay: Layout, gib: float, dev: torch.device) -> None:
    """A large load cancelled a few ms into its copies: time from ``cancel()`` to the transfer ending
    cancelled, against the whole load."""
    n = lay.blocks_for(gib)
    rep.begin(f"cancellation: {n * lay.block_bytes / 2**30:.2f} GiB loads cancelled mid-copy")
    caches = lay.cache(n, dev)

    async def run() -> tuple[float, float]:
        async with Offloader(caches, host_blocks=n) as off:
            await off.store({i: i for i in range(n)})
            whole, latencies = float("inf"), []
            for _ in range(3):
                _sync(dev)
                t0 = time.perf_counter()
                await off.load({i: n - 1 - i for i in range(n)})
                whole = min(whole, time.perf_counter() - t0)
            for _ in range(5):
                _sync(dev)
                t = off.load({i: n - 1 - i for i in range(n)})
                await asyncio.sleep(whole / 10)  # a tenth of the way in
                t0 = time.perf_counter()
                t.cancel()
                try:
                    await t
                except TransferCancelled:
                    latencies.append(time.perf_counter() - t0)
            return whole, statistics.median(latencies) if latencies else float("nan")

    whole, latency = asyncio.run(run())
    rep.extra["cancel"] = {"whole_load_s": whole, "cancel_to_end_s": latency}
    if latency != latency:  # NaN
        print("    (every load finished before its cancel: nothing to report)", flush=True)
        return
    rep.row("load cancelled mid-copy: cancel() to end", "ms", latency * 1e3, whole * 1e3, None,
            note="median of 5; ceiling = the whole load")


def engine_loop_scenario(rep: Report, lay: Layout, gib: float, dev: torch.device, steps: int = 150, python_ms: float = 3.0) -> None:
    """A synthetic serving step, with and without offloading; reports step-time inflation.

    Each step runs GPU work on the caller's stream (a matmul; on CPU, none) and ``python_ms``
    of Python (scheduling, input preparation), as an engine does; meanwhile the next step's
    prefix hits (8 blocks) load, and this step's 4 new blocks store once its GPU work is done
    (ordered after it on the caller's stream). The step waits for the loads it needs and for
    the previous step's stores, never for copies it could overlap.
    """
    rep.begin(f"engine loop: {steps} steps of {python_ms:.0f} ms Python + GPU work, 8-block loads and 4-block stores")
    hits, new = 8, 4  # hits load into blocks [0, 2 * hits), alternating halves; new blocks come after
    n = max(lay.blocks_for(gib), 2 * hits + new * steps)
    caches = lay.cache(n, dev)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) if dev.type == "cuda" else None

    def gpu_work() -> None:
        if a is not None:
            for _ in range(4):
                a @ a

    async def run(off: Offloader | None) -> float:
        stores: list[Any] = []
        loading: Any = None
        t0 = time.perf_counter()
        for step in range(steps):
            if loading is not None:
                await loading  # this step's prefix is in place
            gpu_work()
            if off is not None:  # the next step's prefix hits, into the other half of the hit blocks
                half = hits * ((step + 1) % 2)
                loading = off.load({("p", j): half + j for j in range(hits)})
            _python_work(python_ms / 1e3)
            for t in stores:
                await t
            stores = []
            if off is not None:
                stores = [off.store({("s", step, j): 2 * hits + (step * new + j) % (n - 2 * hits) for j in range(new)})]
            if dev.type == "cuda":  # the step's end: its own stream done (a device-wide sync would wait for the copies too)
                torch.cuda.current_stream(dev).synchronize()
        for t in [*stores, *([loading] if loading is not None else [])]:
            await t
        return (time.perf_counter() - t0) / steps

    async def both() -> tuple[float, float]:
        async with Offloader(caches, host_blocks=hits + new * steps + 8) as off:
            await off.store({("p", j): j for j in range(hits)})
            await run(None)  # warm up
            bare = min([await run(None) for _ in range(2)])
            with_off = min([await run(off) for _ in range(2)])
            return bare, with_off

    with _frozen_heap():
        bare, with_off = asyncio.run(both())
    rep.extra["engine_loop"] = {"bare_ms": bare * 1e3, "offloading_ms": with_off * 1e3}
    rep.row("engine step with offloading", "ms", with_off * 1e3, bare * 1e3, None,
            note=f"ceiling = the same step without offloading; inflation {100 * (with_off / bare - 1):+.1f}%")


def wake_floor(n: int = 2000) -> list[float]:
    """Latencies of one ``call_soon_threadsafe`` hop from a plain thread into an idle loop."""
    lt = WorkerLoop("kvoffload-bench-floor")
    lat: list[float] = []
    got = threading.Event()

    def cb(t0: float) -> None:
        lat.append(time.perf_counter() - t0)
        got.set()

    for _ in range(n):
        got.clear()
        time.sleep(0.0002)  # let the loop go idle in epoll
        lt.loop.call_soon_threadsafe(cb, time.perf_counter())
        got.wait()
    lt.stop(5)
    return lat


def bridge_latency(kind: str, n: int = 2000) -> tuple[list[float], float]:
    """From an event's enqueue on an idle stream to the awaiting coroutine resuming; CPU per op."""
    from ._core.cuda.events import make_bridge

    lt = WorkerLoop("kvoffload-bench-bridge", on_thread_start=lambda: torch.cuda.set_device(0))
    bridge = make_bridge(kind, lt.loop, "kvoffload-bench-events")
    stream = torch.cuda.Stream()

    async def run() -> tuple[list[float], float]:
        lat, cpu = [], 0.0
        for _ in range(n):
            await asyncio.sleep(0.0002)
            ev = torch.cuda.Event(blocking=True)
            c0, t0 = time.process_time(), time.perf_counter()
            ev.record(stream)
            await bridge.watch(ev)
            lat.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
        return lat, cpu / n

    out = asyncio.run_coroutine_threadsafe(run(), lt.loop).result()
    bridge.close()
    lt.stop(5)
    return out


def idle_cpu_while_pending(kind: str, seconds: float = 0.5) -> float:
    """CPU seconds per wall second while one store waits about ``seconds`` behind a GPU kernel."""
    caches = {"k": torch.zeros((8, 1024), device="cuda")}
    with Offloader(caches, host_blocks=8, completion=kind) as off:  # type: ignore[arg-type]
        off.store({"warm": 0}).result()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * 1.5e9))
            c0, t0 = time.process_time(), time.perf_counter()
            t = off.store({"k": 1})
        t.result()
        return (time.process_time() - c0) / (time.perf_counter() - t0)


def one_block_latency(kind: str, dev: torch.device, n: int = 500) -> list[float]:
    """Call-to-resume latency of a one-block store awaited from the caller's loop."""
    caches = {"k": torch.zeros((64, 64 << 10), dtype=torch.uint8, device=dev)}

    async def run() -> list[float]:
        lat = []
        async with Offloader(caches, host_blocks=n + 1, completion=kind) as off:  # type: ignore[arg-type]
            for i in range(n):
                await asyncio.sleep(0.0002)
                t0 = time.perf_counter()
                await off.store({i: i % 64})
                lat.append(time.perf_counter() - t0)
        return lat

    return asyncio.run(run())


def latency_scenarios(rep: Report, dev: torch.device) -> None:
    """Completion latency beside the bare wake floor, and CPU use while transfers wait."""
    rep.begin("completion latency vs the cross-thread wake floor")
    floor = _lat(wake_floor())
    rep.extra["wake_floor"] = floor
    if dev.type != "cuda":
        lat = _lat(one_block_latency("poll", dev))
        rep.extra["one_block_store_cpu"] = lat
        rep.row("one-block store, call to resume p50", "us", lat["p50_us"], floor["p50_us"], None, note="CPU tensors")
        return
    for kind in ("poll", "thread"):
        samples, cpu = bridge_latency(kind)
        b = _lat(samples)
        b["cpu_us_per_op"] = cpu * 1e6
        b["idle_cpu_fraction"] = idle_cpu_while_pending(kind)
        rep.extra[f"bridge_{kind}"] = b
        e2e = _lat(one_block_latency(kind, dev))
        rep.extra[f"one_block_store_{kind}"] = e2e
        rep.row(f"completion ({kind}) p50 vs floor p50", "us", b["p50_us"], floor["p50_us"], None,
                note=f"p99 {b['p99_us']:.0f} us, {b['cpu_us_per_op']:.0f} us CPU/op, idle CPU {b['idle_cpu_fraction'] * 100:.1f}%")
        rep.row(f"one-block store ({kind}) call to resume p50", "us", e2e["p50_us"], None, None, note=f"p99 {e2e['p99_us']:.0f} us")


# ---------------------------------------------------------------------------------------------
# output


def plot(report: Report, path: str) -> None:
    """Bar chart of GB/s per scenario and system, and the latency distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gb = [r for r in report.rows if r["unit"] == "GB/s"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    width = 0.27
    xs = range(len(gb))
    for k, (col, label) in enumerate((("ceiling", "ceiling"), ("baseline", "seed baseline"), ("kvoffload", "kvoffload"))):
        ax.bar([x + (k - 1) * width for x in xs], [r[col] or 0 for r in gb], width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["scenario"] for r in gb], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("throughput by scenario")
    ax = axes[1]
    lat = {k: v for k, v in report.extra.items() if isinstance(v, dict) and "p50_us" in v}
    ax.bar(range(len(lat)), [v["p50_us"] for v in lat.values()], label="p50")
    ax.scatter(range(len(lat)), [v["p99_us"] for v in lat.values()], color="k", marker="_", s=200, label="p99")
    ax.set_xticks(range(len(lat)))
    ax.set_xticklabels(list(lat), rotation=30, ha="right", fontsize=8)
    if lat:  # a run that skipped the latency scenarios has nothing to scale
        ax.set_yscale("log")
    ax.set_ylabel("microseconds")
    ax.legend()
    ax.set_title("latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark: progress while it runs, a table at the end, optional JSON and PNG."""
    p = argparse.ArgumentParser(prog="kvoffload bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=None, help="bytes per host transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--disk-gib", type=float, default=None, help="bytes per disk transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--layout", default="32x2x16x8x128:bf16", help="LAYERSxBLOCK_SHAPE:dtype (default: 64 KiB per layer per block)")
    p.add_argument("--disk-dir", default=None, help="directory for the disk scenarios (default: the temp dir)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--ttft-tokens", default=None, help="prompt lengths of the time-to-first-token rows (default 4096,16384,32768 on GPU, 256,1024 on CPU)")
    p.add_argument("--small", type=int, default=5000, help="one-block transfers in the small-transfer scenario")
    p.add_argument("--engine-steps", type=int, default=150, help="steps per run of the engine-loop scenario")
    p.add_argument("--busy-seconds", type=float, default=2.0, help="seconds per measurement of the busy-caller scenario")
    p.add_argument("--skip", default="", help="comma-separated: host,busy,layouts,layers,expedited,cancel,compute,disk,persist,ttft,remote,small,engine,latency")
    p.add_argument("--baseline", default=None, help="path of seed_baseline.py (default: benchmarks/ of the checkout)")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG chart to this file (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    lay = Layout(args.layout)
    base = load_baseline(args.baseline)
    skip = set(filter(None, args.skip.split(",")))
    gpu_only = {"layouts", "layers", "expedited", "compute"} if not cuda else set()
    todo = [s for s in ("host", "busy", "layouts", "layers", "expedited", "cancel", "compute", "disk", "persist", "remote", "ttft", "small",
                        "engine", "latency")
            if s not in skip | gpu_only]
    rep = Report(len(todo))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "gpu": torch.cuda.get_device_name() if cuda else None,
            "cpus": os.cpu_count(), "layout": lay.spec, "block_bytes": lay.block_bytes, "baseline": base is not None}
    print("kvoffload bench:", json.dumps(meta), flush=True)
    if base is None:
        print("  (benchmarks/seed_baseline.py not found: no baseline column)", flush=True)
    gib = args.gib or (2.0 if cuda else 0.25)
    if "host" in todo:
        host_scenarios(rep, lay, gib, dev, base)
    if "busy" in todo:
        busy_caller_scenarios(rep, lay, min(gib, 0.5), dev, base, args.busy_seconds)
    if "layouts" in todo:
        layout_scenarios(rep, min(gib, 1.0), dev, base)
    if "layers" in todo:
        first_layer_scenario(rep, lay, min(gib, 1.0), dev)
    if "expedited" in todo:
        expedited_scenario(rep, lay, min(gib, 1.0), dev)
    if "cancel" in todo:
        cancel_scenario(rep, lay, 4.0 if cuda else min(gib, 0.25), dev)
    if "compute" in todo:
        under_compute_scenarios(rep, lay, min(gib, 0.5), dev, args.busy_seconds)
    if "disk" in todo:
        disk_scenarios(rep, lay, args.disk_gib or (2.0 if cuda else 0.25), dev, base, args.disk_dir, args.io_threads)
    if "persist" in todo:
        persistence_scenarios(rep, lay, args.disk_gib or (2.0 if cuda else 0.25), dev, args.disk_dir, args.io_threads)
    if "remote" in todo:
        remote_scenarios(rep, lay, min(gib, 1.0), dev)
    if "ttft" in todo:
        lengths = [int(x) for x in args.ttft_tokens.split(",")] if args.ttft_tokens else ([4096, 16384, 32768] if cuda else [256, 1024])
        ttft_scenarios(rep, dev, lengths, args.disk_dir)
    if "small" in todo:
        small_transfers(rep, dev, base, args.small)
    if "engine" in todo:
        engine_loop_scenario(rep, lay, min(gib, 0.25), dev, args.engine_steps)
    if "latency" in todo:
        with _frozen_heap():
            latency_scenarios(rep, dev)
    print("\n" + rep.table(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rep.rows, "extra": rep.extra}, f, indent=1)
    if args.plot:
        plot(rep, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
