"""Keys are native: ``bytes``, ``str``, ``int`` (a ``bool`` is the int it equals) or tuples of such keys,
nested tuples included; exactly these types.

Any other key (a float, None, a numpy integer, an enum member, a subclass of a native type, an object
with methods of its own, a frozen dataclass, a tuple holding one of those) is refused with a
``TypeError`` at every public call that takes keys, before anything changes: ``stats()`` is unchanged,
no slot is reserved, no key stored or forgotten, and none of the key's own methods ran. Tuples and
nested tuples round-trip byte-exact; ``1`` and ``True`` are one key, ``1.0`` is refused.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest

import kvoffload
from support.caches import block_bytes, random_caches
from kvoffload._testing import check_index

BLOCKS = 32


class Color(enum.IntEnum):
    RED = 1


class Shape(enum.Enum):
    SQUARE = "square"


class Word(str):
    """A str subclass: hashes and compares as its value, but may override either."""


@dataclass(frozen=True)
class Frozen:
    name: str


class Recording:
    """A key whose ``__hash__``, ``__eq__`` and ``__repr__`` record that they ran (none may, here)."""

    ran: list[str] = []

    def __hash__(self) -> int:
        Recording.ran.append("__hash__")
        return 7

    def __eq__(self, other: object) -> bool:
        Recording.ran.append("__eq__")
        return other is self

    def __repr__(self) -> str:
        Recording.ran.append("__repr__")
        return "Recording()"


BAD_KEYS = {
    "float": lambda: 1.0,
    "None": lambda: None,
    "numpy integer": lambda: np.int64(3),
    "IntEnum member": lambda: Color.RED,
    "Enum member": lambda: Shape.SQUARE,
    "str subclass": lambda: Word("a"),
    "frozen dataclass": lambda: Frozen("a"),
    "own methods": Recording,
    "frozenset": lambda: frozenset({1}),
    "tuple holding a float": lambda: ("a", 1.5),
    "nested tuple holding None": lambda: ("a", (1, (b"x", None))),
    "tuple holding own methods": lambda: (1, Recording()),
    "unhashable list": lambda: [1, 2],
    "unhashable bytearray": lambda: bytearray(b"a"),
}
"""Each makes a key that is not native (a new object each time)."""

STORED = ["a", b"b", 3, ("d", 4)]


class Pairs(Mapping):
    """A mapping that hashes none of its keys (a dict would hash them, running a key's ``__hash__``,
    and could not hold an unhashable one)."""

    def __init__(self, *items: tuple[object, int]) -> None:
        self._items = list(items)

    def __getitem__(self, key: object) -> int:
        for k, v in self._items:
            if k is key:
                return v
        raise KeyError("not here")

    def __iter__(self):
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)


def calls(off: kvoffload.Offloader, bad: object) -> dict[str, object]:
    """Every public call that takes keys, given ``bad`` after good ones (a new key, or stored ones)."""
    return {
        "store": lambda: off.store(Pairs(("new", 20), (bad, 21))),
        "load": lambda: off.load(Pairs(("a", 22), (bad, 23))),
        "lookup": lambda: off.lookup(["a", b"b", bad]),  # type: ignore[list-item]
        "lease": lambda: off.lookup(["a", bad], hold=True),  # type: ignore[list-item]
        "alookup": lambda: asyncio.run(off.alookup(["a", bad])),  # type: ignore[list-item]
        "discard": lambda: off.discard(["a", bad]),  # type: ignore[list-item]
        "in": lambda: bad in off,
    }


@pytest.fixture(scope="module")
def stored():
    caches = random_caches(BLOCKS, seed=5)
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        off.store({k: i for i, k in enumerate(STORED)}).result(10)
        yield off, caches


@pytest.mark.parametrize("call", ["store", "load", "lookup", "lease", "alookup", "discard", "in"])
@pytest.mark.parametrize("kind", list(BAD_KEYS))
def test_a_key_that_is_not_native_is_refused_at_every_call_and_changes_nothing(stored, kind, call):
    off, caches = stored
    Recording.ran.clear()
    bad = BAD_KEYS[kind]()
    before = off.stats()
    cache_before = [block_bytes(caches, b) for b in range(BLOCKS)]
    with pytest.raises(TypeError) as ei:
        calls(off, bad)[call]()
    msg = str(ei.value)
    assert "keys are bytes, str or int" in msg and "IntEnum member is refused" in msg and "int(k)" in msg, msg
    assert "tuple holding" in msg if type(bad) is tuple else "tuple holding" not in msg, msg
    assert not Recording.ran, f"the offloader ran the key's {Recording.ran}"
    after = off.stats()
    assert after == before, "a refused call changed the offloader's state"
    assert (after.pending, after.pinned, after.in_flight) == (0, 0, 0)
    assert [block_bytes(caches, b) for b in range(BLOCKS)] == cache_before, "a refused call wrote the cache"
    assert "new" not in off and off.lookup(STORED) == len(STORED)  # nothing reserved, nothing forgotten
    check_index(off)


def test_the_message_names_the_call_the_position_and_the_type(stored):
    off, _ = stored
    with pytest.raises(TypeError, match=r"^lookup\(\): key 2 has type float; "):
        off.lookup(["a", 1, 2.5])
    with pytest.raises(TypeError, match=r"^store\(\): key 1 is a tuple holding a part of type NoneType; "):
        off.store({"x": 1, ("x", (None,)): 2})
    with pytest.raises(TypeError, match=r"^load\(\): key 0 has type Color; "):
        off.load({Color.RED: 1})
    with pytest.raises(TypeError, match=r"^'in': the key has type int64; "):
        np.int64(1) in off
    with pytest.raises(TypeError, match=r"^discard\(\): key 0 has type Word; .*not subclasses"):
        off.discard([Word("a")])
    assert "a" in off and int(np.int64(3)) in off and str(Word("a")) in off  # converted, they are found


def test_tuples_and_nested_tuples_round_trip_byte_exact():
    rng = random.Random(11)
    caches = random_caches(64, seed=12)
    keys: list[object] = [
        ("req", 1, b"\x00\xff"),
        (("a", 1), (2, (b"b", True)), ()),
        (),
        ((((("deep",),),),),),
        tuple(rng.getrandbits(64) for _ in range(8)),
        ("ünïcode", -(2**70), (b"", ("", 0))),
    ]
    keys += [(rng.randbytes(16), i, (str(i), (i % 3 == 0,))) for i in range(20)]
    src = rng.sample(range(32), len(keys))
    dst = rng.sample(range(32, 64), len(keys))
    with kvoffload.Offloader(caches, host_blocks=len(keys)) as off:
        expected = [block_bytes(caches, s) for s in src]
        result = off.store(dict(zip(keys, src))).result(10)
        assert result.keys == tuple(keys) and result.skipped == ()
        rebuilt = [eval(repr(k)) for k in keys]  # equal, distinct objects
        assert all(a == b and (a is not b or a == ()) for a, b in zip(keys, rebuilt))
        assert off.lookup(rebuilt) == len(keys) and all(k in off for k in rebuilt)
        off.load(dict(zip(rebuilt, dst))).result(10)
        assert [block_bytes(caches, d) for d in dst] == expected
        assert off.store({rebuilt[0]: 0}).result(10).skipped == (rebuilt[0],)
        assert off.discard(rebuilt[:3]) == 3 and not any(k in off for k in keys[:3])
        assert off.lookup(keys[3:]) == len(keys) - 3
        check_index(off)


def test_one_and_true_are_one_key_and_one_point_oh_is_refused():
    caches = random_caches(16, seed=13)
    with kvoffload.Offloader(caches, host_blocks=8) as off:
        assert off.store({1: 2, (0, "x"): 3}).result(10).skipped == ()
        assert off.store({True: 4, (False, "x"): 5}).result(10).skipped == (True, (False, "x"))
        assert True in off and (False, "x") in off and off.lookup([True, 1, (0, "x")]) == 3
        assert off.stats().ready == 2
        off.load({True: 10, (False, "x"): 11}).result(10)
        assert block_bytes(caches, 10) == block_bytes(caches, 2) and block_bytes(caches, 11) == block_bytes(caches, 3)
        for bad in (1.0, (1.0,), (0.0, "x")):
            with pytest.raises(TypeError):
                off.store({bad: 6})
            with pytest.raises(TypeError):
                off.lookup([bad])
            with pytest.raises(TypeError):
                bad in off
        assert off.stats().ready == 2
        assert off.discard([True, (False, "x")]) == 2 and 1 not in off and (0, "x") not in off
        check_index(off)
