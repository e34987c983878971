"""The keys the offloader takes, checked once at each public call, before anything is done.

A key is a ``bytes``, ``str`` or ``int`` (a ``bool`` is the int it equals: ``True`` and ``1`` are
one key), or a tuple of keys, nested tuples included: exactly these types, not subclasses (an
``IntEnum`` member is refused). Their hashing and equality are the interpreter's own, so no caller
code runs inside the offloader and the index finds a key by one dict lookup under its lock
(docs/design.md, *Native keys only*).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from itertools import chain

__all__ = ["NATIVE_KEY_TYPES", "TUPLES", "check_key", "check_keys", "key_list"]

NATIVE_KEY_TYPES = frozenset({bytes, str, int, bool})
"""The types a key (or each part of a tuple key, at any depth) may have."""
TUPLES = frozenset({tuple})
"""A tuple key's type (its parts are checked too)."""


def check_keys(call: str, keys: Iterable[object]) -> None:
    """``TypeError`` naming ``call`` unless every one of ``keys`` is a native key. ``keys``: a list or
    a mapping (its keys), iterated more than once. The common cases cost a type test per key at C
    speed, without hashing anything: all bytes, say, or all tuples of native keys."""
    if NATIVE_KEY_TYPES.issuperset(map(type, keys)):
        return
    if TUPLES.issuperset(map(type, keys)) and NATIVE_KEY_TYPES.issuperset(map(type, chain.from_iterable(keys))):  # type: ignore[arg-type]  # tuples
        return
    for i, key in enumerate(keys):
        bad = _not_native(key)
        if bad is not None:
            raise TypeError(_refusal(f"{call}: key {i}", key, bad))


def check_key(call: str, key: object) -> None:
    """:func:`check_keys` of one key."""
    bad = _not_native(key)
    if bad is not None:
        raise TypeError(_refusal(f"{call}: the key", key, bad))


def key_list(call: str, keys: Iterable[Hashable]) -> list[Hashable]:
    """``keys`` (an iterable of keys) as a list, each checked (:func:`check_keys`). ``TypeError`` for a
    ``str``, ``bytes``, ``bytearray`` or ``memoryview``, which would be taken character by character."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(
            f"{call} takes an iterable of keys, got a {type(keys).__name__}, which would be taken character by "
            f"character: pass [key] for one key"
        )
    out = list(keys)
    check_keys(call, out)
    return out


def _not_native(key: object) -> type | None:
    """None if ``key`` is a native key; else the type that is not native (the key's, or a part's)."""
    t = type(key)
    if t in NATIVE_KEY_TYPES:
        return None
    parts = [key]
    while parts:  # a loop, not a recursion: any depth of nesting is checked
        part = parts.pop()
        t = type(part)
        if t is tuple:
            parts.extend(part)  # type: ignore[arg-type]  # a tuple
        elif t not in NATIVE_KEY_TYPES:
            return t
    return None


def _refusal(what: str, key: object, bad: type) -> str:
    """The message for a key that is not native; runs none of the key's code (no ``repr``)."""
    held = f"is a tuple holding a part of type {bad.__qualname__}" if type(key) is tuple else f"has type {bad.__qualname__}"
    return (
        f"{what} {held}; keys are bytes, str or int (a bool is the int it equals), or tuples of such "
        "keys (nested tuples too): exactly these types, not subclasses (an IntEnum member is refused). "
        "Convert the key first: int(k) for a numpy integer or an enum member, str(k) or bytes(k) for a "
        "subclass, or encode its parts into bytes or a str (a hash of a dataclass's fields, say)"
    )
