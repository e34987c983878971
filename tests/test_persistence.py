"""A persistent disk tier (``persist=True``) across real process restarts and crashes.

A process stores and exits (cleanly, or killed with SIGKILL mid-store or mid-checkpoint); a second
process with the same cache identity finds every finished entry again, byte-exact, and never serves
a torn, stale, corrupted or discarded one. Keys are bytes, str or int.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

import kvoffload
from support.caches import block_bytes, random_caches
from kvoffload._core.base.cache_identity import decode_key
from kvoffload._core.base.persistent_format import HEADER_BYTES, FileHeader, SlotHeader
from kvoffload._core.tiers.persistent_slots import PersistentSlots
from kvoffload._testing import check_index, disk_file_location, disk_file_stat

BLOCKS = 64
SEED = 7

# The child: stores keys "k<i>" from block i % BLOCKS of random_caches(BLOCKS, seed=SEED), a few
# transfers in flight, printing each key once its store has completed; then waits for a line on
# stdin and closes (or is killed). KILL_AT=checkpoint-<n>: SIGKILL itself inside the n-th checkpoint
# (its temporary file written, not yet renamed over the last one).
CHILD = textwrap.dedent("""
    import os, signal, sys
    import kvoffload
    from kvoffload._core.tiers import persistent_slots
    from support.caches import random_caches

    path, host_blocks, disk_blocks, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kill_at = os.environ.get("KILL_AT", "")
    persistent_slots.CHECKPOINT_INTERVAL_S = float(os.environ.get("CHECKPOINT_S", "5"))
    if kill_at.startswith("checkpoint-"):
        left = [int(kill_at.split("-")[1])]
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith(".checkpoint"):
                left[0] -= 1
                if left[0] == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst)
        os.replace = replace
    caches = random_caches(64, seed=7)
    off = kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=path, disk_blocks=disk_blocks, persist=True,
                              fingerprint="model-a").start()
    window = []
    for first in range(0, count, 4):
        keys = [f"k{i}" for i in range(first, min(first + 4, count))]
        window.append((keys, off.store({k: int(k[1:]) % 64 for k in keys})))
        if len(window) == 4 or first + 4 >= count:
            for keys, t in window:
                t.result(30)
                print(" ".join(keys), flush=True)
            window = []
    print("done", flush=True)
    for line in sys.stdin:  # "discard k1 k2 ...": discard, then report; "close": close
        command, *args = line.split()
        if command != "discard":
            break
        print(f"discarded {off.discard(args)}", flush=True)
    off.close()
""")


class Child:
    """A storing process; ``acknowledged`` holds the keys it reported stored."""

    def __init__(self, path, *, host_blocks=0, disk_blocks=256, count=64, env=None):
        tests_dir = os.path.dirname(__file__)
        full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(host_blocks), str(disk_blocks), str(count)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        )
        self.acknowledged: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def read_until(self, lines: int | None = None) -> bool:
        """Read the child's reports until ``lines`` of them (None: until "done"); False if it died."""
        while lines is None or len(self.acknowledged) < lines:
            try:
                line = self._lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError("the child stopped answering") from None
            if not line:
                return False
            if line == "done\n":
                return True
            self.acknowledged += line.split()
        return True

    def command(self, line: str) -> str:
        """Send ``line``; the child's answer."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        try:
            return self._lines.get(timeout=60).strip()
        except queue.Empty:
            raise AssertionError("the child stopped answering") from None

    def finish(self) -> None:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        assert self.proc.wait(60) == 0, self.proc.stderr.read()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stderr):
            f.close()


def reopen(path, **kw):
    caches = random_caches(BLOCKS, seed=99)  # other bytes: every loaded block must be overwritten
    kw = {"host_blocks": 0, "disk_blocks": 256, "fingerprint": "model-a", **kw}
    return kvoffload.Offloader(caches, disk_path=path, persist=True, **kw).start(), caches


def assert_loads_byte_exact(off, caches, keys):
    """Every key in ``keys`` loads the bytes its store came from."""
    want = random_caches(BLOCKS, seed=SEED)
    keys = list(keys)
    for first in range(0, len(keys), BLOCKS):
        part = keys[first : first + BLOCKS]
        off.load({k: b for b, k in enumerate(part)}).result(30)
        for b, k in enumerate(part):
            assert block_bytes(caches, b) == block_bytes(want, int(k[1:]) % BLOCKS), k


def stored_keys(off, candidates):
    """The keys among ``candidates`` the offloader holds."""
    return [k for k in candidates if off.lookup([k]) == 1]


@pytest.mark.parametrize("host_blocks", [0, 32], ids=["disk-only", "host-and-disk"])
@pytest.mark.slow
def test_entries_survive_a_real_restart_byte_exact(tmp_path, host_blocks):
    path = tmp_path / "kv"
    with Child(path, host_blocks=host_blocks, count=48) as child:
        assert child.read_until()
        child.finish()
    assert os.stat(path).st_mode & 0o777 == 0o600
    off, caches = reopen(path)
    try:
        keys = [f"k{i}" for i in range(48)]
        assert sorted(off.keys()) == sorted(keys)  # what a restarted server rebuilds its index from
        assert off.lookup(keys) == 48
        s = off.stats()
        assert s.recovered == 48 and s.dropped_at_open == 0 and s.disk_ready == 48
        assert_loads_byte_exact(off, caches, keys)
    finally:
        off.close()


@pytest.mark.slow
def test_sigkill_mid_store_keeps_every_finished_entry_and_serves_no_torn_one(tmp_path):
    path = tmp_path / "kv"
    with Child(path, count=400, disk_blocks=512, env={"CHECKPOINT_S": "0.02"}) as child:
        assert child.read_until(lines=120)  # stores keep running, some in flight, checkpoints being written
        child.kill()
        acknowledged = list(child.acknowledged)
    off, caches = reopen(path, disk_blocks=512)
    try:
        held = stored_keys(off, [f"k{i}" for i in range(400)])
        assert set(acknowledged) <= set(held), sorted(set(acknowledged) - set(held))[:5]
        assert_loads_byte_exact(off, caches, held)  # those it finished after the last report too: never torn
    finally:
        off.close()


@pytest.mark.parametrize("which", [1, 3], ids=["first-checkpoint", "third-checkpoint"])
@pytest.mark.slow
def test_sigkill_mid_checkpoint_keeps_every_finished_entry(tmp_path, which):
    path = tmp_path / "kv"
    with Child(path, count=400, disk_blocks=512, env={"CHECKPOINT_S": "0.01", "KILL_AT": f"checkpoint-{which}"}) as child:
        finished = child.read_until()
        assert child.proc.wait(60) == -signal.SIGKILL, "the child was to kill itself inside a checkpoint"
        acknowledged = list(child.acknowledged)
        assert not finished or len(acknowledged) == 400
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert leftovers, "the killed checkpoint left its temporary file"
    off, caches = reopen(path, disk_blocks=512)
    try:
        held = stored_keys(off, [f"k{i}" for i in range(400)])
        assert set(acknowledged) <= set(held)
        assert_loads_byte_exact(off, caches, held)
        assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n], "the reopen removes half-written checkpoints"
    finally:
        off.close()


@pytest.mark.slow
def test_sigkill_with_a_host_tier_loses_the_finished_stores_only_in_host_memory(tmp_path):
    path = tmp_path / "kv"
    # 64 keys through 16 host slots: each window's stores spill the oldest host entries to disk before they
    # finish, so at the kill k0..k47 are on disk and k48..k63, finished too, only in host memory.
    with Child(path, host_blocks=16, count=64, env={"CHECKPOINT_S": "0.02"}) as child:
        assert child.read_until()
        child.kill()
        assert child.acknowledged == [f"k{i}" for i in range(64)]
    off, caches = reopen(path)
    try:
        held = stored_keys(off, [f"k{i}" for i in range(64)])
        assert held == [f"k{i}" for i in range(48)], held  # host memory is not written through to disk
        assert off.stats().recovered == 48
        assert_loads_byte_exact(off, caches, held)
        check_index(off)
    finally:
        off.close()


def slot_offsets(path) -> dict[str, int]:
    """Where each key's slot (its header page, then its payload) starts in the file, read from the file."""
    data = open(path, "rb").read()
    header = FileHeader.parse(data)
    stride = HEADER_BYTES + header.slot_bytes
    out = {}
    for slot in range(header.slots):
        at = header.data_offset + slot * stride
        h = SlotHeader.parse(data[at : at + HEADER_BYTES])
        if h is not None:
            out[decode_key(h.key)] = at
    return out


def flip(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def store_and_close(path, count, **kw):
    caches = random_caches(BLOCKS, seed=SEED)
    kw = {"host_blocks": 0, "disk_blocks": 256, "fingerprint": "model-a", **kw}
    with kvoffload.Offloader(caches, disk_path=path, persist=True, **kw) as off:
        off.store({f"k{i}": i % BLOCKS for i in range(count)}).result(30)
    return slot_offsets(path)


def store_spilling(path, count, *, host_blocks, disk_blocks, hold=()):
    """Store ``k0``..``k<count-1>`` one by one through a host tier of ``host_blocks`` (the oldest spill to a disk
    tier of ``disk_blocks`` as the host tier fills), take a lease on ``hold`` (kept over the close), check the
    index, close cleanly."""
    caches = random_caches(BLOCKS, seed=SEED)
    off = kvoffload.Offloader(caches, host_blocks=host_blocks, disk_path=path, disk_blocks=disk_blocks, persist=True,
                              fingerprint="model-a").start()
    try:
        for i in range(count):
            off.store({f"k{i}": i % BLOCKS}).result(30)
        s = off.stats()
        assert (s.host_ready, s.disk_ready) == (host_blocks, min(disk_blocks, count - host_blocks)), s
        lease = off.lookup(list(hold), hold=True) if hold else None
        assert lease is None or lease.count == len(hold)
        check_index(off)
    finally:
        off.close()  # with the lease still held


@pytest.mark.slow
def test_a_clean_close_with_a_full_disk_keeps_the_newest_entries(tmp_path):
    path = tmp_path / "kv"
    store_spilling(path, 20, host_blocks=8, disk_blocks=12)  # disk: k0..k11 (full); host only: k12..k19
    off, caches = reopen(path, disk_blocks=12)
    try:
        check_index(off)
        held = stored_keys(off, [f"k{i}" for i in range(20)])
        assert held == [f"k{i}" for i in range(8, 20)], held  # the 8 oldest gave their slots to the host entries
        s = off.stats()
        assert s.recovered == 12 and s.dropped_at_open == 0
        assert_loads_byte_exact(off, caches, held)
        check_index(off)
    finally:
        off.close()


def test_a_clean_close_with_a_full_disk_never_takes_a_held_slot(tmp_path):
    path = tmp_path / "kv"
    # disk: k0..k7 (full), k0 held by a lease over the close; host only: k8..k15. Every disk slot but k0's is
    # rewritten, with the 7 newest host entries: k8, the oldest of them, finds no slot.
    store_spilling(path, 16, host_blocks=8, disk_blocks=8, hold=["k0"])
    off, caches = reopen(path, disk_blocks=8)
    try:
        held = stored_keys(off, [f"k{i}" for i in range(16)])
        assert held == ["k0"] + [f"k{i}" for i in range(9, 16)], held
        assert off.stats().dropped_at_open == 0
        assert_loads_byte_exact(off, caches, held)
        check_index(off)
    finally:
        off.close()


@pytest.mark.slow
def test_a_corrupted_header_is_dropped_on_reopen(tmp_path):
    path = tmp_path / "kv"
    offsets = store_and_close(path, 8)
    flip(path, offsets["k3"] + 30)  # inside k3's header
    off, caches = reopen(path)
    try:
        assert stored_keys(off, [f"k{i}" for i in range(8)]) == [f"k{i}" for i in range(8) if i != 3]
        assert off.stats().dropped_at_open == 1
        assert_loads_byte_exact(off, caches, [f"k{i}" for i in range(8) if i != 3])
    finally:
        off.close()


def test_verify_fails_the_load_of_a_corrupted_payload_and_drops_the_entry(tmp_path):
    path = tmp_path / "kv"
    offsets = store_and_close(path, 8)
    flip(path, offsets["k5"] + 4096 + 100)  # inside k5's payload: the clean checkpoint vouches for its header
    off, caches = reopen(path, verify=True)
    try:
        assert off.lookup([f"k{i}" for i in range(8)]) == 8
        with pytest.raises(kvoffload.TransferError) as ei:
            off.load({"k5": 0}).result(30)
        assert "CRC32C" in str(ei.value.__cause__)
        assert off.lookup(["k5"]) == 0 and off.stats().checksum_failures == 1
        assert_loads_byte_exact(off, caches, [f"k{i}" for i in range(8) if i != 5])
    finally:
        off.close()


def test_another_model_fingerprint_is_refused_and_the_file_kept_for_its_own(tmp_path):
    path = tmp_path / "kv"
    store_and_close(path, 48)
    before = path.read_bytes()
    with pytest.raises(kvoffload.StartError) as ei:
        reopen(path, fingerprint="model-b")
    said = str(ei.value)
    assert "fingerprint: 'model-b' here, 'model-a' there" in said and "left as it is" in said
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kv", "kv.checkpoint"]
    off, caches = reopen(path)  # the right fingerprint afterwards finds every entry
    try:
        keys = [f"k{i}" for i in range(48)]
        assert off.lookup(keys) == 48 and off.stats().recovered == 48
        assert_loads_byte_exact(off, caches, keys)
    finally:
        off.close()


@pytest.mark.slow
def test_a_directory_as_disk_path_holds_one_file_per_cache_identity(tmp_path):
    caches = random_caches(BLOCKS, seed=SEED)
    for fingerprint in ("model-a", "model-b"):
        with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path, disk_blocks=64, persist=True, fingerprint=fingerprint) as off:
            off.store({f"{fingerprint}-{i}": i for i in range(4)}).result(30)
            assert os.path.dirname(off.disk_file) == str(tmp_path)
    files = sorted(n for n in os.listdir(tmp_path) if not n.endswith(".checkpoint"))
    assert len(files) == 2 and all(n.startswith("kvoffload-") and n.endswith(".cache") for n in files)
    for fingerprint in ("model-a", "model-b"):
        off, _ = reopen(tmp_path, fingerprint=fingerprint, disk_blocks=64)
        try:
            assert off.lookup([f"{fingerprint}-{i}" for i in range(4)]) == 4
        finally:
            off.close()
    # without persistence the file has no name, in that directory (not in its parent)
    with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path, disk_blocks=16) as off:
        assert disk_file_stat(off).st_nlink == 0 and off.disk_file is None
        assert os.path.dirname(disk_file_location(off)) == str(tmp_path)
        off.store({"x": 1}).result(30)
    assert len(os.listdir(tmp_path)) == 4


def test_discarded_keys_never_come_back_after_a_restart(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    store_and_close(path, 8)  # a clean close: its checkpoint lists all 8
    off, caches = reopen(path, io_threads=1)
    assert off.discard(["k1", "k2"]) == 2
    off._running_storage().disk.pool.submit(lambda: None).result(30)  # one IO thread: the tombstones are written
    monkeypatch.setattr(PersistentSlots, "write_checkpoint", lambda *a, **k: 0)  # then a crash: no checkpoint since
    off.close()
    monkeypatch.undo()
    off, caches = reopen(path)
    try:
        assert stored_keys(off, [f"k{i}" for i in range(8)]) == [f"k{i}" for i in range(8) if i not in (1, 2)]
        assert sorted(off.keys()) == [f"k{i}" for i in range(8) if i not in (1, 2)]
        assert off.stats().dropped_at_open == 0
    finally:
        off.close()


@pytest.mark.slow
def test_keys_discarded_just_before_close_never_come_back(tmp_path):
    path = tmp_path / "kv"
    store_and_close(path, 8)
    off, caches = reopen(path)
    off._running_storage().disk.persistent._pool = None  # as when close cancels the queued job that voids their headers
    assert off.discard(["k1", "k6"]) == 2
    off.close()
    off, caches = reopen(path)
    try:
        assert stored_keys(off, [f"k{i}" for i in range(8)]) == [f"k{i}" for i in range(8) if i not in (1, 6)]
    finally:
        off.close()


@pytest.mark.parametrize("key", [("tuple", 1), 1.5, None, b"x" * 2000])
def test_keys_a_persistent_tier_cannot_encode_are_refused_at_the_call(tmp_path, key):
    caches = random_caches(BLOCKS)
    with kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=16, persist=True) as off:
        with pytest.raises((TypeError, ValueError)):
            off.store({key: 1})
        s = off.stats()
        assert s.pending == 0 and s.ready == 0 and s.host_free == 4
        if type(key) in (tuple, bytes):  # a native key, which the index could hold but the persistent tier cannot
            assert off.lookup([key]) == 0
        off.store({b"ok": 1}).result(10)


def test_persist_options_are_checked():
    caches = random_caches(BLOCKS)
    with pytest.raises(ValueError, match="needs persist"):
        kvoffload.Offloader(caches, fingerprint="m")
    with pytest.raises(ValueError, match="needs persist"):
        kvoffload.Offloader(caches, verify=True)
    with pytest.raises(ValueError, match="disk tier"):
        kvoffload.Offloader(caches, persist=True)
    with pytest.raises(TypeError, match="fingerprint"):
        kvoffload.Offloader(caches, disk_path="x", disk_blocks=4, persist=True, fingerprint=3)


def test_the_persistent_file_is_private_and_has_a_name(tmp_path):
    path = tmp_path / "kv"
    caches = random_caches(BLOCKS)
    with kvoffload.Offloader(caches, host_blocks=0, disk_path=path, disk_blocks=16, persist=True) as off:
        st = disk_file_stat(off)
        assert st.st_nlink == 1 and st.st_mode & 0o777 == 0o600 and os.stat(path).st_ino == st.st_ino
    assert sorted(os.listdir(tmp_path)) == ["kv", "kv.checkpoint"]


@pytest.mark.slow
def test_keys_discarded_just_before_a_crash_never_come_back(tmp_path):
    path = tmp_path / "kv"
    with Child(path, count=200) as child:
        assert child.read_until()
        discarded = [f"k{i}" for i in range(0, 200, 2)]
        assert child.command("discard " + " ".join(discarded)) == "discarded 100"
        child.kill()  # at once: discard() returned, nothing else had time to run
    off, caches = reopen(path)
    try:
        kept = [f"k{i}" for i in range(1, 200, 2)]
        assert stored_keys(off, discarded) == []
        assert stored_keys(off, kept) == kept
        assert_loads_byte_exact(off, caches, kept)
    finally:
        off.close()


def test_lookup_stats_and_stores_never_wait_for_a_disk_header_write(tmp_path, faults):
    caches = random_caches(BLOCKS, seed=SEED)
    with kvoffload.Offloader(caches, host_blocks=32, disk_path=tmp_path / "kv", disk_blocks=64, persist=True) as off:
        off.store({f"k{i}": i for i in range(40)}).result(30)  # k0-k7 go to disk, the rest to host memory
        assert off.stats().disk_ready == 8 and off.discard(["k38", "k39"]) == 2  # room in host memory for one more store
        gate = faults.gate(off, "pwritev")  # holds every disk write: the header voids of the discards below
        discards = [threading.Thread(target=off.discard, args=([k],)) for k in ("k0", "k1")]
        for t in discards:
            t.start()
        gate.wait_entered()
        done = threading.Event()
        seen = []

        def others() -> None:
            seen.extend([off.lookup(["k5", "k6"]), "k20" in off, off.stats().disk_slots])
            off.store({"new": 3}).result(30)
            done.set()

        other = threading.Thread(target=others)
        other.start()
        answered = done.wait(10)
        gate.open()
        for t in [*discards, other]:
            t.join(30)
        assert answered, "lookup(), in, stats() or store() waited for a disk write"
        assert seen == [2, True, 64]
        assert off.lookup(["k0"]) == 0 and off.lookup(["k1"]) == 0 and off.lookup(["new"]) == 1


def test_a_failed_start_removes_the_persistent_file_it_created_and_keeps_one_it_found(tmp_path, monkeypatch):
    from kvoffload._core.tiers import disk

    caches = random_caches(BLOCKS, seed=SEED)

    def no_memory(*args, **kwargs):
        raise MemoryError("no memory for the bounce buffers")

    monkeypatch.setattr(disk, "HostBuffer", no_memory)  # start() fails once the file is open
    with pytest.raises(kvoffload.StartError, match="bounce"):
        kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "new", disk_blocks=16, persist=True).start()
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    store_and_close(tmp_path / "kv", 8)
    before = (tmp_path / "kv").read_bytes(), (tmp_path / "kv.checkpoint").read_bytes()
    monkeypatch.setattr(disk, "HostBuffer", no_memory)
    with pytest.raises(kvoffload.StartError):
        reopen(tmp_path / "kv")
    monkeypatch.undo()
    assert ((tmp_path / "kv").read_bytes(), (tmp_path / "kv.checkpoint").read_bytes()) == before
    off, caches = reopen(tmp_path / "kv")
    try:
        assert off.lookup([f"k{i}" for i in range(8)]) == 8
    finally:
        off.close()


def test_a_disk_tier_on_a_ram_backed_file_system_is_warned_about(caplog):
    from kvoffload._core.base.file_systems import ram_backed_fs

    if not os.path.isdir("/dev/shm") or ram_backed_fs("/dev/shm") is None:
        pytest.skip("no tmpfs at /dev/shm")
    caches = random_caches(BLOCKS)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        with kvoffload.Offloader(caches, host_blocks=0, disk_path="/dev/shm", disk_blocks=4) as off:
            off.store({"a": 1}).result(30)
    assert "saves no memory" in caplog.text and "tmpfs" in caplog.text
