"""The host tier: store and load GB/s, contiguous and random block ids, both directions at once,
beside one large pinned copy (the ceiling) and the seed-style baseline."""

from __future__ import annotations

import mmap
import time
from types import ModuleType

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .measure import best_gbps, sync_device
from .report import Report

__all__ = ["host_ceilings", "host_scenarios"]


def host_ceilings(nbytes: int, dev: torch.device) -> tuple[float, float, float | None]:
    """One large copy GPU->host, host->GPU, and both at once (GPU only), in GB/s, through ``2 * nbytes``
    of host memory (pinned on a GPU; faulted in before the first copy), freed again on return."""
    try:
        return _ceilings(nbytes, dev)
    finally:
        if dev.type == "cuda":  # torch keeps freed pinned memory cached for reuse: give it back
            getattr(torch._C, "_host_emptyCache", lambda: None)()


def _ceilings(nbytes: int, dev: torch.device) -> tuple[float, float, float | None]:
    cuda = dev.type == "cuda"
    # page-aligned and faulted in: pinned by torch on a GPU, anonymous pages on CPU
    host = torch.zeros(2 * nbytes, dtype=torch.uint8, pin_memory=True) if cuda else \
        torch.frombuffer(mmap.mmap(-1, 2 * nbytes), dtype=torch.uint8).zero_()
    dbuf = torch.empty(2 * nbytes, dtype=torch.uint8, device=dev)
    h1, h2 = host[:nbytes], host[nbytes:]
    d1, d2 = dbuf[:nbytes], dbuf[nbytes:]
    ceil_d2h = best_gbps(nbytes, lambda: h1.copy_(d1, non_blocking=True), dev)
    ceil_h2d = best_gbps(nbytes, lambda: d1.copy_(h1, non_blocking=True), dev)
    if not cuda:
        return ceil_d2h, ceil_h2d, None
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)
        s1.synchronize()
        s2.synchronize()

    return ceil_d2h, ceil_h2d, best_gbps(2 * nbytes, both, dev)


def host_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: ModuleType) -> None:
    """Host store/load, contiguous and random ids; both directions at once."""
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"host tier: {nbytes / 2**30:.2f} GiB per transfer, ceiling = one large copy")
    ceil_d2h, ceil_h2d, ceil_both = host_ceilings(nbytes, dev)  # its buffers are freed before the cache is built

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
            sync_device(dev)
            t0 = time.perf_counter()
            a = off.store({i: i for i in range(n, 2 * n)})
            b = off.load({i: i for i in range(n)})
            a.result()
            b.result()
            best = max(best, 2 * nbytes / (time.perf_counter() - t0) / 1e9)
        results["both"] = best
    bres: dict[str, float] = {}
    hbase = base.HostBaseline(caches, 2 * n)
    try:
        for order, blocks in ids.items():
            bres[f"store_{order}"] = best_gbps(nbytes, lambda: hbase.wait(hbase.store([(blocks[i], i) for i in range(n)])), dev)
            bres[f"load_{order}"] = best_gbps(nbytes, lambda: hbase.wait(hbase.load([(i, blocks[i]) for i in range(n)])), dev)

        def both_base() -> None:
            j1 = hbase.store([(i, i) for i in range(n, 2 * n)])
            j2 = hbase.load([(i, i) for i in range(n)])
            hbase.wait(j1)
            hbase.wait(j2)

        bres["both"] = best_gbps(2 * nbytes, both_base, dev)
    finally:
        hbase.close()
    for order in ("contiguous", "random"):
        floor = 0.96 if dev.type == "cuda" else None  # bulk transfers of 64 KiB pieces keep pace with one large copy
        rep.row(f"host store, {order} ids", "GB/s", results[f"store_{order}"], ceil_d2h, bres[f"store_{order}"], floor=floor)
        rep.row(f"host load, {order} ids", "GB/s", results[f"load_{order}"], ceil_h2d, bres[f"load_{order}"], floor=floor)
    rep.row("host store + load at once", "GB/s", results["both"], ceil_both, bres["both"])
