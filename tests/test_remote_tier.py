"""The remote tier (``Offloader(remote=...)``) on real Redis servers: blocks shared between
offloaders of different processes, byte-exact; ``alookup`` counts; remote hits loaded become local
hits; keys gone from the server, servers dying mid-load and coming back; background writes waited
for by ``close()``; a three-node cluster; identities that never share blocks; keys refused at the
call. tests/support/redis_servers.py starts the servers (installing redis-server if it can; the tests skip
only when it can neither be found nor installed)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import kvoffload
from support.caches import block_bytes, random_caches
from kvoffload import TransferError
from support.redis_servers import TcpProxy, binaries, cluster, redis_server  # binaries, cluster: fixtures

pytestmark = pytest.mark.timeout(60)

BLOCKS = 16
SEED = 7


@pytest.fixture
def server(binaries):
    """A server of the test's own (nothing another test stored is there)."""
    with redis_server(binaries) as s:
        yield s


def store_and_close(url: str, keys: list, *, seed: int = SEED, **kw: object) -> kvoffload.OffloaderStats:
    """An offloader storing block i of ``random_caches(BLOCKS, seed)`` under ``keys[i]``, closed (its
    background writes waited for): its final stats."""
    off = kvoffload.Offloader(random_caches(BLOCKS, seed=seed), remote=url, **{"host_blocks": BLOCKS, **kw}).start()
    try:
        off.store({k: i for i, k in enumerate(keys)}).result(10)
    finally:
        off.close()
    return off.stats()


def reader(url: str, **kw: object) -> kvoffload.Offloader:
    """An offloader whose cache holds other bytes (seed 99) than the writers', writing nothing to the
    remote (``remote_write="none"``: no background write holds its entries while a test counts them)."""
    return kvoffload.Offloader(random_caches(BLOCKS, seed=99), host_blocks=BLOCKS, remote=url, **{"remote_write": "none", **kw}).start()


def same_block(off: kvoffload.Offloader, block: int, source: dict, source_block: int) -> bool:
    return block_bytes(off._caches, block) == block_bytes(source, source_block)


CHILD = textwrap.dedent("""
    import sys
    import kvoffload
    from support.caches import random_caches
    url, count = sys.argv[1], int(sys.argv[2])
    off = kvoffload.Offloader(random_caches(16, seed=7), host_blocks=16, remote=url, fingerprint="model-a").start()
    off.store({f"p{i}": i for i in range(count)}).result(10)
    off.close()
    s = off.stats()
    print(s.remote_writes, s.remote_write_failures, s.remote_writes_pending, flush=True)
""")


@pytest.mark.asyncio
@pytest.mark.slow
async def test_two_processes_share_a_prefix_byte_exact(server):
    tests_dir = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, server.url, "8"], capture_output=True, text=True, env=env, timeout=50, check=True,
    ).stdout
    assert out.split() == ["8", "0", "0"]  # close() waited for every background write
    written = random_caches(BLOCKS, seed=SEED)
    keys = [f"p{i}" for i in range(8)]
    off = reader(server.url, fingerprint="model-a")
    try:
        assert off.lookup(keys) == 0
        assert await off.alookup(keys + ["absent"]) == 8
        await off.load({k: 8 + i for i, k in enumerate(keys)})
        assert all(same_block(off, 8 + i, written, i) for i in range(8))
        assert off.lookup(keys) == 8  # kept as host entries: local hits now
        s = off.stats()
        assert (s.remote_hits, s.remote_lookup_hits, s.remote_misses) == (8, 8, 0)
        await off.load({k: i for i, k in enumerate(keys)})  # from host memory this time
        assert off.stats().remote_hits == 8
        assert all(same_block(off, i, written, i) for i in range(8))
    finally:
        off.close()


@pytest.mark.asyncio
async def test_alookup_counts_local_hits_then_remote_hits(server):
    store_and_close(server.url, ["a", "b", "c", "d"])
    off = reader(server.url)
    try:
        off.store({"a": 0, "b": 1}).result(10)  # local: a, b
        assert await off.alookup(["a", "b", "c", "d", "e", "c"]) == 4
        assert await off.alookup(["a", "x", "c"]) == 1  # the first miss ends the prefix
        assert await off.alookup(["c", "e", "d"]) == 1
        assert await off.alookup([]) == 0
        assert off.stats().remote_lookup_hits == 2 + 0 + 1
    finally:
        off.close()
    plain = kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS).start()
    try:
        plain.store({"a": 0}).result(10)
        assert await plain.alookup(["a", "b"]) == 1  # no remote tier: lookup()
    finally:
        plain.close()


@pytest.mark.asyncio
async def test_key_gone_from_the_server_fails_the_load_and_corrupts_nothing(server):
    store_and_close(server.url, ["g0", "g1", "g2"])
    off = reader(server.url)
    try:
        off.store({"local": 5}).result(10)
        before = {b: block_bytes(off._caches, b) for b in range(BLOCKS)}
        assert await off.alookup(["g0", "g1", "g2"]) == 3
        assert server.command("FLUSHALL") == b"OK"
        with pytest.raises(TransferError):
            await off.load({"g0": 0, "g1": 1, "local": 2})
        assert {b: block_bytes(off._caches, b) for b in range(BLOCKS)} == before  # no block written
        assert off.lookup(["g0"]) == 0 and off.lookup(["g1"]) == 0  # nothing published
        s = off.stats()
        assert s.remote_misses >= 1 and s.host_free == BLOCKS - 1 and s.pinned == 0 and s.pending == 0
        with pytest.raises(kvoffload.MissingKeysError):  # no longer reported: refused at the call
            off.load({"g0": 0})
        await off.load({"local": 3})
        assert block_bytes(off._caches, 3) == before[5]
    finally:
        off.close()


@pytest.mark.asyncio
@pytest.mark.slow
async def test_server_dying_mid_load_fails_it_local_tiers_keep_working_and_it_works_again(server):
    keys = [f"s{i}" for i in range(BLOCKS // 2)]
    store_and_close(server.url, keys)
    proxy = await TcpProxy(server.port).start()
    off = reader(proxy.url)
    try:
        off.store({"local": 15}).result(10)
        assert await off.alookup(keys) == len(keys)
        proxy.hold_replies_after(0)
        load = off.load({k: i for i, k in enumerate(keys)})
        await proxy.holding.wait()  # the load is reading replies
        server.stop()
        proxy.cut()
        with pytest.raises(TransferError):
            await load
        assert off.lookup(keys) == 0
        assert off.stats().pinned == 0 and off.stats().pending == 0
        assert await off.alookup(["local"] + keys) == 1  # local hits only while the server is down
        assert off.stats().remote_unavailable >= 1
        await off.load({"local": 0})  # the local tiers keep working
        off.store({"local2": 14}).result(10)
        server.start()
        store_and_close(server.url, keys)  # a restarted server holds nothing: store again
        deadline = time.monotonic() + 20
        while await off.alookup(keys) != len(keys):  # the store's backoff passes
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await off.load({k: i for i, k in enumerate(keys)})
        written = random_caches(BLOCKS, seed=SEED)
        assert all(same_block(off, i, written, i) for i in range(len(keys)))
    finally:
        off.close()
        await proxy.close()


def test_background_writes_are_counted_and_waited_for_by_close(server):
    stats = store_and_close(server.url, [f"w{i}" for i in range(BLOCKS)])
    assert (stats.remote_writes, stats.remote_write_failures, stats.remote_writes_pending) == (BLOCKS, 0, 0)
    assert stats.in_flight == 0 and stats.pinned == 0
    assert server.command("DBSIZE") == BLOCKS
    none = store_and_close(server.url, ["n0", "n1"], remote_write="none")
    assert none.remote_writes == 0 and server.command("DBSIZE") == BLOCKS


def test_background_writes_to_a_dead_server_fail_quietly(binaries):
    with redis_server(binaries) as s:
        url = s.url
    off = kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote=url).start()
    try:
        off.store({"x": 0, "y": 1}).result(10)  # the caller's store is not failed by the remote
        assert off.lookup(["x", "y"]) == 2
    finally:
        off.close()
    s2 = off.stats()
    assert s2.remote_write_failures == 2 and s2.remote_writes == 0 and s2.remote_writes_pending == 0


@pytest.mark.asyncio
@pytest.mark.slow
async def test_cluster_round_trip(cluster):
    url = f"redis+cluster://127.0.0.1:{cluster[0].port}"
    keys = [f"c{i}-{os.urandom(4).hex()}" for i in range(12)]
    assert store_and_close(url, keys).remote_writes == 12
    off = reader(url)
    try:
        assert await off.alookup(keys) == 12
        await off.load({k: i for i, k in enumerate(keys)})
        written = random_caches(BLOCKS, seed=SEED)
        assert all(same_block(off, i, written, i) for i in range(12))
    finally:
        off.close()


@pytest.mark.asyncio
async def test_identities_never_share_blocks(server):
    keys = ["i0", "i1"]
    store_and_close(server.url, keys, fingerprint="model-a")
    for kw, expected in (
        ({"fingerprint": "model-b"}, 0), ({}, 0), ({"fingerprint": "model-a", "remote_shard": "1"}, 0),
        ({"fingerprint": "model-a"}, 2),
    ):
        off = reader(server.url, **kw)
        try:
            assert await off.alookup(keys) == expected, kw
            with pytest.raises(kvoffload.MissingKeysError) if expected == 0 else contextlib.nullcontext():
                await off.load({"i0": 0, "i1": 1})
        finally:
            off.close()


@pytest.mark.asyncio
async def test_bad_keys_are_refused_at_the_call(server):
    off = reader(server.url)
    try:
        with pytest.raises(TypeError):
            off.store({("tuple", 1): 0})
        with pytest.raises(TypeError):
            await off.alookup(["fine", 1.5])
        with pytest.raises(TypeError):
            await off.alookup("one-key")
        assert off.stats().stores == 0 and off.stats().host_free == BLOCKS
    finally:
        off.close()
    assert server.command("DBSIZE") == 0


def test_fingerprint_needs_persist_or_remote():
    with pytest.raises(ValueError, match="persist=True or remote"):
        kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, fingerprint="m")
    with pytest.raises(TypeError):
        kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote=42)
    with pytest.raises(ValueError):
        kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote="redis://h/0", remote_write="later")
    kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, fingerprint="m", remote="redis://127.0.0.1:1/0")


SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


@pytest.mark.parametrize("url, why", [
    ("http://x", "scheme 'http'"),
    ("redis-cluster://h:7000", "scheme 'redis-cluster'"),
    ("h:6379", "scheme 'h'"),
    ("redis://h:port/0", "Port could not be cast"),
    ("redis://h:99999/0", "Port out of range"),
    ("redis://h/0?db=zero", "'db'"),
    ("redis://h/0?socket_timeout=soon", "'socket_timeout'"),
    ("redis+cluster://h:7000/1", "'db' must be 0"),
    ("redis://[::1/0", "IPv6"),
    ("http://user:hunter2@h/0", "scheme 'http'"),
    ("redis://user:hunter2@h:port/0", "Port"),
])
def test_a_remote_url_the_store_cannot_use_is_refused_at_construction(tmp_path, url, why):
    """Before the persistent disk file is created, not at start(); without connecting to anything."""
    with pytest.raises(ValueError) as e:
        kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, disk_path=tmp_path / "kv", disk_blocks=BLOCKS,
                            persist=True, remote=url)
    message = str(e.value)
    assert message.startswith("remote=") and why in message and all(s in message for s in SCHEMES), message
    assert "hunter2" not in message
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:1/0", "REDIS://127.0.0.1:1", "rediss://h:6380/2", "unix:///tmp/no-such.sock?db=3",
    "redis+cluster://127.0.0.1:1", "rediss+cluster://u:p@h:7000/0", "redis://h/0?socket_timeout=0.5",
])
def test_remote_urls_the_store_takes_are_accepted_without_connecting(url):
    off = kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote=url)
    assert off.options.remote == url


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_remote_load_is_cancellable_and_gives_its_slots_back(server):
    keys = [f"x{i}" for i in range(4)]
    store_and_close(server.url, keys)
    proxy = await TcpProxy(server.port).start()
    off = reader(proxy.url)
    try:
        before = {b: block_bytes(off._caches, b) for b in range(BLOCKS)}
        assert await off.alookup(keys) == 4
        proxy.hold_replies_after(0)
        load = off.load({k: i for i, k in enumerate(keys)})
        await proxy.holding.wait()
        assert load.cancel()
        with pytest.raises(kvoffload.TransferCancelled):
            await load
        proxy.release()
        assert {b: block_bytes(off._caches, b) for b in range(BLOCKS)} == before
        s = off.stats()
        assert (s.host_free, s.pending, s.pinned, s.cancelled) == (BLOCKS, 0, 0, 1)
        deadline = time.monotonic() + 20
        while await off.alookup(keys) != 4:  # and it loads when let run (once a connection the cancel cut is replaced)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await off.load({k: i for i, k in enumerate(keys)})
        written = random_caches(BLOCKS, seed=SEED)
        assert all(same_block(off, i, written, i) for i in range(4))
    finally:
        off.close()
        await proxy.close()


@pytest.mark.asyncio
@pytest.mark.slow
async def test_close_drops_writes_it_cannot_wait_for_and_their_pins(server):
    proxy = await TcpProxy(server.port).start()
    off = kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote=proxy.url).start()
    try:
        proxy.hold_replies_after(0)  # the server's replies never come
        await off.store({"h0": 0, "h1": 1})
        assert off.stats().remote_writes_pending == 2 and off.stats().pinned == 2 and off.stats().in_flight == 0
        started = time.monotonic()
        await off.aclose(timeout=0.3)
        assert time.monotonic() - started < 5
    finally:
        await proxy.close()
    s = off.stats()
    assert (s.remote_writes_pending, s.remote_writes, s.remote_write_failures) == (0, 0, 2)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]


@pytest.mark.asyncio
async def test_a_bad_value_on_the_server_fails_the_load_never_a_wrong_block(server):
    from kvoffload._core.base.cache_identity import encode_key

    store_and_close(server.url, ["v0", "v1"])
    off = reader(server.url)
    try:
        before = {b: block_bytes(off._caches, b) for b in range(BLOCKS)}
        assert await off.alookup(["v0", "v1"]) == 2
        names = [off._runtime.remote.store.name_of(encode_key(k)) for k in ("v0", "v1")]
        value = server.command("GET", names[1])
        server.command("SET", names[0], value)  # another key's value under v0's name
        with pytest.raises(TransferError):
            await off.load({"v0": 0, "v1": 1})
        assert {b: block_bytes(off._caches, b) for b in range(BLOCKS)} == before
        s = off.stats()
        assert (s.remote_bad_values, s.remote_misses, s.host_free, s.pending) == (1, 1, BLOCKS, 0)
        assert off.lookup(["v0"]) == 0 and off.lookup(["v1"]) == 0
    finally:
        off.close()


def test_prometheus_exposes_the_remote_tier(server):
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvoffload.prometheus import OffloaderCollector

    off = kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote=server.url).start()
    try:
        off.store({"m0": 0, "m1": 1}).result(10)
    finally:
        off.close()
    registry = prometheus_client.CollectorRegistry()
    registry.register(OffloaderCollector(off, name="n"))
    get = registry.get_sample_value
    assert get("kvoffload_remote_keys_total", {"offloader": "n", "event": "written"}) == 2
    assert get("kvoffload_remote_writes_pending", {"offloader": "n"}) == 0
    assert get("kvoffload_remote_unavailable_total", {"offloader": "n"}) == 0


def test_alookup_under_trio(server):
    trio = pytest.importorskip("trio")
    store_and_close(server.url, ["t0", "t1"])
    off = reader(server.url)
    try:
        assert trio.run(off.alookup, ["t0", "t1", "t2"]) == 2
    finally:
        off.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tiers", ["host", "disk-only"])
@pytest.mark.asyncio
async def test_remote_hits_load_into_a_gpu_cache(server, tmp_path, tiers):
    keys = [f"gpu{i}" for i in range(8)]
    store_and_close(server.url, keys)  # written from a CPU cache of the same geometry
    sizes = {"host_blocks": BLOCKS} if tiers == "host" else {"host_blocks": 0, "disk_path": str(tmp_path / "kv"), "disk_blocks": BLOCKS}
    # disk-only: fetched into the load bounce buffer and written to disk, then copied to the GPU (three chunks)
    off = kvoffload.Offloader(random_caches(BLOCKS, device="cuda", seed=99), remote=server.url, chunk_bytes=3 * slot_bytes(), **sizes).start()
    try:
        assert await off.alookup(keys) == 8
        await off.load({k: 8 + i for i, k in enumerate(keys)})
        torch.cuda.synchronize()
        written = random_caches(BLOCKS, seed=SEED)
        assert all(same_block(off, 8 + i, written, i) for i in range(8))
        await off.load({k: i for i, k in enumerate(keys)}, per_tensor=tiers == "host")  # now local hits
        assert all(same_block(off, i, written, i) for i in range(8))
    finally:
        off.close()


@pytest.mark.asyncio
async def test_remote_hits_take_room_from_unused_entries_only(server):
    keys = [f"r{i}" for i in range(4)]
    store_and_close(server.url, keys)
    off = reader(server.url)
    try:
        local = [f"l{i}" for i in range(BLOCKS)]
        off.store({k: i for i, k in enumerate(local)}).result(10)  # every host slot taken
        assert await off.alookup(keys) == 4
        with off.lookup(local, hold=True) as lease:  # held: not to be evicted
            assert lease.count == BLOCKS
            with pytest.raises(kvoffload.CapacityError):
                off.load({k: i for i, k in enumerate(keys)})
            assert off.lookup(local) == BLOCKS and off.stats().evicted == 0
        await off.load({k: i for i, k in enumerate(keys)})  # the least recently used local entries make room
        assert off.stats().evicted == 4 and off.lookup(keys) == 4
        written = random_caches(BLOCKS, seed=SEED)
        assert all(same_block(off, i, written, i) for i in range(4))
    finally:
        off.close()


def written_bytes(seed: int = SEED) -> dict:
    return random_caches(BLOCKS, seed=seed)


@pytest.mark.asyncio
async def test_a_disk_only_offloader_writes_its_blocks_through_and_loads_remote_hits(server, tmp_path):
    keys = [f"d{i}" for i in range(10)]
    written = store_and_close(server.url, keys, host_blocks=0, disk_path=str(tmp_path / "w.kv"), disk_blocks=BLOCKS)
    assert written.remote_writes == len(keys) and written.remote_write_failures == 0
    off = kvoffload.Offloader(
        random_caches(BLOCKS, seed=99), host_blocks=0, disk_path=str(tmp_path / "r.kv"), disk_blocks=BLOCKS, remote=server.url,
        remote_write="none", chunk_bytes=3 * slot_bytes(),  # three blocks a chunk: several chunks
    ).start()
    try:
        assert await off.alookup(keys) == len(keys)
        await off.load({k: i for i, k in enumerate(keys)})
        assert all(same_block(off, i, written_bytes(), i) for i in range(len(keys)))
        s = off.stats()
        assert s.remote_hits == len(keys) and s.disk_ready == len(keys) and s.pinned == 0 and s.pending == 0
        await off.load({k: BLOCKS - 1 - i for i, k in enumerate(keys)})  # now local: read back from the disk slots
        assert all(same_block(off, BLOCKS - 1 - i, written_bytes(), i) for i in range(len(keys)))
        assert off.stats().remote_hits == len(keys)
    finally:
        off.close()


def slot_bytes() -> int:
    """The bytes of one host or disk slot of ``random_caches(BLOCKS)``."""
    return kvoffload.Offloader(random_caches(BLOCKS), host_blocks=1).layout.slot_bytes


@pytest.mark.asyncio
async def test_a_store_larger_than_the_host_tier_is_written_through_whole(server, tmp_path):
    keys = [f"L{i}" for i in range(12)]
    # the first 8 straight to disk
    assert store_and_close(server.url, keys, host_blocks=4, disk_path=str(tmp_path / "w.kv"), disk_blocks=BLOCKS).remote_writes == len(keys)
    off = reader(server.url)
    try:
        assert await off.alookup(keys) == len(keys)
        await off.load({k: i for i, k in enumerate(keys)})
        assert all(same_block(off, i, written_bytes(), i) for i in range(len(keys)))
    finally:
        off.close()


@pytest.mark.asyncio
async def test_remote_hits_go_to_disk_slots_when_every_host_slot_is_held(server, tmp_path):
    keys = [f"r{i}" for i in range(4)]
    store_and_close(server.url, keys)
    off = kvoffload.Offloader(
        random_caches(BLOCKS, seed=99), host_blocks=BLOCKS, disk_path=str(tmp_path / "r.kv"), disk_blocks=BLOCKS, remote=server.url,
        remote_write="none",
    ).start()
    try:
        local = [f"l{i}" for i in range(BLOCKS)]
        off.store({k: i for i, k in enumerate(local)}).result(10)
        assert await off.alookup(keys) == 4
        with off.lookup(local, hold=True) as lease:
            assert lease.count == BLOCKS
            await off.load({k: i for i, k in enumerate(keys)})
            s = off.stats()
            assert s.evicted == 0 and s.spilled == 0 and s.host_ready == BLOCKS and s.disk_ready == 4
        assert all(same_block(off, i, written_bytes(), i) for i in range(4))
        assert off.lookup(keys) == 4 and off.lookup(local) == BLOCKS
    finally:
        off.close()


def poison(off: kvoffload.Offloader) -> dict[int, bytes]:
    """Fill every cache block with a pattern of its own (block b: bytes ``0x5A ^ b``); its bytes by block."""
    for b in range(BLOCKS):
        for t in off._caches.values():
            t[b].view(-1).view(torch.uint8).fill_(0x5A ^ b)
    return {b: block_bytes(off._caches, b) for b in range(BLOCKS)}


def through_disk_slots(url: str, tmp_path, tiers: str) -> tuple[kvoffload.Offloader, int]:
    """An offloader whose remote hits go to disk slots, chunks of three blocks: disk-only (also
    persistent), every host slot held (by the test), or four host slots two of which are held (the
    first keys of a load to disk slots, its last two to host slots); and how many keys to load."""
    kw: dict = {"disk_path": str(tmp_path / "r.kv"), "disk_blocks": BLOCKS, "remote": url, "remote_write": "none", "chunk_bytes": 3 * slot_bytes()}
    host = {"disk-only": 0, "persistent": 0, "host-held": BLOCKS, "mixed": 4}[tiers]
    if tiers == "persistent":
        kw["persist"] = True
    return kvoffload.Offloader(random_caches(BLOCKS, seed=99), host_blocks=host, **kw).start(), 6 if tiers == "mixed" else 10


@pytest.mark.parametrize("spoil", ["gone", "bad-value"])
@pytest.mark.parametrize("tiers", ["disk-only", "persistent", "host-held", "mixed"])
@pytest.mark.asyncio
async def test_a_later_chunk_failing_a_load_through_disk_slots_writes_no_cache_block(server, tmp_path, tiers, spoil):
    from kvoffload._core.base.cache_identity import encode_key

    store_and_close(server.url, [f"k{i}" for i in range(10)])
    off, n = through_disk_slots(server.url, tmp_path, tiers)
    keys = [f"k{i}" for i in range(n)]
    bad = n - 1 if tiers == "mixed" else 7  # of a chunk after the first two (mixed: of the part to host slots)
    try:
        held = {"host-held": BLOCKS, "mixed": 2}.get(tiers, 0)
        if held:
            off.store({f"l{i}": i for i in range(held)}).result(10)
        with off.lookup([f"l{i}" for i in range(held)], hold=True):
            before = poison(off)
            assert await off.alookup(keys) == n
            name = off._runtime.remote.store.name_of(encode_key(keys[bad]))
            if spoil == "gone":
                assert server.command("DEL", name) == 1
            else:  # another key's value under its name
                server.command("SET", name, server.command("GET", off._runtime.remote.store.name_of(encode_key(keys[0]))))
            with pytest.raises(TransferError):
                await off.load({k: i for i, k in enumerate(keys)})
            assert {b: block_bytes(off._caches, b) for b in range(BLOCKS)} == before  # no block written
            assert [off.lookup([k]) for k in keys] == [0] * n  # nothing published
            s = off.stats()
            assert (s.pinned, s.pending, s.in_flight, s.failed, s.disk_free) == (held, 0, 0, 1, BLOCKS)  # pinned: the lease's
            assert s.host_free == {"mixed": 2}.get(tiers, 0) and s.ready == held
            assert (s.remote_misses, s.remote_bad_values) == (1, 1 if spoil == "bad-value" else 0)
            good = [k for k in keys if k != keys[bad]]
            await off.load({k: i for i, k in enumerate(good)})  # the others still load, byte-exact
            sources = [int(k[1:]) for k in good]
            assert all(same_block(off, i, written_bytes(), src) for i, src in enumerate(sources))
            assert all(block_bytes(off._caches, b) == before[b] for b in range(len(good), BLOCKS))
            assert off.lookup(good) == len(good) and off.stats().pinned == held
    finally:
        off.close()


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_load_through_disk_slots_cancelled_after_its_first_chunk_writes_no_cache_block(server, tmp_path):
    from kvoffload._core.base.cache_identity import encode_key

    keys = [f"c{i}" for i in range(10)]
    store_and_close(server.url, keys)
    proxy = await TcpProxy(server.port).start()
    off, _ = through_disk_slots(proxy.url, tmp_path, "disk-only")
    try:
        before = poison(off)
        assert await off.alookup(keys) == len(keys)
        value = int(server.command("STRLEN", off._runtime.remote.store.name_of(encode_key(keys[0]))))
        proxy.hold_replies_after(3 * value + value // 2)  # the first chunk's three values pass, the second's are held
        load = off.load({k: i for i, k in enumerate(keys)})
        await proxy.holding.wait()
        assert load.cancel()
        with pytest.raises(kvoffload.TransferCancelled):
            await load
        proxy.release()
        assert {b: block_bytes(off._caches, b) for b in range(BLOCKS)} == before
        s = off.stats()
        assert (s.disk_free, s.pending, s.pinned, s.in_flight, s.cancelled) == (BLOCKS, 0, 0, 0, 1)
        assert off.lookup(keys[:1]) == 0
        deadline = time.monotonic() + 20
        while await off.alookup(keys) != len(keys):  # once a connection the cancel cut is replaced
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await off.load({k: i for i, k in enumerate(keys)})
        assert all(same_block(off, i, written_bytes(), i) for i in range(len(keys)))
    finally:
        off.close()
        await proxy.close()


@pytest.mark.asyncio
async def test_write_on_eviction_sends_a_block_only_as_the_local_tiers_evict_it(server):
    writer = kvoffload.Offloader(random_caches(BLOCKS, seed=SEED), host_blocks=4, remote=server.url, remote_write="evict").start()
    try:
        writer.store({f"a{i}": i for i in range(4)}).result(10)
        s = writer.stats()  # a write is counted pending before the store's end (through) or at the eviction (evict)
        assert s.remote_writes_pending == 0 and s.remote_writes == 0 and server.command("DBSIZE") == 0  # nothing evicted, nothing sent
        writer.store({f"b{i}": 4 + i for i in range(4)}).result(10)  # evicts a0..a3 and overwrites their slots
    finally:
        writer.close()  # waits for the background writes
    s = writer.stats()
    assert s.remote_writes == 4 and s.evicted == 4 and s.remote_writes_dropped == 0 and s.remote_write_failures == 0
    off = reader(server.url)
    try:
        assert await off.alookup([f"a{i}" for i in range(4)] + ["b0"]) == 4  # the b's were never evicted
        await off.load({f"a{i}": i for i in range(4)})
        assert all(same_block(off, i, written_bytes(), i) for i in range(4))  # the evicted bytes, not their heirs'
    finally:
        off.close()


@pytest.mark.asyncio
async def test_write_on_eviction_reads_blocks_evicted_from_the_disk_tier(server, tmp_path):
    writer = kvoffload.Offloader(
        random_caches(BLOCKS, seed=SEED), host_blocks=2, disk_path=str(tmp_path / "w.kv"), disk_blocks=2, remote=server.url,
        remote_write="evict",
    ).start()
    try:
        for i in range(0, 6, 2):  # the third store spills the second, whose disk slots the first held
            writer.store({f"e{i}": i, f"e{i + 1}": i + 1}).result(10)
    finally:
        writer.close()  # waits for the background writes
    s = writer.stats()
    assert s.evicted_disk == 2 and s.remote_writes == 2 and s.spilled == 4
    off = reader(server.url)
    try:
        assert await off.alookup(["e0", "e1", "e2"]) == 2
        await off.load({"e0": 0, "e1": 1})
        assert same_block(off, 0, written_bytes(), 0) and same_block(off, 1, written_bytes(), 1)
    finally:
        off.close()


def test_write_on_eviction_drops_what_finds_no_staging_room_and_counts_it(server):
    off = kvoffload.Offloader(
        random_caches(BLOCKS, seed=SEED), host_blocks=8, remote=server.url, remote_write="evict", bounce_bytes=slot_bytes(),
    ).start()
    try:
        off.store({f"x{i}": i for i in range(8)}).result(10)
        off.store({f"y{i}": 8 + i for i in range(8)}).result(10)  # 8 evicted at once, one staging slot
    finally:
        off.close()  # waits for the background write
    s = off.stats()
    assert s.evicted == 8 and s.remote_writes == 1 and s.remote_writes_dropped == 7


def test_remote_write_modes_are_checked():
    with pytest.raises(ValueError, match="'through', 'evict' or 'none'"):
        kvoffload.Offloader(random_caches(BLOCKS), host_blocks=BLOCKS, remote="redis://127.0.0.1:1/0", remote_write="back")


@pytest.mark.parametrize("write, disk, staged", [("through", True, True), ("through", False, False), ("evict", False, True), ("none", True, False)])
def test_the_remote_staging_buffer_is_in_the_footprint(host_allocations, tmp_path, write, disk, staged):
    from kvoffload._core.runtime import Footprint

    slot = slot_bytes()
    tiers = {"disk_path": str(tmp_path / "kv"), "disk_blocks": 4} if disk else {}
    # no server needed: start() does not connect
    with kvoffload.Offloader(
        random_caches(BLOCKS), host_blocks=4, remote="redis://127.0.0.1:1/0", remote_write=write, bounce_bytes=2 * slot, **tiers,
    ) as off:
        need = Footprint.of(off.layout, off.options, off.options.tier_slots(slot))
        assert need.remote_staging == (2 * slot if staged else 0)
        assert sum(host_allocations) == need.host_slab + need.disk_bounce + need.remote_staging
