"""Property-based bad input: every malformed call fails at the call, clearly, and nothing moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload
from conftest import random_caches
from test_bad_input import ListKeyed

NUM_BLOCKS = 32
CACHES = random_caches(NUM_BLOCKS, seed=51)
SNAPSHOT = {n: t.clone() for n, t in CACHES.items()}


@pytest.fixture(scope="module")
def off():
    o = kvoffload.Offloader(CACHES, host_blocks=16).start()
    o.store({("ok", i): i for i in range(8)}).result(30)
    yield o
    o.close()


def unchanged(off: kvoffload.Offloader, before: kvoffload.OffloaderStats) -> None:
    assert off.stats() == before, "a rejected call changed the offloader's state"
    for n, t in CACHES.items():
        assert torch.equal(t.view(torch.uint8), SNAPSHOT[n].view(torch.uint8)), "a rejected call wrote the cache"


bad_ids = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=NUM_BLOCKS),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.lists(st.integers(0, 3), max_size=2),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(good=st.dictionaries(st.tuples(st.just("ok"), st.integers(0, 7)), st.integers(0, NUM_BLOCKS - 1), max_size=4),
       bad_key=st.integers(100, 200), bad=bad_ids, kind=st.sampled_from(["store", "load"]))
def test_any_bad_block_id_is_rejected_at_the_call(off, good, bad_key, bad, kind):
    blocks = dict(good)
    blocks[("bad", bad_key)] = bad
    before = off.stats()
    expected = (TypeError, ValueError) if kind == "store" else (TypeError, ValueError, kvoffload.MissingKeysError)
    with pytest.raises(expected):
        (off.store if kind == "store" else off.load)(blocks)
    unchanged(off, before)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=2, max_size=6).filter(lambda x: len(set(x)) < len(x)))
def test_duplicate_destinations_are_rejected(off, ids):
    before = off.stats()
    with pytest.raises(ValueError, match="destination block"):
        off.load({("ok", i % 8): b for i, b in enumerate(ids)} | {("ok", 7 - j): ids[0] for j in range(1)})
    unchanged(off, before)


def test_unhashable_keys_are_rejected(off):
    before = off.stats()
    with pytest.raises(TypeError):
        off.store(ListKeyed([([1, 2], 3)]))
    with pytest.raises(TypeError):
        off.load(ListKeyed([([1, 2], 3)]))
    with pytest.raises(TypeError):
        off.lookup([[1, 2]])
    unchanged(off, before)


@pytest.mark.parametrize("bad", [None, 3, "blocks", [("a", 1)], {("a", 1)}])
def test_non_mappings_are_rejected(off, bad):
    before = off.stats()
    for call in (off.store, off.load):
        with pytest.raises(TypeError):
            call(bad)
    unchanged(off, before)


def test_huge_mapping_fails_whole_and_moves_nothing(off):
    before = off.stats()
    blocks = {("huge", i): i % NUM_BLOCKS for i in range(200_000)}
    blocks[("huge", "last")] = NUM_BLOCKS  # one bad id at the very end
    with pytest.raises(ValueError):
        off.store(blocks)
    unchanged(off, before)
    with pytest.raises(kvoffload.CapacityError):  # valid, but more than the tier holds
        off.store({("huge", i): i % NUM_BLOCKS for i in range(200_000)})
    unchanged(off, before)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4), perm_seed=st.integers(0, 100))
def test_non_contiguous_caches_are_rejected(shape, perm_seed):
    t = torch.zeros([4] + shape)
    dims = list(range(t.dim()))
    g = torch.Generator().manual_seed(perm_seed)
    order = [dims[i] for i in torch.randperm(len(dims), generator=g).tolist()]
    view = t.permute(order)
    if view.is_contiguous() or view.shape[0] == 0:
        return
    with pytest.raises(ValueError, match="contiguous"):
        kvoffload.Offloader({"a": view})


def test_mixed_devices_and_unsupported_devices_are_rejected():
    with pytest.raises(ValueError):
        kvoffload.Offloader({"a": torch.zeros(4, 4), "b": torch.zeros(4, 4, device="meta")})
    with pytest.raises(ValueError):
        kvoffload.Offloader({"a": torch.zeros(4, 4, device="meta")})
    with pytest.raises(ValueError):
        kvoffload.Offloader({"a": torch.zeros(4, 4), "b": torch.zeros(5, 4)})


def test_out_of_range_ids_never_reach_a_copy(off, monkeypatch):
    """The range check comes before any address arithmetic: the mover is never called."""
    from kvoffload._core.movers import CpuMover

    calls = []
    monkeypatch.setattr(CpuMover, "to_host", lambda self, *a: calls.append(a))
    monkeypatch.setattr(CpuMover, "to_device", lambda self, *a: calls.append(a))
    for bad in (NUM_BLOCKS, 2**40, -1, -(2**40)):
        with pytest.raises(ValueError):
            off.store({("x", bad): bad})
        with pytest.raises(ValueError):
            off.load({("ok", 0): bad})
    assert calls == []
