"""Store KV-cache blocks in host memory and load them back, from asyncio.

Runs on the GPU if there is one, else on CPU tensors:  python examples/quickstart.py
"""

import asyncio

import torch

import kvoffload


async def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Two layers, each [blocks, K/V, tokens, heads, dim]; dim 0 indexes blocks.
    kv_caches = {f"layer.{i}": torch.randn(64, 2, 16, 8, 128, device=device) for i in range(2)}
    before = kv_caches["layer.0"][3].clone()

    async with kvoffload.Offloader(kv_caches, host_blocks=256) as off:
        # Keys are any hashable; serving engines use block hashes.
        result = await off.store({b"prefix-0": 3, b"prefix-1": 4})
        print(f"stored {len(result.keys)} blocks, {result.nbytes} bytes in {result.seconds * 1e3:.2f} ms")

        print("cached prefix length:", off.lookup([b"prefix-0", b"prefix-1", b"prefix-2"]))

        await off.load({b"prefix-0": 10, b"prefix-1": 11})  # into GPU blocks 10 and 11
        assert torch.equal(kv_caches["layer.0"][10], before)
        print("loaded; block 10 now holds what block 3 held")
        print(off.stats())


if __name__ == "__main__":
    asyncio.run(main())
