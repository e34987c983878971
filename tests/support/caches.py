"""Random KV caches in several dtypes and piece sizes, and comparing their bytes."""

from __future__ import annotations

import torch


def random_caches(num_blocks: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Several tensors with different dtypes and bytes per block, filled with random bits."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "k0": ((num_blocks, 4, 16), torch.float32),  # 256 B per block
        "v0": ((num_blocks, 3, 5), torch.int16),  # 30 B per block: odd sizes exercise slot padding
        "k1": ((num_blocks, 2, 8, 8), torch.bfloat16),  # 256 B
        "v1": ((num_blocks, 1000), torch.uint8),  # 1000 B
    }
    out = {}
    for name, (shape, dtype) in shapes.items():
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        out[name] = raw.view(dtype).view(shape).to(device)
    return out


def block_bytes(caches: dict[str, torch.Tensor], block: int) -> bytes:
    """Every byte of one block, across tensors."""
    return b"".join(t[block].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() for t in caches.values())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (random bits include NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def check_every_visible_key(off, caches, orig, keys_to_blocks) -> list:
    """Load every visible key into blocks 0..n-1 and compare with the block it was stored from.

    ``orig`` is a copy of the cache taken before the stores; returns the visible keys.
    """
    visible = [k for k in keys_to_blocks if k in off]
    for t in caches.values():
        t.zero_()
    if visible:
        await off.load({k: i for i, k in enumerate(visible)})
    for i, k in enumerate(visible):
        for n in caches:
            assert same_bytes(caches[n][i], orig[n][keys_to_blocks[k]]), (k, n)
    return visible
