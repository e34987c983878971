"""What one transfer costs in CPU time, GIL hand-overs and wake-ups, per transfer kind.

For a one-block store, an 8-block load and bulk (64 MiB) stores and loads, N transfers run from
one asyncio loop, awaited one after the other and then with 64 in flight (4 for bulk), and each
is charged, per transfer:

* the CPU time of the calling thread (``time.thread_time``: the calls, the awaits, the loop's turns),
* the CPU time of kvoffload's own threads (every thread named ``kvoffload-*`` that the offloader
  started, read from ``/proc/self/task/<tid>/schedstat``; a copy between CPU tensors runs there),
* their GIL acquisitions, through a proxy: the threads' context switches, voluntary and involuntary,
  from ``/proc/self/task/<tid>/status``. CPython (3.11, 3.12) counts no GIL acquisitions; a thread
  that is switched out and back in, asleep in a GIL-released wait or blocked on the GIL itself,
  takes the GIL once when it runs Python again. The proxy misses takes that never block (a GIL
  released around a call that returns at once, found free again) and counts a wake that then
  waits for the GIL twice or three times (the wake, the GIL wait, a forced switch);
  :func:`calibrate_gil_proxy` measures it on threads woken a known number of times (by
  ``time.sleep``: exactly 1.0 per wake; by ``queue.get()`` from a Python thread: 1 to 3),
* the wake-ups of kvoffload's event loops: how often a worker loop began an idle turn, a ``select``
  with a timeout other than 0, which sleeps until a post wakes it (or returns at once when one is
  already waiting); counted in a second pass with a profile hook on kvoffload's threads
  (``threading.setprofile``), which slows them.

Uses the public API only. ``python -m kvoffload.bench.transfer_cost`` prints the rows (CUDA
tensors when a GPU is there, CPU tensors otherwise).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import queue
import selectors
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

import torch

import kvoffload

__all__ = ["transfer_cost_scenarios", "calibrate_gil_proxy", "ThreadCounters", "read_thread_counters"]

BLOCK_BYTES = 64 << 10
"""Bytes per cache block: a K and a V tensor of 32 KiB rows each."""
BULK_BYTES = 64 << 20


class Report(Protocol):
    """What the scenarios report to: the benchmark's summary table."""

    extra: dict[str, Any]

    def begin(self, what: str) -> None: ...

    def row(self, scenario: str, unit: str, kvoffload: float, *, note: str = "", bare_hop: float | None = None) -> None: ...


# -- per-thread counters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadCounters:
    """A thread's CPU time and context switches so far (Linux ``/proc``; zeros elsewhere)."""

    cpu_ns: int = 0
    voluntary: int = 0
    involuntary: int = 0

    def __sub__(self, other: ThreadCounters) -> ThreadCounters:
        return ThreadCounters(self.cpu_ns - other.cpu_ns, self.voluntary - other.voluntary, self.involuntary - other.involuntary)

    def __add__(self, other: ThreadCounters) -> ThreadCounters:
        return ThreadCounters(self.cpu_ns + other.cpu_ns, self.voluntary + other.voluntary, self.involuntary + other.involuntary)


def read_thread_counters(native_id: int | None) -> ThreadCounters:
    """The counters of the thread with kernel id ``native_id`` (zeros if it has ended, or off Linux)."""
    if native_id is None:
        return ThreadCounters()
    base = f"/proc/self/task/{native_id}"
    try:
        with open(f"{base}/schedstat") as f:
            cpu_ns = int(f.read().split()[0])
        vol = invol = 0
        with open(f"{base}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return ThreadCounters()
    return ThreadCounters(cpu_ns, vol, invol)


def _sum_counters(threads: list[threading.Thread]) -> dict[str, ThreadCounters]:
    return {t.name: read_thread_counters(t.native_id) for t in threads}


def _switches_of_thread(body: Callable[[], None], drive: Callable[[], None]) -> ThreadCounters:
    """The counters a thread gathers from the moment it is woken to run ``body()``, while ``drive()``
    runs here, to its end (read while the thread still lives: an ended thread's counters are gone).
    Its start is one wake more than ``body()``'s own."""
    ready, go, finished, release = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def run() -> None:
        ready.set()
        go.wait()
        body()
        finished.set()
        release.wait()

    t = threading.Thread(target=run, name="gil-proxy-check", daemon=True)
    t.start()
    ready.wait()
    time.sleep(0.005)  # asleep in go.wait() when counting starts
    before = read_thread_counters(t.native_id)
    go.set()
    drive()
    finished.wait()
    time.sleep(0.005)
    after = read_thread_counters(t.native_id)
    release.set()
    t.join()
    return after - before


def calibrate_gil_proxy(wakes: int = 200) -> dict[str, float]:
    """Context switches the GIL proxy counts per known wake, two known cases:

    * ``"timed_sleep"``: a thread that sleeps ``wakes`` times in ``time.sleep`` while no other thread
      runs Python; it finds the GIL free at each wake: 1.0 is exact.
    * ``"queue_get"``: a thread woken ``wakes`` times in ``queue.get()`` by a thread that then waits for
      its answer; it takes the GIL once per wake, but often waits for it first (its waker still holds
      it), and that wait is a second switch: between 1.0 and 3.0.
    """

    def sleeps() -> None:
        for _ in range(wakes):
            time.sleep(0.0002)

    timed = _switches_of_thread(sleeps, lambda: None)
    jobs: queue.SimpleQueue[int] = queue.SimpleQueue()
    acks: queue.SimpleQueue[int] = queue.SimpleQueue()

    def answer() -> None:
        for _ in range(wakes):
            acks.put(jobs.get())

    def ask() -> None:
        for i in range(wakes):
            jobs.put(i)
            acks.get()

    got = _switches_of_thread(answer, ask)
    known = wakes + 1  # and the wake that starts the thread's body
    return {"timed_sleep": (timed.voluntary + timed.involuntary) / known, "queue_get": (got.voluntary + got.involuntary) / known}


# -- wake-up counting: a profile hook on kvoffload's threads ---------------------------------------------

_SELECT_CODES = frozenset(
    c.select.__code__ for c in (getattr(selectors, n, None) for n in ("EpollSelector", "PollSelector", "SelectSelector", "KqueueSelector",
                                                                     "DevpollSelector"))
    if c is not None
)


class _SleepCounter:
    """Counts, per thread named ``kvoffload-*``, the selector calls that may sleep (timeout not 0)."""

    def __init__(self) -> None:
        self.sleeps: dict[str, int] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        """For threads started from now on (the offloader's, when it starts after this)."""
        threading.setprofile(self._hook_for_new_thread)

    def uninstall(self) -> None:
        threading.setprofile(None)  # None removes the hook

    def _hook_for_new_thread(self, frame: FrameType, event: str, arg: Any) -> None:
        name = threading.current_thread().name
        if not name.startswith("kvoffload-"):
            sys.setprofile(None)
            return
        sys.setprofile(self._make_hook(name))

    def _make_hook(self, name: str) -> Callable[[FrameType, str, Any], None]:
        codes, sleeps, lock = _SELECT_CODES, self.sleeps, self._lock

        def hook(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code in codes and frame.f_locals.get("timeout") != 0:
                with lock:
                    sleeps[name] = sleeps.get(name, 0) + 1

        return hook

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.sleeps)


# -- the scenarios -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kind:
    label: str
    blocks: int
    """Blocks per transfer."""
    direction: str
    """"store" or "load"."""
    count: int
    """Transfers per measurement."""
    depth: int
    """Transfers in flight in the concurrent mode."""


def _kinds(scale: float, bulk_bytes: int) -> list[_Kind]:
    bulk = max(1, bulk_bytes // BLOCK_BYTES)
    n = max(16, int(2000 * scale))
    size = f"{bulk_bytes >> 20} MiB" if bulk_bytes >= 1 << 20 else f"{bulk_bytes >> 10} KiB"
    return [
        _Kind("one-block store", 1, "store", n, 64),
        _Kind("8-block load", 8, "load", n, 64),
        _Kind(f"bulk store {size}", bulk, "store", max(4, int(12 * scale)), 4),
        _Kind(f"bulk load {size}", bulk, "load", max(4, int(12 * scale)), 4),
    ]


async def _sequential(op: Callable[[int], Awaitable[Any]], n: int) -> None:
    for i in range(n):
        await op(i)


async def _in_flight(op: Callable[[int], Awaitable[Any]], n: int, *, depth: int) -> None:
    counter = itertools.count()

    async def lane() -> None:
        while (i := next(counter)) < n:
            await op(i)

    await asyncio.gather(*(lane() for _ in range(depth)))


def _caches(num_blocks: int, dev: torch.device) -> dict[str, torch.Tensor]:
    half = BLOCK_BYTES // 2
    return {name: torch.zeros((num_blocks, half), dtype=torch.uint8, device=dev) for name in ("k", "v")}


def _median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


async def _measure_once(
    run: Callable[[int], Awaitable[None]], n: int, threads: list[threading.Thread], sleeps: _SleepCounter | None,
) -> dict[str, float]:
    """``run(n)`` transfers, charged per transfer."""
    await asyncio.sleep(0.02)  # the workers' turns after the transfers before end
    t0, c0, k0 = time.perf_counter(), time.thread_time_ns(), _sum_counters(threads)
    z0 = sleeps.snapshot() if sleeps is not None else {}
    await run(n)
    c1, t1 = time.thread_time_ns(), time.perf_counter()
    await asyncio.sleep(0.02)
    k1 = _sum_counters(threads)
    z1 = sleeps.snapshot() if sleeps is not None else {}
    per_thread = {name: k1[name] - k0[name] for name in k1}
    total = sum(per_thread.values(), ThreadCounters())
    row: dict[str, float] = {
        "transfers": n,
        "caller_cpu_us": (c1 - c0) / n / 1e3,
        "kvoffload_cpu_us": total.cpu_ns / n / 1e3,
        "gil_proxy": (total.voluntary + total.involuntary) / n,
        "voluntary_switches": total.voluntary / n,
        "involuntary_switches": total.involuntary / n,
        "wall_us": (t1 - t0) / n * 1e6,
    }
    for name, d in per_thread.items():
        row[f"{name}_cpu_us"] = d.cpu_ns / n / 1e3
        row[f"{name}_switches"] = (d.voluntary + d.involuntary) / n
    if sleeps is not None:
        row["wakes"] = sum(z1.get(k, 0) - z0.get(k, 0) for k in z1) / n
        for name in z1:
            row[f"{name}_wakes"] = (z1[name] - z0.get(name, 0)) / n
    return row


async def _measure_kind(
    kind: _Kind, dev: torch.device, sleeps: _SleepCounter | None, repeats: int,
) -> dict[str, dict[str, float]]:
    """Both modes of one kind on a fresh offloader; per mode the per-transfer costs (the median of
    ``repeats`` runs). With ``sleeps`` (installed before the offloader starts), the selector sleeps too."""
    depth_blocks = kind.blocks * kind.depth
    num_blocks = max(2 * depth_blocks, 64)
    caches = _caches(num_blocks, dev)
    loads = kind.direction == "load"
    key_sets = 16 if kind.blocks <= 8 else 4
    # Loads read keys stored once; stores evict the least recently used keys in steady state.
    host_blocks = kind.blocks * key_sets if loads else 2 * depth_blocks
    before_threads = set(threading.enumerate())
    out: dict[str, dict[str, float]] = {}
    async with kvoffload.Offloader(caches, host_blocks=host_blocks) as off:
        if loads:
            for s in range(key_sets):
                await off.store({("k", s, j): j for j in range(kind.blocks)})
        serial = itertools.count()
        span = num_blocks - kind.blocks + 1

        def op(i: int) -> kvoffload.Transfer:
            first = (i * kind.blocks) % span
            if loads:
                s = i % key_sets
                return off.load({("k", s, j): first + j for j in range(kind.blocks)})
            n = next(serial)
            return off.store({("s", n, j): first + j for j in range(kind.blocks)})

        for mode, depth in (("awaited one by one", 1), (f"{kind.depth} in flight", kind.depth)):
            run = functools.partial(_sequential, op) if depth == 1 else functools.partial(_in_flight, op, depth=depth)
            await run(max(8, kind.count // 10))  # warm-up
            # after it: threads the offloader starts at its first transfers (a landing watcher) count too
            threads = [t for t in threading.enumerate()
                       if t not in before_threads and t.name.startswith("kvoffload-") and t.name not in ("kvoffload-start", "kvoffload-close")]
            rows = [await _measure_once(run, kind.count, threads, sleeps) for _ in range(repeats)]
            out[mode] = _median_rows(rows)
    return out


async def _two_hop(count: int, depth: int) -> dict[str, float]:
    """The floor a transfer's hand-overs cost: a bare hop to another thread's event loop and back
    (``call_soon_threadsafe`` both ways, nothing done there), charged as a transfer is."""
    hop_loop = asyncio.new_event_loop()
    hop = threading.Thread(target=hop_loop.run_forever, name="two-hop", daemon=True)
    hop.start()
    loop = asyncio.get_running_loop()

    def op(i: int) -> asyncio.Future[None]:
        fut = loop.create_future()
        hop_loop.call_soon_threadsafe(loop.call_soon_threadsafe, fut.set_result, None)
        return fut

    run = functools.partial(_sequential, op) if depth == 1 else functools.partial(_in_flight, op, depth=depth)
    try:
        await run(max(8, count // 10))
        await asyncio.sleep(0.02)
        c0, k0 = time.thread_time_ns(), read_thread_counters(hop.native_id)
        await run(count)
        c1 = time.thread_time_ns()
        await asyncio.sleep(0.02)
        d = read_thread_counters(hop.native_id) - k0
    finally:
        hop_loop.call_soon_threadsafe(hop_loop.stop)
        hop.join()
        hop_loop.close()
    return {"caller_cpu_us": (c1 - c0) / count / 1e3, "kvoffload_cpu_us": d.cpu_ns / count / 1e3,
            "gil_proxy": (d.voluntary + d.involuntary) / count, "wakes": d.voluntary / count}


def measure(dev: torch.device, scale: float = 1.0, repeats: int = 3, bulk_bytes: int = BULK_BYTES) -> dict[str, Any]:
    """Every kind's per-transfer costs (a timing pass, then a pass counting wake-ups), a bare two-hop's
    for comparison, and the GIL proxy's calibration. ``scale`` multiplies the transfer counts; each
    figure is the median of ``repeats`` runs; bulk transfers move ``bulk_bytes`` each."""
    per_kind: dict[str, dict[str, dict[str, float]]] = {}
    result: dict[str, Any] = {"kinds": per_kind, "gil_proxy_per_known_wake": calibrate_gil_proxy()}
    kinds = _kinds(scale, bulk_bytes)
    for kind in kinds:
        timed = asyncio.run(_measure_kind(kind, dev, None, repeats))
        counter = _SleepCounter()
        counter.install()
        try:
            counted = asyncio.run(_measure_kind(kind, dev, counter, 1))
        finally:
            counter.uninstall()
        for mode, row in timed.items():
            row["wakes"] = counted[mode]["wakes"]
            for k, v in counted[mode].items():
                if k.endswith("_wakes"):
                    row[k] = v
        per_kind[kind.label] = timed
    n = kinds[0].count
    result["two_hop"] = {
        mode: _median_rows([asyncio.run(_two_hop(n, depth)) for _ in range(repeats)])
        for mode, depth in (("awaited one by one", 1), ("64 in flight", 64))
    }
    return result


def transfer_cost_scenarios(
    rep: Report, dev: torch.device, scale: float = 1.0, repeats: int = 3, bulk_bytes: int = BULK_BYTES,
) -> None:
    """Per transfer kind and mode: caller CPU, kvoffload threads' CPU, GIL acquisitions (proxy) and
    worker wake-ups per transfer, against a bare two-hop (the bare hop column); the whole
    measurement in ``rep.extra["transfer_cost"]``. See :func:`measure` for the arguments."""
    rep.begin("per-transfer cost: caller CPU, kvoffload threads' CPU, GIL takes (context-switch proxy), wake-ups")
    data = measure(dev, scale, repeats, bulk_bytes)
    rep.extra["transfer_cost"] = data
    proxy = data["gil_proxy_per_known_wake"]
    hop = data["two_hop"]
    for label, modes in data["kinds"].items():
        for mode, r in modes.items():
            name = f"{label}, {mode}"
            # bare hop: a hop to another loop's thread and back, from the same number in flight
            b = hop["awaited one by one" if mode == "awaited one by one" else "64 in flight"]
            rep.row(f"{name}: caller CPU", "us/xfer", r["caller_cpu_us"], bare_hop=b["caller_cpu_us"],
                    note=f"wall {r['wall_us']:.0f} us/xfer; bare hop there and back")
            rep.row(f"{name}: kvoffload CPU", "us/xfer", r["kvoffload_cpu_us"], bare_hop=b["kvoffload_cpu_us"],
                    note="kvoffload-* threads, copies included")
            rep.row(f"{name}: GIL takes", "GIL/xfer", r["gil_proxy"], bare_hop=b["gil_proxy"],
                    note=f"context switches (vol {r['voluntary_switches']:.2f} + invol {r['involuntary_switches']:.2f}); "
                         f"per known wake the proxy counts {proxy['timed_sleep']:.2f} (GIL free) to {proxy['queue_get']:.2f}")
            rep.row(f"{name}: wake-ups", "wakes/xfer", r["wakes"], bare_hop=b["wakes"],
                    note="worker loop sleeps in select (bare hop: voluntary switches)")


class _PrintingReport:
    """A stand-in report that prints rows."""

    def __init__(self) -> None:
        self.extra: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []

    def begin(self, what: str) -> None:
        print(f"{what} ...\n  {'scenario':58s} {'unit':>10s} {'kvoffload':>10s} {'bare hop':>10s}  note", flush=True)

    def row(self, scenario: str, unit: str, kvoffload: float, note: str = "", bare_hop: float | None = None) -> None:
        self.rows.append({"scenario": scenario, "unit": unit, "kvoffload": kvoffload, "bare_hop": bare_hop, "note": note})
        base = f"{bare_hop:10.2f}" if bare_hop is not None else " " * 9 + "-"
        print(f"  {scenario:58s} {unit:>10s} {kvoffload:10.2f} {base}  {note}", flush=True)


if __name__ == "__main__":
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    scale = float(os.environ.get("KVOFFLOAD_COST_SCALE", "1"))
    transfer_cost_scenarios(_PrintingReport(), device, scale)
