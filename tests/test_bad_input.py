"""Bad input, property-based: every malformed call fails at the call with a clear TypeError or
ValueError, and nothing moves (``stats()`` unchanged, cache bytes unchanged, no key added, no
thread started, no file created).

Block mappings: one bad entry (wrong type, negative, out of range, huge) hidden at a random place
among good ones, for store and load (and no out-of-range id ever reaches a copy); non-mappings;
unhashable keys (a custom Mapping whose keys are lists), also after good keys, for store, load, lookup
and discard (refused as keys that are not native: tests/test_native_keys.py has the others); duplicate destinations; missing keys; huge mappings. Caches: malformed mappings, views
with odd strides (accepted views must round-trip every byte, the others must be refused at
construction; the view a ``num_blocks`` mismatch suggests is one that is accepted), tensors on mixed
or unsupported devices (``meta`` stands in for a second device), and malformed options (exact exception types for a fixed list, property-based for the rest).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload
from support.caches import random_caches, same_bytes
from support.process import kvoffload_threads

NUM_BLOCKS = 32
STORED = [("s", i) for i in range(8)]  # stored from blocks 0..7 before the tests
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Fixture:
    def __init__(self) -> None:
        self.caches = random_caches(NUM_BLOCKS, seed=91)
        self.off = kvoffload.Offloader(self.caches, host_blocks=16).start()
        self.off.store({k: i for i, k in enumerate(STORED)}).result(30)
        self.snapshot = {n: t.clone() for n, t in self.caches.items()}

    def expect_nothing_moved(self, before: kvoffload.OffloaderStats, keys=()) -> None:
        assert self.off.stats() == before, "a rejected call changed the offloader's state"
        for n, t in self.caches.items():
            assert same_bytes(t, self.snapshot[n]), "a rejected call wrote the cache"
        for k in keys:
            try:
                present = k in self.off
            except TypeError:  # unhashable
                continue
            assert present == (k in STORED), f"key {k!r} appeared after a rejected call"


@pytest.fixture(scope="module")
def fx():
    f = Fixture()
    yield f
    f.off.close()


# -- block ids -------------------------------------------------------------------------------------

wrong_type_ids = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),  # 3.0 too: an integral float is not an id
    st.text(max_size=3),
    st.binary(max_size=3),
    st.none(),
    st.booleans(),
    st.complex_numbers(max_magnitude=10),
    st.decimals(allow_nan=False, min_value=0, max_value=NUM_BLOCKS - 1),
    st.fractions(min_value=0, max_value=NUM_BLOCKS - 1),
    st.lists(st.integers(0, 3), max_size=2),
    st.tuples(st.integers(0, 3)),
    st.sampled_from([np.float64(3.0), np.bool_(True), torch.tensor(3.0), torch.tensor([1, 2]), object(), {1: 2}]),
)
out_of_range_ids = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=NUM_BLOCKS),
    st.sampled_from([2**63, 2**64 + 3, -(2**63), np.int64(-1), np.uint64(2**63), np.int32(NUM_BLOCKS), torch.tensor(NUM_BLOCKS)]),
)
keys = st.one_of(st.text(max_size=4), st.binary(max_size=4), st.integers(), st.tuples(st.text(max_size=2), st.integers(0, 9)))


@SETTINGS
@given(
    kind=st.sampled_from(["store", "load"]),
    n_good=st.integers(0, 6),
    position=st.integers(0, 6),
    bad_key=keys.filter(lambda k: k not in STORED),
    bad=st.one_of(wrong_type_ids.map(lambda v: (v, TypeError)), out_of_range_ids.map(lambda v: (v, ValueError))),
    data=st.data(),
)
@pytest.mark.slow
def test_a_bad_block_id_anywhere_fails_the_call_and_moves_nothing(fx, kind, n_good, position, bad_key, bad, data):
    value, expected = bad
    if kind == "store":
        good = data.draw(st.dictionaries(keys.filter(lambda k: k != bad_key), st.integers(0, NUM_BLOCKS - 1), max_size=n_good), label="good")
    else:  # stored keys, distinct destinations
        chosen = data.draw(st.lists(st.sampled_from(STORED), max_size=n_good, unique=True), label="good keys")
        dests = data.draw(st.permutations(range(NUM_BLOCKS)), label="dests")
        good = dict(zip(chosen, dests))
    items = list(good.items())
    items.insert(min(position, len(items)), (bad_key, value))
    blocks = dict(items)
    before = fx.off.stats()
    call = fx.off.store if kind == "store" else fx.off.load
    with pytest.raises(expected) as ei:
        call(blocks)
    assert not isinstance(ei.value, kvoffload.OffloadError)
    msg = str(ei.value)
    assert "block id" in msg and repr(bad_key) in msg, f"unclear message: {msg!r}"
    fx.expect_nothing_moved(before, list(blocks))


non_mappings = st.one_of(
    st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=5),
    st.lists(st.tuples(st.text(max_size=2), st.integers(0, NUM_BLOCKS - 1)), max_size=3),
    st.frozensets(st.integers(0, 5), max_size=3),
    st.tuples(st.tuples(st.just("a"), st.just(1))),
    st.sampled_from([{"a": 1}.items(), {"a": 1}.keys(), iter([("a", 1)]), {("a", 1)}, torch.tensor([1, 2]), np.array([[1, 2]])]),
)


@SETTINGS
@given(kind=st.sampled_from(["store", "load"]), blocks=non_mappings)
def test_a_non_mapping_fails_the_call(fx, kind, blocks):
    before = fx.off.stats()
    with pytest.raises(TypeError, match="mapping"):
        (fx.off.store if kind == "store" else fx.off.load)(blocks)
    fx.expect_nothing_moved(before)


class ListKeyed(Mapping):
    """A Mapping whose keys may be lists (a dict cannot hold them)."""

    def __init__(self, items):
        self._items = list(items)

    def __getitem__(self, key):
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)


@SETTINGS
@given(
    kind=st.sampled_from(["store", "load", "lookup"]),
    n_good=st.integers(0, 5),
    position=st.integers(0, 5),
    bad_key=st.one_of(st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                      st.sets(st.integers(), max_size=2), st.just(bytearray(b"k"))),
)
def test_an_unhashable_key_anywhere_fails_the_call_and_moves_nothing(fx, kind, n_good, position, bad_key):
    good = [(k, 8 + i) for i, k in enumerate(STORED[:n_good])] if kind != "store" else [(("new", i), i) for i in range(n_good)]
    items = list(good)
    items.insert(min(position, len(items)), (bad_key, 20))
    before = fx.off.stats()
    with pytest.raises(TypeError, match="keys are bytes, str or int"):
        if kind == "lookup":  # the keys before the bad one are all stored: lookup must get to it
            fx.off.lookup([k for k, _ in items])
        else:
            (fx.off.store if kind == "store" else fx.off.load)(ListKeyed(items))
    fx.expect_nothing_moved(before, [k for k, _ in good])


@SETTINGS
@given(ids=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=2, max_size=len(STORED)).filter(lambda x: len(set(x)) < len(x)))
def test_two_keys_loading_into_one_block_fail_the_call(fx, ids):
    before = fx.off.stats()
    blocks = dict(zip(STORED, ids))
    dup = next(b for j, b in enumerate(ids) if b in ids[:j])  # the first id named a second time
    with pytest.raises(ValueError, match=f"both name destination block {dup}"):
        fx.off.load(blocks)
    fx.expect_nothing_moved(before)


class IntKey(int):
    """Not a native key (a subclass of int)."""


_PARTS = st.one_of(st.text(max_size=3), st.binary(max_size=3), st.integers(-3, 3), st.booleans())
_KEYS = st.one_of(_PARTS, st.tuples(_PARTS, _PARTS), st.tuples(_PARTS, st.tuples(_PARTS)), st.builds(IntKey, st.integers(0, 3)),
                  st.floats(allow_nan=False))
_IDS = st.one_of(st.integers(-2, NUM_BLOCKS + 1), st.booleans(), st.builds(np.int64, st.integers(0, NUM_BLOCKS - 1)),
                 st.just(1.0))


def _outcome(call, blocks):
    try:
        transfer = call(blocks)
    except (TypeError, ValueError, KeyError) as e:
        return type(e), str(e)
    transfer.result(10)
    return "ok"


@SETTINGS
@given(items=st.lists(st.tuples(_KEYS, _IDS), max_size=6, unique_by=lambda kv: (type(kv[0]), kv[0])), kind=st.sampled_from(["store", "load"]))
def test_a_dict_and_any_other_mapping_of_the_same_items_are_checked_alike(fx, items, kind):
    """The check of a plain dict (its common case at C speed) and of any other mapping with the same
    items (checked in Python) accept the same calls and refuse the others with the same error."""
    blocks = dict(items)
    call = fx.off.store if kind == "store" else fx.off.load
    as_dict = _outcome(call, blocks)
    as_mapping = _outcome(call, ListKeyed(blocks.items()))
    assert as_dict == as_mapping
    if as_dict == "ok" and kind == "store":
        fx.off.discard([k for k in blocks if k not in STORED])
    elif as_dict == "ok":  # loaded stored keys: the cache as the other tests expect it
        for n, t in fx.caches.items():
            t.copy_(fx.snapshot[n])


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


def test_out_of_range_ids_never_reach_a_copy(fx, faults):
    """The range check comes before any address arithmetic: no copy is ever called."""
    spies = [faults.spy(fx.off, "to_host"), faults.spy(fx.off, "to_device")]
    before = fx.off.stats()
    for bad in (NUM_BLOCKS, 2**40, -1, -(2**40)):
        with pytest.raises(ValueError):
            fx.off.store({("x", bad): bad})
        with pytest.raises(ValueError):
            fx.off.load({STORED[0]: bad})
    assert [s.calls for s in spies] == [[], []]
    fx.expect_nothing_moved(before, [("x", NUM_BLOCKS)])


def test_duplicate_sources_are_fine_for_a_store():
    caches = random_caches(8, seed=92)
    with kvoffload.Offloader(caches, host_blocks=4) as off:
        off.store({"a": 3, "b": 3}).result(10)
        off.load({"a": 5, "b": 6}).result(10)
        for t in caches.values():
            assert same_bytes(t[5], t[3]) and same_bytes(t[6], t[3])


def test_huge_mappings_fail_at_the_call_quickly_and_move_nothing(fx):
    n = 300_000
    before = fx.off.stats()
    checks = [
        (lambda: fx.off.store({("h", i): i % NUM_BLOCKS for i in range(n)}), kvoffload.CapacityError),  # valid, too many
        (lambda: fx.off.store({**{("h", i): i % NUM_BLOCKS for i in range(n)}, ("h", "last"): -1}), ValueError),
        (lambda: fx.off.store({**{("h", i): i % NUM_BLOCKS for i in range(n)}, ("h", "last"): 1.5}), TypeError),
        (lambda: fx.off.load({("h", i): i % NUM_BLOCKS for i in range(n)}), ValueError),  # destinations repeat
        (lambda: fx.off.load({("h", i): i for i in range(NUM_BLOCKS)}), kvoffload.MissingKeysError),
    ]
    for call, expected in checks:
        t0 = time.perf_counter()
        with pytest.raises(expected) as ei:
            call()
        took = time.perf_counter() - t0
        assert took < 5, f"rejecting a huge mapping took {took:.1f} s"
        assert len(str(ei.value)) < 500, "the error message grows with the mapping"
        fx.expect_nothing_moved(before, [("h", 0), ("h", "last")])


def test_after_is_refused_for_cpu_caches(fx):
    before = fx.off.stats()
    for after in (object(), torch.zeros(1), 0):
        for call in (fx.off.store, fx.off.load):
            with pytest.raises(ValueError, match="after"):
                call({STORED[0]: 20}, after=after)
    fx.expect_nothing_moved(before)


# -- known bugs ------------------------------------------------------------------------------------


@pytest.fixture
def own():
    """A fixture of its own, for tests that may change it (the known-bug tests below)."""
    f = Fixture()
    yield f
    f.off.close()


def test_a_bool_tensor_is_not_a_block_id(own):
    before = own.off.stats()
    with pytest.raises(TypeError):
        own.off.store({"flag": torch.tensor(True)}).result(10)
    own.expect_nothing_moved(before, ["flag"])


def test_discard_with_an_unhashable_key_discards_nothing(own):
    before = own.off.stats()
    with pytest.raises(TypeError):
        own.off.discard([STORED[0], ["unhashable"]])
    own.expect_nothing_moved(before, STORED)


# -- caches ----------------------------------------------------------------------------------------


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
        ({"a": torch.zeros(4, 8)[:, ::2]}, ValueError),  # rows of one-element pieces
        ({"a": torch.zeros(4, 4, device="meta")}, ValueError),  # a device kvoffload cannot copy from
    ],
)
def test_bad_caches_rejected(bad, exc):
    with pytest.raises(exc):
        kvoffload.Offloader(bad)

VIEWS = ["transpose", "step", "narrow", "expand", "permute", "rows-step", "rows-slice", "unsqueeze", "as-is"]


def make_view(base: torch.Tensor, how: str, k: int) -> torch.Tensor:
    if how == "transpose":
        return base.transpose(1, base.dim() - 1)
    if how == "step":
        return base[:, ::2]
    if how == "narrow":
        return base.narrow(1, k % base.shape[1], max(1, base.shape[1] - 1 - k % base.shape[1]))
    if how == "expand":
        return base[:, :1].expand(base.shape[0], 3, *base.shape[2:])
    if how == "permute":
        dims = list(range(1, base.dim()))
        return base.permute(0, *dims[k % len(dims):], *dims[: k % len(dims)])
    if how == "rows-step":  # every other block: blocks are not evenly packed
        return base[::2]
    if how == "rows-slice":  # a contiguous window of blocks (storage offset): fine
        return base[1:-1]
    if how == "unsqueeze":
        return base.unsqueeze(1)
    return base


@settings(max_examples=60, deadline=None, database=None)
@given(
    shape=st.lists(st.integers(2, 6), min_size=1, max_size=3),
    blocks=st.integers(4, 9),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.float64]),
    how=st.sampled_from(VIEWS),
    k=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_a_cache_view_is_refused_at_construction_or_round_trips_exactly(shape, blocks, dtype, how, k, seed):
    g = torch.Generator().manual_seed(seed)
    n = blocks * int(np.prod(shape))
    raw = torch.randint(1, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    base = raw.view(dtype).view(blocks, *shape)
    view = make_view(base, how, k)
    other = random_caches(view.shape[0], seed=seed)["v1"]  # a well-formed neighbour
    caches = {"view": view, "other": other}
    threads = set(kvoffload_threads())
    nb = view.shape[0]
    try:
        kvoffload.Offloader(caches, host_blocks=nb)
    except ValueError as e:  # refused for a stated reason, before anything started
        assert not view.is_contiguous(), f"a contiguous cache was refused: {e}"
        assert re.search("not contiguous|overlap|share bytes|pieces per block", str(e)), e
        assert set(kvoffload_threads()) == threads
        return
    orig = {n_: t.clone() for n_, t in caches.items()}
    before_base = base.clone()
    with kvoffload.Offloader(caches, host_blocks=nb) as off:
        off.store({i: i for i in range(nb)}).result(10)
        off.load({i: nb - 1 - i for i in range(nb)}).result(10)
    for n_, t in caches.items():
        assert same_bytes(t, orig[n_].flip(0)), f"{how} view of {tuple(base.shape)}: wrong bytes in {n_}"
    if how == "rows-slice":  # blocks outside the window were never touched
        assert same_bytes(base[0], before_base[0]) and same_bytes(base[-1], before_base[-1])


SUGGESTED_VIEW = re.compile(r"pass t\.(transpose|movedim)\((\d+), (\d+)\)")


@settings(max_examples=80, deadline=None, database=None)
@given(other=st.lists(st.integers(1, 5), min_size=1, max_size=3), at=st.integers(1, 3), contiguous_blocks_first=st.booleans())
def test_a_suggested_view_for_blocks_along_another_dim_is_accepted(other, at, contiguous_blocks_first):
    nb = 7
    shape = list(other)
    shape.insert(min(at, len(shape)), nb)  # the blocks along a dim other than 0
    t = torch.zeros(shape, dtype=torch.float16)
    if contiguous_blocks_first:  # a view whose memory has the blocks outermost
        d = shape.index(nb, 1)
        t = torch.zeros([nb] + shape[:d] + shape[d + 1 :], dtype=torch.float16).movedim(0, d)
    with pytest.raises(ValueError, match=f"num_blocks={nb}") as ei:
        kvoffload.Offloader({"kv": t}, num_blocks=nb)
    message = str(ei.value)
    candidates = [getattr(t, how)(*args) for d in range(1, t.dim()) if t.shape[d] == nb
                  for how, args in (("transpose", (0, d)), ("movedim", (d, 0)))]
    usable = []
    for view in candidates:
        try:
            kvoffload.Offloader({"kv": view}, num_blocks=nb)
            usable.append(view)
        except ValueError:
            pass
    suggested = SUGGESTED_VIEW.search(message)
    if not usable:
        assert suggested is None and "copy" in message, message
        return
    assert suggested, message
    how, a, b = suggested.groups()
    view = getattr(t, how)(int(a), int(b))
    off = kvoffload.Offloader({"kv": view}, num_blocks=nb)  # the suggestion is accepted ...
    assert off.layout.num_blocks == nb and off.layout.block_bytes * nb == t.numel() * t.element_size()  # ... whole


def test_no_view_is_suggested_that_would_be_refused():
    t = torch.zeros(2, 16, 100)  # blocks along the last dim: every view with them first has strided rows
    with pytest.raises(ValueError, match="num_blocks=100") as ei:
        kvoffload.Offloader({"kv": t}, num_blocks=100)
    assert not SUGGESTED_VIEW.search(str(ei.value)) and "copy" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1, 16)[:, :8],  # one block cut out of a wider row: contiguous, stride(0) == 16
    lambda: torch.zeros(4).as_strided((1, 4), (999, 1)),
    lambda: torch.zeros(8, 0),  # blocks of zero bytes
], ids=["one-block-slice", "one-block-as-strided", "zero-byte-blocks"])
def test_odd_stride_caches_fail_clearly_at_construction(make):
    t = make()
    try:
        off = kvoffload.Offloader({"a": t}, host_blocks=2)
    except ValueError:
        return  # refused clearly, at the call
    try:
        off.start()
        off.store({"k": 0}).result(10)
        off.load({"k": 0}).result(10)
    finally:
        off.close()


@settings(max_examples=40, deadline=None, database=None)
@given(n=st.integers(1, 4), position=st.integers(0, 4), meta_first=st.booleans())
def test_caches_on_mixed_devices_are_refused_at_construction(tmp_path_factory, n, position, meta_first):
    caches = {f"cpu{i}": torch.zeros(8, 16) for i in range(n)}
    items = list(caches.items())
    items.insert(0 if meta_first else min(position, n), ("meta", torch.zeros(8, 16, device="meta")))
    path = tmp_path_factory.mktemp("mixed") / "kv"
    threads = set(kvoffload_threads())
    with pytest.raises(ValueError, match="meta"):
        kvoffload.Offloader(dict(items), host_blocks=4, disk_path=path, disk_blocks=4)
    assert set(kvoffload_threads()) == threads and not os.listdir(path.parent)


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"host_blocks": -1}, ValueError),
        ({"host_blocks": 2.5}, TypeError),
        ({"host_blocks": True}, TypeError),
        ({"completion": "poll"}, TypeError),  # an option that is no more
        ({"copy_engine": "sm"}, ValueError),
        ({"disk_blocks": 8}, ValueError),  # no path
        ({"disk_path": "kv"}, ValueError),  # no slots
        ({"host_blocks": 0}, ValueError),  # no room at all
        ({"disk_path": 3, "disk_blocks": 8}, TypeError),
        ({"disk_path": "kv", "disk_blocks": -1}, ValueError),
        ({"disk_path": "kv", "disk_blocks": 8, "io_threads": 0}, ValueError),
        ({"host_bytes": "1 GB"}, ValueError),
        ({"host_bytes": 1.5e9}, TypeError),
        ({"host_blocks": 8, "host_bytes": "1MiB"}, ValueError),  # both for one tier
        ({"host_bytes": 0}, ValueError),  # no room at all
        ({"disk_bytes": "1MiB"}, ValueError),  # no path
        ({"disk_path": "kv", "disk_blocks": 8, "disk_bytes": "1MiB"}, ValueError),  # both for one tier
    ],
)
def test_bad_options_rejected(caches, kw, exc):
    with pytest.raises(exc):
        kvoffload.Offloader(caches, **kw)


bad_options = st.one_of(
    st.fixed_dictionaries({"host_blocks": st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=2), st.booleans())}),
    st.fixed_dictionaries({"host_bytes": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), st.binary(max_size=2),
                                                    st.text(max_size=4).filter(lambda s: not s.strip().isdigit()))}),
    st.fixed_dictionaries({"host_blocks": st.integers(0, 8), "host_bytes": st.integers(0, 1 << 20)}),  # both for one tier
    st.fixed_dictionaries({"chunk_bytes": st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none())}),
    st.fixed_dictionaries({"io_threads": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=2))}),
    st.fixed_dictionaries({"disk_blocks": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans())}),
    st.fixed_dictionaries({"copy_engine": st.text(max_size=6).filter(lambda s: s not in ("kernel", "dma"))}),
    st.fixed_dictionaries({"disk_path": st.one_of(st.integers(), st.lists(st.text(max_size=2), max_size=2)), "disk_blocks": st.just(4)}),
    st.just({"disk_blocks": 4}),  # no path
    st.just({"disk_path": "PATH"}),  # no slots
    st.just({"host_blocks": 0}),  # no room at all
)


@settings(max_examples=80, deadline=None, database=None)
@given(opts=bad_options)
def test_malformed_options_are_refused_at_construction(tmp_path_factory, opts):
    d = tmp_path_factory.mktemp("opts")
    opts = {k: (str(d / "kv") if v == "PATH" else v) for k, v in opts.items()}
    threads = set(kvoffload_threads())
    with pytest.raises((TypeError, ValueError)) as ei:
        kvoffload.Offloader(random_caches(4, seed=1), **opts)
    assert not isinstance(ei.value, kvoffload.OffloadError)
    assert set(kvoffload_threads()) == threads and not os.listdir(d)
