"""``kvoffload bench``: kvoffload beside the ceiling, in one run, with ratios.

Scenarios now: completion latency of each CUDA completion bridge beside the
bare cross-thread wake floor (``call_soon_threadsafe`` into an idle loop), and
host-tier store/load throughput (contiguous and random block ids) beside one
large pinned copy each way. CPU-only machines run what needs no CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from typing import Any

import torch

from .loops import LoopThread
from .offloader import Offloader

__all__ = ["main"]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50_us": _pct(xs, 0.5) * 1e6, "p99_us": _pct(xs, 0.99) * 1e6, "mean_us": statistics.fmean(xs) * 1e6}


def wake_floor(n: int = 2000) -> dict[str, float]:
    """Latency of one ``call_soon_threadsafe`` hop from a plain thread into an idle loop."""
    lt = LoopThread("kvoffload-bench-floor")
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
    return _summary(lat)


def bridge_latency(kind: str, n: int = 2000) -> dict[str, float]:
    """Enqueue-to-resume latency of a completion bridge on an idle stream, and CPU per op."""
    from .cuda.events import make_bridge

    lt = LoopThread("kvoffload-bench-bridge", on_thread_start=lambda: torch.cuda.set_device(0))
    bridge = make_bridge(kind, lt.loop, "kvoffload-bench-events")
    stream = torch.cuda.Stream()

    async def run() -> tuple[list[float], float]:
        lat = []
        cpu = 0.0
        for _ in range(n):
            await asyncio.sleep(0.0002)
            ev = torch.cuda.Event(blocking=True)
            c0 = time.process_time()
            t0 = time.perf_counter()
            ev.record(stream)
            await bridge.watch(ev)
            lat.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
        return lat, cpu / n

    lat, cpu = asyncio.run_coroutine_threadsafe(run(), lt.loop).result()
    bridge.close()
    lt.stop(5)
    return {**_summary(lat), "cpu_us_per_op": cpu * 1e6}


def idle_cpu_while_pending(kind: str, seconds: float = 0.5) -> float:
    """CPU seconds per wall second spent while one store waits ``seconds`` behind a GPU kernel."""
    caches = {"k": torch.zeros((8, 1024), device="cuda")}
    with Offloader(caches, host_blocks=8, completion=kind) as off:
        off.store({"warm": 0}).result()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * 1.5e9))  # ~1.5 GHz clock: roughly `seconds`
            c0, t0 = time.process_time(), time.perf_counter()
            t = off.store({"k": 1})
        t.result()
        return (time.process_time() - c0) / (time.perf_counter() - t0)


def transfer_latency(kind: str, n: int = 500) -> dict[str, float]:
    """Call-to-resume latency of a one-block store awaited from the caller's loop."""
    caches = {"k": torch.zeros((64, 16384), dtype=torch.uint8, device="cuda")}

    async def run() -> list[float]:
        lat = []
        async with Offloader(caches, host_blocks=n + 1, completion=kind) as off:
            for i in range(n):
                await asyncio.sleep(0.0002)
                t0 = time.perf_counter()
                await off.store({i: i % 64})
                lat.append(time.perf_counter() - t0)
        return lat

    return _summary(asyncio.run(run()))


def host_throughput(gib: float, layers: int) -> dict[str, Any]:
    """GB/s of the pinned-copy ceiling and of kvoffload's host store/load, contiguous and random."""
    from .demo import make_cache
    from .hostmem import HostBuffer

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    block_bytes = layers * 2 * 16 * 8 * 128 * 2
    nblocks = max(2, int(gib * 2**30) // block_bytes)
    nbytes = nblocks * block_bytes
    out: dict[str, Any] = {"bytes": nbytes, "device": str(dev)}

    def timed(fn: Any) -> float:
        best = float("inf")
        for _ in range(3):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    hb = HostBuffer(nbytes, pin=cuda)
    dbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out["ceiling_d2h"] = timed(lambda: hb.tensor.copy_(dbuf, non_blocking=True))
    out["ceiling_h2d"] = timed(lambda: dbuf.copy_(hb.tensor, non_blocking=True))
    dbuf = None  # noqa: F841 - free the GPU buffer before the cache is built
    hb.close()
    caches = make_cache(nblocks, layers, dev)
    perm = torch.randperm(nblocks).tolist()
    with Offloader(caches, host_blocks=nblocks) as off:
        for order, ids in (("contiguous", list(range(nblocks))), ("random", perm)):
            st, ld = [], []
            for rep in range(3):
                off.discard(range(nblocks))
                st.append(off.store({i: ids[i] for i in range(nblocks)}).result().gbps)
                ld.append(off.load({i: ids[i] for i in range(nblocks)}).result().gbps)
            out[f"store_{order}"] = max(st)
            out[f"load_{order}"] = max(ld)
    for k in list(out):
        if k.startswith("store_"):
            out[f"{k}_vs_ceiling"] = out[k] / out["ceiling_d2h"]
        elif k.startswith("load_"):
            out[f"{k}_vs_ceiling"] = out[k] / out["ceiling_h2d"]
    return out


class RawDirectIo:
    """The disk ceiling: ``threads`` threads doing O_DIRECT pwritev / preadv of ``nbytes`` in 8 MiB calls."""

    def __init__(self, path: str, nbytes: int, threads: int, job_bytes: int = 8 << 20) -> None:
        import mmap
        import os

        self.path, self.nbytes, self.threads = path, nbytes, threads
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.bufs = [mmap.mmap(-1, job_bytes) for _ in range(threads)]
        for b in self.bufs:
            b.write(os.urandom(job_bytes))
        self.offsets = list(range(0, nbytes, job_bytes))

    def _run(self, op: Any) -> float:
        from concurrent.futures import ThreadPoolExecutor

        def worker(i: int) -> None:
            for off in self.offsets[i :: self.threads]:
                op(self.fd, [self.bufs[i]], off)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(worker, range(self.threads)))
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def write(self) -> float:
        """GB/s of one pass of writes."""
        import os

        return self._run(os.pwritev)

    def read(self) -> float:
        """GB/s of one pass of reads."""
        import os

        return self._run(os.preadv)

    def close(self) -> None:
        import os

        for b in self.bufs:
            b.close()
        os.close(self.fd)
        os.unlink(self.path)


def disk_throughput(gib: float, layers: int, disk_dir: str | None, io_threads: int, rounds: int = 3) -> dict[str, Any]:
    """Disk store/load with no host tier beside raw multi-threaded O_DIRECT on the same file system.

    Rounds alternate ceiling and kvoffload so that both see the same disk
    weather; each figure is the best of its rounds.
    """
    import os
    import shutil
    import tempfile

    from .demo import make_cache

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block_bytes = layers * 2 * 16 * 8 * 128 * 2
    nblocks = max(2, int(gib * 2**30) // block_bytes)
    nbytes = nblocks * block_bytes
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=disk_dir)
    raw = None
    try:
        raw = RawDirectIo(os.path.join(tmp, "raw"), nbytes, io_threads)
        caches = make_cache(nblocks, layers, dev)
        perm = torch.randperm(nblocks).tolist()
        cw, cr, st, ld = [], [], [], []
        with Offloader(caches, host_blocks=0, disk_path=os.path.join(tmp, "kv"), disk_blocks=nblocks, io_threads=io_threads) as off:
            for _ in range(rounds):
                off.discard(range(nblocks))
                cw.append(raw.write())
                st.append(off.store({i: perm[i] for i in range(nblocks)}).result().gbps)
                cr.append(raw.read())
                ld.append(off.load({i: perm[i] for i in range(nblocks)}).result().gbps)
        out: dict[str, Any] = {"bytes": nbytes, "io_threads": io_threads, "rounds": rounds,
                               "ceiling_write": max(cw), "ceiling_read": max(cr), "store": max(st), "load": max(ld)}
        out["store_vs_ceiling"] = out["store"] / out["ceiling_write"]
        out["load_vs_ceiling"] = out["load"] / out["ceiling_read"]
        return out
    finally:
        if raw is not None:
            raw.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a table, optionally writes JSON."""
    p = argparse.ArgumentParser(prog="kvoffload bench")
    p.add_argument("--gib", type=float, default=None, help="bytes per throughput transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--disk-gib", type=float, default=None, help="bytes per disk transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--disk-dir", default=None, help="directory for the disk scenarios (default: the temp dir)")
    p.add_argument("--io-threads", type=int, default=4)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
                           "gpu": torch.cuda.get_device_name() if cuda else None}
    print("[1/4] wake floor ...", flush=True)
    res["wake_floor"] = wake_floor()
    if cuda:
        print("[2/4] completion bridges ...", flush=True)
        for kind in ("thread", "poll"):
            res[f"bridge_{kind}"] = bridge_latency(kind)
            res[f"store1_{kind}"] = transfer_latency(kind)
            res[f"idle_cpu_{kind}"] = idle_cpu_while_pending(kind)
    print("[3/4] host throughput ...", flush=True)
    res["host"] = host_throughput(args.gib or (2.0 if cuda else 0.25), args.layers)
    print("[4/4] disk throughput ...", flush=True)
    res["disk"] = disk_throughput(args.disk_gib or (2.0 if cuda else 0.25), args.layers, args.disk_dir, args.io_threads)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
