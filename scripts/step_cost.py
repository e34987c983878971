"""What an engine step's transfers cost its thread, on the GPU path with the GPU stood in for, on any machine.

Each step does what the bench's *engine loop* scenario does with kvoffload, without the GPU work:
it awaits the last step's 8-block load (landed by then), starts the next one, runs ``--python-ms``
of Python (the step's own work, which leaves kvoffload's code and data cold, as in an engine), awaits
the last step's 4-block store and starts this step's. The offloader takes its GPU path over CPU
caches (``kvoffload._testing.take_gpu_path``): copies are enqueued at call time and followed by a
landing watcher, through a stand-in copier whose copies have landed when its call returns. What is
timed is the calling thread's CPU in the calls and the awaits: the Python of kvoffload's own hot
path, which the CUDA driver's calls add to on a GPU.

    python scripts/step_cost.py [--python-ms 3] [--steps 1500] [--runs 3] [--calls]

Prints, per run, the median and lower quartile of that CPU per step. Run it from two checkouts,
interleaved, to compare them: the machine's speed drifts between runs. ``--calls`` counts instead
the Python functions of kvoffload entered per step, in every thread, instead (a profile hook, which
slows them: their time is then not printed).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import threading
import time
import types
from typing import Any

import torch

import kvoffload
import kvoffload._testing
from kvoffload.bench.measure import python_steps

HITS, NEW = 8, 4


class Landed:
    """A copy's completion event: complete from the start."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StandInCopier:
    """The GPU copier's face over the CPU copier: each chunk is copied during the call and has landed."""

    def __init__(self, real: Any) -> None:
        self.real, self.chunk_blocks = real, real.chunk_blocks

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: Any) -> None:
        pass

    def take_cancel_flag(self) -> None:
        return None

    def ring_when_complete(self, event: Any, semaphore: Any, in_order: bool = True, for_thread: bool = False) -> None:
        semaphore.ring()

    def to_host(self, block_ids: Any, host: Any, rows: Any) -> Landed:
        self.real.to_host(block_ids, host, rows)
        return Landed()

    def to_device(self, host: Any, rows: Any, block_ids: Any) -> Landed:
        self.real.to_device(host, rows, block_ids)
        return Landed()

    def close(self) -> None:
        self.real.close()


class CallCounter:
    """Counts the Python functions of kvoffload's package entered, in every thread, while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls = 0
        self.package = os.path.dirname(kvoffload.__file__)

    def hook(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call" and frame.f_code.co_filename.startswith(self.package):
            self.calls += 1

    def __enter__(self) -> CallCounter:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]  # None removes the hook


async def run(steps: int, python_ms: float, turns_per_ms: float, counter: CallCounter | None = None) -> list[int]:
    """The calling thread's CPU (ns) in each step's calls and awaits, after 50 steps of warm-up
    (``counter``: turned on for those steps)."""
    caches = {f"layer.{i}": torch.zeros((128, 64), dtype=torch.uint8) for i in range(8)}
    turns = max(0, round(python_ms * turns_per_ms))
    per_step: list[int] = []
    async with kvoffload.Offloader(caches, host_blocks=HITS + NEW * 50 + 8) as off:
        kvoffload._testing.take_gpu_path(off, lambda kind, real: StandInCopier(real))
        await off.store({("p", j): j for j in range(HITS)})
        loading: Any = None
        storing: Any = None
        gc.disable()
        try:
            for step in range(steps):
                python_steps(turns)
                if counter is not None:
                    counter.on = step >= 50
                t0 = time.thread_time_ns()
                if loading is not None:
                    await loading
                loading = off.load({("p", j): HITS * (step % 2) + j for j in range(HITS)})
                if storing is not None:
                    await storing
                storing = off.store({("s", step, j): 2 * HITS + (step * NEW + j) % 100 for j in range(NEW)})
                if step >= 50:
                    per_step.append(time.thread_time_ns() - t0)
                if step % 50 == 49:  # room for the next 50 steps' stores
                    if counter is not None:
                        counter.on = False
                    await storing
                    storing = None
                    off.discard([("s", s, j) for s in range(step - 49, step + 1) for j in range(NEW)])
            if counter is not None:
                counter.on = False
            if storing is not None:
                await storing
            await loading
        finally:
            gc.enable()
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-ms", type=float, default=3.0, help="the step's own Python between its transfers")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", action="store_true", help="count kvoffload's Python calls per step instead")
    args = parser.parse_args()
    t0 = time.perf_counter()
    python_steps(200)
    turns_per_ms = 200 / ((time.perf_counter() - t0) * 1e3)
    if args.calls:
        with CallCounter() as counter:
            per = asyncio.run(run(args.steps, args.python_ms, turns_per_ms, counter))
        print(f"kvoffload's Python calls per step, every thread: {counter.calls / len(per):.1f} ({len(per)} steps: an 8-block load "
              f"and a 4-block store, each called and awaited; comprehensions count as calls before Python 3.12)")
        return
    for r in range(args.runs):
        per = sorted(asyncio.run(run(args.steps, args.python_ms, turns_per_ms)))
        print(f"run {r + 1}: the calling thread's CPU in a step's calls and awaits: median {statistics.median(per) / 1e3:.1f} us, "
              f"lower quartile {per[len(per) // 4] / 1e3:.1f} us ({len(per)} steps, {args.python_ms:g} ms of Python each)", flush=True)


if __name__ == "__main__":
    main()
