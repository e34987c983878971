"""Store+load round trips beside a matmul loop that keeps the GPU busy: copy GB/s against the idle
GPU and the matmul's time against the matmul alone, per GPU copy option (GPU only)."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .measure import rounds_gbps
from .report import Report

__all__ = ["under_compute_scenarios"]


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
        ("copy_engine=dma", {"copy_engine": "dma"}),
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

            idle, _ = rounds_gbps(round_trip, seconds, busy_other=False)
            stop = threading.Event()
            times: list[float] = []

            def compute() -> None:
                matmul_loop(stop.is_set, times)

            th = threading.Thread(target=compute, name="bench-matmul")
            th.start()
            try:
                busy, _ = rounds_gbps(round_trip, seconds, busy_other=False)
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

