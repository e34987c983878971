"""Keys are caller code: their ``__hash__``, ``__eq__`` and ``__repr__`` may call back into the offloader.

A key's methods run outside the offloader's locks, so a key that looks keys up, asks ``key in off``,
reads ``stats()`` or discards keys from its methods, in the thread of the call or in another thread it
waits for, neither deadlocks the offloader nor sees it half-way through an operation. Keys that are
equal but distinct objects are one key; two stores of one key racing each other store it once.

A call that would deadlock is detected with a bounded wait (a thread joined with a timeout): a failing
run fails within seconds and leaves its stuck offloader unclosed (closing it would hang too).
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable, Hashable

import pytest
import torch

import kvoffload
from support.caches import random_caches, same_bytes
from support.keys import Named
from kvoffload._core.tiers.index import BlockIndex
from kvoffload._testing import check_index

BOUND_S = 5.0
"""Longer than any operation here takes by far: a call still running after this is deadlocked."""

_inside = threading.local()
_stuck: list[kvoffload.Offloader] = []
"""Offloaders left deadlocked by a failing run: kept alive so that no finalizer tries to close them."""


class Callback:
    """What an armed key does in its ``__hash__``, ``__eq__`` and ``__repr__``: one call into the
    offloader, in the calling thread or in another thread it waits for (a bounded wait: ``stuck`` counts
    the waits that ran out). Keys used inside that call do not call again."""

    def __init__(self, call: Callable[[], object], in_thread: bool) -> None:
        self.call = call
        self.in_thread = in_thread
        self.armed = False
        self.made = 0
        self.stuck = 0
        self.errors: list[BaseException] = []

    def __call__(self) -> None:
        if not self.armed or getattr(_inside, "calling", False):
            return
        if not self.in_thread:
            self._run()
            return
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        t.join(BOUND_S)
        if t.is_alive():
            self.stuck += 1

    def _run(self) -> None:
        _inside.calling = True
        try:
            self.call()
            self.made += 1
        except BaseException as e:  # reported by the test
            self.errors.append(e)
        finally:
            _inside.calling = False


class Key:
    """A key with methods of its own, equal to every ``Key`` of the same name (whatever the object).

    ``callback`` runs at the start of each of the methods named in ``calls_from``."""

    __slots__ = ("name", "callback", "calls_from")

    def __init__(
        self, name: str, callback: Callable[[], None] | None = None, calls_from: tuple[str, ...] = ("hash", "eq", "repr"),
    ) -> None:
        self.name = name
        self.callback = callback
        self.calls_from = calls_from

    def _call(self, method: str) -> None:
        if self.callback is not None and method in self.calls_from:
            self.callback()

    def __hash__(self) -> int:
        self._call("hash")
        return hash(("Key", self.name))

    def __eq__(self, other: object) -> bool:
        self._call("eq")
        return isinstance(other, Key) and other.name == self.name

    def __repr__(self) -> str:
        self._call("repr")
        return f"Key({self.name!r})"


def run_bounded(fn: Callable[[], object]) -> object:
    """``fn()`` in a thread; fails the test if it has not returned within BOUND_S."""
    out: list[object] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(BOUND_S)
    if t.is_alive():
        raise TimeoutError("the call deadlocked")
    if errors:
        raise errors[0]
    return out[0]


# -- a key calling back, through every operation -------------------------------------------------


def op_store(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    result = off.store({Key("c", cb): 4, Key("d", cb): 5}).result(BOUND_S)
    assert [k.name for k in result.keys] == ["c", "d"] and result.skipped == ()
    cb.armed = False
    off.load({Key("c"): 12, Key("d"): 13}).result(BOUND_S)
    for t in caches.values():
        assert same_bytes(t[12], t[4]) and same_bytes(t[13], t[5])


def op_load(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    off.load({Key("a", cb): 10, Key("b", cb): 11}).result(BOUND_S)
    for t in caches.values():
        assert same_bytes(t[10], t[1]) and same_bytes(t[11], t[2])


def op_load_missing(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    with pytest.raises(kvoffload.MissingKeysError) as err:  # its message shows the key: __repr__ runs
        off.load({Key("a", cb): 10, Key("zz", cb): 11})
    assert [k.name for k in err.value.missing] == ["zz"] and "Key('zz')" in str(err.value)


def op_lookup(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    assert off.lookup([Key("a", cb), Key("b", cb), Key("zz", cb), Key("a", cb)]) == 2


def op_discard(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    assert off.discard([Key("a", cb), Key("zz", cb), Key("a", cb)]) == 1
    cb.armed = False
    assert Key("a") not in off and Key("b") in off


def op_contains(off: kvoffload.Offloader, cb: Callback, caches: dict[str, torch.Tensor]) -> None:
    assert Key("b", cb) in off and Key("zz", cb) not in off


OPERATIONS = {
    "store": op_store, "load": op_load, "load_missing": op_load_missing, "lookup": op_lookup, "discard": op_discard,
    "in": op_contains,
}
CALLBACKS: dict[str, Callable[[kvoffload.Offloader], object]] = {
    "lookup": lambda off: off.lookup([Key("a"), Key("b"), b"plain"]),
    "in": lambda off: Key("b") in off,
    "stats": lambda off: off.stats(),
    "discard": lambda off: off.discard(["spare", Key("spare")]),
}


@pytest.mark.parametrize("thread", ["same thread", "other thread"])
@pytest.mark.parametrize("callback", list(CALLBACKS))
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_a_key_calling_the_offloader_from_its_methods_never_deadlocks_it(operation, callback, thread):
    caches = random_caches(16)
    off = kvoffload.Offloader(caches, host_blocks=8).start()
    try:
        off.store({Key("a"): 1, Key("b"): 2, "spare": 3}).result(BOUND_S)
        cb = Callback(lambda: CALLBACKS[callback](off), in_thread=thread == "other thread")
        cb.armed = True
        try:
            run_bounded(lambda: OPERATIONS[operation](off, cb, caches))
        except TimeoutError:
            _stuck.append(off)
            pytest.fail(f"{operation} deadlocked when a key's method called {callback}() in the {thread}")
        cb.armed = False
        assert cb.stuck == 0, f"{operation} held a lock while a key's method waited for {callback}() in another thread"
        assert cb.made > 0 and not cb.errors, cb.errors
        check_index(off)
        s = off.stats()
        assert s.pending == s.pinned == s.in_flight == 0, s
    finally:
        if off not in _stuck:
            off.close()


# -- equal keys ------------------------------------------------------------------------------------------


class Color(enum.IntEnum):
    """Ints with methods of their own: ``Color.RED == 1`` and they hash alike."""

    RED = 1
    GREEN = 2


def test_equal_but_distinct_key_objects_are_one_key(caches):
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        assert off.store({Key("a"): 1}).result(BOUND_S).keys == (Key("a"),)
        assert off.store({Key("a"): 2}).result(BOUND_S).skipped == (Key("a"),)
        assert off.lookup([Key("a")]) == 1 and Key("a") in off and off.stats().ready == 1
        off.load({Key("a"): 10}).result(BOUND_S)
        for t in caches.values():
            assert same_bytes(t[10], t[1])
        # Ints and IntEnum members that equal them are one key too, whichever is stored first.
        assert off.store({Color.RED: 3, 2: 4}).result(BOUND_S).skipped == ()
        assert off.store({1: 5, Color.GREEN: 6}).result(BOUND_S).skipped == (1, Color.GREEN)
        assert 1 in off and Color.GREEN in off and off.lookup([1, Color.RED, 2, Color.GREEN]) == 4
        off.load({1: 11, Color.GREEN: 12}).result(BOUND_S)
        for t in caches.values():
            assert same_bytes(t[11], t[3]) and same_bytes(t[12], t[4])
        assert off.discard([Key("a"), 1, Color.GREEN, Color.RED]) == 3
        assert off.lookup([Key("a")]) == 0 and Color.RED not in off and 2 not in off and off.stats().ready == 0
        check_index(off)


def test_a_key_stored_again_while_a_store_compares_it_is_stored_once(caches):
    # A store compares its key with the stored equal one; meanwhile, from that very comparison, the stored
    # one is discarded and an equal key stored again from another block. The store finds the new one.
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        replaced = threading.Event()

        def replace() -> None:
            if not replaced.is_set():
                replaced.set()
                assert off.discard([Key("a")]) == 1
                off.store({Key("a"): 2}).result(BOUND_S)

        cb = Callback(replace, in_thread=True)
        off.store({Key("a", cb, calls_from=("eq",)): 1}).result(BOUND_S)  # compared, it calls replace()
        key = Key("a")
        cb.armed = True
        result = run_bounded(lambda: off.store({key: 3}).result(BOUND_S))
        cb.armed = False
        assert replaced.is_set() and cb.stuck == 0 and not cb.errors, cb.errors
        assert result.skipped == (key,) and result.keys == ()
        assert off.stats().ready == 1
        off.load({Key("a"): 10}).result(BOUND_S)
        for t in caches.values():
            assert same_bytes(t[10], t[2])
        check_index(off)


def test_a_key_discarded_while_a_store_compares_it_is_stored_anew(caches):
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        cb = Callback(lambda: off.discard([Key("a")]), in_thread=True)
        off.store({Key("a", cb, calls_from=("eq",)): 1}).result(BOUND_S)  # compared, it discards itself
        key = Key("a")
        cb.armed = True
        result = run_bounded(lambda: off.store({key: 3}).result(BOUND_S))
        cb.armed = False
        assert cb.made > 0 and cb.stuck == 0 and not cb.errors, cb.errors
        assert result.keys == (key,) and result.skipped == ()
        off.load({Key("a"): 10}).result(BOUND_S)
        for t in caches.values():
            assert same_bytes(t[10], t[3])
        check_index(off)


class Slow(Named):
    """A :class:`Named` key whose comparisons let other threads run."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        os.sched_yield()
        return super().__eq__(other)

    __hash__ = Named.__hash__


def test_threads_storing_equal_keys_at_once_store_each_key_once(caches):
    names = [f"k{i}" for i in range(6)]
    threads, rounds = 6, 15
    barrier = threading.Barrier(threads + 1)
    stored: list[list[str]] = [[] for _ in range(rounds)]
    stored_lock = threading.Lock()
    errors: list[BaseException] = []

    def storer(n: int, off: kvoffload.Offloader) -> None:
        try:
            for r in range(rounds):
                barrier.wait(BOUND_S)
                # Every thread stores every name: some as native strings, most as distinct Slow objects.
                blocks: dict[Hashable, int] = {Slow(name) if (n + i) % 3 else name: n for i, name in enumerate(names)}
                result = off.store(blocks).result(BOUND_S)
                with stored_lock:
                    stored[r] += [k if isinstance(k, str) else k.name for k in result.keys]
                barrier.wait(BOUND_S)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    with kvoffload.Offloader(caches, host_blocks=64) as off:
        workers = [threading.Thread(target=storer, args=(n, off), daemon=True) for n in range(threads)]
        for w in workers:
            w.start()
        try:
            for r in range(rounds):
                barrier.wait(BOUND_S)  # the threads store
                barrier.wait(BOUND_S)  # they are done
                assert sorted(stored[r]) == names, f"round {r}: stored {sorted(stored[r])}"
                assert off.stats().ready == len(names)
                check_index(off)
                assert off.discard([Slow(name) for name in names[::2]] + names[1::2]) == len(names)
        except threading.BrokenBarrierError:
            pytest.fail(f"a storing thread failed: {errors!r}")
        except BaseException:
            barrier.abort()  # only then: after the last round, threads may still be leaving their last wait
            raise
        finally:
            for w in workers:
                w.join(BOUND_S)
        assert not errors, errors


class Raising(Key):
    """A key whose ``__hash__`` or ``__eq__`` raises (``raises_in``)."""

    __slots__ = ("raises_in",)

    def __init__(self, name: str, raises_in: str) -> None:
        super().__init__(name)
        self.raises_in = raises_in

    def __hash__(self) -> int:
        if self.raises_in == "hash":
            raise LookupError("hash")
        return super().__hash__()

    def __eq__(self, other: object) -> bool:
        if self.raises_in == "eq":
            raise LookupError("eq")
        return super().__eq__(other)

    __ne__ = object.__ne__


@pytest.mark.parametrize("raises_in", ["hash", "eq"])
def test_a_key_whose_methods_raise_fails_the_call_and_changes_nothing(caches, raises_in):
    with kvoffload.Offloader(caches, host_blocks=4) as off:
        off.store({Key("a"): 1, "b": 2, Key("c"): 3}).result(BOUND_S)
        before = off.stats()
        bad = Raising("a", raises_in)  # hashes as Key("a"): compared with it
        calls = {
            "store": lambda: off.store({Key("d"): 4, bad: 5}),  # d is not reserved either
            "load": lambda: off.load({"b": 10, bad: 11}),
            "lookup": lambda: off.lookup(["b", bad]),
            "in": lambda: bad in off,
            "discard": lambda: off.discard(["b", bad]),
        }
        for name, call in calls.items():
            with pytest.raises(LookupError):
                call()
            check_index(off)
            s = off.stats()
            assert (s.ready, s.pending, s.pinned, s.host_free, s.in_flight) == (3, 0, 0, 1, 0), (name, s)
        assert off.lookup(["b", Key("a"), Key("c")]) == 3 and Key("d") not in off and off.stats().evicted == before.evicted


# -- the index itself ------------------------------------------------------------------------------------


class Watched:
    """A key that records whether the index's lock was held while one of its methods ran."""

    def __init__(self, name: str, ix: BlockIndex, under_lock: list[str]) -> None:
        self.name, self.ix, self.under_lock = name, ix, under_lock

    def _check(self, method: str) -> None:
        if self.ix._lock.locked():
            self.under_lock.append(f"{method} of {self.name}")

    def __hash__(self) -> int:
        self._check("__hash__")
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        self._check("__eq__")
        return isinstance(other, Watched) and other.name == self.name

    def __repr__(self) -> str:
        self._check("__repr__")
        return f"Watched({self.name!r})"


def test_the_index_runs_no_key_method_under_its_lock():
    ix = BlockIndex(4, 2)
    under_lock: list[str] = []

    def k(name: str) -> Watched:
        return Watched(name, ix, under_lock)

    r = ix.reserve([k("a"), k("b"), "c", k("a"), k("d")])
    assert [e.key.name if isinstance(e.key, Watched) else e.key for e in r.entries] == ["a", "b", "c", "d"]
    assert [x.name for x in r.skipped] == ["a"]
    ix.publish(r.entries)
    r = ix.reserve([k("b"), k("e")])  # spills the least recently used to disk
    assert len(r.skipped) == 1 and len(r.spills) == 1
    for s in r.spills:
        ix.spill_done(s)
    ix.publish(r.entries)
    assert ix.lookup([k("a"), k("b"), "c", k("zz"), k("d")]) == 3
    assert k("e") in ix and k("zz") not in ix
    pins = ix.pin([k("b"), "c"])
    with pytest.raises(kvoffload.MissingKeysError):
        ix.pin([k("zz")])
    ix.unpin(pins)
    ix.counts()
    ix.check()
    assert ix.discard([k("b"), k("zz"), "c", k("b")]) == 2
    ix.check()
    assert not under_lock, under_lock
