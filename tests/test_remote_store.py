"""The remote store on real Redis servers: a standalone server and a three-node cluster on
127.0.0.1 (tests/support/redis_servers.py starts them, installing redis-server if it can; the tests skip
only when it can neither be found nor installed)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest
import pytest_asyncio

pytest.importorskip("redis", reason="the remote tier's tests need redis-py (the redis extra)")
import redis.asyncio as aredis  # noqa: E402
from redis.asyncio.cluster import RedisCluster  # noqa: E402

from kvoffload import OffloadError
from kvoffload._core.base.cache_identity import encode_key
from kvoffload._core.base.errors import ClosedError
from kvoffload._core.tiers.remote import RedisStore, RemoteStore, RemoteUnavailableError, pack_value
from support.redis_servers import RedisServer, TcpProxy, binaries, cluster, free_port, redis_server  # binaries, cluster: fixtures

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def shared_server(binaries):
    """One standalone server for the tests that only store and read (each under its own identity)."""
    with redis_server(binaries) as server:
        yield server


@pytest.fixture
def fresh_server(binaries):
    """A server of the test's own, started with the test's arguments: ``fresh_server(*args)``."""
    with contextlib.ExitStack() as stack:
        yield lambda *args: stack.enter_context(redis_server(binaries, args))


def identity() -> bytes:
    """A new cache identity digest: no other test's values are visible under it."""
    return os.urandom(16)


def random_blocks(count: int, nbytes: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(count)]


def empty_like(blocks: list[np.ndarray]) -> list[np.ndarray]:
    return [np.full_like(b, 0xA5) for b in blocks]


KEYS = [encode_key(k) for k in (b"\x00\xff{}", "{req}-3", "plain", 0, -1, 2**70)]


def keys_for(count: int) -> list[bytes]:
    return KEYS + [encode_key(os.urandom(32)) for _ in range(count - len(KEYS))]


@pytest_asyncio.fixture(params=["standalone", "cluster url", "cluster detected", "cluster client"])
async def store(request):
    """A store on the shared server or the cluster, reached by each way a caller can name it."""
    if request.param == "standalone":
        s = RedisStore(request.getfixturevalue("shared_server").url, identity())
    else:
        port = request.getfixturevalue("cluster")[0].port
        if request.param == "cluster url":
            s = RedisStore(f"redis+cluster://127.0.0.1:{port}", identity())
        elif request.param == "cluster detected":
            s = RedisStore(f"redis://127.0.0.1:{port}", identity())
        else:
            client = RedisCluster(host="127.0.0.1", port=port)
            s = RedisStore(client, identity())
    yield s
    await s.close()
    if request.param == "cluster client":
        await client.aclose()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvoffload-remote")], "helper threads left running"


@pytest.mark.asyncio
async def test_blocks_round_trip_byte_exact(store):
    keys = keys_for(40)
    # Sizes across windows: 2 MiB blocks (a window each), odd small ones (many per window).
    blocks = random_blocks(12, 2 << 20, seed=1) + random_blocks(28, 12_345, seed=2)
    assert await store.put(keys, blocks) == [True] * 40
    absent = [encode_key(b"never stored")]
    assert await store.exists(keys + absent) == [True] * 40 + [False]
    out = empty_like(blocks) + [np.zeros(16, np.uint8)]
    assert await store.get_into(keys + absent, out) == [True] * 40 + [False]
    assert all(np.array_equal(a, b) for a, b in zip(blocks, out))
    assert store.is_cluster == ("cluster" in repr(store))

    await store.delete(keys[:5])
    assert await store.get_into(keys[:6], out[:6]) == [False] * 5 + [True]
    c = store.counters()
    assert (c.values_put, c.bytes_put, c.values_got, c.misses, c.bad_values) == (40, sum(b.nbytes for b in blocks), 41, 6, 0)
    assert (c.keys_checked, c.keys_found, c.connection_errors, c.reconnects) == (41, 40, 0, 0)


@pytest.mark.asyncio
async def test_a_store_fills_memoryviews_of_host_memory_and_takes_any_buffer(shared_server):
    store = RedisStore(shared_server.url, identity())
    slab = bytearray(3 * 4096)
    rows = [memoryview(slab)[i * 4096:(i + 1) * 4096] for i in range(3)]
    sources = [bytes(range(256)) * 16, bytearray(os.urandom(4096)), memoryview(os.urandom(4096))]
    keys = keys_for(6)[:3]
    assert await store.put(keys, sources) == [True] * 3
    assert await store.get_into(keys, rows) == [True] * 3
    assert [bytes(r) for r in rows] == [bytes(s) for s in sources]
    await store.close()


@pytest.mark.asyncio
async def test_two_identities_never_see_each_others_values(shared_server):
    a, b = RedisStore(shared_server.url, identity()), RedisStore(shared_server.url, identity())
    keys = keys_for(8)
    blocks_a, blocks_b = random_blocks(8, 1000, seed=3), random_blocks(8, 1000, seed=4)
    await a.put(keys, blocks_a)
    assert await b.exists(keys) == [False] * 8
    assert await b.get_into(keys, empty_like(blocks_b)) == [False] * 8
    await b.put(keys[:4], blocks_b[:4])
    out_a, out_b = empty_like(blocks_a), empty_like(blocks_b)
    assert await a.get_into(keys, out_a) == [True] * 8
    assert await b.get_into(keys, out_b) == [True] * 4 + [False] * 4
    assert all(np.array_equal(x, y) for x, y in zip(out_a, blocks_a))
    assert all(np.array_equal(x, y) for x, y in zip(out_b[:4], blocks_b[:4]))
    # Two namespaces on one server, same identity: apart as well.
    digest = identity()
    n1, n2 = RedisStore(shared_server.url, digest, namespace="one"), RedisStore(shared_server.url, digest, namespace="two")
    await n1.put(keys[:1], blocks_a[:1])
    assert await n2.exists(keys[:1]) == [False]
    for s in (a, b, n1, n2):
        await s.close()


CORRUPTIONS = {
    "payload byte flipped": lambda good, digest, key, other: good[:-1] + bytes([good[-1] ^ 1]),
    "truncated": lambda good, digest, key, other: good[:-100],
    "extended": lambda good, digest, key, other: good + b"\0",
    "header byte flipped": lambda good, digest, key, other: good[:10] + bytes([good[10] ^ 0x40]) + good[11:],
    "another key's value": lambda good, digest, key, other: pack_value(digest, other, np.zeros(1000, np.uint8)),
    "another identity's value": lambda good, digest, key, other: pack_value(bytes(16), key, np.zeros(1000, np.uint8)),
    "a block of another size": lambda good, digest, key, other: pack_value(digest, key, np.zeros(999, np.uint8)),
    "foreign bytes": lambda good, digest, key, other: os.urandom(1044),
    "an empty string": lambda good, digest, key, other: b"",
    "a header alone": lambda good, digest, key, other: good[: len(good) - 1000],
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@pytest.mark.asyncio
async def test_a_corrupted_value_is_a_counted_miss(shared_server, corruption):
    digest = identity()
    store = RedisStore(shared_server.url, digest)
    keys = keys_for(8)
    blocks = random_blocks(8, 1000, seed=5)
    await store.put(keys, blocks)
    victim = keys[3]
    good = shared_server.command("GET", store.name_of(victim))
    assert isinstance(good, bytes)
    shared_server.command("SET", store.name_of(victim), CORRUPTIONS[corruption](good, digest, victim, keys[4]))

    out = empty_like(blocks)
    found = await store.get_into(keys, out)
    assert found == [True] * 3 + [False] + [True] * 4
    assert all(np.array_equal(out[i], blocks[i]) for i in range(8) if i != 3)
    c = store.counters()
    assert (c.misses, c.bad_values, c.values_got, c.connection_errors) == (1, 1, 7, 0)
    await store.close()


@pytest.mark.asyncio
async def test_a_value_of_another_type_at_a_key_is_a_counted_miss(shared_server):
    store = RedisStore(shared_server.url, identity())
    keys = keys_for(7)[:2]
    await store.put(keys, random_blocks(2, 100, seed=6))
    shared_server.command("DEL", store.name_of(keys[0]))
    shared_server.command("HSET", store.name_of(keys[0]), "field", "value")
    assert await store.get_into(keys, [np.zeros(100, np.uint8)] * 2) == [False, True]
    assert store.counters().bad_values == 1
    await store.close()


@pytest.mark.asyncio
async def test_values_evicted_under_maxmemory_are_misses_not_errors(fresh_server):
    # Room for the values in flight (query buffers count towards maxmemory) and a dozen more.
    server = fresh_server("--maxmemory", "32mb", "--maxmemory-policy", "allkeys-lru")
    store = RedisStore(server.url, identity())
    keys = keys_for(48)
    blocks = random_blocks(48, 1 << 20, seed=7)
    assert await store.put(keys, blocks) == [True] * 48  # each SET evicts older values to fit
    out = empty_like(blocks)
    found = await store.get_into(keys, out)
    assert 0 < sum(found) < 48, found
    assert all(np.array_equal(out[i], blocks[i]) for i in range(48) if found[i])
    # Reads may evict too (their replies' buffers count towards maxmemory): keys only go away.
    still_there = await store.exists(keys)
    assert not any(there and not was for there, was in zip(still_there, found))
    c = store.counters()
    assert (c.misses, c.bad_values, c.connection_errors) == (48 - sum(found), 0, 0)
    await store.close()


@pytest.mark.asyncio
async def test_values_the_server_refuses_are_reported_not_raised(fresh_server):
    server = fresh_server("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    store = RedisStore(server.url, identity(), connections=1, window_bytes=1)  # one value in flight at a time
    keys = keys_for(12)
    stored = await store.put(keys, random_blocks(12, 1 << 20, seed=8))
    assert stored[0] and not stored[-1], stored
    c = store.counters()
    assert (c.values_put, c.puts_refused, c.connection_errors) == (sum(stored), 12 - sum(stored), 0)
    assert await store.exists(keys) == stored
    await store.close()


@pytest.mark.asyncio
async def test_a_server_stopped_mid_batch_raises_our_error_then_the_store_reconnects(fresh_server):
    server = fresh_server()
    proxy = await TcpProxy(server.port).start()  # lets the test stop the server while a batch is being read
    store = RedisStore(proxy.url, identity(), connections=1, window_bytes=1, backoff_s=0.05)
    keys = keys_for(16)
    blocks = random_blocks(16, 1 << 20, seed=9)
    await store.put(keys, blocks)

    proxy.hold_replies_after(3 << 20)  # about three blocks read, then the batch waits for more
    batch = asyncio.ensure_future(store.get_into(keys, empty_like(blocks)))
    await proxy.holding.wait()
    server.stop()
    proxy.cut()
    with pytest.raises(RemoteUnavailableError) as caught:
        await batch
    assert isinstance(caught.value, OffloadError) and caught.value.retry_in_s > 0
    assert store.counters().connection_errors == 1

    server.start()  # same port, empty: a restarted cache
    await asyncio.sleep(caught.value.retry_in_s)  # the backoff the store announced
    out = empty_like(blocks)
    assert await store.get_into(keys, out) == [False] * 16
    assert await store.put(keys, blocks) == [True] * 16
    assert await store.get_into(keys, out) == [True] * 16
    assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
    c = store.counters()
    assert (c.connection_errors, c.reconnects) == (1, 1)
    await store.close()
    await proxy.close()


@pytest.mark.asyncio
async def test_a_batch_cancelled_mid_read_leaves_no_reply_behind_for_the_next(fresh_server):
    server = fresh_server()
    proxy = await TcpProxy(server.port).start()
    store = RedisStore(proxy.url, identity(), connections=2, window_bytes=1)
    keys = keys_for(16)
    blocks = random_blocks(16, 1 << 20, seed=13)
    await store.put(keys, blocks)
    proxy.hold_replies_after(3 << 20)
    batch = asyncio.ensure_future(store.get_into(keys, empty_like(blocks)))
    await proxy.holding.wait()
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    proxy.release()
    out = empty_like(blocks)
    assert await store.get_into(keys[::-1], out[::-1]) == [True] * 16
    assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
    c = store.counters()
    assert (c.connection_errors, c.bad_values) == (0, 0)
    await store.close()
    await proxy.close()


@pytest.mark.asyncio
async def test_a_restarted_server_is_used_again_without_a_failed_call(fresh_server):
    server = fresh_server()
    store = RedisStore(server.url, identity(), connections=2, window_bytes=1)
    keys = keys_for(8)
    blocks = random_blocks(8, 1000, seed=10)
    await store.put(keys, blocks)  # leaves idle connections in the pool
    server.stop()
    server.start()
    assert await store.put(keys, blocks) == [True] * 8  # stale connections are replaced at once
    assert store.counters().connection_errors == 0
    await store.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_connection_refused_at_start_is_our_error_fast_then_calls_fail_fast(scheme):
    store = RedisStore(f"{scheme}://127.0.0.1:{free_port()}", identity(), backoff_s=60)
    started = time.monotonic()
    with pytest.raises(RemoteUnavailableError) as caught:
        await store.connect()
    assert time.monotonic() - started < 1.0
    assert 30 <= caught.value.retry_in_s <= 60
    started = time.monotonic()
    for call in (store.exists(KEYS), store.get_into(KEYS[:1], [bytearray(1)]), store.put(KEYS[:1], [b"x"]), store.delete(KEYS)):
        with pytest.raises(RemoteUnavailableError):
            await call
    assert time.monotonic() - started < 0.5  # no network: the 60 s backoff is not waited for
    c = store.counters()
    assert (c.connection_errors, c.calls_refused, c.reconnects) == (1, 4, 0)
    await store.close()


@pytest.mark.asyncio
async def test_a_server_that_stops_answering_is_our_error_after_the_timeout(fresh_server):
    server = fresh_server()
    store = RedisStore(server.url, identity(), timeout_s=0.2, backoff_s=0)
    keys = keys_for(6)
    await store.put(keys, random_blocks(6, 1000, seed=11))
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(RemoteUnavailableError):
            await store.exists(keys)
        assert time.monotonic() - started < 1.5
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert await store.exists(keys) == [True] * 6
    assert (store.counters().connection_errors, store.counters().reconnects) == (1, 1)
    await store.close()


@pytest.mark.asyncio
async def test_values_stay_found_while_and_after_their_slot_moves_to_another_node(cluster):
    store = RedisStore(f"redis+cluster://127.0.0.1:{cluster[0].port}", identity())
    keys = keys_for(10)
    blocks = random_blocks(10, 5000, seed=12)
    await store.put(keys, blocks)
    name = store.name_of(keys[0])
    slot = cluster[0].command("CLUSTER", "KEYSLOT", name)
    ids = {node.port: node.command("CLUSTER", "MYID").decode() for node in cluster}
    owner = next(n for n in cluster if n.command("CLUSTER", "COUNTKEYSINSLOT", str(slot)) > 0)
    target = next(n for n in cluster if n is not owner)

    target.command("CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[owner.port])
    owner.command("CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target.port])
    in_slot = owner.command("CLUSTER", "GETKEYSINSLOT", str(slot), "1000")  # other tests' keys may share the slot
    assert isinstance(in_slot, list) and name in in_slot
    owner.command("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *in_slot)
    out = empty_like(blocks)
    assert await store.get_into(keys, out) == [True] * 10  # the moved key through ASK
    for node in cluster:
        node.command("CLUSTER", "SETSLOT", str(slot), "NODE", ids[target.port])
    out = empty_like(blocks)
    assert await store.get_into(keys, out) == [True] * 10  # through MOVED
    assert await store.exists(keys) == [True] * 10
    assert all(np.array_equal(x, y) for x, y in zip(out, blocks))
    assert store.counters().connection_errors == 0
    await store.close()


@pytest.mark.asyncio
async def test_a_callers_client_is_used_as_configured_and_left_open(shared_server):
    client = aredis.Redis(host="127.0.0.1", port=shared_server.port)
    store = RedisStore(client, identity())
    assert isinstance(store, RemoteStore)
    keys = keys_for(7)[:1]
    assert await store.put(keys, [b"abc"]) == [True]
    await store.close()
    assert await client.ping()
    with pytest.raises(ClosedError):
        await store.exists(keys)
    await client.aclose()


@pytest.mark.asyncio
async def test_bad_arguments_are_refused_before_anything_is_sent(shared_server):
    store = RedisStore(shared_server.url, identity())
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        await store.put(KEYS[:2], [b"x"])
    with pytest.raises(TypeError, match="encoded keys"):
        await store.exists(["text"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="read-only"):
        await store.get_into(KEYS[:1], [b"immutable"])
    with pytest.raises(TypeError, match="C-contiguous"):
        await store.get_into(KEYS[:1], [np.zeros((4, 4), np.uint8)[:, 1]])
    assert await store.exists([]) == [] and await store.get_into([], []) == []
    assert store.counters() == type(store.counters())()
    for bad in ({"namespace": "a:b"}, {"connections": 0}, {"ttl_s": 0}):
        with pytest.raises(ValueError):
            RedisStore(shared_server.url, identity(), **bad)
    with pytest.raises(ValueError, match="identity digest"):
        RedisStore(shared_server.url, b"short")
    with pytest.raises(ValueError, match="remote URL"):
        RedisStore("http://127.0.0.1:1", identity())
    await store.close()


@pytest.mark.asyncio
async def test_values_expire_after_ttl(fresh_server):
    server = fresh_server()
    store = RedisStore(server.url, identity(), ttl_s=30)
    await store.put(KEYS[:1], [b"abc"])
    ttl_ms = server.command("PTTL", store.name_of(KEYS[0]))
    assert isinstance(ttl_ms, int) and 25_000 < ttl_ms <= 30_000
    await store.close()


def test_the_server_helper_removes_what_it_started(binaries):
    with redis_server(binaries) as server:
        directory, process = server.directory, server.process
        assert server.command("PING") == b"PONG"
    assert process is not None and process.poll() is not None
    assert not os.path.exists(directory)
    assert isinstance(server, RedisServer)
