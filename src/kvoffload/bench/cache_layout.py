"""The KV layout a scenario runs on: ``--layout LAYERSxBLOCK_SHAPE:dtype``."""

from __future__ import annotations

import torch

__all__ = ["Layout"]


class Layout:
    """A KV layout: ``layers`` tensors of ``[blocks, *block_shape]`` in ``dtype``."""

    def __init__(self, spec: str = "32x2x16x8x128:bf16") -> None:
        dims, _, dt = spec.partition(":")
        parts = [int(x) for x in dims.split("x")]
        if len(parts) < 2 or any(p <= 0 for p in parts):
            raise ValueError(f"layout {spec!r}: want LAYERSxD1x...:dtype, e.g. 32x2x16x8x128:bf16")
        self.spec = spec
        self.layers, self.block_shape = parts[0], tuple(parts[1:])
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}[dt or "bf16"]
        elems = 1
        for d in self.block_shape:
            elems *= d
        self.piece_bytes = elems * torch.empty(0, dtype=self.dtype).element_size()
        self.block_bytes = self.piece_bytes * self.layers

    def blocks_for(self, gib: float) -> int:
        """Blocks in ``gib`` GiB (at least 2)."""
        return max(2, int(gib * 2**30) // self.block_bytes)

    def cache(self, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Random cache (random bits, never zeros)."""
        out = {}
        for i in range(self.layers):
            raw = torch.randint(-(2**31), 2**31 - 1, (num_blocks * self.piece_bytes // 4,), dtype=torch.int32, device=device)
            out[f"layer.{i}"] = raw.view(torch.uint8).view(self.dtype).view(num_blocks, *self.block_shape)
        return out

