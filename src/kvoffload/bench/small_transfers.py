"""One-block transfers: how many per second, all at once against the seed-style baseline and 64 in
flight against a bare hop into another thread's loop and back; CPU per transfer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

import torch

from kvoffload import Offloader

from .measure import LoopThread, frozen_heap
from .report import Report

__all__ = ["small_transfers"]


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
    lt = LoopThread("kvoffload-bench-hop")

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
        lt.stop()


def small_transfers(rep: Report, dev: torch.device, base: ModuleType, count: int = 5000) -> None:
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

    with frozen_heap():
        rate, cpu, stores, loads = asyncio.run(run())
    with frozen_heap():
        hop = _two_hop_rate(count)
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

