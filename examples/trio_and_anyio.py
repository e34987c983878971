"""Await transfers under anyio (on asyncio or trio) and under trio itself; a cancel scope cancels them.

python examples/trio_and_anyio.py          # the trio runs need trio: pip install trio
"""

import importlib.util

import anyio
import torch

import kvoffload


async def main() -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv_caches = {"k": torch.randn(256, 16, 1024, device=device), "v": torch.randn(256, 16, 1024, device=device)}
    async with kvoffload.Offloader(kv_caches, host_blocks=256) as off:  # start and close off the event loop
        await off.store({("seq", i): i for i in range(128)})

        async def load(first: int) -> None:
            await off.load({("seq", i): 128 + i for i in range(first, first + 32)})

        async with anyio.create_task_group() as tg:  # four loads at once
            for first in range(0, 128, 32):
                tg.start_soon(load, first)

        # A cancel scope around an awaited transfer cancels the transfer; the scope's own
        # cancellation is handled by the scope, as for any other awaitable.
        t = off.store({("more", i): i for i in range(128)})
        with anyio.move_on_after(0) as scope:
            await t
        state = "cancelled" if t.cancelled() else "completed before the cancel reached it"
        return f"loaded 128 blocks; a store in an expired scope: {state} (scope cancelled: {scope.cancelled_caught})"


if __name__ == "__main__":
    print("anyio on asyncio:", anyio.run(main))
    if importlib.util.find_spec("trio") is not None:
        print("anyio on trio:   ", anyio.run(main, backend="trio"))
        import trio

        print("trio.run:        ", trio.run(main))
    else:
        print("trio is not installed: pip install trio, then run this again")
