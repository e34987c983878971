"""What a stored block means outside this process: the cache identity and the key encoding.

A block's bytes are only meaningful to a cache of the same geometry (tensors, dtypes, the shape
of one block in each, how a block's pieces pack into a slot) computing the same model. Tiers that
outlive the process or are shared with other processes (the persistent disk file, a remote
store) tag what they write with the :class:`CacheIdentity`'s digest and encode keys with
:func:`encode_key`, so a block is only ever found again under the same key by a cache of the same
identity. Keys are ``bytes``, ``str`` or ``int``: encoded by value, never pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

from .layout import BlockLayout

__all__ = ["CacheIdentity", "MAX_KEY_BYTES", "decode_key", "encode_key"]

MAX_KEY_BYTES = 1024
"""The longest encoded key a shared or persistent tier takes (a type tag and the value's bytes)."""

_BYTES, _STR, _INT = b"b", b"s", b"i"


def encode_key(key: Hashable) -> bytes:
    """``key`` as bytes: a one-byte type tag, then the value (``bytes`` as is, ``str`` as UTF-8,
    ``int`` as signed big-endian; ``bool`` as the int it equals, as the index treats it).

    ``TypeError`` for any other type (tuples included: join their parts into bytes or a str);
    ``ValueError`` for a key longer than :data:`MAX_KEY_BYTES` encoded, or a str that is not valid
    Unicode (a lone surrogate)."""
    if isinstance(key, bytes):
        out = _BYTES + key
    elif isinstance(key, str):
        try:
            out = _STR + key.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"key {key!r} cannot be encoded as UTF-8: {e.reason}") from None
    elif isinstance(key, int):
        n = int(key)
        out = _INT + n.to_bytes((n + (n < 0)).bit_length() // 8 + 1, "big", signed=True)
    else:
        raise TypeError(
            f"keys of a persistent or shared tier are bytes, str or int, got {type(key).__name__}: "
            "encode the key's parts into bytes or a str (a prefix hash, say)"
        )
    if len(out) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(out) - 1} bytes is longer than {MAX_KEY_BYTES - 1} bytes: store a hash of it instead")
    return out


def decode_key(data: bytes) -> bytes | str | int:
    """The key :func:`encode_key` encoded as ``data``; ``ValueError`` if ``data`` is not one."""
    tag, value = data[:1], data[1:]
    if tag == _BYTES:
        return bytes(value)
    if tag == _STR:
        return bytes(value).decode("utf-8")  # UnicodeDecodeError is a ValueError
    if tag == _INT and value:
        return int.from_bytes(value, "big", signed=True)
    raise ValueError(f"not an encoded key: {bytes(data[:16])!r}")


@dataclass(frozen=True)
class CacheIdentity:
    """The facts a stored block's meaning depends on, and their digest.

    ``tensors``: each cache tensor's name, dtype and the shape of one block in it; ``pieces``:
    where each piece of a block goes in a slot; ``slot_bytes``; ``fingerprint``: the caller's
    model identity (weights hash, name and revision); ``shard``: which shard of a sharded cache
    (a tensor-parallel rank), if any; ``namespace``: the tenant (``namespace=``), if any, so that
    caches of different tenants never share a block whatever their keys.

    An identity without a namespace digests as it did before namespaces existed (the field is
    left out of its JSON), so persistent files and remote values written then are found again.
    """

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    pieces: tuple[tuple[str, int, int, tuple[int, ...]], ...]
    slot_bytes: int
    fingerprint: str
    shard: str = ""
    namespace: str = ""

    @classmethod
    def of(
        cls, kv_caches: Mapping[str, torch.Tensor], layout: BlockLayout, fingerprint: str | bytes | None = None, shard: str = "",
        namespace: str = "",
    ) -> CacheIdentity:
        """The identity of ``kv_caches`` (described by ``layout``) computing the model ``fingerprint``."""
        fp = fingerprint.hex() if isinstance(fingerprint, bytes) else (fingerprint or "")
        return cls(
            tensors=tuple((name, str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape[1:])) for name, t in kv_caches.items()),
            pieces=tuple((p.name, p.offset, p.nbytes, tuple(p.index)) for p in layout.pieces),
            slot_bytes=layout.slot_bytes,
            fingerprint=fp,
            shard=shard,
            namespace=namespace,
        )

    def to_json(self) -> str:
        """A canonical JSON text of the identity (what :attr:`digest` hashes; stored beside the data)."""
        fields: dict[str, object] = {
            "tensors": self.tensors, "pieces": self.pieces, "slot_bytes": self.slot_bytes, "fingerprint": self.fingerprint, "shard": self.shard,
        }
        if self.namespace:
            fields["namespace"] = self.namespace
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> CacheIdentity:
        """The identity :meth:`to_json` wrote; ``ValueError`` for anything else."""
        try:
            d = json.loads(text)
            return cls(
                tensors=tuple((str(n), str(dt), tuple(int(x) for x in shape)) for n, dt, shape in d["tensors"]),
                pieces=tuple((str(n), int(o), int(b), tuple(int(x) for x in ix)) for n, o, b, ix in d["pieces"]),
                slot_bytes=int(d["slot_bytes"]), fingerprint=str(d["fingerprint"]), shard=str(d["shard"]),
                namespace=str(d.get("namespace", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a cache identity: {e}") from None

    @property
    def digest(self) -> bytes:
        """16 bytes naming this identity (BLAKE2b of :meth:`to_json`)."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=16).digest()

    def differences(self, other: CacheIdentity) -> list[str]:
        """What differs from ``other``, for people: ``["fingerprint: 'llama-a' here, 'llama-b' there"]``."""
        out = []
        for name in ("tensors", "pieces", "slot_bytes", "fingerprint", "shard", "namespace"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: {_short(mine)} here, {_short(theirs)} there")
        return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
