"""A disk tier's slots encrypted at rest when the tier is not persistent (``encryption_key=``).

The file holds only ciphertext (AES-256-GCM of each block, a fresh random nonce per write, the
slot number and a random id of this file as associated data); each slot's nonce and tag stay in
this process's memory, since the file dies with it. Encryption and decryption run on the IO
threads (``cryptography`` releases the GIL), through page-aligned memory of their own, so a
host slot being spilled is never encrypted in place. A slot that fails its tag (altered on disk)
fails its batch with ``OSError(EBADMSG)``, and the load with ``TransferError``.

A persistent tier seals its slots itself (:mod:`.persistent_slots`: nonce and tag in each
slot's header page).
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..base.diskfile import IOV_MAX, DiskFile
from ..base.layout import runs
from ..base.sealing import NONCE_BYTES, TAG_BYTES, BadSeal, EncryptionKey

__all__ = ["EncryptedSlots"]

_PAGE = 4096


class EncryptedSlots:
    """IO calls that encrypt rows into a non-persistent disk file's slots and decrypt them back."""

    def __init__(self, file: DiskFile, slots: int, slot_bytes: int, block_bytes: int, key: EncryptionKey) -> None:
        self.file = file
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self.key = key
        self._file_id = os.urandom(16)
        self._nonces = bytearray(slots * NONCE_BYTES)
        self._tags = bytearray(slots * TAG_BYTES)
        """Each slot's nonce and tag, as last written (zeros: never written; its read fails)."""

    def write_calls(self, rows: Sequence[Any], slots: Sequence[int], job_bytes: int) -> list[Callable[[], None]]:
        """Calls writing ``rows[i]`` encrypted to slot ``slots[i]``; consecutive slots share a ``pwritev``."""
        return [functools.partial(self._write, group, rows, slots) for group in self._groups(slots, job_bytes)]

    def read_calls(self, rows: Sequence[Any], slots: Sequence[int], job_bytes: int) -> list[Callable[[], None]]:
        """Calls reading slot ``slots[i]`` into ``rows[i]``, decrypted once its tag verified."""
        return [functools.partial(self._read, group, rows, slots) for group in self._groups(slots, job_bytes)]

    def _groups(self, slots: Sequence[int], job_bytes: int) -> list[range]:
        per_job = max(1, min(job_bytes // self.slot_bytes, IOV_MAX))
        out: list[range] = []
        starts, lengths = runs(list(slots))
        for s, n in zip(starts.tolist(), lengths.tolist()):
            out += [range(j, min(j + per_job, s + n)) for j in range(s, s + n, per_job)]
        return out

    def _scratch(self, n: int) -> list[memoryview]:
        """``n`` page-aligned rows of a slot and a page each (ciphertext, then room for its tag)."""
        stride = self.slot_bytes + _PAGE
        memory = memoryview(mmap.mmap(-1, stride * n))
        return [memory[j * stride : (j + 1) * stride] for j in range(n)]

    def _aad(self, slot: int) -> bytes:
        return self._file_id + slot.to_bytes(8, "little")

    def _write(self, group: range, rows: Sequence[Any], slots: Sequence[int]) -> None:
        scratch = self._scratch(len(group))
        sealed = []
        for n, i in enumerate(group):
            out, slot = scratch[n], slots[i]
            nonce = os.urandom(NONCE_BYTES)
            self.key.encrypt_into(nonce, memoryview(rows[i]).cast("B")[: self.block_bytes], self._aad(slot), out[: self.block_bytes + TAG_BYTES])
            sealed.append((slot, nonce, bytes(out[self.block_bytes : self.block_bytes + TAG_BYTES])))
            out[self.block_bytes : self.slot_bytes] = bytes(self.slot_bytes - self.block_bytes)
        self.file.write([s[: self.slot_bytes] for s in scratch], self.file_offset(slots[group[0]]))
        for slot, nonce, tag in sealed:
            self._nonces[slot * NONCE_BYTES : (slot + 1) * NONCE_BYTES] = nonce
            self._tags[slot * TAG_BYTES : (slot + 1) * TAG_BYTES] = tag

    def _read(self, group: range, rows: Sequence[Any], slots: Sequence[int]) -> None:
        scratch = self._scratch(len(group))
        self.file.read([s[: self.slot_bytes] for s in scratch], self.file_offset(slots[group[0]]))
        for n, i in enumerate(group):
            slot, sealed = slots[i], scratch[n]
            sealed[self.block_bytes : self.block_bytes + TAG_BYTES] = self._tags[slot * TAG_BYTES : (slot + 1) * TAG_BYTES]
            nonce = bytes(self._nonces[slot * NONCE_BYTES : (slot + 1) * NONCE_BYTES])
            try:
                self.key.decrypt_into(nonce, sealed[: self.block_bytes + TAG_BYTES], self._aad(slot), memoryview(rows[i]).cast("B")[: self.block_bytes])
            except BadSeal as e:
                raise OSError(errno.EBADMSG, f"disk slot {slot} of {self.file.path}: {e}") from None

    def file_offset(self, slot: int) -> int:
        return slot * self.slot_bytes
