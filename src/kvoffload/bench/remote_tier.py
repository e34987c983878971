"""The remote tier on a redis-server on loopback, beside redis-py's own pipelined SET and GET; the
server the remote rows (here and in the time-to-first-token scenario) run against."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import torch

from kvoffload import Offloader

from .cache_layout import Layout
from .report import Report

__all__ = ["redis_server", "redis_unavailable", "remote_scenarios"]


def redis_unavailable() -> str | None:
    """Why no remote row can run here (no ``redis-server`` on PATH, no redis-py), or None."""
    if shutil.which("redis-server") is None:
        return "no redis-server on PATH"
    if importlib.util.find_spec("redis") is None:
        return "needs redis-py: pip install 'kvoffload[redis]'"
    return None


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server started on a free loopback port, with no persistence, answering PING; yields
    its URL (``redis://127.0.0.1:PORT/0``) and stops it (its directory removed) on exit. Check
    :func:`redis_unavailable` first."""
    import redis

    server = shutil.which("redis-server")
    assert server is not None, redis_unavailable()
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-redis-")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", "", "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        with redis.Redis(port=port) as client:
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.01)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def remote_scenarios(rep: Report, lay: Layout, gib: float, dev: torch.device, rounds: int = 3, disk_dir: str | None = None) -> None:
    """The remote tier on a redis-server on loopback (started here if one is on PATH, else skipped):
    a store's background write-through until every block is on the server, and ``alookup`` + ``load``
    of those blocks into another offloader (into its host slots, and into the disk slots of a
    disk-only one, its file in ``disk_dir``), beside redis-py's own pipelined SET and GET of the same
    bytes (one value per block, windows of 4 MiB) in the same run."""
    n = lay.blocks_for(gib)
    nbytes = n * lay.block_bytes
    what = f"remote tier: {nbytes / 2**30:.2f} GiB per transfer to a redis-server on loopback, ceiling = redis-py pipelined SET/GET"
    reason = redis_unavailable()
    if reason is not None:
        rep.skip(what, reason)
        return
    import redis

    rep.begin(what)
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-", dir=disk_dir)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        url = stack.enter_context(redis_server())
        raw = stack.enter_context(redis.Redis.from_url(url))
        figures: dict[str, list[float]] = {k: [] for k in ("store", "load", "load_disk", "set", "get")}
        caches = lay.cache(n, dev)
        slab = bytearray(os.urandom(lay.block_bytes))
        values = [bytes(slab) for _ in range(n)]
        window = max(1, (4 << 20) // lay.block_bytes)
        disk_reader = stack.enter_context(Offloader(
            lay.cache(n, dev), host_blocks=0, disk_path=os.path.join(tmp, "kv"), disk_blocks=n, remote=url, remote_write="none",
        ))
        with Offloader(caches, host_blocks=n, remote=url) as writer, Offloader(lay.cache(n, dev), host_blocks=n, remote=url) as reader:
            for r in range(rounds):
                keys = [f"bench-{r}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                writer.store({k: i for i, k in enumerate(keys)}).result()
                while writer.stats().remote_writes_pending:
                    time.sleep(0.001)
                figures["store"].append(nbytes / (time.perf_counter() - t0) / 1e9)

                async def fetch(off: Offloader) -> None:
                    assert await off.alookup(keys) == n
                    await off.load({k: i for i, k in enumerate(keys)})

                for name, off in (("load", reader), ("load_disk", disk_reader)):
                    t0 = time.perf_counter()
                    asyncio.run(fetch(off))
                    figures[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
                    off.discard(keys)
                writer.discard(keys)
                raw.flushall()
                t0 = time.perf_counter()
                for first in range(0, n, window):
                    pipe = raw.pipeline(transaction=False)
                    for i in range(first, min(n, first + window)):
                        pipe.set(f"raw-{i}", values[i])
                    pipe.execute()
                figures["set"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for first in range(0, n, window):
                    pipe = raw.pipeline(transaction=False)
                    for i in range(first, min(n, first + window)):
                        pipe.get(f"raw-{i}")
                    pipe.execute()
                figures["get"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                raw.flushall()
    best = {k: max(v) for k, v in figures.items()}
    rep.row("remote store (background write-through)", "GB/s", best["store"], best["set"], None,
            note="from store() until every block is on the server")
    rep.row("remote load (alookup + load)", "GB/s", best["load"], best["get"], None)
    rep.row("remote load via disk slots (no host)", "GB/s", best["load_disk"], best["get"], None,
            note="a disk-only offloader: every block fetched and written to disk, then copied to the cache")
    sealed_remote_rows(rep, lay, n, dev, rounds)


def sealed_remote_rows(rep: Report, lay: Layout, n: int, dev: torch.device, rounds: int) -> None:
    """What sealing costs the remote tier (docs/security.md): write-through and ``alookup`` + ``load``
    with values unsealed, signed (``remote_secret``: HMAC-SHA256 on the store's helper threads) and
    signed and encrypted (``encryption_key``: AES-256-GCM), in alternating rounds on one server."""
    import secrets as random_bytes

    if importlib.util.find_spec("cryptography") is None:
        rep.skip("remote tier sealed", "the cryptography package is not installed (pip install 'kvoffload[crypto]')")
        return
    nbytes = n * lay.block_bytes
    secret, key = random_bytes.token_bytes(32), random_bytes.token_bytes(32)
    configs: dict[str, dict[str, object]] = {
        "plain": {}, "signed": {"remote_secret": secret}, "sealed": {"remote_secret": secret, "encryption_key": key},
    }
    figures: dict[str, list[float]] = {f"{c}_{d}": [] for c in configs for d in ("store", "load")}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server())
        pairs = {
            c: (stack.enter_context(Offloader(lay.cache(n, dev), host_blocks=n, remote=url, **extra)),  # type: ignore[arg-type]
                stack.enter_context(Offloader(lay.cache(n, dev), host_blocks=n, remote=url, remote_write="none", **extra)))  # type: ignore[arg-type]
            for c, extra in configs.items()
        }
        for r in range(rounds):
            for c, (writer, reader) in pairs.items():
                keys = [f"sealed-{c}-{r}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                writer.store({k: i for i, k in enumerate(keys)}).result()
                while writer.stats().remote_writes_pending:
                    time.sleep(0.001)
                figures[f"{c}_store"].append(nbytes / (time.perf_counter() - t0) / 1e9)

                async def fetch() -> None:
                    assert await reader.alookup(keys) == n
                    await reader.load({k: i for i, k in enumerate(keys)})

                t0 = time.perf_counter()
                asyncio.run(fetch())
                figures[f"{c}_load"].append(nbytes / (time.perf_counter() - t0) / 1e9)
                reader.discard(keys)
                writer.discard(keys)
    best = {k: max(v) for k, v in figures.items()}
    for c, what in (("signed", "remote {}, signed (remote_secret)"), ("sealed", "remote {}, signed + AES-256-GCM")):
        rep.row(what.format("store (write-through)"), "GB/s", best[f"{c}_store"], best["plain_store"], None,
                note="ceiling = the same, values unsealed")
        rep.row(what.format("load (alookup + load)"), "GB/s", best[f"{c}_load"], best["plain_load"], None,
                note="ceiling = the same, values unsealed")
