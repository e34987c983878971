"""What a remote value holds and what a remote key is called.

A value is a header, then the block's bytes (the payload)::

    offset  size  field
    0       4     magic b"KVOR"
    4       2     format version (1), little-endian like every field
    6       2     header length: these 44 bytes plus the encoded key
    8       16    identity digest (CacheIdentity.digest)
    24      2     encoded key length
    26      2     flags (0; a reader of version 1 rejects any other)
    28      8     payload length
    36      4     CRC32C of the payload
    40      4     CRC32C of bytes 0-39 and the encoded key
    44      n     the encoded key (cache_identity.encode_key)
    44+n    ...   the payload

A value read back is checked before any of its bytes are handed on: its length (a truncated or
extended value), the header's own checksum, the identity, the key it was stored under, the
payload's length and checksum. Anything else (a foreign value, a half-written one, a value of
another cache or another key that a bug or an operator put there) is rejected as a
:class:`BadValue`, which the stores count and report as a miss. Nothing is pickled.

Remote key names: ``<namespace>:v1:<identity digest, hex>:{<16 hex digits of a hash of the key>}``
followed by the encoded key's bytes. The digest keeps caches of different models, geometries or
ranks apart; the braces are a Redis Cluster hash tag, so keys spread evenly over the slots whatever
braces the encoded key itself contains (a str key ``"{req}-3"`` would otherwise hash only
``req``).
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, cast

import crc32c
import numpy as np

from ...base.cache_identity import MAX_KEY_BYTES

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .store_protocol import BlockBuffer

__all__ = [
    "BadValue", "DIGEST_BYTES", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "byte_view", "check_namespace", "copy_bytes", "key_name",
    "name_prefix", "pack_header", "pack_value", "pack_value_into", "unpack_value", "value_bytes",
]

MAGIC = b"KVOR"
FORMAT_VERSION = 1
DIGEST_BYTES = 16
_FIXED = struct.Struct("<4sHH16sHHQI")  # every field before the header's own CRC
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIXED.size + _CRC.size
"""The fixed part of the header; the encoded key follows it."""


class BadValue(ValueError):
    """A value that is not a valid block of this cache under this key; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _crc(data: Buffer, value: int = 0) -> int:
    return int(crc32c.crc32c(data, value))


def byte_view(buffer: BlockBuffer) -> memoryview:
    """``buffer`` as a flat memoryview of bytes (no copy); ``TypeError`` unless it is C-contiguous."""
    return memoryview(cast("Buffer", buffer)).cast("B")


def pack_header(digest: bytes, key: bytes, payload_bytes: int, payload_crc: int) -> bytes:
    """The header of a value holding ``payload_bytes`` whose CRC32C is ``payload_crc``."""
    _check_digest(digest)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"an encoded key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES + len(key), digest, len(key), 0, payload_bytes, payload_crc)
    return fixed + _CRC.pack(_crc(key, _crc(fixed))) + key


def pack_value(digest: bytes, key: bytes, payload: BlockBuffer) -> bytes:
    """Header and payload as one ``bytes`` (what is stored)."""
    view = byte_view(payload)
    return b"".join((pack_header(digest, key, view.nbytes, _crc(view)), view))


def value_bytes(key: bytes, payload_bytes: int) -> int:
    """The length of the value holding ``payload_bytes`` under the encoded ``key``."""
    return HEADER_BYTES + len(key) + payload_bytes


def pack_value_into(out: memoryview, digest: bytes, key: bytes, payload: memoryview) -> None:
    """Header and payload written into ``out``, exactly :func:`value_bytes` long (a byte view).
    Releases the GIL while it checksums and copies the payload."""
    header = pack_header(digest, key, payload.nbytes, _crc(payload))
    out[: len(header)] = header
    copy_bytes(out[len(header):], payload)


def copy_bytes(out: memoryview, data: memoryview) -> None:
    """Copy ``data`` into ``out`` (byte views of one length), releasing the GIL for large copies."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(data, np.uint8))


def unpack_value(value: Buffer, digest: bytes, key: bytes) -> memoryview:
    """The payload of ``value`` (a view of it, no copy) once every check passed; :class:`BadValue` otherwise."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise BadValue(f"{view.nbytes} bytes, shorter than a header")
    magic, version, header_bytes, their_digest, key_bytes, flags, payload_bytes, payload_crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BadValue("not a kvoffload value (no magic)")
    if version != FORMAT_VERSION or flags != 0:
        raise BadValue(f"format version {version} flags {flags:#x}; this reader knows version {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES + key_bytes or view.nbytes < header_bytes:
        raise BadValue("header length does not match its key length, or the value is shorter than its header")
    (header_crc,) = _CRC.unpack_from(view, _FIXED.size)
    if header_crc != _crc(view[HEADER_BYTES:header_bytes], _crc(view[:_FIXED.size])):
        raise BadValue("header checksum mismatch")
    if their_digest != digest:
        raise BadValue("value of another cache identity")
    if view[HEADER_BYTES:header_bytes] != key:
        raise BadValue("value stored under another key")
    payload = view[header_bytes:]
    if payload.nbytes != payload_bytes:
        raise BadValue(f"payload of {payload.nbytes} bytes, the header says {payload_bytes}: truncated or extended")
    if _crc(payload) != payload_crc:
        raise BadValue("payload checksum mismatch")
    return payload


def check_namespace(namespace: str) -> bytes:
    """``namespace`` as the bytes that start every key name; ``ValueError`` unless it is a non-empty
    ASCII name without braces, colons or whitespace."""
    if not namespace or not namespace.isascii() or any(c in namespace for c in "{}: \t\r\n"):
        raise ValueError(f"a remote namespace is a non-empty ASCII name without braces, colons or spaces, got {namespace!r}")
    return namespace.encode()


def key_name(prefix: bytes, key: bytes) -> bytes:
    """The remote key name of the encoded ``key`` under ``prefix`` (see :func:`name_prefix`)."""
    tag = hashlib.blake2b(key, digest_size=8).hexdigest().encode()
    return b"".join((prefix, b"{", tag, b"}", key))


def name_prefix(namespace: bytes, digest: bytes) -> bytes:
    """What every key name of the cache ``digest`` starts with: ``<namespace>:v1:<digest hex>:``."""
    _check_digest(digest)
    return b"%s:v%d:%s:" % (namespace, FORMAT_VERSION, digest.hex().encode())


def _check_digest(digest: bytes) -> None:
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise ValueError(f"an identity digest is {DIGEST_BYTES} bytes (CacheIdentity.digest), got {digest!r}")
