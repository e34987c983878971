"""Validation, lifecycle and the index API on CPU caches."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

import kvoffload
from conftest import block_bytes, random_caches


def test_public_names_importable():
    for name in ["Offloader", "Transfer", "TransferResult", "OffloadError", "TransferError", "CapacityError",
                 "MissingKeysError", "ClosedError", "OffloaderStats", "BlockLayout"]:
        assert hasattr(kvoffload, name)
    assert issubclass(kvoffload.MissingKeysError, KeyError)
    for e in (kvoffload.TransferError, kvoffload.CapacityError, kvoffload.MissingKeysError, kvoffload.ClosedError):
        assert issubclass(e, kvoffload.OffloadError)


def test_layout_geometry(caches):
    layout = kvoffload.BlockLayout.of(caches)
    assert layout.num_blocks == 64
    assert layout.block_bytes == 256 + 30 + 256 + 1000
    assert layout.slot_bytes == 4096 and layout.slot_bytes % 4096 == 0
    assert [p.offset for p in layout.pieces] == [0, 256, 286, 542]


@pytest.mark.parametrize(
    "bad, exc",
    [
        ([], TypeError),
        ({}, ValueError),
        ({"a": [1, 2]}, TypeError),
        ({1: torch.zeros(4, 4)}, TypeError),
        ({"a": torch.zeros(4, 4), "b": torch.zeros(5, 4)}, ValueError),
        ({"a": torch.zeros(4, 4).t()}, ValueError),
        ({"a": torch.zeros(0, 4)}, ValueError),
        ({"a": torch.zeros(4, 8)[:, ::2]}, ValueError),
    ],
)
def test_bad_caches_rejected(bad, exc):
    with pytest.raises(exc):
        kvoffload.Offloader(bad)


@pytest.mark.parametrize("kw, exc", [({"host_blocks": -1}, ValueError), ({"host_blocks": 2.5}, TypeError),
                                     ({"host_blocks": True}, TypeError), ({"completion": "spin"}, ValueError)])
def test_bad_options_rejected(caches, kw, exc):
    with pytest.raises(exc):
        kvoffload.Offloader(caches, **kw)


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"disk_blocks": 8}, ValueError),  # no path
        ({"disk_path": "kv"}, ValueError),  # no slots
        ({"host_blocks": 0}, ValueError),  # no room at all
        ({"disk_path": 3, "disk_blocks": 8}, TypeError),
        ({"disk_path": "kv", "disk_blocks": -1}, ValueError),
        ({"disk_path": "kv", "disk_blocks": 8, "io_threads": 0}, ValueError),
    ],
)
def test_bad_disk_options_rejected(caches, kw, exc):
    with pytest.raises(exc):
        kvoffload.Offloader(caches, **kw)


@pytest.mark.parametrize(
    "blocks, exc",
    [
        ([("a", 1)], TypeError),
        ({"a": "1"}, TypeError),
        ({"a": 1.0}, TypeError),
        ({"a": True}, TypeError),
        ({"a": None}, TypeError),
        ({"a": -1}, ValueError),
        ({"a": 64}, ValueError),
        ({"a": 2**63}, ValueError),
    ],
)
def test_bad_block_mappings_rejected_and_nothing_moves(make_offloader, caches, blocks, exc):
    off = make_offloader(caches, host_blocks=16)
    before = off.stats()
    with pytest.raises(exc):
        off.store(blocks)
    with pytest.raises(exc):
        off.load(blocks)
    assert off.stats() == before


def test_numpy_integer_ids_accepted(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    off.store({"a": np.int64(3)}).result(10)
    assert "a" in off


def test_load_rejects_duplicate_destinations_and_missing_keys(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    off.store({"a": 1, "b": 2}).result(10)
    with pytest.raises(ValueError, match="both name destination block 5"):
        off.load({"a": 5, "b": 5})
    with pytest.raises(kvoffload.MissingKeysError) as ei:
        off.load({"a": 5, "zz": 6})
    assert ei.value.missing == ("zz",)
    with pytest.raises(KeyError):
        off.load({"zz": 6})
    assert off.stats().pinned == 0  # a failed validation pinned nothing


def test_use_before_start_and_after_close(caches):
    off = kvoffload.Offloader(caches, host_blocks=8)
    with pytest.raises(kvoffload.ClosedError, match="not started"):
        off.store({"a": 1})
    with off:
        off.store({"a": 1}).result(10)
    assert off.closed
    for call in (lambda: off.store({"b": 1}), lambda: off.load({"a": 1}), lambda: off.lookup(["a"]), off.start):
        with pytest.raises(kvoffload.ClosedError):
            call()
    off.close()  # idempotent


def test_store_skips_present_keys_and_reports_them(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    r1 = off.store({"a": 1, "b": 2}).result(10)
    r2 = off.store({"a": 3, "c": 4}).result(10)
    assert r1.keys == ("a", "b") and r1.skipped == ()
    assert r2.keys == ("c",) and r2.skipped == ("a",)
    assert r2.nbytes == kvoffload.BlockLayout.of(caches).block_bytes
    # the skipped key kept its original bytes (block 1, not 3)
    off.load({"a": 10}).result(10)
    assert block_bytes(caches, 10) == block_bytes(caches, 1)


def test_lookup_counts_leading_stored_keys(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    off.store({b"h0": 0, b"h1": 1, b"h3": 3}).result(10)
    assert off.lookup([b"h0", b"h1", b"h2", b"h3"]) == 2
    assert off.lookup([b"h2", b"h0"]) == 0
    assert off.lookup([]) == 0
    assert b"h3" in off and b"h2" not in off


def test_discard(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({i: i for i in range(4)}).result(10)
    assert off.discard([0, 1, 99]) == 2
    assert 0 not in off and 2 in off
    assert off.stats().host_free == 2
    with pytest.raises(kvoffload.MissingKeysError):
        off.load({0: 5})


def test_lru_eviction_keeps_recently_used(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({i: i for i in range(4)}).result(10)
    off.load({0: 20}).result(10)  # 0 becomes most recently used
    off.store({4: 4, 5: 5}).result(10)  # evicts the two least recently used: 1 and 2
    assert [k in off for k in range(6)] == [True, False, False, True, True, True]
    assert off.stats().evicted == 2


def test_capacity_error_when_everything_is_in_use(make_offloader):
    caches = random_caches(64)
    off = make_offloader(caches, host_blocks=4)
    with pytest.raises(kvoffload.CapacityError):
        off.store({i: i for i in range(5)})
    assert off.stats().host_free == 4  # nothing reserved
    off.store({i: i for i in range(4)}).result(10)
    assert off.lookup(range(4)) == 4


def test_empty_mappings_finish_at_once(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    assert off.store({}).result(0).keys == ()
    assert off.load({}).result(0).keys == ()


def test_unclosed_offloader_is_cleaned_up_by_gc(caches):
    before = {t.ident for t in threading.enumerate()}
    off = kvoffload.Offloader(caches, host_blocks=8).start()
    off.store({"a": 1}).result(10)
    del off
    gc.collect()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvoffload")]
    assert not left
