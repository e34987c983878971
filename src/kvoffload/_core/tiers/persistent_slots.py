"""The persistent disk tier's slots: headers written with every payload, checked on every read,
checkpoints of the index, and the rebuild of the index when a file is reopened.

Formats: :mod:`..persistent_format`. What holds, and why:

- A slot's header and payload go to disk in one ``pwritev`` (header page first), so a process
  killed at any moment leaves each slot as it was or as it was written: a write is never half
  visible to a later reopen. Where the device itself tears a write (power loss), the payload's
  CRC32C no longer matches: slots a reopen cannot vouch for are checked (below), and
  ``verify=True`` checks every slot read.
- A discarded entry's header is overwritten with zeros (a tombstone) at once, so it never comes
  back after a restart; an evicted one needs none (its bytes were still right for its key, and its
  slot is rewritten by the store that evicted it).
- Every read checks the slot's header against what this process wrote or found there (key and
  sequence number): a slot whose bytes are not the entry's is never loaded (``OSError(EBADMSG)``:
  the load fails, the entry is dropped).
- A checkpoint lists the entries, least recently used first, with each slot's sequence number and
  CRC. On reopen, every header is read; a header that matches its checkpoint record is trusted;
  any other valid header (a slot written after the last checkpoint) is trusted only once its
  payload's CRC32C verifies. Of two slots with one key the later one counts.
- Sealed (``remote_secret=``, ``encryption_key=``): every slot written is signed (HMAC-SHA256 over
  its header page and stored payload) and/or encrypted (AES-256-GCM, a nonce per write, the file's
  namespace, the sequence number and the key as associated data), on the IO thread that writes
  it; every read checks the MAC before the payload is handed on, then decrypts it. A slot that
  fails is dropped as a damaged one is (``OSError(EBADMSG)``, counted in ``checksum_failures``):
  a slot another process wrote without the secret is never loaded. A reopen drops every slot not
  sealed as this tier seals (a file written before, or with other options), so it starts over.
- Checkpoints are written by an IO thread every :data:`CHECKPOINT_INTERVAL_S` while anything
  changed, and at close. Their cost is building the record list (Python) and one sequential
  write, so they run whole on an IO thread: an async file API (aiofiles) would only move the
  write itself off a loop, not the work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import glob
import hashlib
import itertools
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from ..base.cache_identity import CacheIdentity, decode_key, encode_key
from ..base.errors import OffloadError
from ..base.diskfile import IOV_MAX, DiskFile
from ..base.layout import runs
from ..base.persistent_format import (
    CHECKPOINT_SUFFIX, ENCRYPTED, HEADER_BYTES, SIGNED, Checkpoint, CheckpointRecord, FileHeader, HeaderDamaged, SlotHeader, crc32c_of,
)
from ..base.sealing import KID_BYTES, TAG_BYTES, BadSeal, Sealer

__all__ = ["CHECKPOINT_INTERVAL_S", "PersistentSlots", "Recovered"]

log = logging.getLogger("kvoffload")

CHECKPOINT_INTERVAL_S = 5.0
"""Seconds between background checkpoints (written only when something changed)."""


_VOIDS_PER_JOB = 64
"""Header voids an IO thread makes in one go when many slots are voided at once."""
_PURPOSE = b"kvoffload disk slot\0"
"""What a slot's MAC starts with (no tag of another kind of record is ever a slot's)."""


@dataclass(frozen=True)
class Recovered:
    """What a reopen found: the entries (``(key, slot)``, least recently used first) and how many
    slots it dropped because their header or checksum did not verify."""

    entries: list[tuple[Hashable, int]]
    dropped: int
    reason: str
    """Why the file was started empty, or ``""`` if its entries were kept."""


class PersistentSlots:
    """Slot headers, checks and checkpoints of one persistent disk file (see the module docstring).

    Thread-safe: IO threads write and read slots, the worker loops plan them, the caller discards.
    """

    def __init__(
        self, file: DiskFile, slots: int, slot_bytes: int, block_bytes: int, identity: CacheIdentity, *, verify: bool,
        sealer: Sealer | None = None,
    ) -> None:
        self.file = file
        self.sealer = sealer if sealer is not None else Sealer()
        self.flags = (SIGNED if self.sealer.secrets is not None else 0) | (ENCRYPTED if self.sealer.key is not None else 0)
        """What every slot of this tier is sealed with (:mod:`..base.persistent_format`)."""
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.block_bytes = block_bytes
        self.identity = identity
        self.verify = verify
        self.stride = HEADER_BYTES + slot_bytes
        self.header = _new_header(slots, slot_bytes, identity)
        self.namespace = b""
        self._written: dict[int, tuple[int, int, bytes]] = {}
        """Slot -> (sequence number, payload CRC32C, encoded key) of what it holds, as written or found."""
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        """Guards the slot sets below; never held across IO (the index calls :meth:`forget` under its lock)."""
        self._slot_io_ended = threading.Condition(self._lock)
        """Notified when a slot leaves :attr:`_voiding`."""
        self._writing: set[int] = set()
        """Slots an IO thread is writing now (a tombstone never lands on them meanwhile)."""
        self._voiding: set[int] = set()
        """Slots whose header is being voided now (a write of them waits for it)."""
        self._tombstones: list[int] = []
        """Slots whose headers are to be voided (:meth:`forget`)."""
        self._tombstoning = False
        self._pool: Executor | None = None
        self._changes = 0
        """Slot writes and tombstones so far (a checkpoint is due when this moved)."""
        self._checkpointed = -1
        self._checkpoint_lock = threading.Lock()
        """Held while a checkpoint is written: one at a time, none after the clean one of close."""
        self._closed = False
        self.checksum_failures = 0
        self.on_bad_slot: Callable[[int], object] = lambda slot: None
        """Called (on an IO thread) with a slot whose header or checksum failed a read: drop its entry."""

    # -- geometry ------------------------------------------------------------------

    def offset(self, slot: int) -> int:
        """Where slot ``slot``'s header page starts in the file."""
        return self.header.data_offset + slot * self.stride

    @property
    def file_bytes(self) -> int:
        """The file's size: its header, then every slot's header page and payload."""
        return self.header.data_offset + self.slots * self.stride

    @staticmethod
    def file_bytes_of(slots: int, slot_bytes: int, identity: CacheIdentity) -> int:
        """:attr:`file_bytes` of a file of ``slots`` slots of ``slot_bytes`` for ``identity``."""
        return _new_header(slots, slot_bytes, identity).data_offset + slots * (HEADER_BYTES + slot_bytes)

    # -- open ----------------------------------------------------------------------

    def open(self, pool: Executor) -> Recovered:
        """Use the file: rebuild the entries of a reopened one whose identity matches; start a new
        one, one never initialised (all zeros) or one whose header is damaged empty (logging why).
        A file of another cache identity, another format or not kvoffload's is refused with
        :class:`~..base.errors.OffloadError` and left exactly as it was. IO runs on ``pool``."""
        self._pool = pool
        found: FileHeader | None = None
        reason = "new file"
        if self.file.existed:
            first = self.file.read_bytes(0, HEADER_BYTES)
            reason = "it was never initialised" if not any(first) else ""
            try:
                if not reason:
                    n = FileHeader.length(first)
                    found = FileHeader.parse(first if n <= HEADER_BYTES else self.file.read_bytes(0, n))
            except HeaderDamaged as e:  # kvoffload's file, its header lost: started empty below
                reason = str(e)
            except (ValueError, UnicodeDecodeError) as e:
                raise OffloadError(
                    f"disk_path {self.file.path!r} is not a persistent disk file kvoffload can use ({e}); it was left "
                    "as it is: remove it or choose another disk_path"
                ) from None
            if found is not None:
                mismatch = self._mismatch(found)
                if mismatch:
                    raise OffloadError(
                        f"disk_path {self.file.path!r} holds the persistent cache of another cache identity ({mismatch}); "
                        "it was left as it is: give that identity, choose another disk_path (a directory gives each "
                        "cache identity a file of its own), or remove the file to start it anew"
                    )
        if found is None:
            if self.file.existed:
                log.warning("kvoffload: %s: started the persistent disk tier empty: %s", self.file.path, reason)
            self._initialise()
            return Recovered([], 0, reason)
        self.header = FileHeader(self.slot_bytes, self.slots, found.epoch, found.identity_digest, found.identity_json)
        self.namespace = _namespace(found)
        intact = max(0, (self.file.found_bytes - found.data_offset) // self.stride)
        """Slots the file holds whole: a file cut shorter than its header says lost the slots past the cut."""
        if intact < found.slots:
            log.warning(
                "kvoffload: %s: the file is %d bytes, shorter than the %d its header says: the %d slots past the cut are dropped",
                self.file.path, self.file.found_bytes, found.data_offset + found.slots * self.stride, found.slots - intact,
            )
        self.file.resize(self.file_bytes)
        if found.slots != self.slots:
            self.file.write_bytes(self.header.pack(), 0)
        recovered = self._rebuild(pool, min(found.slots, self.slots), intact)
        self._remove_stale_temporaries()
        return recovered

    def _mismatch(self, found: FileHeader) -> str:
        """Why the file found holds another cache's blocks (``""``: it holds this cache's)."""
        if found.identity_digest == self.identity.digest:
            return ""
        try:
            theirs = CacheIdentity.from_json(found.identity_json)
        except ValueError:
            return "its cache identity is unreadable"
        return "; ".join(self.identity.differences(theirs) or ["(digest)"])

    def _initialise(self) -> None:
        """Start the file empty: a new epoch, so no slot written before is valid."""
        self.header = _new_header(self.slots, self.slot_bytes, self.identity)
        self.namespace = _namespace(self.header)
        self.file.resize(self.file_bytes)
        self.file.write_bytes(self.header.pack(), 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.checkpoint_path)
        self._remove_stale_temporaries()

    def _rebuild(self, pool: Executor, slots: int, intact: int) -> Recovered:
        """Read every header of the first ``slots`` (of which the first ``intact`` are whole in the
        file); keep what the checkpoint vouches for or its CRC verifies, one slot per key (the latest
        write); void every other slot's header, so that nothing dropped now comes back later."""
        checkpoint = self._read_checkpoint()
        listed = {r.slot: r for r in checkpoint.records} if checkpoint is not None else {}
        headers, dropped = self._read_headers(pool, min(slots, intact + 1))  # damaged headers are dropped slots
        headers += [None] * (slots - len(headers))
        trusted: dict[int, SlotHeader] = {}
        unverified: list[tuple[int, SlotHeader]] = []
        void: list[int] = []
        """Slots holding a header of this file that is not kept."""
        for slot, h in enumerate(headers):
            if h is None or h.namespace != self.namespace:
                continue  # empty, or written before the file was last started empty
            r = listed.get(slot)
            if slot >= intact or h.payload_bytes != self.block_bytes or (r is not None and r.seq > h.seq) or h.flags != self.flags:
                void.append(slot)  # cut short, older than the write the checkpoint saw land there (a lost write), sealed otherwise
            elif r is not None and (r.seq, r.payload_crc, r.key) == (h.seq, h.payload_crc, h.key):
                trusted[slot] = h
            else:
                unverified.append((slot, h))
        dropped += len(void) + sum(1 for slot in listed if slots > slot >= intact and headers[slot] is None)
        good = self._verify_payloads(pool, unverified)
        dropped += len(unverified) - len(good)
        kept_slots = {slot for slot, _ in good} | set(trusted)
        void += [slot for slot, _ in unverified if slot not in kept_slots]
        # one slot per key: the latest write wins; the older ones are voided
        best: dict[bytes, tuple[int, int]] = {}
        for slot, h in itertools.chain(trusted.items(), good):
            if h.key not in best or best[h.key][1] < h.seq:
                if h.key in best:
                    void.append(best[h.key][0])
                best[h.key] = (slot, h.seq)
            else:
                void.append(slot)
        order = [r.slot for r in checkpoint.records] if checkpoint is not None else []
        rank = {slot: i for i, slot in enumerate(order)}
        kept = sorted(((slot, seq, key) for key, (slot, seq) in best.items()), key=lambda t: (t[0] not in rank, rank.get(t[0], 0), t[1]))
        all_headers = {**trusted, **dict(good)}
        entries: list[tuple[Hashable, int]] = []
        for slot, seq, key in kept:
            try:
                entries.append((decode_key(key), slot))
            except ValueError:
                dropped += 1
                void.append(slot)
                continue
            h = all_headers[slot]
            self._written[slot] = (h.seq, h.payload_crc, h.key)
        top = max([checkpoint.next_seq if checkpoint is not None else 1] + [h.seq + 1 for h in headers if h is not None])
        self._seq = itertools.count(top)
        self._void(sorted(set(void)), pool)
        log.info(
            "kvoffload: %s: reopened the persistent disk tier: %d entries (%d vouched for by the %s checkpoint, "
            "%d verified by checksum), %d slots dropped",
            self.file.path, len(entries), len(trusted), "clean" if checkpoint is not None and checkpoint.clean else "last",
            len(good), dropped,
        )
        return Recovered(entries, dropped, "")

    def _read_headers(self, pool: Executor, slots: int) -> tuple[list[SlotHeader | None], int]:
        """Each slot's header (None: a tombstone, never written, or damaged), and how many were damaged."""
        out: list[SlotHeader | None] = [None] * slots
        per_job = 4096

        def job(first: int, n: int) -> int:
            damaged = 0
            buf = mmap.mmap(-1, HEADER_BYTES)
            try:
                for slot in range(first, first + n):
                    self.file.read([buf], self.offset(slot))
                    page = memoryview(buf)
                    out[slot] = h = SlotHeader.parse(page)
                    damaged += h is None and bytes(page[:6]) == b"KVSLOT"
                    page.release()
            finally:
                buf.close()
            return damaged

        futures = [pool.submit(job, first, min(per_job, slots - first)) for first in range(0, slots, per_job)]
        return out, sum(f.result() for f in futures)

    def _verify_payloads(self, pool: Executor, candidates: list[tuple[int, SlotHeader]]) -> list[tuple[int, SlotHeader]]:
        """Those of ``candidates`` whose payload's CRC32C matches their header."""
        ok = [False] * len(candidates)

        def job(i: int) -> None:
            buf = mmap.mmap(-1, self.slot_bytes)
            try:
                slot, h = candidates[i]
                self.file.read([buf], self.offset(slot) + HEADER_BYTES)
                stored = memoryview(buf)[: self.block_bytes]
                ok[i] = crc32c_of(stored) == h.payload_crc and self._authentic(h, stored)
                stored.release()
            finally:
                buf.close()

        for f in [pool.submit(job, i) for i in range(len(candidates))]:
            f.result()
        return [c for c, good in zip(candidates, ok) if good]

    # -- writes and reads (on IO threads) --------------------------------------------

    def write_calls(self, rows: Sequence[Any], slots: Sequence[int], keys: Sequence[Hashable], job_bytes: int) -> list[Callable[[], None]]:
        """IO calls writing ``rows[i]`` (a slot's bytes) with its header to slot ``slots[i]``, for
        ``keys[i]``: consecutive slots share a ``pwritev``. Sequence numbers are taken now."""
        encoded = [encode_key(k) for k in keys]
        seqs = [next(self._seq) for _ in slots]
        return [functools.partial(self._write, group, rows, slots, encoded, seqs) for group in self._groups(slots, job_bytes)]

    def _groups(self, slots: Sequence[int], job_bytes: int) -> list[range]:
        """Index ranges of runs of consecutive ``slots``, cut at ``job_bytes`` and at IOV_MAX buffers."""
        per_job = max(1, min(job_bytes // self.stride, IOV_MAX // 2))
        out: list[range] = []
        starts, lengths = runs(list(slots))
        for s, n in zip(starts.tolist(), lengths.tolist()):
            out += [range(j, min(j + per_job, s + n)) for j in range(s, s + n, per_job)]
        return out

    def _write(self, group: range, rows: Sequence[Any], slots: Sequence[int], keys: list[bytes], seqs: list[int]) -> None:
        view = memoryview(mmap.mmap(-1, HEADER_BYTES * len(group)))  # page aligned; freed with its last view
        ciphertext = self._ciphertext_rows(len(group))
        buffers: list[Any] = []
        written = []
        for n, i in enumerate(group):
            payload = memoryview(rows[i]).cast("B")
            page = view[n * HEADER_BYTES : (n + 1) * HEADER_BYTES]
            if self.flags:
                payload, crc = self._seal(page, payload, ciphertext[n] if ciphertext else None, seqs[i], keys[i])
            else:
                crc = crc32c_of(payload[: self.block_bytes])
                SlotHeader(self.namespace, seqs[i], self.block_bytes, crc, keys[i]).pack_into(page)
            buffers += [page, payload]
            written.append((slots[i], (seqs[i], crc, keys[i])))
        mine = [slots[i] for i in group]
        with self._lock:
            while self._voiding.intersection(mine):  # a void of one of them runs: this write lands after it
                self._slot_io_ended.wait()
            self._writing.update(mine)
        try:
            self.file.write(buffers, self.offset(slots[group[0]]))
        except BaseException:
            with self._lock:  # a failed write may have left a header over a torn payload: void it
                self._writing.difference_update(mine)
                self._tombstones += mine
            self._write_tombstones()
            raise
        with self._lock:  # one step: a tombstone never finds these slots in neither set
            self._writing.difference_update(mine)
            self._written.update(written)
            self._changes += 1

    # -- sealing (on IO threads) -------------------------------------------------------

    def _ciphertext_rows(self, n: int) -> list[memoryview]:
        """``n`` page-aligned rows of a slot and a page each (ciphertext and its tag), for an
        encrypted tier; [] otherwise. Freed with their last view."""
        if not self.flags & ENCRYPTED:
            return []
        stride = self.slot_bytes + HEADER_BYTES
        memory = memoryview(mmap.mmap(-1, stride * n))
        return [memory[j * stride : (j + 1) * stride] for j in range(n)]

    def _aad(self, seq: int, key: bytes) -> bytes:
        return self.namespace + seq.to_bytes(8, "little") + key

    def _seal(self, page: memoryview, payload: memoryview, out: memoryview | None, seq: int, key: bytes) -> tuple[memoryview, int]:
        """Pack the sealed header of ``payload`` into ``page``; what to write as the payload (its
        ciphertext in ``out`` when encrypted, else ``payload``) and its CRC32C."""
        nonce, tag = bytes(12), bytes(TAG_BYTES)
        stored = payload
        if out is not None and self.sealer.key is not None:
            nonce = self.sealer.nonce()
            self.sealer.key.encrypt_into(nonce, payload[: self.block_bytes], self._aad(seq, key), out[: self.block_bytes + TAG_BYTES])
            tag = bytes(out[self.block_bytes : self.block_bytes + TAG_BYTES])
            out[self.block_bytes : self.slot_bytes] = bytes(self.slot_bytes - self.block_bytes)
            stored = out[: self.slot_bytes]
        secrets_ = self.sealer.secrets
        kid = secrets_.signing_kid if secrets_ is not None else bytes(KID_BYTES)
        crc = crc32c_of(stored[: self.block_bytes])
        SlotHeader(self.namespace, seq, self.block_bytes, crc, key, self.flags, kid, nonce, tag).pack_into(page)
        if secrets_ is not None:
            SlotHeader.set_mac(page, secrets_.sign((_PURPOSE, SlotHeader.signed_part(page), stored[: self.block_bytes])))
        return stored, crc

    def _authentic(self, h: SlotHeader, stored: memoryview) -> bool:
        """Whether slot header ``h`` is sealed as this tier seals and its MAC (if signed) matches ``stored``."""
        if h.flags != self.flags:
            return False
        if self.sealer.secrets is None:
            return True
        page = memoryview(bytearray(HEADER_BYTES))
        h.pack_into(page)
        try:
            self.sealer.secrets.check(h.kid, h.mac, (_PURPOSE, SlotHeader.signed_part(page), stored))
        except BadSeal:
            return False
        return True

    def read_calls(self, rows: Sequence[Any], slots: Sequence[int], job_bytes: int) -> list[Callable[[], None]]:
        """IO calls reading slot ``slots[i]`` into ``rows[i]``, each header checked against what the
        slot should hold (and, with ``verify``, the payload's CRC32C)."""
        return [functools.partial(self._read, group, rows, slots) for group in self._groups(slots, job_bytes)]

    def _read(self, group: range, rows: Sequence[Any], slots: Sequence[int]) -> None:
        view = memoryview(mmap.mmap(-1, HEADER_BYTES * len(group)))
        ciphertext = self._ciphertext_rows(len(group))  # encrypted: read there, decrypted into the rows once checked
        buffers: list[Any] = []
        for n, i in enumerate(group):
            stored = ciphertext[n][: self.slot_bytes] if ciphertext else memoryview(rows[i]).cast("B")
            buffers += [view[n * HEADER_BYTES : (n + 1) * HEADER_BYTES], stored]
        self.file.read(buffers, self.offset(slots[group[0]]))
        for n, i in enumerate(group):
            self._check(slots[i], buffers[2 * n], buffers[2 * n + 1], ciphertext[n] if ciphertext else None, memoryview(rows[i]).cast("B"))

    def _check(self, slot: int, page: memoryview, payload: memoryview, sealed: memoryview | None = None, out: memoryview | None = None) -> None:
        """Raise ``OSError(EBADMSG)`` unless ``slot`` holds what was written there (and, with
        ``verify``, its payload's CRC32C matches; sealed, its MAC matches and, encrypted, it decrypts
        from ``sealed`` into ``out``); the entry is then dropped (:attr:`on_bad_slot`)."""
        want = self._written.get(slot)
        h = SlotHeader.parse(page)
        problem = ""
        if want is None or h is None or h.namespace != self.namespace or (h.seq, h.key) != (want[0], want[2]):
            problem = "its header is not the one written there"
        elif self.verify and crc32c_of(payload[: self.block_bytes]) != want[1]:
            problem = "its payload fails its CRC32C"
        elif self.flags and not self._authentic(h, payload[: self.block_bytes]):
            problem = "it fails its MAC or is not sealed as this tier seals: written by someone without the secret, or altered"
        elif sealed is not None and out is not None and self.sealer.key is not None:
            sealed[self.block_bytes : self.block_bytes + TAG_BYTES] = h.tag
            try:
                self.sealer.key.decrypt_into(h.nonce, sealed[: self.block_bytes + TAG_BYTES], self._aad(h.seq, h.key), out[: self.block_bytes])
            except BadSeal as e:
                problem = str(e)
        if problem and problem != "its header is not the one written there":
            with self._lock:
                self.checksum_failures += 1
        if problem:
            self.on_bad_slot(slot)
            raise OSError(errno.EBADMSG, f"disk slot {slot} of {self.file.path}: {problem}; the entry is dropped")

    def forget(self, slot: int) -> None:
        """The entry in ``slot`` is gone (discarded, evicted, dropped) and the slot free: its header is
        overwritten with zeros soon, on an IO thread (or by :meth:`void_forgotten`), unless the slot
        is written again first. Takes no lock but this object's, briefly: the index calls it under its own."""
        with self._lock:
            if self._written.pop(slot, None) is None:
                return
            self._changes += 1
            self._tombstones.append(slot)
            if self._tombstoning or self._pool is None:
                return
            self._tombstoning = True
        try:
            self._pool.submit(self._write_tombstones)
        except RuntimeError:  # closing: close() voids what is left
            with self._lock:
                self._tombstoning = False

    def void_forgotten(self) -> None:
        """Return once the header of every slot forgotten so far is voided on disk (written here, or by
        the IO thread already writing it): after a discard, so that a process killed once
        ``discard()`` returned never finds those keys again. Call it holding no lock, from any thread
        but an IO thread."""
        self._write_tombstones(self._pool)
        with self._lock:
            while self._voiding:
                self._slot_io_ended.wait()

    def write_tombstones_now(self) -> None:
        """At close, once no IO thread runs: void the headers still waiting for it (their job may
        have been cancelled with the IO pool)."""
        self._write_tombstones()

    def _write_tombstones(self, pool: Executor | None = None) -> None:
        """Void the headers of forgotten slots until none is left (on an IO thread, in
        :meth:`void_forgotten` or at close), many of them shared among ``pool``'s threads. A slot
        written again meanwhile is skipped; one being written is voided only once its write ended,
        so the later write always wins."""
        while True:
            with self._lock:
                queued, self._tombstones = self._tombstones, []
                slots = sorted({s for s in queued if s not in self._written and s not in self._writing and s not in self._voiding})
                if not queued:
                    self._tombstoning = False
                    return
                self._voiding.update(slots)
            try:
                self._void(slots, pool if len(slots) >= _VOIDS_PER_JOB else None)
            except OSError:
                log.warning("kvoffload: %s: could not void slot headers; their old entries may come back after a restart", self.file.path, exc_info=True)
            finally:
                with self._lock:
                    self._voiding.difference_update(slots)
                    self._slot_io_ended.notify_all()

    def _void(self, slots: Sequence[int], pool: Executor | None = None) -> None:
        """Overwrite the header pages of ``slots`` with zeros, here or shared among ``pool``'s threads."""
        zeros = mmap.mmap(-1, HEADER_BYTES)

        def void_part(part: Sequence[int]) -> None:
            for s in part:
                self.file.write([zeros], self.offset(s))

        try:
            if pool is None:
                void_part(slots)
                return
            parts = []
            for i in range(0, len(slots), _VOIDS_PER_JOB):
                try:
                    parts.append(pool.submit(void_part, slots[i : i + _VOIDS_PER_JOB]))
                except RuntimeError:  # the pool is shutting down: the rest here, then
                    void_part(slots[i:])
                    break
            concurrent.futures.wait(parts)  # all of them ended before any error is raised: none writes later
            for f in parts:
                f.result()
        finally:
            zeros.close()

    # -- checkpoints ---------------------------------------------------------------

    @property
    def checkpoint_path(self) -> str:
        return self.file.path + CHECKPOINT_SUFFIX

    def due(self) -> bool:
        """Something changed since the last checkpoint."""
        return self._changes != self._checkpointed

    def write_checkpoint(self, entries: Iterable[tuple[Hashable, int]], *, clean: bool = False) -> int:
        """Write a checkpoint of ``entries`` (``(key, disk slot)``, least recently used first); returns
        how many it lists. Entries whose slot does not hold their key's bytes yet are left out. Holds
        no lock a transfer, a lookup or a discard waits for while it writes."""
        with self._checkpoint_lock:
            if self._closed:
                return 0
            with self._lock:
                changes = self._changes
                written = dict(self._written)
            records: list[CheckpointRecord] = []
            for key, slot in entries:
                w = written.get(slot)
                if w is None:
                    continue
                try:
                    if encode_key(key) != w[2]:
                        continue
                except (TypeError, ValueError):
                    continue
                records.append(CheckpointRecord(slot, w[0], w[1], w[2]))
            data = Checkpoint(self.namespace, next(self._seq), clean, tuple(records)).pack()
            tmp = f"{self.checkpoint_path}.tmp-{secrets.token_hex(6)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                try:
                    with os.fdopen(fd, "wb", closefd=False) as f:
                        f.write(data)
                    if clean:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self.checkpoint_path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._checkpointed = changes
            if clean:
                self._closed = True
        return len(records)

    def _read_checkpoint(self) -> Checkpoint | None:
        """The last checkpoint, if it is this file's, whole and safe to trust."""
        path = self.checkpoint_path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("kvoffload: %s: ignoring the checkpoint (%s); every slot is checked instead", path, e)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                log.warning("kvoffload: %s: ignoring the checkpoint (not a private file of this user)", path)
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
        try:
            checkpoint = Checkpoint.parse(data)
        except ValueError as e:
            log.warning("kvoffload: %s: ignoring the checkpoint (%s); every slot is checked instead", path, e)
            return None
        return checkpoint if checkpoint.namespace == self.namespace else None

    def _remove_stale_temporaries(self) -> None:
        """Checkpoints a killed process left half written."""
        for tmp in glob.glob(glob.escape(self.checkpoint_path) + ".tmp-*"):
            with contextlib.suppress(OSError):
                st = os.lstat(tmp)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                    os.unlink(tmp)

    async def checkpoint_every(self, interval: float, snapshot: Callable[[], list[tuple[Hashable, int]]], pool: Executor) -> None:
        """(A task on a worker loop.) Every ``interval`` seconds, when something changed, write a
        checkpoint of ``snapshot()`` on ``pool``; until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            if not self.due():
                continue
            try:
                await loop.run_in_executor(pool, lambda: self.write_checkpoint(snapshot()))
            except RuntimeError:  # the pool is shutting down
                return
            except OSError:
                log.warning("kvoffload: %s: writing a checkpoint failed; trying again later", self.checkpoint_path, exc_info=True)


def _new_header(slots: int, slot_bytes: int, identity: CacheIdentity) -> FileHeader:
    """The header of a file started empty for ``identity``: a new epoch."""
    return FileHeader(slot_bytes, slots, secrets.token_bytes(16), identity.digest, identity.to_json())


def _namespace(header: FileHeader) -> bytes:
    """What every valid slot header of this file carries: its identity and epoch, digested."""
    return hashlib.blake2b(header.identity_digest + header.epoch, digest_size=16).digest()

