"""Completion latency: a transfer's end reaching the awaiting coroutine, beside the bare cross-thread
wake floor; the completion bridges' latency and CPU on a GPU."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from kvoffload import Offloader
from kvoffload._testing import completion_bridge

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


def bridge_latency(kind: str, n: int = 2000) -> tuple[list[float], float]:
    """From an event's enqueue on an idle stream to the awaiting coroutine resuming; CPU per op."""
    lt = LoopThread("kvoffload-bench-bridge", on_start=lambda: torch.cuda.set_device(0))
    bridge = completion_bridge(kind, lt.loop)
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
    lt.stop()
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
    floor = latency_summary(wake_floor())
    rep.extra["wake_floor"] = floor
    if dev.type != "cuda":
        lat = latency_summary(one_block_latency("poll", dev))
        rep.extra["one_block_store_cpu"] = lat
        rep.row("one-block store, call to resume p50", "us", lat["p50_us"], floor["p50_us"], None, note="CPU tensors")
        return
    for kind in ("poll", "thread"):
        samples, cpu = bridge_latency(kind)
        b = latency_summary(samples)
        b["cpu_us_per_op"] = cpu * 1e6
        b["idle_cpu_fraction"] = idle_cpu_while_pending(kind)
        rep.extra[f"bridge_{kind}"] = b
        e2e = latency_summary(one_block_latency(kind, dev))
        rep.extra[f"one_block_store_{kind}"] = e2e
        rep.row(f"completion ({kind}) p50 vs floor p50", "us", b["p50_us"], floor["p50_us"], None,
                note=f"p99 {b['p99_us']:.0f} us, {b['cpu_us_per_op']:.0f} us CPU/op, idle CPU {b['idle_cpu_fraction'] * 100:.1f}%")
        rep.row(f"one-block store ({kind}) call to resume p50", "us", e2e["p50_us"], None, None, note=f"p99 {e2e['p99_us']:.0f} us")

