"""What a remote value holds and what a remote key is called.

A value is a header, then the block's bytes (the payload)::

    offset  size  field
    0       4     magic b"KVOR"
    4       2     format version (1), little-endian like every field
    6       2     header length: these 44 bytes, the encoded key and the seal
    8       16    identity digest (CacheIdentity.digest)
    24      2     encoded key length
    26      2     flags: 1 signed (a MAC), 2 encrypted; 0 for neither (a reader that knows
                  no sealing rejects any other)
    28      8     payload length (the block's bytes)
    36      4     CRC32C of the body (what follows the header)
    40      4     CRC32C of bytes 0-39, the encoded key and the seal's key id and nonce
    44      n     the encoded key (cache_identity.encode_key)
    44+n    48    the seal, when flags are not 0: key id of the signing secret (4, zeros when
                  unsigned), AES-GCM nonce (12, zeros when not encrypted), HMAC-SHA256 tag (32,
                  zeros when unsigned) over every header byte before it and the body
    ...     ...   the body: the payload, or, encrypted, its AES-256-GCM ciphertext and tag (16)
                  with the identity digest and the encoded key as associated data

With a :class:`~...base.sealing.Sealer` (``remote_secret=``, ``encryption_key=``), a value is
written sealed and a value read must be sealed the same way: a reader with a secret refuses
values that are unsigned, signed by a secret it does not hold or whose tag does not match; a
reader with a key refuses plaintext values and values that fail decryption.

A value read back is checked before any of its bytes are handed on: its length (a truncated or
extended value), the header's own checksum, the identity, the key it was stored under, the
payload's length and checksum, then its seal: the MAC before a byte is copied out, decryption
into the caller's buffer last. Anything else (a foreign value, a half-written one, a value of
another cache or another key that a bug or an operator put there, a forged one) is rejected as a
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
from ...base.sealing import KID_BYTES, MAC_BYTES, NONCE_BYTES, TAG_BYTES, BadSeal, Sealer

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from .store_protocol import BlockBuffer

__all__ = [
    "BadValue", "DIGEST_BYTES", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "byte_view", "check_namespace", "copy_bytes", "key_name",
    "name_prefix", "pack_header", "pack_value", "pack_value_into", "unpack_value", "unpack_value_into", "value_bytes",
]

MAGIC = b"KVOR"
FORMAT_VERSION = 1
DIGEST_BYTES = 16
_FIXED = struct.Struct("<4sHH16sHHQI")  # every field before the header's own CRC
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIXED.size + _CRC.size
"""The fixed part of the header; the encoded key follows it."""
SIGNED, ENCRYPTED = 1, 2
"""Flags of a sealed value."""
SEAL_BYTES = KID_BYTES + NONCE_BYTES + MAC_BYTES
_NO_KID, _NO_NONCE, _NO_MAC = bytes(KID_BYTES), bytes(NONCE_BYTES), bytes(MAC_BYTES)
_PURPOSE = b"kvoffload remote value\0"
"""What a value's MAC starts with (no tag of another kind of record is ever a value's)."""


class BadValue(ValueError):
    """A value that is not a valid block of this cache under this key; ``reason`` says why,
    ``cause`` in a short fixed phrase (what the stores log once per cause)."""

    def __init__(self, reason: str, cause: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.cause = cause or reason

    @property
    def security(self) -> bool:
        """The value failed its seal (forged, altered, unsigned or of another key): worth an operator's look."""
        return self.cause in _SECURITY_CAUSES


_SECURITY_CAUSES = {"unknown secret", "MAC mismatch", "decryption failed", "unsealed value", "sealed differently"}


def flags_of(sealer: Sealer | None) -> int:
    """The flags of the values ``sealer`` writes."""
    if sealer is None:
        return 0
    return (SIGNED if sealer.secrets is not None else 0) | (ENCRYPTED if sealer.key is not None else 0)


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


def pack_value(digest: bytes, key: bytes, payload: BlockBuffer, sealer: Sealer | None = None) -> bytes:
    """Header and payload as one ``bytes`` (what is stored), sealed by ``sealer`` if given."""
    view = byte_view(payload)
    out = bytearray(value_bytes(key, view.nbytes, sealer))
    pack_value_into(memoryview(out), digest, key, view, sealer)
    return bytes(out)


def value_bytes(key: bytes, payload_bytes: int, sealer: Sealer | None = None) -> int:
    """The length of the value holding ``payload_bytes`` under the encoded ``key``, sealed by ``sealer``."""
    flags = flags_of(sealer)
    return HEADER_BYTES + len(key) + (SEAL_BYTES if flags else 0) + payload_bytes + (TAG_BYTES if flags & ENCRYPTED else 0)


def pack_value_into(out: memoryview, digest: bytes, key: bytes, payload: memoryview, sealer: Sealer | None = None) -> None:
    """Header and payload written into ``out``, exactly :func:`value_bytes` long (a byte view),
    sealed by ``sealer``. Releases the GIL while it encrypts, checksums, signs and copies the payload."""
    flags = flags_of(sealer)
    if not flags:
        header = pack_header(digest, key, payload.nbytes, _crc(payload))
        out[: len(header)] = header
        copy_bytes(out[len(header):], payload)
        return
    assert sealer is not None
    _check_digest(digest)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"an encoded key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
    header_bytes = HEADER_BYTES + len(key) + SEAL_BYTES
    body = out[header_bytes:]
    nonce = _NO_NONCE
    if sealer.key is not None:
        nonce = sealer.nonce()
        sealer.key.encrypt_into(nonce, payload, digest + key, body)
    else:
        copy_bytes(body, payload)
    kid = sealer.secrets.signing_kid if sealer.secrets is not None else _NO_KID
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, header_bytes, digest, len(key), flags, payload.nbytes, _crc(body))
    head = fixed + _CRC.pack(_crc(nonce, _crc(kid, _crc(key, _crc(fixed))))) + key + kid + nonce
    out[: len(head)] = head
    tag = sealer.secrets.sign((_PURPOSE, head, body)) if sealer.secrets is not None else _NO_MAC
    out[len(head) : header_bytes] = tag


def copy_bytes(out: memoryview, data: memoryview) -> None:
    """Copy ``data`` into ``out`` (byte views of one length), releasing the GIL for large copies."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(data, np.uint8))


def unpack_value_into(value: Buffer, digest: bytes, key: bytes, out: memoryview, sealer: Sealer | None = None) -> None:
    """Check ``value`` (against ``sealer`` too: see the module docstring), then copy or decrypt its
    payload into ``out`` (a writable byte view exactly as long as the block); :class:`BadValue`
    otherwise (``out`` then holds unspecified bytes, and nothing unchecked was copied into it but
    by a decryption that failed)."""
    flags = flags_of(sealer)
    if not flags:
        payload = unpack_value(value, digest, key)
        if payload.nbytes != out.nbytes:
            raise BadValue(f"a block of {payload.nbytes} bytes for a buffer of {out.nbytes}", "wrong size")
        copy_bytes(out, payload)
        return
    assert sealer is not None
    view = memoryview(value).cast("B")
    head, body, their_flags, payload_bytes = _checked(view, digest, key)
    if their_flags != flags:
        if not their_flags:
            raise BadValue("an unsealed value where this reader needs them sealed", "unsealed value")
        raise BadValue(f"sealed with flags {their_flags:#x}, this reader seals with {flags:#x}", "sealed differently")
    kid_at = len(head) - SEAL_BYTES
    kid, nonce, tag = head[kid_at : kid_at + KID_BYTES], head[kid_at + KID_BYTES : kid_at + KID_BYTES + NONCE_BYTES], head[-MAC_BYTES:]
    try:
        if sealer.secrets is not None:
            sealer.secrets.check(bytes(kid), bytes(tag), (_PURPOSE, head[:-MAC_BYTES], body))
        if payload_bytes != out.nbytes:
            raise BadValue(f"a block of {payload_bytes} bytes for a buffer of {out.nbytes}", "wrong size")
        if sealer.key is not None:
            sealer.key.decrypt_into(bytes(nonce), body, digest + key, out)
        else:
            copy_bytes(out, body)
    except BadSeal as e:
        raise BadValue(str(e), e.cause) from None


def _checked(view: memoryview, digest: bytes, key: bytes) -> tuple[memoryview, memoryview, int, int]:
    """A value's header and body, its flags and payload length, once its structure, checksums,
    identity and key were checked (its seal not yet)."""
    if view.nbytes < HEADER_BYTES:
        raise BadValue(f"{view.nbytes} bytes, shorter than a header", "too short")
    magic, version, header_bytes, their_digest, key_bytes, flags, payload_bytes, body_crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise BadValue("not a kvoffload value (no magic)", "no magic")
    if version != FORMAT_VERSION or flags & ~(SIGNED | ENCRYPTED):
        raise BadValue(f"format version {version} flags {flags:#x}; this reader knows version {FORMAT_VERSION}", "unknown format")
    seal = SEAL_BYTES if flags else 0
    if header_bytes != HEADER_BYTES + key_bytes + seal or view.nbytes < header_bytes:
        raise BadValue("header length does not match its key length, or the value is shorter than its header", "bad header")
    (header_crc,) = _CRC.unpack_from(view, _FIXED.size)
    crc = _crc(view[HEADER_BYTES : header_bytes - (MAC_BYTES if flags else 0)], _crc(view[: _FIXED.size]))
    if header_crc != crc:
        raise BadValue("header checksum mismatch", "header checksum")
    if their_digest != digest:
        raise BadValue("value of another cache identity", "another identity")
    if view[HEADER_BYTES : HEADER_BYTES + key_bytes] != key:
        raise BadValue("value stored under another key", "another key")
    body = view[header_bytes:]
    if body.nbytes != payload_bytes + (TAG_BYTES if flags & ENCRYPTED else 0):
        raise BadValue(f"payload of {body.nbytes} bytes, the header says {payload_bytes}: truncated or extended", "wrong length")
    if _crc(body) != body_crc:
        raise BadValue("payload checksum mismatch", "payload checksum")
    return view[:header_bytes], body, flags, payload_bytes


def unpack_value(value: Buffer, digest: bytes, key: bytes) -> memoryview:
    """The payload of an unsealed ``value`` (a view of it, no copy) once every check passed;
    :class:`BadValue` otherwise (a sealed value included: see :func:`unpack_value_into`)."""
    view = memoryview(value).cast("B")
    _, body, flags, _ = _checked(view, digest, key)
    if flags:
        raise BadValue(f"a sealed value (flags {flags:#x}) where this reader takes unsealed ones", "sealed differently")
    return body


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
