"""The bytes of a persistent disk tier: file header, slot headers, index checkpoint.

The file (``disk_path``)::

    [file header, padded to data_offset] [slot 0: header page | payload] [slot 1: ...] ...

The file header names the cache identity (its digest and JSON), the slot geometry and an
*epoch*, 16 random bytes drawn when the file was (re)initialised. Slot ``i`` starts at
``data_offset + i * (HEADER_BYTES + slot_bytes)``: one 4096-byte header page, then the payload,
so every O_DIRECT call stays aligned and a slot's header and payload go to disk in one
``pwritev``. A header holds the key, the payload's length and CRC32C, a sequence number (the
order slots were written in) and the *namespace*, a digest of identity and epoch; a page of
zeros (a *tombstone*) marks a slot whose entry was discarded. Headers carry their own CRC32C.

A sealed slot (``remote_secret=``, ``encryption_key=``: :mod:`.sealing`) also carries a *seal* at
the end of its header page: flags (1 signed, 2 encrypted), the signing secret's key id, the
AES-GCM nonce and tag of an encrypted payload, and last an HMAC-SHA256 tag over every byte of the
page before it and the stored payload. The payload's CRC32C is that of the bytes stored (the
ciphertext, when encrypted). A page without a seal reads as unsealed: files written before
sealing existed open as they did, and a sealed tier drops their slots.

The checkpoint (``disk_path + ".checkpoint"``) lists the disk tier's entries, least recently
used first, each with its slot, sequence number and payload CRC, and ends with a CRC32C of the
whole file. It is written to a temporary name and renamed over the last one, so a crash leaves
either the old checkpoint or the new one. All integers are little-endian.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import crc32c

from .sealing import KID_BYTES, MAC_BYTES, NONCE_BYTES, TAG_BYTES

__all__ = [
    "CHECKPOINT_SUFFIX", "ENCRYPTED", "HEADER_BYTES", "SIGNED", "Checkpoint", "CheckpointRecord", "FileHeader", "HeaderDamaged", "SlotHeader",
    "crc32c_of",
]

HEADER_BYTES = 4096
"""One header page per slot (the O_DIRECT alignment)."""

CHECKPOINT_SUFFIX = ".checkpoint"

_FILE_MAGIC = b"KVOFFLD\x01"
_FILE_VERSION = 1
_FILE_FIXED = struct.Struct("<8sIIQQQ16s16sI")  # magic, version, header bytes, slot bytes, slots, data offset, epoch, identity digest, json length
_SLOT_MAGIC = b"KVSLOT\x00\x01"
_SLOT_FIXED = struct.Struct("<8s16sQQII")  # magic, namespace, seq, payload length, payload crc, key length
_CHECKPOINT_MAGIC = b"KVCKPT\x00\x01"
_CHECKPOINT_FIXED = struct.Struct("<8s16sQQB")  # magic, namespace, next seq, records, clean
_RECORD = struct.Struct("<QQII")  # slot, seq, payload crc, key length
_CRC = struct.Struct("<I")
_SEAL_MAGIC = b"KVSEAL\x00\x01"
_SEAL = struct.Struct(f"<8sI{KID_BYTES}s{NONCE_BYTES}s{TAG_BYTES}s")  # magic, flags, key id, nonce, GCM tag; then the MAC
_SEAL_AT = HEADER_BYTES - _SEAL.size - MAC_BYTES
"""Where a slot header page's seal starts (the MAC ends the page)."""
SIGNED, ENCRYPTED = 1, 2
"""Flags of a sealed slot."""
_MAX_FILE_HEADER = 64 << 20
"""The largest file header read (a cache identity of a million tensors is well below)."""


class HeaderDamaged(ValueError):
    """A file header of this format whose bytes do not hold together (checksum, data offset): the
    file is kvoffload's, its contents lost; any other ``ValueError`` of :meth:`FileHeader.parse` says
    the bytes are not a header of this format at all."""


def crc32c_of(data: object) -> int:
    """CRC32C of a buffer (the GIL is released for large ones: call it on an IO thread)."""
    return int(crc32c.crc32c(data))  # type: ignore[arg-type]  # any buffer


@dataclass(frozen=True)
class FileHeader:
    """The first bytes of a persistent disk file."""

    slot_bytes: int
    slots: int
    epoch: bytes
    identity_digest: bytes
    identity_json: str

    @property
    def data_offset(self) -> int:
        """Where slot 0 starts: past the header, rounded up to a page."""
        n = _FILE_FIXED.size + len(self.identity_json.encode()) + _CRC.size
        return -(-n // HEADER_BYTES) * HEADER_BYTES

    def pack(self) -> bytes:
        """The header padded to :attr:`data_offset` bytes."""
        text = self.identity_json.encode()
        body = _FILE_FIXED.pack(
            _FILE_MAGIC, _FILE_VERSION, HEADER_BYTES, self.slot_bytes, self.slots, self.data_offset, self.epoch,
            self.identity_digest, len(text),
        ) + text
        return (body + _CRC.pack(crc32c_of(body))).ljust(self.data_offset, b"\0")

    @staticmethod
    def length(data: bytes) -> int:
        """How many bytes the header starting ``data`` takes (its :attr:`data_offset`), read from its
        fixed part (the first page holds it); ``ValueError`` as :meth:`parse` for foreign bytes. A file
        header of any size is read as: this page, then :meth:`length` bytes, then :meth:`parse`."""
        return int(_check_fixed(data)[5])

    @classmethod
    def parse(cls, data: bytes) -> FileHeader:
        """The header at the start of ``data`` (at least :meth:`length` bytes); ``ValueError`` saying
        what is wrong otherwise."""
        magic, version, header_bytes, slot_bytes, slots, data_offset, epoch, digest, n = _check_fixed(data)
        end = _FILE_FIXED.size + n
        if len(data) < end + _CRC.size or _CRC.unpack_from(data, end)[0] != crc32c_of(data[:end]):
            raise HeaderDamaged("its file header is damaged (checksum)")
        out = cls(slot_bytes, slots, bytes(epoch), bytes(digest), bytes(data[_FILE_FIXED.size : end]).decode())
        if out.data_offset != data_offset:
            raise HeaderDamaged("its file header is damaged (data offset)")
        return out


def _check_fixed(data: bytes) -> tuple[Any, ...]:
    """The fixed part of a file header, checked for what it alone can show."""
    if len(data) < _FILE_FIXED.size or data[:8] != _FILE_MAGIC:
        raise ValueError("not a kvoffload disk file (no file header)")
    fixed = _FILE_FIXED.unpack_from(data)
    version, header_bytes, data_offset, n = fixed[1], fixed[2], fixed[5], fixed[8]
    if version != _FILE_VERSION or header_bytes != HEADER_BYTES:
        raise ValueError(f"written by another version of kvoffload (format {version})")
    if data_offset % HEADER_BYTES or data_offset < _FILE_FIXED.size + n + _CRC.size or data_offset > _MAX_FILE_HEADER:
        raise HeaderDamaged("its file header is damaged (data offset)")
    return fixed


@dataclass(frozen=True)
class SlotHeader:
    """What a slot's header page says about its payload."""

    namespace: bytes
    seq: int
    payload_bytes: int
    payload_crc: int
    key: bytes
    """The encoded key (:func:`~.cache_identity.encode_key`)."""
    flags: int = 0
    """Sealed: :data:`SIGNED`, :data:`ENCRYPTED`, both; 0 for an unsealed slot."""
    kid: bytes = bytes(KID_BYTES)
    nonce: bytes = bytes(NONCE_BYTES)
    tag: bytes = bytes(TAG_BYTES)
    """The AES-GCM tag of an encrypted payload."""
    mac: bytes = bytes(MAC_BYTES)
    """The HMAC-SHA256 tag of a signed slot, over :meth:`signed_part` of its page and the payload."""

    def pack_into(self, page: memoryview) -> None:
        """Write this header over ``page`` (``HEADER_BYTES``, zeroed past the header but for a seal)."""
        body = _SLOT_FIXED.pack(_SLOT_MAGIC, self.namespace, self.seq, self.payload_bytes, self.payload_crc, len(self.key)) + self.key
        end = len(body) + _CRC.size
        page[: len(body)] = body
        page[len(body) : end] = _CRC.pack(crc32c_of(body))
        page[end:] = bytes(len(page) - end)
        if self.flags:
            page[_SEAL_AT : _SEAL_AT + _SEAL.size] = _SEAL.pack(_SEAL_MAGIC, self.flags, self.kid, self.nonce, self.tag)
            page[HEADER_BYTES - MAC_BYTES :] = self.mac

    @staticmethod
    def signed_part(page: memoryview) -> memoryview:
        """What a slot's MAC covers of its header page: every byte before the MAC."""
        return page[: HEADER_BYTES - MAC_BYTES]

    @staticmethod
    def set_mac(page: memoryview, mac: bytes) -> None:
        """Write a signed slot's MAC into its packed ``page``."""
        page[HEADER_BYTES - MAC_BYTES :] = mac

    @classmethod
    def parse(cls, page: bytes | memoryview) -> SlotHeader | None:
        """The header in ``page``, or None for a tombstone, a never-written slot or a damaged header."""
        if bytes(page[:8]) != _SLOT_MAGIC:
            return None
        magic, namespace, seq, payload_bytes, payload_crc, key_len = _SLOT_FIXED.unpack_from(page)
        end = _SLOT_FIXED.size + key_len
        if end + _CRC.size > len(page):
            return None
        if _CRC.unpack_from(page, end)[0] != crc32c_of(page[:end]):
            return None
        seal: tuple[Any, ...] = ()
        if len(page) == HEADER_BYTES and end + _CRC.size <= _SEAL_AT and bytes(page[_SEAL_AT : _SEAL_AT + 8]) == _SEAL_MAGIC:
            _, flags, kid, nonce, tag = _SEAL.unpack_from(page, _SEAL_AT)
            seal = (flags, bytes(kid), bytes(nonce), bytes(tag), bytes(page[HEADER_BYTES - MAC_BYTES :]))
        return cls(bytes(namespace), seq, payload_bytes, payload_crc, bytes(page[_SLOT_FIXED.size : end]), *seal)


@dataclass(frozen=True)
class CheckpointRecord:
    """One entry of a checkpoint: the slot holding ``key``'s payload as written at ``seq``."""

    slot: int
    seq: int
    payload_crc: int
    key: bytes


@dataclass(frozen=True)
class Checkpoint:
    """The disk tier's entries at one moment, least recently used first."""

    namespace: bytes
    next_seq: int
    """The sequence number the next slot write takes."""
    clean: bool
    """Written by a clean close: nothing was written after it."""
    records: tuple[CheckpointRecord, ...]

    def pack(self) -> bytes:
        parts = [_CHECKPOINT_FIXED.pack(_CHECKPOINT_MAGIC, self.namespace, self.next_seq, len(self.records), self.clean)]
        parts += [_RECORD.pack(r.slot, r.seq, r.payload_crc, len(r.key)) + r.key for r in self.records]
        body = b"".join(parts)
        return body + _CRC.pack(crc32c_of(body))

    @classmethod
    def parse(cls, data: bytes) -> Checkpoint:
        """The checkpoint ``data`` holds; ``ValueError`` for a torn, damaged or foreign one."""
        if len(data) < _CHECKPOINT_FIXED.size + _CRC.size or data[:8] != _CHECKPOINT_MAGIC:
            raise ValueError("not a kvoffload checkpoint")
        if _CRC.unpack_from(data, len(data) - _CRC.size)[0] != crc32c_of(memoryview(data)[: -_CRC.size]):
            raise ValueError("the checkpoint is torn or damaged (checksum)")
        _, namespace, next_seq, count, clean = _CHECKPOINT_FIXED.unpack_from(data)
        end = len(data) - _CRC.size
        if count > (end - _CHECKPOINT_FIXED.size) // _RECORD.size:
            raise ValueError(f"the checkpoint is damaged (it claims {count} records)")
        records: list[CheckpointRecord] = []
        at = _CHECKPOINT_FIXED.size
        for _ in range(count):
            if at + _RECORD.size > end:
                raise ValueError("the checkpoint is damaged (a record runs past its end)")
            slot, seq, crc, key_len = _RECORD.unpack_from(data, at)
            at += _RECORD.size
            records.append(CheckpointRecord(slot, seq, crc, bytes(data[at : at + key_len])))
            at += key_len
        if at != end:
            raise ValueError("the checkpoint is damaged (length)")
        return cls(bytes(namespace), next_seq, bool(clean), tuple(records))

