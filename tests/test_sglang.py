"""kvoffload.sglang against SGLang 0.5.23's own classes (``pip install --no-deps sglang==0.5.23``).

The backend is built by SGLang's ``StorageBackendFactory`` from the extra config of
``--hicache-storage-backend dynamic``, as SGLang's cache controller builds it, over SGLang's real host
pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over a device pool on ``device="cpu"``), in
every layout served; every page is checked byte for byte through SGLang's own ``get_data_page``.
tests/support/sglang_env.py says what is stubbed to import SGLang beside a CPU torch (torchvision,
IPython: neither is used here).
"""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from support.sglang_env import backend_config, create_backend, device_pool, host_pool, sglang_available, storage_config

_why = sglang_available()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

import kvoffload  # noqa: E402
from kvoffload._testing import disk_io  # noqa: E402
from kvoffload.sglang import BATCH_PAGES, KvoffloadStorage, parse_extra_config, pool_caches  # noqa: E402
from support.redis_servers import redis_binaries, redis_server  # noqa: E402
from support.waiting import spin_until  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
SMALL = {"bounce_bytes": "64KiB", "io_threads": 2}
"""Small bounce buffers: the tests' pages are a few KiB, and a batch still takes several chunks."""


@pytest.fixture
def redis():
    """A real redis-server on loopback (installed if missing; the test is skipped if it cannot be)."""
    found = redis_binaries()
    if found is None:
        pytest.skip("redis-server is not installed and could not be installed")
    with redis_server(found) as server:
        yield server


@pytest.fixture
def backends():
    """Build backends as SGLang does (factory, then the host pool); every one is closed at teardown."""
    made: list[KvoffloadStorage] = []

    def make(pool, *, mla: bool = False, **kw):
        config_kw = {k: kw.pop(k) for k in ("model", "tp_rank", "tp_size", "dp_rank", "metrics") if k in kw}
        backend = create_backend(storage_config(backend_config(**{**SMALL, **kw}), mla=mla, **config_kw), pool)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def fill_random(pool, seed: int = 0) -> None:
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def token_indices(pool, pages: list[int]) -> torch.Tensor:
    """The host indices SGLang passes for ``pages``: ``page_size`` token indices per page."""
    ps = pool.page_size
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)


def page_bytes(pool, page: int) -> torch.Tensor:
    """A page's bytes as SGLang's generic path reads them (its flat data page)."""
    return pool.get_data_page(page * pool.page_size, flat=True).clone().view(torch.uint8)


def keys_of(n: int, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i:060d}" for i in range(n)]  # SGLang's keys: 64 hex digits of a page hash


# -- built by SGLang's factory ------------------------------------------------------------------


def test_sglangs_factory_builds_the_backend_from_the_extra_config(tmp_path, backends):
    pool = host_pool(device_pool(False), "page_first")
    backend = backends(pool, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    assert isinstance(backend, KvoffloadStorage) and isinstance(backend, HiCacheStorage)
    assert backend.mem_pool_host is pool
    # the host pool's own tensors are the caches: nothing copied
    caches = pool_caches(pool)
    assert {t.untyped_storage().data_ptr() for t in caches.values()} == {pool.kv_buffer.untyped_storage().data_ptr()}
    assert backend.stats().disk_slots == BATCH_PAGES and backend.stats().host_slots == 0


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_batch_round_trips_byte_exact_through_the_disk_tier(tmp_path, backends, layout, mla):
    pool = host_pool(device_pool(mla), layout)
    backend = backends(pool, mla=mla, disk_path=str(tmp_path), disk_pages=2 * BATCH_PAGES)
    fill_random(pool)
    total = pool.size // pool.page_size
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(1)).tolist()
    src, dst = perm[:BATCH_PAGES], perm[BATCH_PAGES:BATCH_PAGES + 1]  # a full batch of scattered pages
    keys = keys_of(BATCH_PAGES)
    expected = [page_bytes(pool, p) for p in src]

    assert backend.batch_set_v1(keys, token_indices(pool, src)) == [True] * BATCH_PAGES
    assert backend.batch_exists(keys) == BATCH_PAGES
    pool.kv_buffer.zero_()
    # the whole batch back into the same pages, then one page elsewhere
    assert backend.batch_get_v1(keys, token_indices(pool, src)) == [True] * BATCH_PAGES
    for page, want in zip(src, expected):
        assert torch.equal(page_bytes(pool, page), want), f"page {page}"
    untouched = [p for p in range(total) if p not in set(src)]
    assert all(not page_bytes(pool, p).any() for p in untouched), "a load wrote outside its pages"
    assert backend.batch_get_v1(keys[7:8], token_indices(pool, dst)) == [True]
    assert torch.equal(page_bytes(pool, dst[0]), expected[7])
    assert backend.failures() == {}


def test_batch_exists_and_batch_get_v1_count_the_leading_hits(tmp_path, backends):
    pool = host_pool(device_pool(False), "layer_first")
    backend = backends(pool, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    fill_random(pool)
    keys = keys_of(8)
    stored = [0, 1, 2, 3, 4, 6]  # page 5's key missing: 6 comes after a miss
    assert backend.batch_set_v1([keys[i] for i in stored], token_indices(pool, [10 + i for i in stored])) == [True] * 6
    assert backend.batch_exists(keys) == 5
    assert backend.batch_exists(keys[6:]) == 1
    assert backend.exists(keys[6]) and not backend.exists(keys[5])
    expected = [page_bytes(pool, 10 + i) for i in range(5)]
    pool.kv_buffer.zero_()
    got = backend.batch_get_v1(keys, token_indices(pool, list(range(50, 58))))
    assert got == [True] * 5 + [False] * 3
    assert all(torch.equal(page_bytes(pool, 50 + i), expected[i]) for i in range(5))
    assert not any(page_bytes(pool, 50 + i).any() for i in range(5, 8)), "pages after the leading hits were written"
    assert backend.batch_get_v1(keys_of(3, "missing"), token_indices(pool, [60, 61, 62])) == [False] * 3
    assert backend.failures() == {}  # misses are not failures


def test_a_stored_page_is_not_written_again(tmp_path, backends):
    pool = host_pool(device_pool(False), "page_first")
    backend = backends(pool, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    fill_random(pool)
    keys = keys_of(4)
    assert backend.batch_set_v1(keys, token_indices(pool, [0, 1, 2, 3])) == [True] * 4
    written = backend.stats().disk_bytes_written
    assert backend.batch_set_v1(keys, token_indices(pool, [4, 5, 6, 7])) == [True] * 4
    assert backend.stats().disk_bytes_written == written


# -- persistence, identity ------------------------------------------------------------------------


def test_a_persistent_tier_is_found_again_by_a_new_backend_of_the_same_rank_and_model(tmp_path, backends):
    pool = host_pool(device_pool(False), "page_first_direct")
    fill_random(pool, seed=3)
    keys = keys_of(20)
    expected = [page_bytes(pool, p) for p in range(20)]
    settings = dict(disk_path=str(tmp_path), disk_pages=BATCH_PAGES, persist=True, fingerprint="weights-1")
    first = backends(pool, **settings)
    assert first.batch_set_v1(keys, token_indices(pool, list(range(20)))) == [True] * 20
    first.close()

    again = backends(pool, **settings)
    assert again.stats().recovered == 20
    assert again.batch_exists(keys) == 20
    pool.kv_buffer.zero_()
    assert again.batch_get_v1(keys, token_indices(pool, list(range(30, 50)))) == [True] * 20
    assert all(torch.equal(page_bytes(pool, 30 + i), expected[i]) for i in range(20))
    again.close()

    # another model, other weights, another rank: none of them reads these pages
    for other in (dict(model="other/model"), dict(fingerprint="weights-2"), dict(tp_rank=1, tp_size=2)):
        backend = backends(pool, **{**settings, **other})
        assert backend.batch_exists(keys) == 0, other
        backend.close()
    # one directory per rank under disk_path, each with its files
    assert sorted(os.listdir(tmp_path)) == ["rank-tp0of1-pp0of1-cp0of1-dp0", "rank-tp1of2-pp0of1-cp0of1-dp0"]


def test_two_backends_share_pages_through_a_real_redis_server(tmp_path, backends, redis):
    server = redis
    writer_pool = host_pool(device_pool(False), "layer_first")
    reader_pool = host_pool(device_pool(False), "layer_first", ratio=4.0)
    fill_random(writer_pool, seed=5)
    keys = keys_of(BATCH_PAGES)
    expected = [page_bytes(writer_pool, p) for p in range(BATCH_PAGES)]
    common = dict(disk_pages=BATCH_PAGES, remote=server.url, fingerprint="w")
    writer = backends(writer_pool, disk_path=str(tmp_path / "a"), **common)
    reader = backends(reader_pool, disk_path=str(tmp_path / "b"), **common)
    assert writer.batch_set_v1(keys, token_indices(writer_pool, list(range(BATCH_PAGES)))) == [True] * BATCH_PAGES
    spin_until(lambda: writer.stats().remote_writes >= BATCH_PAGES, what="the remote writes")

    assert reader.stats().ready == 0
    assert reader.batch_exists(keys + keys_of(1, "missing")) == BATCH_PAGES
    dst = list(range(BATCH_PAGES, 2 * BATCH_PAGES))
    assert reader.batch_get_v1(keys, token_indices(reader_pool, dst)) == [True] * BATCH_PAGES
    assert all(torch.equal(page_bytes(reader_pool, d), want) for d, want in zip(dst, expected))
    assert reader.stats().remote_hits == BATCH_PAGES

    # another rank or another model shares the server, never the pages
    for other in (dict(tp_rank=1, tp_size=2), dict(model="other/model")):
        stranger = backends(host_pool(device_pool(False), "layer_first"), disk_path=str(tmp_path / "c"), **common,
                            **other)
        assert stranger.batch_exists(keys) == 0, other
    # MLA ranks hold the same KV: a second TP rank reads what the first stored
    mla_writer_pool = host_pool(device_pool(True), "page_first")
    fill_random(mla_writer_pool, seed=6)
    mla_writer = backends(mla_writer_pool, mla=True, tp_size=2, disk_path=str(tmp_path / "m0"), **common)
    assert mla_writer.batch_set_v1(keys[:4], token_indices(mla_writer_pool, [0, 1, 2, 3])) == [True] * 4
    spin_until(lambda: mla_writer.stats().remote_writes >= 4, what="the remote writes")
    mla_reader_pool = host_pool(device_pool(True), "page_first")
    mla_reader = backends(mla_reader_pool, mla=True, tp_rank=1, tp_size=2, disk_path=str(tmp_path / "m1"), **common)
    assert mla_reader.batch_get_v1(keys[:4], token_indices(mla_reader_pool, [9, 10, 11, 12])) == [True] * 4
    assert all(torch.equal(page_bytes(mla_reader_pool, 9 + i), page_bytes(mla_writer_pool, i)) for i in range(4))

    # the server gone: lookups count local hits only, fetches fail as False, nothing raises
    server.stop()
    late = backends(host_pool(device_pool(False), "layer_first"), disk_path=str(tmp_path / "d"), **common)
    assert late.batch_exists(keys) == 0
    assert late.batch_get_v1(keys[:2], token_indices(late.mem_pool_host, [0, 1])) == [False, False]
    assert reader.batch_exists(keys) == BATCH_PAGES  # its own disk tier still holds them


def test_a_secret_and_a_namespace_from_the_extra_config_guard_the_shared_pages(tmp_path, backends, redis, monkeypatch):
    """``remote_secret`` (from an environment variable) and ``namespace`` reach the offloader: a backend
    with the secret and the namespace reads the pages, one of another namespace finds none."""
    monkeypatch.setenv("KVOFFLOAD_TEST_SECRET", "s" * 32)
    pool = host_pool(device_pool(False), "page_first")
    fill_random(pool, seed=8)
    keys = keys_of(8)
    common = dict(disk_pages=BATCH_PAGES, remote=redis.url, remote_secret="env:KVOFFLOAD_TEST_SECRET")
    writer = backends(pool, disk_path=str(tmp_path / "a"), namespace="tenant-a", **common)
    assert writer.batch_set_v1(keys, token_indices(pool, list(range(8)))) == [True] * 8
    spin_until(lambda: writer.stats().remote_writes >= 8, what="the remote writes")
    reader_pool = host_pool(device_pool(False), "page_first")
    reader = backends(reader_pool, disk_path=str(tmp_path / "b"), namespace="tenant-a", **common)
    assert reader.batch_get_v1(keys, token_indices(reader_pool, list(range(8)))) == [True] * 8
    assert all(torch.equal(page_bytes(reader_pool, p), page_bytes(pool, p)) for p in range(8))
    stranger = backends(host_pool(device_pool(False), "page_first"), disk_path=str(tmp_path / "c"), namespace="tenant-b", **common)
    assert stranger.batch_exists(keys) == 0


# -- failures: False, counted, logged once; never an exception ------------------------------------


def test_a_failing_disk_answers_false_and_the_backend_keeps_serving(tmp_path, backends, caplog):
    pool = host_pool(device_pool(False), "page_first")
    backend = backends(pool, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    fill_random(pool)
    io = disk_io(backend.offloader)
    real_write, real_read = io.pwritev, io.preadv

    def eio(*args):
        raise OSError(errno.EIO, "injected EIO")

    keys = keys_of(8)
    io.pwritev = eio
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert backend.batch_set_v1(keys[:4], token_indices(pool, [0, 1, 2, 3])) == [False] * 4
        assert backend.batch_set_v1(keys[:4], token_indices(pool, [0, 1, 2, 3])) == [False] * 4
    assert backend.failures() == {"batch_set_v1: TransferError": 2}
    assert sum("batch_set_v1 failed" in r.getMessage() for r in caplog.records) == 1  # logged once per cause
    assert backend.batch_exists(keys) == 0  # nothing torn became visible

    io.pwritev = real_write
    assert backend.batch_set_v1(keys[:4], token_indices(pool, [0, 1, 2, 3])) == [True] * 4
    expected = [page_bytes(pool, p) for p in range(4)]
    io.preadv = eio
    assert backend.batch_get_v1(keys[:4], token_indices(pool, [20, 21, 22, 23])) == [False] * 4
    assert backend.failures()["batch_get_v1: TransferError"] == 1
    io.preadv = real_read
    assert backend.batch_get_v1(keys[:4], token_indices(pool, [20, 21, 22, 23])) == [True] * 4
    assert all(torch.equal(page_bytes(pool, 20 + i), expected[i]) for i in range(4))


def test_malformed_calls_and_calls_outside_the_backends_life_answer_false(tmp_path, backends):
    pool = host_pool(device_pool(False), "layer_first")
    unregistered = KvoffloadStorage(storage_config(backend_config(disk_path=str(tmp_path), disk_pages=BATCH_PAGES)))
    assert unregistered.batch_exists(keys_of(2)) == 0
    assert unregistered.batch_set_v1(keys_of(2), token_indices(pool, [0, 1])) == [False, False]
    assert unregistered.batch_get_v1(keys_of(2), token_indices(pool, [0, 1])) == [False, False]

    backend = backends(pool, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    assert backend.batch_set_v1(keys_of(2), token_indices(pool, [0])) == [False, False]  # one page's indices for two keys
    assert backend.batch_set_v1(keys_of(1), torch.arange(1, 1 + pool.page_size)) == [False]  # not a page start
    assert backend.batch_set_v1(keys_of(1), token_indices(pool, [pool.size // pool.page_size])) == [False]  # past the pool
    assert backend.batch_set_v1(keys_of(2), token_indices(pool, [0, 1])) == [True, True]
    backend.close()
    assert backend.batch_exists(keys_of(2)) == 0
    assert backend.batch_get_v1(keys_of(2), token_indices(pool, [3, 4])) == [False, False]
    assert backend.batch_set_v1(keys_of(2), token_indices(pool, [3, 4])) == [False, False]
    assert set(backend.failures()) == {"batch_set_v1: ValueError", "batch_exists: ClosedError", "batch_get_v1: ClosedError",
                                       "batch_set_v1: ClosedError"}


# -- configuration: checked at construction --------------------------------------------------------


@pytest.mark.parametrize("extra, message", [
    ({"disk_path": "/x", "disk_byts": "1GiB"}, "unknown key(s) 'disk_byts' (did you mean 'disk_bytes'?)"),
    ({"disk_path": "/x"}, "the disk tier needs its size too"),
    ({"disk_bytes": "1GiB"}, "needs disk_path too"),
    ({"disk_path": "/x", "disk_bytes": "1 GB"}, "'disk_bytes'"),
    ({"disk_path": "/x", "disk_bytes": "1GiB", "disk_pages": 4}, "not both"),
    ({"disk_path": "/x", "disk_pages": 0}, "less than 1"),
    ({"disk_path": "/x", "disk_pages": 200, "persist": "yes"}, "'persist'"),
    ({"disk_path": "/x", "disk_pages": 200, "verify": True}, "needs persist"),
    ({"disk_path": "/x", "disk_pages": 200, "fingerprint": "w"}, "needs persist"),
    ({"disk_path": "/x", "disk_pages": 200, "io_threads": 0}, "'io_threads'"),
    ({"disk_path": "/x", "disk_pages": 200, "io_timeout_s": -1}, "'io_timeout_s'"),
    ({"disk_path": "/x", "disk_pages": 200, "remote": "http://x"}, "'remote'"),
    ({"disk_path": "/x", "disk_pages": 200, "remote_write": "always"}, "'remote_write'"),
    ({}, "gives kvoffload no tier"),
    ({"remote": "redis://127.0.0.1:1/0"}, "gives kvoffload no tier"),
    ({"disk_path": "/x", "disk_pages": 200, "namespace": 5}, "'namespace'"),
    ({"disk_path": "/x", "disk_pages": 200, "remote_secret": b"x" * 32}, "'remote_secret'"),
    ({"disk_path": "/x", "disk_pages": 200, "persist": True, "remote_secret": "env:KVOFFLOAD_TEST_NEVER_SET"},
     "KVOFFLOAD_TEST_NEVER_SET"),
])
def test_bad_extra_config_is_a_clear_error_at_construction(extra, message):
    with pytest.raises(ValueError) as e:
        KvoffloadStorage(storage_config(backend_config(**extra)))
    assert message in str(e.value)


def test_what_the_tiers_or_the_pool_cannot_serve_fails_the_attach(tmp_path):
    with pytest.raises(ValueError, match="MLA model with tp_size=2.*give remote"):
        KvoffloadStorage(storage_config(backend_config(disk_path=str(tmp_path), disk_pages=BATCH_PAGES), mla=True, tp_size=2))
    pool = host_pool(device_pool(False), "page_first")
    with pytest.raises(ValueError, match=f"fewer than one SGLang batch of {BATCH_PAGES} pages"):
        create_backend(storage_config(backend_config(disk_path=str(tmp_path), disk_pages=BATCH_PAGES - 1)), pool)
    assert parse_extra_config(backend_config(disk_path="/x", disk_bytes="4GiB")).disk_bytes == 4 << 30
    assert os.listdir(tmp_path) == []


# -- SGLang's generic path, metrics, clear --------------------------------------------------------


def test_the_generic_path_round_trips_flat_data_pages(tmp_path, backends):
    pool = host_pool(device_pool(True), "layer_first", ratio=4.0)
    backend = backends(pool, mla=True, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    fill_random(pool, seed=9)
    keys = keys_of(3)
    values = [pool.get_data_page(p * pool.page_size, flat=True) for p in (5, 6, 7)]  # what SGLang's backup hands over
    free_before = pool.available_size()
    assert backend.batch_set(keys, values)
    assert backend.set(keys_of(1, "one")[0], values[0])
    assert pool.available_size() == free_before  # staging pages went back to SGLang's allocator
    assert backend.exists(keys[2]) and backend.batch_exists(keys) == 3
    targets = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys + keys_of(1, "missing"), targets + [pool.get_dummy_flat_data_page()])
    assert got[3] is None and all(g is t for g, t in zip(got, targets))
    assert all(torch.equal(g.view(torch.uint8), v.view(torch.uint8)) for g, v in zip(got, values))
    one = backend.get(keys_of(1, "one")[0], pool.get_dummy_flat_data_page())
    assert one is not None and torch.equal(one.view(torch.uint8), values[0].view(torch.uint8))


def test_get_stats_reports_sglangs_metrics_and_kvoffloads_figures_and_clear_forgets(tmp_path, backends):
    pool = host_pool(device_pool(False), "page_first")
    backend = backends(pool, metrics=True, disk_path=str(tmp_path), disk_pages=BATCH_PAGES)
    fill_random(pool)
    keys = keys_of(16)
    assert all(backend.batch_set_v1(keys, token_indices(pool, list(range(16)))))
    assert all(backend.batch_get_v1(keys, token_indices(pool, list(range(16, 32)))))
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert metrics.backup_pgs == [16] and metrics.prefetch_pgs == [16]
    assert all(b > 0 for b in metrics.backup_bandwidth + metrics.prefetch_bandwidth)
    assert isinstance(metrics.kvoffload, kvoffload.OffloaderStats) and metrics.kvoffload.disk_ready == 16
    assert metrics.failures == {}
    assert backend.get_stats().backup_pgs == []  # taken: since the last call
    backend.clear()
    assert backend.batch_exists(keys) == 0 and backend.stats().disk_ready == 0
