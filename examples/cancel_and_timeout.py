"""Cancel transfers by cancelling the awaiting task, with a timeout, or explicitly; shield to opt out.

python examples/cancel_and_timeout.py
"""

import asyncio

import torch

import kvoffload


async def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv_caches = {"k": torch.randn(512, 64, 1024, device=device), "v": torch.randn(512, 64, 1024, device=device)}
    # small chunks: a transfer can be stopped between chunks of 4 blocks
    async with kvoffload.Offloader(kv_caches, host_blocks=512, chunk_bytes=4 * 2 * 64 * 1024 * 4) as off:
        transfer = off.store({("seq", i): i for i in range(512)})
        try:
            async with asyncio.timeout(0.001):
                await transfer  # cancelled when the timeout fires
        except TimeoutError:
            # The CancelledError behind the timeout arrived only after queued copies finished.
            print("timed out; transfer cancelled:", transfer.cancelled())
        # Chunks that landed before the cancel are stored whole; the rest are not visible.
        print("blocks stored before the cancel:", off.lookup([("seq", i) for i in range(512)]))

        # Explicit cancel from anywhere (another task, another thread):
        t = off.store({("other", i): i for i in range(512)})
        t.cancel()
        try:
            await t
        except kvoffload.TransferCancelled:  # cancelled by someone else: not this task's CancelledError
            print("cancelled explicitly")

        # asyncio.shield: the waiter gives up, the transfer finishes anyway.
        t = off.store({("kept", i): i for i in range(64)})
        try:
            await asyncio.wait_for(asyncio.shield(t), timeout=1e-6)
        except TimeoutError:
            pass
        print("shielded transfer still completes:", len((await t).keys), "blocks")


if __name__ == "__main__":
    asyncio.run(main())
