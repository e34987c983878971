"""Python busy beside transfers: bulk store+load GB/s with another thread or the calling thread busy
in Python against all idle; an application thread's Python loop beside one-block stores driven from
another thread against the loop alone, kvoffload and the seed-style baseline driving."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .measure import frozen_heap, python_work, rate_beside, rounds_gbps
from .report import Report

__all__ = ["app_thread_scenario", "busy_caller_scenarios"]


def busy_caller_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, base: ModuleType, seconds: float = 2.0) -> None:
    """Bulk store+load GB/s while the process's Python is busy, against the same with it idle.

    *another thread busy*: a pure-Python loop runs on the main thread while a second thread drives
    round trips (store, load, discard). *caller busy*: the thread that calls ``store()``/``load()``
    runs the Python loop until each transfer is done. The baseline runs the first variant.
    """
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    rep.begin(f"busy caller: {nbytes / 2**30:.2f} GiB store+load round trips, Python busy vs idle")
    caches = lay.cache(2 * n, dev)
    ids = torch.randperm(2 * n).tolist()[:n]
    alone = python_work(min(seconds, 1.0))
    with Offloader(caches, host_blocks=n) as off:

        def kvo_round() -> int:
            off.store({i: ids[i] for i in range(n)}).result()
            off.load({i: 2 * n - 1 - i for i in range(n)}).result()
            off.discard(range(n))
            return 2 * nbytes

        def kvo_round_busy_caller() -> int:
            store = off.store({i: ids[i] for i in range(n)})
            python_work(60.0, until=store.done)
            store.result()
            load = off.load({i: 2 * n - 1 - i for i in range(n)})
            python_work(60.0, until=load.done)
            load.result()
            off.discard(range(n))
            return 2 * nbytes

        idle, _ = rounds_gbps(kvo_round, seconds, busy_other=False)
        busy, rate = rounds_gbps(kvo_round, seconds, busy_other=True)
        caller, _ = rounds_gbps(kvo_round_busy_caller, seconds, busy_other=False)
    hbase = base.HostBaseline(caches, n)
    try:

        def base_round() -> int:
            hbase.wait(hbase.store([(ids[i], i) for i in range(n)]))
            hbase.wait(hbase.load([(i, 2 * n - 1 - i) for i in range(n)]))
            return 2 * nbytes

        b_idle, _ = rounds_gbps(base_round, seconds, busy_other=False)
        b_busy, _ = rounds_gbps(base_round, seconds, busy_other=True)
    finally:
        hbase.close()
    rep.extra["busy_caller"] = {"idle": idle, "other_busy": busy, "caller_busy": caller, "baseline_idle": b_idle,
                                "baseline_other_busy": b_busy, "python_alone_its": alone, "python_beside_kvoffload_its": rate}
    rep.row("store+load, all threads idle", "GB/s", idle, None, b_idle)
    rep.row("store+load, another thread busy", "GB/s", busy, idle, b_busy,
            note=f"ceiling = idle; the busy loop ran at {rate / alone:.2f} of alone")
    rep.row("store+load, calling thread busy", "GB/s", caller, idle, None, note="ceiling = idle")



def paced_stores(issue: Callable[[int, int], None], per_s: float | None, burst: int = 16) -> Callable[[], int]:
    """A driver step for :func:`rate_beside`: each call issues the one-block stores due by now at
    ``per_s`` a second (all of them, at most ``burst``; ``burst`` every call with no rate) by
    ``issue(first, count)``, which returns once they are done, and returns ``count``; it sleeps
    until the next store is due when none is."""
    issued = 0
    start: float | None = None

    def step() -> int:
        nonlocal issued, start
        now = time.perf_counter()
        if start is None:
            start = now
        count = burst if per_s is None else min(burst, int((now - start) * per_s) + 1 - issued)
        if count <= 0:
            assert per_s is not None
            time.sleep(start + issued / per_s - now)
            return 0
        issue(issued, count)
        issued += count
        return count

    return step


def loop_time_per_store(loop: float, alone: float, stores_per_s: float) -> float:
    """The loop's time lost per store done, in microseconds: what the stores took from it (its share
    of alone short of 1) per store they completed; the share's noise makes it negative at times."""
    return (1.0 - loop / alone) * 1e6 / max(stores_per_s, 1.0)


def app_thread_scenario(rep: Report, lay: Layout, dev: torch.device, base: ModuleType, seconds: float = 2.0,
                        per_s: float = 5000.0, slots: int = 64, rounds: int = 4) -> None:
    """An application's own Python (a pure-Python loop on the main thread) while another thread drives
    one-block stores, each waited for and then discarded, paced at ``per_s`` a second and unpaced:
    the loop's speed against the loop alone (the ceiling), with kvoffload driving and with the
    seed-style baseline driving; the stores each achieved are in the note.

    The loop alone and beside each system run ``rounds`` times, half of ``seconds`` each, in a
    rotating order, and each system's figure is the median of the loop's speed beside it over its
    speed alone in the same round, times the median alone: the machine's speed drifts by tens of
    percent within seconds. The baseline's waits cost it a switch interval each, so it completes far
    fewer stores than it is paced at; a third row paces kvoffload at what the baseline completed, so
    that the two are also compared at equal work, and each row's note gives the loop's time lost per
    store done (:func:`loop_time_per_store`)."""
    rep.begin(f"application thread: a Python loop beside one-block stores ({lay.block_bytes >> 10} KiB) "
              f"from another thread, {per_s:,.0f}/s and unpaced, vs the loop alone")
    caches = lay.cache(slots, dev)
    each = seconds / 2

    with frozen_heap(), Offloader(caches, host_blocks=slots) as off:

        def kvoffload_stores(first: int, count: int) -> None:
            keys = range(first, first + count)
            for t in [off.store({k: k % slots}) for k in keys]:
                t.result()
            off.discard(keys)

        hbase = base.HostBaseline(caches, slots)

        def baseline_stores(first: int, count: int) -> None:
            for job in [hbase.store([(k % slots, k % slots)]) for k in range(first, first + count)]:
                hbase.wait(job)

        def in_rounds(drivers: dict[str, Callable[[], Callable[[], int]]]) -> tuple[float, dict[str, tuple[float, float]]]:
            """The loop alone, and beside each driver (a fresh paced step per run), in rotating rounds:
            (the median alone, it/s; per driver: (its figure, it/s; the stores it completed, per s))."""
            names = ["alone", *drivers]
            alone: list[float] = []
            shares: dict[str, list[float]] = {n: [] for n in drivers}
            done: dict[str, list[float]] = {n: [] for n in drivers}
            for r in range(rounds):
                got: dict[str, tuple[float, float]] = {}
                for name in names[r % len(names):] + names[: r % len(names)]:
                    got[name] = (0.0, python_work(each)) if name == "alone" else rate_beside(drivers[name](), each, busy_other=True)
                alone.append(got["alone"][1])
                for name in drivers:
                    shares[name].append(got[name][1] / got["alone"][1])
                    done[name].append(got[name][0])
            a = statistics.median(alone)
            return a, {n: (a * statistics.median(shares[n]), statistics.median(done[n])) for n in drivers}

        try:
            for pace in (per_s, None):
                alone, by = in_rounds({"kvoffload": lambda: paced_stores(kvoffload_stores, pace),
                                       "baseline": lambda: paced_stores(baseline_stores, pace)})
                (kvo_loop, kvo_stores), (b_loop, b_stores) = by["kvoffload"], by["baseline"]
                label = f"{pace:,.0f} one-block stores/s" if pace else "one-block stores, unpaced"
                kvo_cost, b_cost = loop_time_per_store(kvo_loop, alone, kvo_stores), loop_time_per_store(b_loop, alone, b_stores)
                rep.extra[f"app_thread_{'paced' if pace else 'unpaced'}"] = {
                    "loop_alone_its": alone, "loop_beside_kvoffload_its": kvo_loop, "kvoffload_stores_per_s": kvo_stores,
                    "loop_beside_baseline_its": b_loop, "baseline_stores_per_s": b_stores,
                    "kvoffload_loop_us_per_store": kvo_cost, "baseline_loop_us_per_store": b_cost,
                }
                rep.row(f"Python loop beside {label}", "it/s", kvo_loop, alone, b_loop,
                        note=f"ceiling = the loop alone; stores/s done: kvoffload {kvo_stores:,.0f}, baseline {b_stores:,.0f}; "
                             f"the loop's time lost per store done: kvoffload {kvo_cost:,.0f} us, baseline {b_cost:,.0f} us; "
                             f"medians of {rounds} rounds")
                if pace and b_stores < 0.9 * pace:  # the baseline fell behind: compare at the work it did
                    equal = max(b_stores, 1.0)
                    alone_eq, by_eq = in_rounds({"kvoffload": lambda: paced_stores(kvoffload_stores, equal)})
                    kvo_eq, kvo_eq_stores = by_eq["kvoffload"]
                    rep.extra["app_thread_equal_work"] = {"loop_alone_its": alone_eq, "loop_beside_kvoffload_its": kvo_eq,
                                                          "kvoffload_stores_per_s": kvo_eq_stores, "paced_at_per_s": equal}
                    rep.row("Python loop beside one-block stores, equal work", "it/s", kvo_eq, alone_eq,
                            b_loop * alone_eq / alone,
                            note=f"ceiling = the loop alone; kvoffload paced at the {equal:,.0f} stores/s the baseline completed "
                                 f"in the row above (it did {kvo_eq_stores:,.0f}); baseline = its share there, times this alone")
        finally:
            hbase.close()
