"""Python calls inside kvoffload per transfer, call and end, in every thread.

Counts the Python functions of kvoffload entered (a profile hook on every thread) while an awaiting
task makes transfers one by one, each awaited as soon as it is called: a one-block store, an
8-block load, and a one-block store waited for with ``result()`` from another thread. What a
transfer costs in Python shows here before any timer can see it; run it from two checkouts to
compare them.

    python scripts/transfer_calls.py [--device cuda] [--block small|layout] [--transfers 200]

``--block small`` (the default): one 64 KiB tensor, the bench's one-block scenarios' cache; a copy
that small lands while its caller looks again, so the caller ends it. ``--block layout``: the
bench's default layout (32 tensors, 2 MiB blocks), whose one-block copy is still in flight when
awaited, so the landing watcher ends it. The hook sees every thread from Python 3.12
(``threading.setprofile_all_threads``); before that it is set before the offloader starts, so its
threads have it. Before Python 3.12 a comprehension counts as a call.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from types import FrameType
from typing import Any

import torch

from kvoffload import Offloader
from kvoffload.bench.cache_layout import Layout
from kvoffload.bench.measure import frozen_heap


class CallCounter:
    """Counts calls of kvoffload's own Python (the bench's excepted) while :attr:`on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls = 0

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        """The profile hook: counts each Python call into kvoffload's files (not the bench's)."""
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if "kvoffload" in name and "bench" not in name:
                self.calls += 1


def caches_for(block: str, device: torch.device) -> dict[str, torch.Tensor]:
    """A 64-block cache: one 64 KiB tensor (``small``) or the bench's default layout (``layout``)."""
    if block == "layout":
        return Layout().cache(64, device)
    return {"k": torch.zeros((64, 64 << 10), dtype=torch.uint8, device=device)}


async def count(caches: dict[str, torch.Tensor], transfers: int, counter: CallCounter) -> dict[str, float]:
    """Calls per transfer of each kind, after as many of it to warm up."""
    per: dict[str, float] = {}
    async with Offloader(caches, host_blocks=4 * transfers) as off:
        await off.store({("hit", j): j for j in range(8)})

        async def store(tag: object, i: int) -> None:
            await off.store({(tag, i): 8 + i % 48})

        async def load(tag: object, i: int) -> None:
            await off.load({("hit", j): 16 + j for j in range(8)})

        async def store_result(tag: object, i: int) -> None:
            transfer = off.store({(tag, i): 8 + i % 48})
            await asyncio.to_thread(transfer.result)

        kinds = {"one-block store, awaited": store, "8-block load, awaited": load,
                 "one-block store, result() in another thread": store_result}
        for name, make in kinds.items():
            for measured in (False, True):
                counter.calls, counter.on = 0, measured
                for i in range(transfers):
                    await make((name, measured), i)
                counter.on = False
                off.discard([key for key in off.keys() if key[0] != "hit"])
            per[name] = counter.calls / transfers
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--block", choices=("small", "layout"), default="small")
    parser.add_argument("--transfers", type=int, default=200)
    args = parser.parse_args()
    counter = CallCounter()
    every_thread = getattr(threading, "setprofile_all_threads", threading.setprofile)
    every_thread(counter.hook)
    sys.setprofile(counter.hook)
    with frozen_heap():
        per = asyncio.run(count(caches_for(args.block, torch.device(args.device)), args.transfers, counter))
    sys.setprofile(None)
    every_thread(None)  # type: ignore[arg-type]  # None removes the hook
    for name, calls in per.items():
        print(f"{name}: {calls:.1f} Python calls inside kvoffload, call and end, every thread")


if __name__ == "__main__":
    main()
