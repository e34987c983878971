"""Completion latency: a one-block store's call to the awaiting coroutine's resumption, beside the bare
cross-thread wake floor; on a GPU, the CPU kvoffload uses while a store waits behind a kernel."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from kvoffload import Offloader

from .measure import LoopThread, latency_summary
from .report import Report

__all__ = ["latency_scenarios"]


def wake_floor(n: int = 2000) -> list[float]:
    """Latencies of one ``call_soon_threadsafe`` hop from a plain thread into an idle loop."""
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
    lt.stop()
    return lat


def idle_cpu_while_pending(seconds: float = 0.5) -> float:
    """CPU seconds per wall second while one store waits about ``seconds`` behind a GPU kernel."""
    caches = {"k": torch.zeros((8, 1024), device="cuda")}
    with Offloader(caches, host_blocks=8) as off:
        off.store({"warm": 0}).result()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * 1.5e9))
            c0, t0 = time.process_time(), time.perf_counter()
            t = off.store({"k": 1})
        t.result()
        return (time.process_time() - c0) / (time.perf_counter() - t0)


def one_block_latency(dev: torch.device, n: int = 500) -> list[float]:
    """Call-to-resume latency of a one-block store awaited from the caller's loop."""
    caches = {"k": torch.zeros((64, 64 << 10), dtype=torch.uint8, device=dev)}

    async def run() -> list[float]:
        lat = []
        async with Offloader(caches, host_blocks=n + 1) as off:
            for i in range(n):
                await asyncio.sleep(0.0002)
                t0 = time.perf_counter()
                await off.store({i: i % 64})
                lat.append(time.perf_counter() - t0)
        return lat

    return asyncio.run(run())


def latency_scenarios(rep: Report, dev: torch.device) -> None:
    """Completion latency beside the bare wake floor, and CPU use while a transfer waits."""
    rep.begin("completion latency vs the cross-thread wake floor")
    floor = latency_summary(wake_floor())
    rep.extra["wake_floor"] = floor
    e2e = latency_summary(one_block_latency(dev))
    rep.extra["one_block_store"] = e2e
    note = f"p99 {e2e['p99_us']:.0f} us; bare hop: one way into an idle loop, p50"
    if dev.type == "cuda":
        idle = idle_cpu_while_pending()
        rep.extra["idle_cpu_fraction"] = idle
        note += f"; CPU while a store waits behind a kernel {idle * 100:.1f}% of a core"
    else:
        note += "; CPU tensors"
    rep.row("one-block store, call to resume p50", "us", e2e["p50_us"], bare_hop=floor["p50_us"], note=note)
