"""A disk tier that survives a restart: store, close, reopen and find the blocks again.

A directory as disk_path holds one file per cache identity (the tensors' geometry and your
model's fingerprint), so a model and its next weights share the directory without sharing a
file. A file of another identity is refused, never emptied.

Runs on the GPU if there is one, else on CPU tensors:  python examples/persistent_restart.py
"""

import asyncio
import os
import tempfile

import torch

import kvoffload


def make_caches(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}": torch.randn(64, 2, 16, 8, 128, generator=g).to(device) for i in range(2)}


async def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as cache_dir:
        kv_caches = make_caches(device)
        keys = {f"prefix-{i}": i for i in range(8)}  # block hashes in a serving engine
        opts = dict(host_blocks=16, disk_path=cache_dir, disk_blocks=32, persist=True, fingerprint="my-model@rev-1")

        async with kvoffload.Offloader(kv_caches, **opts) as off:
            await off.store(keys)
            rev1_file = off.disk_file
            print("stored 8 blocks; the file is", os.path.basename(rev1_file))
        # close() wrote the host-resident entries to disk and checkpointed: a "restart" follows

        restarted = make_caches(device)
        for t in restarted.values():
            t.zero_()
        async with kvoffload.Offloader(restarted, **opts) as off:
            print("found again after the restart:", off.stats().recovered, "entries; hit length", off.lookup(list(keys)))
            await off.load({k: 32 + b for k, b in keys.items()})  # into blocks 32..39
            assert all(torch.equal(restarted[n][32 + b], kv_caches[n][b]) for n in kv_caches for b in keys.values())
            print("loaded byte for byte")
            off.discard(["prefix-7"])  # gone for good: its header is voided on disk before discard() returns

        # other weights: the same directory gives them a file of their own
        async with kvoffload.Offloader(restarted, **{**opts, "fingerprint": "my-model@rev-2"}) as off:
            print("rev-2 starts with", off.stats().recovered, "entries in its own file", os.path.basename(off.disk_file))

        # a file path holding another identity's cache is refused and left as it was
        try:
            kvoffload.Offloader(restarted, **{**opts, "disk_path": rev1_file, "fingerprint": "typo"}).start()
        except kvoffload.StartError as e:
            print("refused:", str(e.__cause__ or e).split(";")[0])


asyncio.run(main())
