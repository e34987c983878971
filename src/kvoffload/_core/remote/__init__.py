"""The remote tier's engines: a small async interface (:class:`RemoteStore`) and its engine on the
Redis protocol (:class:`RedisStore`), with the value format they share."""

from .redis_store import RedisStore
from .store_protocol import RemoteCounters, RemoteStore, RemoteUnavailableError
from .value_format import BadValue, key_name, name_prefix, pack_value, unpack_value

__all__ = [
    "BadValue", "RedisStore", "RemoteCounters", "RemoteStore", "RemoteUnavailableError", "key_name", "name_prefix", "pack_value",
    "unpack_value",
]
