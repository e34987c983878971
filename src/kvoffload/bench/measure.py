"""Timing helpers the scenarios share: best-of GB/s, percentiles, a pure-Python loop standing for an
engine's own work, a driver thread beside it, a frozen heap, and a thread running an asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LoopThread", "best_gbps", "frozen_heap", "latency_summary", "percentile", "python_steps", "python_work", "rate_beside", "rounds_gbps",
           "sync_device"]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then keep what exists out of the garbage collector's full passes (``gc.freeze()``,
    as serving engines do once started), for the scenarios that time many small transfers: with
    torch's objects on the heap a full pass takes 40-80 ms, and one landing in a 5,000-transfer
    measurement halved its rate (26,000 against 47,000 one-block stores/s on CPU tensors)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def sync_device(dev: torch.device) -> None:
    """Wait for ``dev``'s queued work (nothing to wait for on CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_gbps(nbytes: int, fn: Callable[[], Any], dev: torch.device, reps: int = 3) -> float:
    """GB/s of the fastest of ``reps`` calls of ``fn`` moving ``nbytes``, device work included."""
    best = float("inf")
    for _ in range(reps):
        sync_device(dev)
        t0 = time.perf_counter()
        fn()
        sync_device(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency_summary(xs: list[float]) -> dict[str, float]:
    """p50, p99 and mean of latencies ``xs`` (seconds), in microseconds."""
    return {"p50_us": percentile(xs, 0.5) * 1e6, "p99_us": percentile(xs, 0.99) * 1e6, "mean_us": statistics.fmean(xs) * 1e6}




def python_work(seconds: float, until: Callable[[], bool] | None = None) -> float:
    """A pure-Python loop (what a serving engine's thread does between kernel launches) for
    ``seconds`` or until ``until()``; returns its iterations per second."""
    n, d = 0, {}
    t0 = time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end and not (until is not None and until()):
        for i in range(1000):
            d[i & 63] = i * 3
        n += 1
    return n / max(time.perf_counter() - t0, 1e-9)


def python_steps(count: int) -> None:
    """``count`` turns of :func:`python_work`'s loop: a fixed amount of Python, which takes longer
    when other threads take the GIL meanwhile (:func:`python_work` runs for a fixed time instead)."""
    d: dict[int, int] = {}
    for _ in range(count):
        for i in range(1000):
            d[i & 63] = i * 3


def rate_beside(step: Callable[[], int], seconds: float, busy_other: bool) -> tuple[float, float]:
    """``step()`` called back to back on a thread of its own for ``seconds`` (after one call to warm
    up), with the main thread idle (sleeping) or busy in Python; returns (what the steps returned,
    summed, per second; the Python loop's iterations per second meanwhile, 0 when idle)."""
    stop = threading.Event()
    moved = [0]
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            while not stop.is_set():
                moved[0] += step()
        except BaseException as e:  # reported below
            errors.append(e)

    step()  # warm up
    th = threading.Thread(target=drive, name="bench-driver")
    t0 = time.perf_counter()
    th.start()
    rate = 0.0
    if busy_other:
        rate = python_work(seconds)
    else:
        time.sleep(seconds)
    stop.set()
    th.join()
    if errors:
        raise errors[0]
    return moved[0] / (time.perf_counter() - t0), rate


def rounds_gbps(round_trip: Callable[[], int], seconds: float, busy_other: bool) -> tuple[float, float]:
    """GB/s of store+load round trips (``round_trip()`` returns the bytes it moved) run back to back
    on a thread of their own for ``seconds``, with the main thread idle (sleeping) or busy in Python;
    returns (GB/s, Python it/s meanwhile)."""
    bytes_per_s, rate = rate_beside(round_trip, seconds, busy_other)
    return bytes_per_s / 1e9, rate


class LoopThread:
    """An asyncio loop running forever in a daemon thread of its own: the bare cross-thread hop the
    latency floors are measured with (it is the bench's, not the library's)."""

    def __init__(self, name: str, on_start: Callable[[], Any] | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                if on_start is not None:
                    on_start()
            except BaseException as e:  # raised by the constructor
                failed.append(e)
                return
            finally:
                ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self.loop.close()
            raise failed[0]

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, join its thread, close the loop."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
