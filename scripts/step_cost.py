"""What an engine step's transfers cost its thread, on the GPU path with the GPU stood in for, on any machine.

Each step does what the bench's *engine loop* scenario does with kvoffload, without the GPU work:
it awaits the last step's 8-block load (landed by then), starts the next one, runs ``--python-ms``
of Python (the step's own work, which leaves kvoffload's code and data cold, as in an engine), awaits
the last step's 4-block store and starts this step's. The offloader takes its GPU path over CPU
caches (``kvoffload._testing.take_gpu_path``): copies are enqueued at call time and followed by a
landing watcher, through a stand-in copier whose copies have landed when its call returns. What is
timed is the calling thread's CPU in the calls and the awaits: the Python of kvoffload's own hot
path, which the CUDA driver's calls add to on a GPU.

    python scripts/step_cost.py [--python-ms 3] [--steps 1500] [--runs 3] [--calls | --profile N] [--gpu]

Prints, per run, the median and lower quartile of that CPU per step. Run it from two checkouts,
interleaved, to compare them: the machine's speed drifts between runs. ``--calls`` counts instead
the Python functions of kvoffload entered per step, in every thread (a profile hook, which slows
them: their time is then not printed). ``--profile N`` prints the calling thread's N costliest
functions per step (cProfile, own time: compiled calls such as the driver's show as themselves).
``--gpu`` runs the real GPU path instead of the stand-in, on a GPU: the bench's cache layout
(32 tensors of 2 MiB blocks) on the device, and the step's GPU work (four bf16 4096x4096 matmuls)
queued on the caller's stream before its load, as in the bench, so the driver's calls are timed too.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import sys
import threading
import time
import types
from typing import Any

import torch

import kvoffload
import kvoffload._testing
from kvoffload.bench.cache_layout import Layout
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


async def run(steps: int, python_ms: float, turns_per_ms: float, counter: CallCounter | None = None, gpu: bool = False,
              profile: Any = None) -> list[int]:
    """The calling thread's CPU (ns) in each step's calls and awaits, after 50 steps of warm-up
    (``counter``, ``profile``: turned on for those steps)."""
    if gpu:
        caches = Layout().cache(128, torch.device("cuda"))
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    else:
        caches = {f"layer.{i}": torch.zeros((128, 64), dtype=torch.uint8) for i in range(8)}
    turns = max(0, round(python_ms * turns_per_ms))
    per_step: list[int] = []
    async with kvoffload.Offloader(caches, host_blocks=HITS + NEW * 50 + 8) as off:
        if not gpu:
            kvoffload._testing.take_gpu_path(off, lambda kind, real: StandInCopier(real))
        await off.store({("p", j): j for j in range(HITS)})
        loading: Any = None
        storing: Any = None
        gc.disable()
        try:
            for step in range(steps):  # the bench's step: await, GPU work, load, Python, await, store
                on = step >= 50
                if counter is not None:
                    counter.on = on
                if profile is not None and on:
                    profile.enable()
                t0 = time.thread_time_ns()
                if loading is not None:
                    await loading
                t1 = time.thread_time_ns()
                if gpu:
                    for _ in range(4):
                        a @ a
                t2 = time.thread_time_ns()
                loading = off.load({("p", j): HITS * (step % 2) + j for j in range(HITS)})
                t3 = time.thread_time_ns()
                if profile is not None:
                    profile.disable()
                python_steps(turns)
                if profile is not None and on:
                    profile.enable()
                t4 = time.thread_time_ns()
                if storing is not None:
                    await storing
                storing = off.store({("s", step, j): 2 * HITS + (step * NEW + j) % 100 for j in range(NEW)})
                if on:
                    per_step.append((t1 - t0) + (t3 - t2) + (time.thread_time_ns() - t4))
                if profile is not None:
                    profile.disable()
                if gpu:
                    torch.cuda.current_stream().synchronize()
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
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the calling thread's N costliest functions per step")
    parser.add_argument("--gpu", action="store_true", help="the real GPU path, on a GPU (the bench's layout, matmuls queued)")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device")
    t0 = time.perf_counter()
    python_steps(200)
    turns_per_ms = 200 / ((time.perf_counter() - t0) * 1e3)
    if args.calls:
        with CallCounter() as counter:
            per = asyncio.run(run(args.steps, args.python_ms, turns_per_ms, counter, args.gpu))
        print(f"kvoffload's Python calls per step, every thread: {counter.calls / len(per):.1f} ({len(per)} steps: an 8-block load "
              f"and a 4-block store, each called and awaited; comprehensions count as calls before Python 3.12)")
        return
    if args.profile:
        prof = cProfile.Profile()
        per = asyncio.run(run(args.steps, args.python_ms, turns_per_ms, gpu=args.gpu, profile=prof))
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
        print(f"the calling thread's costliest functions, per step ({len(per)} steps; cProfile's own overhead included):")
        for (file, line, name), (_, calls, own, cumulative, _) in rows[: args.profile]:
            print(f"  {own / len(per) * 1e6:7.1f} us own {cumulative / len(per) * 1e6:7.1f} us cumulative "
                  f"{calls / len(per):5.1f} calls  {os.path.basename(file)}:{line} {name}")
        return
    for r in range(args.runs):
        per = sorted(asyncio.run(run(args.steps, args.python_ms, turns_per_ms, gpu=args.gpu)))
        print(f"run {r + 1}: the calling thread's CPU in a step's calls and awaits: median {statistics.median(per) / 1e3:.1f} us, "
              f"lower quartile {per[len(per) // 4] / 1e3:.1f} us ({len(per)} steps, {args.python_ms:g} ms of Python each)", flush=True)


if __name__ == "__main__":
    main()
