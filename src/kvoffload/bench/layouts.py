"""Host store and load per piece size (4-64 KiB per layer per block), and both directions at once
(GPU only), each with the share of one large copy it must reach (its floor)."""

from __future__ import annotations

import time
from types import ModuleType

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .host_tier import host_ceilings
from .measure import best_gbps, sync_device
from .report import Report

__all__ = ["PIECE_LAYOUTS", "layout_scenarios"]


PIECE_LAYOUTS = {4: "32x2x16x8x8:bf16", 16: "32x2x16x8x32:bf16", 32: "32x2x16x8x64:bf16", 64: "32x2x16x8x128:bf16"}
"""Piece size in KiB -> a 32-layer layout with pieces of that size."""

FLOORS = {4: (0.90, 0.80), 16: (0.95, 0.93), 32: (0.96, 0.95), 64: (0.96, 0.96)}
"""Piece size in KiB -> the share of one large copy a store and a load must reach."""


def layout_scenarios(rep: Report, gib: float, dev: torch.device, base: ModuleType) -> None:
    """Host store and load of random block ids, and both at once, for 4, 16, 32 and 64 KiB pieces."""
    rep.begin(f"layouts: {gib:.2f} GiB per transfer, 32 layers, pieces of 4-64 KiB, random ids")
    for kib, spec in PIECE_LAYOUTS.items():
        lay = Layout(spec)
        n = lay.blocks_for(gib)
        nbytes = n * lay.block_bytes
        ceil_d2h, ceil_h2d, ceil_both = host_ceilings(nbytes, dev)
        caches = lay.cache(2 * n, dev)
        ids = torch.randperm(2 * n).tolist()
        src, dst = ids[:n], ids[n:]
        def both_at_once(off: Offloader) -> float:
            """GB/s of storing keys n.. from ``dst`` while loading keys 0.. (stored) into ``src``."""
            sync_device(dev)
            t0 = time.perf_counter()
            a = off.store({n + i: dst[i] for i in range(n)})
            b = off.load({i: src[i] for i in range(n)})
            a.result()
            b.result()
            return 2 * nbytes / (time.perf_counter() - t0) / 1e9

        st, ld, both = [], [], []
        with Offloader(caches, host_blocks=2 * n) as off:
            for _ in range(3):
                off.discard(range(2 * n))
                st.append(off.store({i: src[i] for i in range(n)}).result().gbps)
                ld.append(off.load({i: dst[i] for i in range(n)}).result().gbps)
                both.append(both_at_once(off))
        hbase = base.HostBaseline(caches, n)
        try:
            bst = best_gbps(nbytes, lambda: hbase.wait(hbase.store([(src[i], i) for i in range(n)])), dev)
            bld = best_gbps(nbytes, lambda: hbase.wait(hbase.load([(i, dst[i]) for i in range(n)])), dev)
        finally:
            hbase.close()
        del caches
        rep.row(f"store, {kib} KiB pieces", "GB/s", max(st), ceil_d2h, bst, floor=FLOORS[kib][0])
        rep.row(f"load, {kib} KiB pieces", "GB/s", max(ld), ceil_h2d, bld, floor=FLOORS[kib][1])
        rep.row(f"store + load at once, {kib} KiB pieces", "GB/s", max(both), ceil_both, None)

