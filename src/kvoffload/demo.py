"""``kvoffload demo``: store a real KV cache, wipe it, load it back, verify every byte.

Runs on the GPU if there is one, else on CPU tensors. First through the host
tier alone, then with a host tier of a quarter of the cache in front of a
temporary disk tier, so that stores spill to disk and loads read from it.
Prints the sizes and the throughput of each step.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import torch

from . import Offloader

__all__ = ["run_demo"]


def make_cache(num_blocks: int, layers: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A vLLM-like cache: per layer one ``[blocks, 2 (K/V), 16 tokens, 8 heads, 128 dims]`` tensor, random."""
    gen = torch.Generator(device=device).manual_seed(1234)
    return {
        f"layer.{i}": torch.randn((num_blocks, 2, 16, 8, 128), generator=gen, device=device, dtype=torch.float32).to(dtype)
        for i in range(layers)
    }


async def _demo(device: torch.device, gib: float, layers: int) -> bool:
    block_bytes = layers * 2 * 16 * 8 * 128 * 2
    num_blocks = max(2, int(gib * 2**30) // block_bytes)
    print(f"device: {device}  layers: {layers}  block: {block_bytes / 2**20:.2f} MiB  blocks: {num_blocks}  "
          f"cache: {num_blocks * block_bytes / 2**30:.2f} GiB", flush=True)
    caches = make_cache(num_blocks, layers, device)
    original = {n: t.clone() for n, t in caches.items()}
    gen = torch.Generator().manual_seed(7)
    src = torch.randperm(num_blocks, generator=gen).tolist()
    dst = torch.randperm(num_blocks, generator=gen).tolist()
    print("allocating host tier ...", flush=True)
    async with Offloader(caches, host_blocks=num_blocks) as off:
        # Warm-up: one small round trip so that timings exclude first-use setup.
        await off.store({("warm", 0): 0})
        await off.load({("warm", 0): 0})
        off.discard([("warm", 0)])

        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stored = await off.store({i: src[i] for i in range(num_blocks)})
        report("store", stored.nbytes, stored.seconds, "random block ids")
        for t in caches.values():
            t.zero_()
        loaded = await off.load({i: dst[i] for i in range(num_blocks)})
        report("load", loaded.nbytes, loaded.seconds, "random block ids")
        print(f"lookup of all keys: {off.lookup(range(num_blocks))} / {num_blocks} stored", flush=True)
    ok = verify(caches, original, src, dst, device)

    # The same cache through a small host tier in front of a temporary disk tier.
    for n, t in caches.items():
        t.copy_(original[n])
    quarter = max(1, num_blocks // 4)
    with tempfile.TemporaryDirectory(prefix="kvoffload-demo-") as tmp:
        path = os.path.join(tmp, "kv.bin")
        print(f"disk tier: a file without a name in {tmp} ({num_blocks * off.layout.slot_bytes / 2**30:.2f} GiB), "
              f"host tier {quarter} blocks", flush=True)
        async with Offloader(caches, host_blocks=quarter, disk_path=path, disk_blocks=num_blocks) as off:
            t0 = time.perf_counter()
            for i in range(0, num_blocks, quarter):  # each store spills the previous quarter to disk
                await off.store({i2: src[i2] for i2 in range(i, min(i + quarter, num_blocks))})
            s = off.stats()
            report("store with spill", num_blocks * off.layout.block_bytes, time.perf_counter() - t0,
                   f"{s.spilled} blocks spilled, {s.host_ready} in host memory, {s.disk_ready} on disk")
            for t in caches.values():
                t.zero_()
            both = await off.load({i: dst[i] for i in range(num_blocks)})
            report("load from both tiers", both.nbytes, both.seconds)
        print(f"files left in {tmp}: {os.listdir(tmp) or 'none'}", flush=True)
        ok = verify(caches, original, src, dst, device) and ok
    return ok


def report(what: str, nbytes: int, seconds: float, note: str = "") -> None:
    """One line: size, time and GB/s of a step."""
    extra = f" ({note})" if note else ""
    print(f"{what}: {nbytes / 2**30:.2f} GiB in {seconds * 1e3:.1f} ms = {nbytes / seconds / 1e9:.2f} GB/s{extra}", flush=True)


def verify(caches: dict[str, torch.Tensor], original: dict[str, torch.Tensor], src: list[int], dst: list[int],
           device: torch.device) -> bool:
    """True if block ``dst[i]`` of every tensor holds what block ``src[i]`` held, byte for byte."""
    print("verifying every byte ...", flush=True)
    src_t = torch.tensor(src, device=device)
    dst_t = torch.tensor(dst, device=device)
    return all(
        torch.equal(caches[n].index_select(0, dst_t).view(torch.uint8), original[n].index_select(0, src_t).view(torch.uint8))
        for n in caches
    )


def run_demo(device: str = "auto", gib: float | None = None, layers: int = 32) -> int:
    """Run the demo; returns a process exit code (0 when every byte matched)."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if gib is None:
        gib = 2.0 if dev.type == "cuda" else 0.25
    t0 = time.perf_counter()
    ok = asyncio.run(_demo(dev, gib, layers))
    print(("OK: every byte round-tripped" if ok else "FAILED: data mismatch") + f" ({time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1
