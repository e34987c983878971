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


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints a table, optionally writes JSON."""
    p = argparse.ArgumentParser(prog="kvoffload bench")
    p.add_argument("--gib", type=float, default=None, help="bytes per throughput transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    res: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
                           "gpu": torch.cuda.get_device_name() if cuda else None}
    print("[1/3] wake floor ...", flush=True)
    res["wake_floor"] = wake_floor()
    if cuda:
        print("[2/3] completion bridges ...", flush=True)
        for kind in ("thread", "poll"):
            res[f"bridge_{kind}"] = bridge_latency(kind)
            res[f"store1_{kind}"] = transfer_latency(kind)
            res[f"idle_cpu_{kind}"] = idle_cpu_while_pending(kind)
    print("[3/3] host throughput ...", flush=True)
    res["host"] = host_throughput(args.gib or (2.0 if cuda else 0.25), args.layers)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
