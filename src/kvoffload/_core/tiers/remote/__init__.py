"""The remote tier's engines: a small async interface (:class:`RemoteStore`) and its engine on the
Redis protocol (:class:`RedisStore`), with the value format they share.

``RedisStore`` is imported on first use: redis-py is an optional dependency (``kvoffload[redis]``),
and ``import kvoffload`` must work without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .store_protocol import RemoteCounters, RemoteRefusedError, RemoteStore, RemoteUnavailableError
from .value_format import BadValue, key_name, name_prefix, pack_value, unpack_value, unpack_value_into

__all__ = [
    "BadValue", "RedisStore", "RemoteCounters", "RemoteRefusedError", "RemoteStore", "RemoteUnavailableError", "key_name", "name_prefix",
    "pack_value", "unpack_value", "unpack_value_into",
]

if TYPE_CHECKING:
    from .redis_store import RedisStore


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from .redis_store import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
