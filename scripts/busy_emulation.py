"""The bench's *another thread busy* row with the GPU stood in for, on any Linux machine.

A thread does store+load round trips of several chunks, each waited for in ``result()``, while the
main thread runs Python without a pause (or sleeps, for the idle figure). The GPU copier is a
stand-in whose chunks land one after the other, ``--chunk-ms`` each (as on one copy engine), and
whose rings are libc's ``sem_post`` run by a POSIX timer's thread at the landing time: no Python
and no GIL, as the CUDA driver runs them as host functions. Everything between the calls and the
rings is kvoffload's own code, so what the row measures, how soon a waiting thread gets the GIL
back behind a thread running Python, is measured as on a GPU.

    python scripts/busy_emulation.py [--chunk-ms 2.6] [--chunks 4] [--seconds 2] [--runs 2]

Prints each run's round trips per second against the copies' own pace (``1 / (2 * chunks *
chunk_ms)``), idle and busy, and the busy loop's speed. Run it from two checkouts to compare them.
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time
from typing import Any

import torch

import kvoffload
import kvoffload._testing
from kvoffload._core.base.cross_thread import WakeSemaphore

SIGEV_THREAD, TIMER_ABSTIME, CLOCK_MONOTONIC = 2, 1, 1
_libc = ctypes.PyDLL(None, use_errno=True)  # keeps the GIL, as the copier's own ring call does


class _Sigval(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]


class _Sigevent(ctypes.Structure):  # glibc's layout on 64-bit Linux
    _fields_ = [("sigev_value", _Sigval), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("sigev_notify_function", ctypes.c_void_p), ("sigev_notify_attributes", ctypes.c_void_p),
                ("pad", ctypes.c_byte * 32)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Rings:
    """``sem_post`` on a semaphore at a given monotonic time, from a timer's thread."""

    def __init__(self) -> None:
        self.timers: list[ctypes.c_void_p] = []

    def ring_at(self, at: float, address: int) -> None:
        event = _Sigevent()
        event.sigev_notify = SIGEV_THREAD
        event.sigev_notify_function = WakeSemaphore.RING_FUNCTION
        event.sigev_value.sival_ptr = address
        timer = ctypes.c_void_p()
        if _libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create")
        spec = _Itimerspec()
        spec.it_value.tv_sec, spec.it_value.tv_nsec = int(at), int((at % 1) * 1e9)
        if _libc.timer_settime(timer, TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timer_settime")
        self.timers.append(timer)  # deleted at the end: deleting an armed timer would cancel its ring

    def close(self) -> None:
        for timer in self.timers:
            _libc.timer_delete(timer)
        self.timers.clear()


class Landing:
    """A chunk's completion event: complete once its landing time has passed."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        while not self.query():
            time.sleep(0.0001)


class StandInCopier:
    """The GPU copier's face, copying nothing: each chunk lands ``chunk_s`` after the one before."""

    def __init__(self, real: Any, chunk_s: float, rings: Rings) -> None:
        self.real, self.chunk_blocks, self.chunk_s, self.rings = real, real.chunk_blocks, chunk_s, rings
        self.free_at = 0.0

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: Any) -> None:
        pass

    def take_cancel_flag(self) -> None:
        return None

    def ring_when_complete(self, event: Landing, semaphore: WakeSemaphore, in_order: bool = True, for_thread: bool = False) -> None:
        self.rings.ring_at(event.at, semaphore.address)

    def _chunk(self) -> Landing:
        self.free_at = max(self.free_at, time.monotonic()) + self.chunk_s
        return Landing(self.free_at)

    def to_host(self, block_ids: Any, host: Any, rows: Any) -> Landing:
        return self._chunk()

    def to_device(self, host: Any, rows: Any, block_ids: Any) -> Landing:
        return self._chunk()

    def close(self) -> None:
        self.real.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-ms", type=float, default=2.6, help="a chunk's copy time (128 MiB over PCIe Gen5: about 2.6 ms)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per store and per load")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each measurement")
    parser.add_argument("--runs", type=int, default=2, help="idle and busy measurements, in turn")
    args = parser.parse_args()
    chunk_s, blocks = args.chunk_ms / 1e3, 64 * args.chunks
    caches = {f"l{i}": torch.zeros(blocks, 4, 1024, dtype=torch.uint8) for i in range(2)}
    pace = 1 / (2 * args.chunks * chunk_s)
    rings = Rings()
    try:
        with kvoffload.Offloader(caches, host_blocks=blocks, chunk_bytes=64 * kvoffload.BlockLayout.of(caches).slot_bytes) as off:
            kvoffload._testing.take_gpu_path(off, lambda kind, copier: StandInCopier(copier, chunk_s, rings))

            def round_trips(stop: threading.Event, done: list[int]) -> None:
                n = 0
                while not stop.is_set():
                    off.store({i: i for i in range(blocks)}).result()
                    off.load({i: blocks - 1 - i for i in range(blocks)}).result()
                    off.discard(range(blocks))
                    n += 1
                done.append(n)

            for run in range(args.runs):
                for busy in (False, True):
                    stop, done = threading.Event(), []
                    driver = threading.Thread(target=round_trips, args=(stop, done))
                    start = time.monotonic()
                    driver.start()
                    turns = 0
                    if busy:
                        end = start + args.seconds
                        while time.monotonic() < end:  # pure Python: the GIL changes hands only when asked
                            for _ in range(1000):
                                turns += 1
                    else:
                        time.sleep(args.seconds)
                    stop.set()
                    driver.join()
                    elapsed = time.monotonic() - start
                    rate = done[0] / elapsed
                    loop = f", the busy loop {turns / elapsed / 1e6:.1f} M turns/s" if busy else ""
                    print(f"[{run + 1}/{args.runs}] {'busy' if busy else 'idle'}: {rate:.1f} round trips/s, {rate / pace:.2f} of the copies' pace{loop}",
                          flush=True)
    finally:
        rings.close()


if __name__ == "__main__":
    main()
