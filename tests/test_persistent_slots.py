"""The persistent disk file's slots, below the offloader: headers written with each payload and
checked on each read, tombstones, checkpoints, and what a reopen keeps and drops."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvoffload._core.base.cache_identity import CacheIdentity
from kvoffload._core.base.diskfile import DiskFile
from kvoffload._core.base.layout import BlockLayout
from kvoffload._core.base.persistent_format import HEADER_BYTES, Checkpoint, FileHeader
from kvoffload._core.tiers.persistent_slots import PersistentSlots

SLOTS = 16


def layout_and_identity(fingerprint="model-a", width=3000):
    caches = {"k": torch.zeros(4, width, dtype=torch.uint8), "v": torch.zeros(4, width, dtype=torch.uint8)}
    layout = BlockLayout.of(caches)
    return layout, CacheIdentity.of(caches, layout, fingerprint)


class Opened:
    """A persistent file opened as the disk tier opens it, with an IO pool."""

    def __init__(self, path, *, fingerprint="model-a", slots=SLOTS, verify=False, width=3000):
        self.layout, self.identity = layout_and_identity(fingerprint, width)
        self.pool = ThreadPoolExecutor(2)
        nbytes = PersistentSlots.file_bytes_of(slots, self.layout.slot_bytes, self.identity)
        self.file = DiskFile(path, nbytes, persistent=True)
        self.slots = PersistentSlots(self.file, slots, self.layout.slot_bytes, self.layout.block_bytes, self.identity, verify=verify)
        self.recovered = self.slots.open(self.pool)
        self.bad: list[int] = []
        self.slots.on_bad_slot = self.bad.append

    def write(self, rows: np.ndarray, slots, keys):
        for call in self.slots.write_calls(list(rows), slots, keys, 1 << 20):
            call()

    def read(self, slots) -> np.ndarray:
        out = aligned_rows(len(slots), self.layout.slot_bytes)
        for call in self.slots.read_calls(list(out), slots, 1 << 20):
            call()
        return out

    def close(self, entries=None):
        if entries is not None:
            self.slots.write_checkpoint(entries, clean=True)
        self.pool.shutdown()
        self.file.close()


def aligned_rows(n, slot_bytes):
    """Rows in page-aligned memory, as the host slab and bounce buffers are (O_DIRECT needs it)."""
    return np.frombuffer(mmap.mmap(-1, n * slot_bytes), np.uint8).reshape(n, slot_bytes)


def random_rows(n, slot_bytes, seed=0):
    rows = aligned_rows(n, slot_bytes)
    rows[:] = np.random.default_rng(seed).integers(0, 256, (n, slot_bytes), dtype=np.uint8)
    return rows


def test_slots_survive_a_clean_reopen_byte_exact_in_lru_order(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    assert f.recovered.entries == [] and f.recovered.reason == "new file"
    rows = random_rows(5, f.layout.slot_bytes)
    keys = [b"a", "b", 3, -70000, b"e" * 40]
    f.write(rows, [0, 1, 2, 7, 8], keys)
    f.close(entries=[(keys[i], s) for i, s in [(3, 7), (0, 0), (4, 8), (1, 1), (2, 2)]])
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(str(path) + ".checkpoint").st_mode & 0o777 == 0o600

    g = Opened(path)
    assert g.recovered.entries == [(-70000, 7), (b"a", 0), (b"e" * 40, 8), ("b", 1), (3, 2)]
    assert g.recovered.dropped == 0
    bl = g.layout.block_bytes
    assert np.array_equal(g.read([0, 1, 2, 7, 8])[:, :bl], rows[:, :bl])
    g.close()


def test_slots_written_after_the_last_checkpoint_are_kept_once_their_checksum_verifies(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(3, f.layout.slot_bytes, seed=1)
    f.write(rows[:1], [0], [b"old"])
    f.slots.write_checkpoint([(b"old", 0)])
    f.write(rows[1:], [4, 5], [b"new1", b"new2"])  # no checkpoint lists these: a crash now
    os.close(os.dup(f.file.fd))
    f.pool.shutdown()
    os.close(f.file.fd)  # as a killed process would: no final checkpoint
    f.file.fd = -1

    g = Opened(path)
    assert g.recovered.entries == [(b"old", 0), (b"new1", 4), (b"new2", 5)]
    bl = g.layout.block_bytes
    assert np.array_equal(g.read([0, 4, 5])[:, :bl], rows[:, :bl])
    g.close()


def corrupt(path, offset, data=b"\xff\xff\xff\xff"):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["header", "payload_after_checkpoint"])
def test_a_corrupted_slot_is_dropped_on_reopen(tmp_path, where):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(2, f.layout.slot_bytes, seed=2)
    f.write(rows, [0, 1], [b"good", b"bad"])
    off = f.slots.offset(1)
    if where == "header":
        f.close(entries=[(b"good", 0), (b"bad", 1)])
        corrupt(path, off + 40)  # inside the header: its own CRC fails
    else:
        f.close()  # no checkpoint: every slot is verified by its payload's CRC32C
        corrupt(path, off + HEADER_BYTES + 100)
    g = Opened(path)
    assert g.recovered.entries == [(b"good", 0)]
    assert g.recovered.dropped == 1
    g.close()


def test_verify_fails_a_read_of_a_payload_corrupted_while_open_and_reports_the_slot(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path, verify=True)
    rows = random_rows(2, f.layout.slot_bytes, seed=3)
    f.write(rows, [0, 1], [b"x", b"y"])
    corrupt(path, f.slots.offset(1) + HEADER_BYTES + 7)
    assert np.array_equal(f.read([0])[0, : f.layout.block_bytes], rows[0, : f.layout.block_bytes])
    with pytest.raises(OSError, match="CRC32C"):
        f.read([1])
    assert f.bad == [1] and f.slots.checksum_failures == 1
    f.close()


def test_a_read_of_a_slot_holding_other_bytes_than_written_fails_without_verify(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(2, f.layout.slot_bytes, seed=4)
    f.write(rows[:1], [0], [b"x"])
    data = f.file.read_bytes(f.slots.offset(0), HEADER_BYTES)
    f.write(rows[1:], [1], [b"y"])
    f.file.write_bytes(data, f.slots.offset(1))  # slot 1 now claims to hold x: a stale header
    with pytest.raises(OSError, match="header"):
        f.read([1])
    assert f.bad == [1]
    f.close()


def test_discarded_slots_never_come_back(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(3, f.layout.slot_bytes, seed=5)
    f.write(rows, [0, 1, 2], [b"a", b"b", b"c"])
    f.slots.write_checkpoint([(b"a", 0), (b"b", 1), (b"c", 2)])
    f.slots.forget(1)  # discarded after the checkpoint: a tombstone, then a crash
    f.pool.shutdown()  # waits for the tombstone
    os.close(f.file.fd)
    f.file.fd = -1
    g = Opened(path)
    assert [k for k, _ in g.recovered.entries] == [b"a", b"c"]
    g.close()


def test_another_identity_starts_the_file_empty_saying_why(tmp_path, caplog):
    path = tmp_path / "kv"
    f = Opened(path)
    f.write(random_rows(1, f.layout.slot_bytes), [0], [b"a"])
    f.close(entries=[(b"a", 0)])
    g = Opened(path, fingerprint="model-b")
    assert g.recovered.entries == [] and "fingerprint" in g.recovered.reason and "model-a" in g.recovered.reason
    assert "fingerprint" in caplog.text
    g.close(entries=[])
    h = Opened(path)  # the file now belongs to model-b: model-a's old slot stays invisible
    assert h.recovered.entries == [] and "fingerprint" in h.recovered.reason
    h.close()
    k = Opened(path, width=4200)
    assert k.recovered.entries == [] and "slots are" in k.recovered.reason
    k.close()


def test_a_damaged_file_header_or_checkpoint_is_never_trusted(tmp_path, caplog):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(1, f.layout.slot_bytes, seed=6)
    f.write(rows, [0], [b"a"])
    f.close(entries=[(b"a", 0)])
    ckpt = str(path) + ".checkpoint"
    data = bytearray(open(ckpt, "rb").read())
    data[30] ^= 1
    open(ckpt, "wb").write(bytes(data))
    g = Opened(path)  # the checkpoint is ignored: the slot's own checksum vouches for it
    assert g.recovered.entries == [(b"a", 0)] and "ignoring the checkpoint" in caplog.text
    g.close()
    corrupt(path, 20)
    h = Opened(path)
    assert h.recovered.entries == [] and "damaged" in h.recovered.reason
    h.close()


def test_growing_and_shrinking_the_file_keeps_the_slots_that_still_fit(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path, slots=8)
    rows = random_rows(2, f.layout.slot_bytes, seed=7)
    f.write(rows, [1, 6], [b"low", b"high"])
    f.close(entries=[(b"low", 1), (b"high", 6)])
    g = Opened(path, slots=32)
    assert g.recovered.entries == [(b"low", 1), (b"high", 6)]
    assert os.path.getsize(path) == g.slots.file_bytes
    g.close(entries=[(b"low", 1), (b"high", 6)])
    h = Opened(path, slots=4)
    assert h.recovered.entries == [(b"low", 1)]
    assert os.path.getsize(path) == h.slots.file_bytes
    h.close()


@pytest.mark.parametrize("mode", [0o644, 0o660, 0o606])
def test_a_file_others_may_read_or_write_is_refused(tmp_path, mode):
    path = tmp_path / "kv"
    Opened(path).close(entries=[])
    os.chmod(path, mode)
    with pytest.raises(Exception, match="mode"):
        Opened(path)
    assert os.stat(path).st_mode & 0o777 == mode  # left as it was


def test_a_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    path = tmp_path / "kv"
    Opened(path).close(entries=[])
    os.chown(path, 12345, 12345)
    with pytest.raises(Exception, match="belongs to user 12345"):
        Opened(path)


def test_a_symlink_is_refused_not_followed(tmp_path):
    target = tmp_path / "real"
    Opened(target).close(entries=[])
    link = tmp_path / "kv"
    link.symlink_to(target)
    with pytest.raises(Exception, match="symlink"):
        Opened(link)


def test_formats_refuse_foreign_bytes():
    with pytest.raises(ValueError):
        FileHeader.parse(b"\0" * 4096)
    with pytest.raises(ValueError):
        Checkpoint.parse(b"KVCKPT\x00\x01" + b"\0" * 64)
