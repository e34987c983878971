"""Loads timed from the caller's side: the first layer of a per-layer load in place, a one-block
load expedited past a bulk load, a large load cancelled mid-copy."""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from kvoffload import Offloader, TransferCancelled

from .cache_layout import Layout
from .measure import sync_device
from .report import Report

__all__ = ["cancel_scenario", "expedited_scenario", "first_layer_scenario"]


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
                sync_device(dev)
                t0 = time.perf_counter()
                await off.load({i: n - 1 - i for i in range(n)})
                bulk = min(bulk, time.perf_counter() - t0)
                sync_device(dev)
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
                    sync_device(dev)
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
                sync_device(dev)
                t0 = time.perf_counter()
                await off.load({i: n - 1 - i for i in range(n)})
                whole = min(whole, time.perf_counter() - t0)
            for _ in range(5):
                sync_device(dev)
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

