"""``kvoffload demo``: store a real KV cache, wipe it, load it back, verify every byte.

Runs on the GPU if there is one, else on CPU tensors. First through the host
tier alone, then with a host tier of a quarter of the cache in front of a
temporary disk tier, so that stores spill to disk and loads read from it.
Prints the sizes and the throughput of each step.

Before allocating anything, :meth:`DemoPlan.check` makes sure the device exists and that the
cache fits: in host memory (on CPU the cache, a copy to verify against and a host tier of the same
size: about 3x ``--gib``; on a GPU the host tier alone), in GPU memory (the cache and its copy)
and in the temporary directory (the disk tier).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from . import OffloadError, Offloader

__all__ = ["DemoPlan", "make_cache", "run_demo"]

PIECE_BYTES = 2 * 16 * 8 * 128 * 2
"""Bytes of one block of one layer: ``[2 (K/V), 16 tokens, 8 heads, 128 dims]`` in bf16 (64 KiB)."""


def _device(spec: str) -> torch.device:
    """``--device`` as a device of this machine; ``ValueError`` naming what is wrong."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"argument --device: want auto, cpu, cuda or cuda:N, got {spec!r}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (f"this torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None
               else "torch sees no GPU (none visible, or no driver)")
        raise ValueError(f"argument --device: {spec!r}, but there is no CUDA device here ({why}); use --device cpu or auto")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"argument --device: {spec!r}, but this machine has {count} CUDA device(s), "
                         f"cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}")
    return dev


def _memory_available() -> int | None:
    """Bytes of host memory available now (``MemAvailable`` of ``/proc/meminfo``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class DemoPlan:
    """What one run of the demo moves, on which device; :meth:`check` builds it, :meth:`run` runs it."""

    device: torch.device
    gib: float
    layers: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return self.layers * PIECE_BYTES

    @property
    def num_blocks(self) -> int:
        """Blocks of the cache (at least 2)."""
        return max(2, int(self.gib * 2**30) // self.block_bytes)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the cache."""
        return self.num_blocks * self.block_bytes

    @classmethod
    def check(cls, device: str = "auto", gib: float | None = None, layers: int = 32) -> DemoPlan:
        """The plan for these options, once the device exists and the cache fits its memory and the
        temporary directory; ``ValueError`` naming the option and the limit otherwise."""
        if gib is not None and not (math.isfinite(gib) and gib > 0):
            raise ValueError(f"argument --gib: want a number above 0, got {gib!r}")
        if layers < 1:
            raise ValueError(f"argument --layers: want a whole number of at least 1, got {layers!r}")
        dev = _device(device)
        plan = cls(dev, gib if gib is not None else (2.0 if dev.type == "cuda" else 0.25), layers)
        plan._check_room()
        return plan

    def _check_room(self) -> None:
        cache = self.cache_bytes
        on_gpu = self.device.type == "cuda"
        # On CPU: the cache, the copy verified against, the host tier. On a GPU: the host tier.
        host_factor = 1 if on_gpu else 3
        limits: list[tuple[str, int, int, str]] = []  # (what is needed, bytes, bytes there, where)
        available = _memory_available()
        if available is not None:
            limits.append(("of host memory" + (" (the host tier)" if on_gpu else " on CPU (the cache, a copy to verify against, the host tier)"),
                           host_factor * cache, available, "available (MemAvailable)"))
        if on_gpu:
            free, _total = torch.cuda.mem_get_info(self.device)
            # The cache and the copy verified against, plus a few layers' worth of temporaries.
            limits.append((f"on {self.device} (the cache and a copy to verify against)", 2 * cache + 4 * cache // self.layers,
                           free, "free there"))
        tmp = tempfile.gettempdir()
        slot = -(-self.block_bytes // 4096) * 4096
        try:
            limits.append((f"in {tmp} (the disk tier's file; TMPDIR chooses the directory)", self.num_blocks * slot,
                           shutil.disk_usage(tmp).free, "free there"))
        except OSError:
            pass
        for what, need, there, where in limits:
            if need > there:
                fits = math.floor(0.9 * there / (need / (cache / 2**30)) * 100) / 100
                hint = f"; try --gib {fits:g}" if fits >= 0.01 else ""
                raise ValueError(f"argument --gib: a {cache / 2**30:.2f} GiB cache needs {need / 2**30:.2f} GiB {what}, "
                                 f"{there / 2**30:.2f} GiB {where}{hint}")

    def run(self) -> int:
        """Run the demo; returns a process exit code: 0 when every byte matched, 1 when not or when
        the library or the machine refused (one line on stderr)."""
        t0 = time.perf_counter()
        try:
            ok = asyncio.run(_demo(self.device, self.num_blocks, self.layers))
        except (OffloadError, MemoryError, OSError, torch.cuda.OutOfMemoryError) as e:
            print(f"kvoffload demo: failed: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            return 1
        print(("OK: every byte round-tripped" if ok else "FAILED: data mismatch") + f" ({time.perf_counter() - t0:.1f} s)")
        return 0 if ok else 1


def make_cache(num_blocks: int, layers: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A vLLM-like cache: per layer one ``[blocks, 2 (K/V), 16 tokens, 8 heads, 128 dims]`` tensor, random."""
    gen = torch.Generator(device=device).manual_seed(1234)
    return {
        f"layer.{i}": torch.randn((num_blocks, 2, 16, 8, 128), generator=gen, device=device, dtype=torch.float32).to(dtype)
        for i in range(layers)
    }


async def _demo(device: torch.device, num_blocks: int, layers: int) -> bool:
    block_bytes = layers * PIECE_BYTES
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
    """Check the options (``ValueError`` naming the one that is wrong) and run the demo; returns a
    process exit code (0 when every byte matched)."""
    return DemoPlan.check(device, gib, layers).run()
