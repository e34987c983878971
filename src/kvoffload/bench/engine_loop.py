"""A synthetic serving loop: step time with no offloading (the ceiling), with kvoffload and with the
seed-style baseline, in the same run, for two lengths of the step's own Python."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Protocol

from types import ModuleType

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .measure import frozen_heap, percentile, python_steps
from .report import Report

__all__ = ["engine_loop_scenario"]

CALIBRATION_TURNS = 5000
"""Turns of the step's Python loop timed alone to learn how many make a millisecond (a few tenths
of a second)."""

HITS, NEW = 8, 4
"""Blocks a step loads (the next step's prefix hits) and stores (its new blocks)."""


class StepOffload(Protocol):
    """What a step asks of an offloading system: start the next step's prefix loads and this step's
    stores, and wait for either."""

    def load_hits(self, step: int) -> Any:
        """Start loading step ``step + 1``'s prefix hits; a handle for :meth:`wait`."""

    def store_new(self, step: int) -> Any:
        """Start storing step ``step``'s new blocks, after its GPU work; a handle for :meth:`wait`."""

    async def wait(self, handle: Any) -> None:
        """Until the transfer ``handle`` (None: none yet) has ended."""


class NoOffload:
    """No offloading: the step as it runs without any (the ceiling)."""

    def load_hits(self, step: int) -> Any:
        return None

    def store_new(self, step: int) -> Any:
        return None

    async def wait(self, handle: Any) -> None:
        pass


class KvoffloadSteps:
    """kvoffload: the prefix hits are keys ``("p", j)``; each step stores keys ``("s", step, j)``."""

    def __init__(self, off: Offloader, cache_blocks: int) -> None:
        self.off, self.cache_blocks = off, cache_blocks

    def load_hits(self, step: int) -> Any:
        half = HITS * ((step + 1) % 2)  # hits load into blocks [0, 2 * HITS), alternating halves
        return self.off.load({("p", j): half + j for j in range(HITS)})

    def store_new(self, step: int) -> Any:
        return self.off.store({("s", step, j): _new_block(step, j, self.cache_blocks) for j in range(NEW)})

    async def wait(self, handle: Any) -> None:
        if handle is not None:
            await handle

    def forget(self, steps: int) -> None:
        """Discard a run's stored blocks, so that the next run stores them again."""
        self.off.discard([("s", s, j) for s in range(steps) for j in range(NEW)])


class BaselineSteps:
    """The seed-style baseline: the prefix hits are host blocks ``[0, HITS)``; stores take the host
    blocks after them in turn. Waiting polls, as the baseline's callers do."""

    def __init__(self, baseline: Any, cache_blocks: int, host_blocks: int) -> None:
        self.baseline, self.cache_blocks, self.host_blocks = baseline, cache_blocks, host_blocks

    def load_hits(self, step: int) -> Any:
        half = HITS * ((step + 1) % 2)
        return self.baseline.load([(j, half + j) for j in range(HITS)])

    def store_new(self, step: int) -> Any:
        return self.baseline.store([(_new_block(step, j, self.cache_blocks), HITS + (step * NEW + j) % (self.host_blocks - HITS))
                                for j in range(NEW)])

    async def wait(self, handle: Any) -> None:
        if handle is not None:
            self.baseline.wait(handle)


def _new_block(step: int, j: int, cache_blocks: int) -> int:
    """The cache block of step ``step``'s ``j``-th new block: after the hit blocks, in turn."""
    return 2 * HITS + (step * NEW + j) % (cache_blocks - 2 * HITS)


def engine_loop_scenario(rep: Report, lay: Layout, gib: float, dev: torch.device, base: ModuleType, steps: int = 20,
                         python_ms: tuple[float, ...] = (3.0, 10.0), rounds: int = 24) -> None:
    """A synthetic serving step with no offloading, with kvoffload, and with the seed-style baseline.

    Each step runs GPU work on the caller's stream (four bf16 4096x4096 matmuls; on CPU, none) and
    ``python_ms`` of Python (scheduling, input preparation: a fixed number of turns of a Python loop,
    that many milliseconds' worth when alone, so that the GIL other threads take during it lengthens
    the step), as an engine does; meanwhile the next
    step's prefix hits (8 blocks) load, and this step's 4 new blocks store once its GPU work is done
    (ordered after it on the caller's stream). The step waits for the loads it needs and for the
    previous step's stores, never for copies it could overlap.

    The three run ``rounds`` times per Python length, each round one short run of ``steps`` steps of
    each (in a rotating order), so that a machine whose speed drifts by tens of percent within seconds
    slows all three alike. Each system's figure is the median over the rounds of its step time divided
    by the bare step's in the same round, times the bare step's median: ``/ceil`` is that median ratio.
    """
    rep.begin(f"engine loop: {rounds} rounds of {steps} steps of {' or '.join(f'{ms:g}' for ms in python_ms)} ms Python "
              f"+ GPU work, {HITS}-block loads and {NEW}-block stores; none, kvoffload, baseline side by side")
    cache_blocks = max(lay.blocks_for(gib), 2 * HITS + NEW * steps)
    host_blocks = HITS + NEW * steps + 8
    caches = lay.cache(cache_blocks, dev)
    cuda = dev.type == "cuda"
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) if cuda else None

    def gpu_work() -> None:
        if a is not None:
            for _ in range(4):
                a @ a

    t0 = time.perf_counter()
    python_steps(CALIBRATION_TURNS)  # the step's own loop, alone: its turns per second
    alone = CALIBRATION_TURNS / (time.perf_counter() - t0)
    turns = {ms: max(1, round(alone * ms / 1e3)) for ms in python_ms}

    async def run(offload: StepOffload, ms: float) -> tuple[float, dict[str, float]]:
        """Seconds per step of one run of ``steps`` steps, and seconds per step in each part of it:
        the offloading system's calls, its waits, and the step's own Python."""
        stores: Any = None
        loading: Any = None
        clock = time.perf_counter
        calls = waits = python = 0.0
        t0 = clock()
        for step in range(steps):
            a = clock()
            await offload.wait(loading)  # this step's prefix is in place
            b = clock()
            gpu_work()
            c = clock()
            loading = offload.load_hits(step)
            d = clock()
            python_steps(turns[ms])
            e = clock()
            await offload.wait(stores)  # the previous step's
            f = clock()
            stores = offload.store_new(step)
            g = clock()
            calls += (d - c) + (g - f)
            waits += (b - a) + (f - e)
            python += e - d
            if cuda:  # the step's end: its own stream done (a device-wide sync would wait for the copies too)
                torch.cuda.current_stream(dev).synchronize()
        await offload.wait(stores)
        await offload.wait(loading)
        return (clock() - t0) / steps, {"calls": calls / steps, "waits": waits / steps, "python": python / steps}

    Runs = dict[str, list[tuple[float, dict[str, float]]]]

    async def measure() -> dict[float, Runs]:
        runs: dict[float, Runs] = {ms: {} for ms in python_ms}
        async with Offloader(caches, host_blocks=host_blocks) as off:
            await off.store({("p", j): j for j in range(HITS)})
            kvo = KvoffloadSteps(off, cache_blocks)
            hb = base.HostBaseline(caches, host_blocks)
            try:
                hb.wait(hb.store([(j, j) for j in range(HITS)]))
                variants: list[tuple[str, StepOffload]] = [("bare", NoOffload()), ("kvoffload", kvo),
                                                           ("baseline", BaselineSteps(hb, cache_blocks, host_blocks))]
                for _, offload in variants:  # warm up
                    await run(offload, python_ms[0])
                    kvo.forget(steps)
                for ms in python_ms:
                    for r in range(rounds):
                        for name, offload in variants[r % 3:] + variants[:r % 3]:
                            runs[ms].setdefault(name, []).append(await run(offload, ms))
                            kvo.forget(steps)
            finally:
                hb.close()
        return runs

    with frozen_heap():
        runs = asyncio.run(measure())
    extra: dict[str, dict[str, float]] = {}
    for ms, by_name in runs.items():
        bare = [seconds for seconds, _ in by_name["bare"]]
        bare_median = statistics.median(bare)
        ratios = {name: [seconds / b for (seconds, _), b in zip(rs, bare)] for name, rs in by_name.items()}
        figure = {name: bare_median * statistics.median(r) for name, r in ratios.items()}
        quartiles = (percentile(ratios["kvoffload"], 0.25), percentile(ratios["kvoffload"], 0.75))
        parts = {name: {part: statistics.median(split[part] for _, split in rs) for part in rs[0][1]} for name, rs in by_name.items()}
        extra[f"{ms:g}ms"] = {**{f"{k}_ms": v * 1e3 for k, v in figure.items()},
                              **{f"{k}_{part}_us": us * 1e6 for k, split in parts.items() for part, us in split.items()},
                              "bare_min_ms": min(bare) * 1e3, "bare_max_ms": max(bare) * 1e3,
                              "kvoffload_ratio_p25": quartiles[0], "kvoffload_ratio_p75": quartiles[1]}
        inflation = {k: f"{100 * (v / bare_median - 1):+.1f}%" for k, v in figure.items() if k != "bare"}
        kvo, bare_parts = parts["kvoffload"], parts["bare"]
        where = (f"kvoffload's extra per step (medians): {1e6 * (kvo['calls'] - bare_parts['calls']):.0f} us in its calls, "
                 f"{1e6 * (kvo['waits'] - bare_parts['waits']):.0f} us in its waits, {1e6 * (kvo['python'] - bare_parts['python']):+.0f} us "
                 f"in the step's own Python (what other threads took of the GIL, and the machine's drift)")
        rep.row(f"engine step, {ms:g} ms of Python", "ms", figure["kvoffload"] * 1e3, bare_median * 1e3, figure["baseline"] * 1e3,
                note="ceiling = no offloading, median step; each system: the median of its step over the bare step's in the "
                     "same round, times that; step-time inflation " + ", ".join(f"{k} {v}" for k, v in inflation.items())
                     + f"; over the rounds, kvoffload's ratio {quartiles[0]:.3f}-{quartiles[1]:.3f} (quartiles) and the bare step "
                     f"{min(bare) * 1e3:.2f}-{max(bare) * 1e3:.2f} ms; " + where)
    rep.extra["engine_loop"] = extra
