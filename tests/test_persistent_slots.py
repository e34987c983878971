"""The persistent disk file's slots, below the offloader: headers written with each payload and
checked on each read, tombstones, checkpoints, and what a reopen keeps and drops."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
import pytest
import torch

from kvoffload._core.base.cache_identity import CacheIdentity
from kvoffload._core.base.diskfile import DiskFile
from kvoffload._core.base.errors import OffloadError
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
        try:
            self.recovered = self.slots.open(self.pool)
        except BaseException:
            self.pool.shutdown()
            self.file.close()
            raise
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


def test_another_identity_is_refused_and_the_file_left_as_it_was(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    f.write(random_rows(1, f.layout.slot_bytes), [0], [b"a"])
    f.close(entries=[(b"a", 0)])
    before = path.read_bytes()
    for kw, said in (({"fingerprint": "model-b"}, "fingerprint: 'model-b' here, 'model-a' there"), ({"width": 4200}, "slot_bytes")):
        with pytest.raises(OffloadError, match="another cache identity") as ei:
            Opened(path, **kw)
        assert said in str(ei.value) and "left as it is" in str(ei.value)
        assert path.read_bytes() == before
    g = Opened(path)  # model-a finds its entry again
    assert [k for k, _ in g.recovered.entries] == [b"a"]
    g.close()


def test_a_file_that_is_not_kvoffloads_is_refused_and_one_never_initialised_is_used(tmp_path):
    path = tmp_path / "kv"
    path.write_bytes(b"precious data, not a cache" * 1000)
    os.chmod(path, 0o600)
    before = path.read_bytes()
    with pytest.raises(OffloadError, match="not a persistent disk file"):
        Opened(path)
    assert path.read_bytes() == before
    path.write_bytes(bytes(3 * HEADER_BYTES))  # as a start killed before it wrote the file header leaves it
    g = Opened(path)
    assert g.recovered.entries == [] and "never initialised" in g.recovered.reason
    g.write(random_rows(1, g.layout.slot_bytes), [0], [b"a"])
    g.close(entries=[(b"a", 0)])
    h = Opened(path)
    assert [k for k, _ in h.recovered.entries] == [b"a"]
    h.close()


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


def crash(f: Opened) -> None:
    """As a killed process leaves the file: no final checkpoint, nothing more written."""
    f.pool.shutdown()
    os.close(f.file.fd)
    f.file.fd = -1


def test_a_cache_identity_of_any_size_reopens(tmp_path, caplog):
    # 80 layers with one tensor per K and V under long names: a file header of several pages
    caches = {f"model.language_model.layers.{i}.self_attn.attn.{kv}_cache": torch.zeros(4, 64, dtype=torch.uint8)
              for i in range(80) for kv in "kv"}
    layout = BlockLayout.of(caches)
    identity = CacheIdentity.of(caches, layout, "a-long-fingerprint@" + "0" * 64)
    assert FileHeader(layout.slot_bytes, SLOTS, b"\0" * 16, identity.digest, identity.to_json()).data_offset > 2 * HEADER_BYTES
    path = tmp_path / "kv"
    for round_ in range(2):
        pool = ThreadPoolExecutor(2)
        file = DiskFile(path, PersistentSlots.file_bytes_of(SLOTS, layout.slot_bytes, identity), persistent=True)
        slots = PersistentSlots(file, SLOTS, layout.slot_bytes, layout.block_bytes, identity, verify=False)
        found = slots.open(pool)
        if round_ == 0:
            for call in slots.write_calls(list(random_rows(1, layout.slot_bytes)), [3], [b"a"], 1 << 20):
                call()
            slots.write_checkpoint([(b"a", 3)], clean=True)
        else:
            assert found.entries == [(b"a", 3)] and found.reason == ""
        pool.shutdown()
        file.close()
    assert "damaged" not in caplog.text


def test_an_older_copy_of_a_key_never_comes_back_once_the_newer_one_is_discarded(tmp_path):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(2, f.layout.slot_bytes, seed=11)
    f.write(rows[:1], [0], [b"a"])  # the first version, whose void a crash lost
    f.write(rows[1:], [1], [b"a"])  # the second, in another slot
    crash(f)
    g = Opened(path)
    assert g.recovered.entries == [(b"a", 1)]
    g.slots.forget(1)  # a clean discard of the key, then a clean close
    g.slots.write_tombstones_now()
    g.close(entries=[])
    h = Opened(path)
    assert h.recovered.entries == [], "the first version came back"
    h.close()


@pytest.mark.parametrize("verify", [False, True])
def test_a_slot_image_older_than_its_checkpoint_record_is_never_served(tmp_path, verify):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(2, f.layout.slot_bytes, seed=12)
    f.write(rows[:1], [0], [b"a"])
    image = f.file.read_bytes(f.slots.offset(0), f.slots.stride)
    f.write(rows[1:], [0], [b"a"])  # rewritten: the checkpoint records this write
    f.close(entries=[(b"a", 0)])
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, image, f.slots.offset(0))  # the write lost: the older image is what the disk holds
    os.close(fd)
    g = Opened(path, verify=verify)
    assert g.recovered.entries == [] and g.recovered.dropped == 1
    g.close(entries=[])
    h = Opened(path)  # voided at the reopen: it does not come back later either
    assert h.recovered.entries == [] and h.recovered.dropped == 0
    h.close()


def test_a_truncated_file_drops_the_slots_past_the_cut_and_serves_no_zeros(tmp_path, caplog):
    path = tmp_path / "kv"
    f = Opened(path)
    rows = random_rows(3, f.layout.slot_bytes, seed=13)
    f.write(rows, [0, 1, 2], [b"a", b"b", b"c"])
    f.close(entries=[(b"a", 0), (b"b", 1), (b"c", 2)])
    os.truncate(path, f.slots.offset(2) + HEADER_BYTES + 1000)  # inside c's payload
    g = Opened(path)
    assert g.recovered.entries == [(b"a", 0), (b"b", 1)] and g.recovered.dropped == 1
    assert "shorter than" in caplog.text
    bl = g.layout.block_bytes
    assert np.array_equal(g.read([0, 1])[:, :bl], rows[:2, :bl])
    assert os.stat(path).st_size == g.slots.file_bytes
    g.close(entries=[(b"a", 0), (b"b", 1)])
    h = Opened(path)
    assert h.recovered.entries == [(b"a", 0), (b"b", 1)] and h.recovered.dropped == 0
    h.close()


def test_the_process_that_loses_the_race_to_create_a_file_leaves_the_winners_file_alone(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    layout, identity = layout_and_identity()
    nbytes = PersistentSlots.file_bytes_of(SLOTS, layout.slot_bytes, identity)
    real_open = os.open
    winner: list[DiskFile] = []

    def open_then_lose_the_lock(name, flags, *args):
        fd = real_open(name, flags, *args)
        if os.fspath(name) == str(path) and flags & os.O_CREAT and not winner:
            # another process opens the new file and locks it before this one can
            monkeypatch.setattr(os, "open", real_open)
            winner.append(DiskFile(path, nbytes, persistent=True))
        return fd

    monkeypatch.setattr(os, "open", open_then_lose_the_lock)
    with pytest.raises(OffloadError, match="in use by another"):
        DiskFile(path, nbytes, persistent=True)
    monkeypatch.setattr(os, "open", real_open)
    try:
        assert winner and os.stat(path).st_ino == os.fstat(winner[0].fd).st_ino, "the loser removed the winner's file"
    finally:
        for w in winner:
            w.close()
    assert os.path.exists(path)


def test_a_checkpoint_whose_rename_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    f = Opened(path)
    f.write(random_rows(1, f.layout.slot_bytes), [0], [b"a"])

    def refuse(src, dst):
        raise OSError(5, "rename refused")

    monkeypatch.setattr(os, "replace", refuse)
    for _ in range(3):
        with pytest.raises(OSError, match="rename refused"):
            f.slots.write_checkpoint([(b"a", 0)])
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["kv"]
    f.close(entries=[(b"a", 0)])


def test_a_checkpoint_claiming_more_records_than_it_holds_is_ignored(tmp_path, caplog):
    path = tmp_path / "kv"
    f = Opened(path)
    f.write(random_rows(2, f.layout.slot_bytes, seed=14), [0, 1], [b"a", b"b"])
    f.close(entries=[(b"a", 0), (b"b", 1)])
    ckpt = str(path) + ".checkpoint"
    data = bytearray(open(ckpt, "rb").read()[:-4])
    data[8 + 16 + 8 : 8 + 16 + 16] = (10**12).to_bytes(8, "little")  # the record count
    open(ckpt, "wb").write(bytes(data) + crc32c.crc32c(bytes(data)).to_bytes(4, "little"))
    with pytest.raises(ValueError, match="records"):
        Checkpoint.parse(open(ckpt, "rb").read())
    g = Opened(path)  # the checkpoint is ignored: each slot's own checksum vouches for it
    assert sorted(k for k, _ in g.recovered.entries) == [b"a", b"b"] and "ignoring the checkpoint" in caplog.text
    g.close()
