"""What the disk tier does with what it finds at disk_path.

Without persistence the disk file never has a name: nothing at disk_path is created, read, reused
or removed, and a process ended any way (SIGTERM, SIGKILL included) leaves no file behind.

With persistence (``persist=True``) the file at disk_path is the cache: nothing there, it creates
its own private file. A file another live offloader holds, in this process or another, is refused
and left alone; so are a symlink (never followed), a fifo (without blocking on it), a socket, a
device. A directory holds the file (one per cache identity when persistent). The file is locked from its creation, and a start that fails removes only a
file it created.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

import kvoffload
from support.caches import block_bytes, random_caches


def open_disk(path, caches=None, persist=True):
    caches = random_caches(8, seed=11) if caches is None else caches
    return kvoffload.Offloader(caches, host_blocks=0, disk_path=path, disk_blocks=8, persist=persist)


def chain_text(e: BaseException) -> str:
    """The messages of ``e`` and its causes (a start error may wrap the disk tier's)."""
    parts = []
    while e is not None:
        parts.append(str(e))
        e = e.__cause__
    return " | ".join(parts)


def assert_refused(path, *words):
    """Starting an offloader on ``path`` fails with OffloadError whose message names ``words``."""
    threads = set(threading.enumerate())
    off = open_disk(path)
    with pytest.raises(kvoffload.OffloadError) as ei:
        off.start()
    text = chain_text(ei.value)
    assert str(path) in text and all(w in text for w in words), text
    assert not [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("kvoffload")]


def round_trip(off, caches):
    """Store two blocks of ``caches`` (``off``'s cache) and load them back elsewhere, byte for byte."""
    want = {k: block_bytes(caches, k) for k in (1, 2)}
    off.store({"rt1": 1, "rt2": 2}).result(10)
    for t in caches.values():
        t[5:7].zero_()
    off.load({"rt1": 5, "rt2": 6}).result(10)
    assert block_bytes(caches, 5) == want[1] and block_bytes(caches, 6) == want[2]


def identity(path):
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_dev, st.st_ino, st.st_rdev


def test_fifo_is_refused_without_opening_it(tmp_path):
    path = tmp_path / "kv"
    os.mkfifo(path, 0o600)
    before = identity(path)
    outcome: list = []

    def start():
        off = open_disk(path)
        try:
            off.start()
            outcome.append(off)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # blocked opening the fifo: release it (either end), then fail
        for flags in (os.O_WRONLY, os.O_RDONLY):
            try:
                os.close(os.open(path, flags | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(10)
        pytest.fail("starting on a fifo blocked")
    (result,) = outcome
    if isinstance(result, kvoffload.Offloader):
        result.close()
    assert isinstance(result, kvoffload.OffloadError), repr(result)
    text = chain_text(result)
    assert str(path) in text and "fifo" in text, text
    assert identity(path) == before


def test_unix_socket_is_refused(tmp_path):
    path = tmp_path / "kv.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        before = identity(path)
        assert_refused(path, "socket")
        assert identity(path) == before


@pytest.mark.parametrize("persist", [True, False], ids=["persistent", "not-persistent"])
def test_a_directory_holds_the_file_and_nothing_else_in_it_is_touched(tmp_path, persist):
    path = tmp_path / "kv"
    path.mkdir()
    (path / "inside").write_bytes(b"keep")
    caches = random_caches(8, seed=11)
    with open_disk(path, caches, persist=persist) as off:
        round_trip(off, caches)
        name = off.disk_file
    if persist:
        assert os.path.dirname(name) == str(path) and os.path.basename(name).startswith("kvoffload-")
        assert sorted(os.listdir(path)) == sorted(["inside", os.path.basename(name), os.path.basename(name) + ".checkpoint"])
    else:
        assert name is None and os.listdir(path) == ["inside"]
    assert (path / "inside").read_bytes() == b"keep" and os.listdir(tmp_path) == ["kv"]


def test_device_is_refused(tmp_path):
    path = tmp_path / "kv"
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    except PermissionError:
        pytest.skip("creating a device node needs privileges")
    before = identity(path)
    assert_refused(path, "character device")
    assert identity(path) == before


def test_a_file_another_offloader_in_this_process_holds_is_refused(tmp_path, make_offloader):
    path = tmp_path / "kv"
    caches = random_caches(8, seed=12)
    first = make_offloader(caches, host_blocks=0, disk_path=path, disk_blocks=8, persist=True)
    before = identity(path)
    assert_refused(path, "in use by another kvoffload offloader")
    assert identity(path) == before
    round_trip(first, caches)  # the first one keeps working
    assert identity(path) == before
    first.close()
    assert identity(path) == before  # kept: it is persistent
    with open_disk(path, caches) as again:
        round_trip(again, caches)


@pytest.mark.slow
def test_a_file_another_process_holds_is_refused(tmp_path):
    path = tmp_path / "kv"
    tests_dir = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, kvoffload
            from support.caches import random_caches
            off = kvoffload.Offloader(random_caches(8), host_blocks=0, disk_path=sys.argv[1], disk_blocks=8, persist=True).start()
            off.store({"k": 1}).result(10)
            print("ready", flush=True)
            sys.stdin.readline()
            off.close()
        """), str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        assert ready and holder.stdout.readline() == "ready\n", holder.stderr.read() if holder.poll() is not None else "no answer"
        before = identity(path)
        assert_refused(path, "in use by another kvoffload offloader")
        assert identity(path) == before
        holder.stdin.write("close\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0, holder.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert path.exists()
    caches = random_caches(8)
    with open_disk(path, caches) as off:
        round_trip(off, caches)


@pytest.mark.parametrize("target", ["file", "fifo", "missing"])
def test_a_symlink_is_refused_not_followed(tmp_path, target):
    dest = tmp_path / "target"
    if target == "file":
        dest.write_bytes(b"do not overwrite")
    elif target == "fifo":
        os.mkfifo(dest)
    link = tmp_path / "kv"
    link.symlink_to(dest)
    before = identity(link)
    assert_refused(link, "symlink")
    assert identity(link) == before
    if target == "file":
        assert dest.read_bytes() == b"do not overwrite"
    elif target == "fifo":
        assert stat.S_ISFIFO(os.lstat(dest).st_mode)
    else:
        assert not os.path.lexists(dest)


def test_the_file_is_locked_before_its_space_is_reserved(tmp_path, monkeypatch):
    path = tmp_path / "kv"
    real = os.posix_fallocate
    seen = []

    def probing(fd, offset, length):
        probe = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("unlocked")
        except BlockingIOError:
            seen.append("locked")
        finally:
            os.close(probe)
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", probing)
    caches = random_caches(8)
    with open_disk(path, caches) as off:
        round_trip(off, caches)
    assert seen == ["locked"]


def test_a_failed_start_removes_only_a_file_it_created(tmp_path, monkeypatch):
    path = tmp_path / "kv"

    def replaced_then_full(fd, offset, length):
        os.unlink(path)  # someone else put their file at the path meanwhile
        path.write_bytes(b"theirs")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", replaced_then_full)
    with pytest.raises(kvoffload.OffloadError) as ei:
        open_disk(path).start()
    assert "cannot reserve" in chain_text(ei.value)
    assert path.read_bytes() == b"theirs"


# -- without persistence ---------------------------------------------------------------------


def whats_there(directory):
    return {name: identity(directory / name) for name in os.listdir(directory)}


@pytest.mark.parametrize("there", ["nothing", "file", "symlink", "fifo", "directory"])
def test_without_persistence_nothing_at_the_path_is_touched_and_no_file_gets_a_name(tmp_path, there):
    path = tmp_path / "kv"
    if there == "file":
        path.write_bytes(b"keep")
    elif there == "symlink":
        (tmp_path / "target").write_bytes(b"keep")
        path.symlink_to(tmp_path / "target")
    elif there == "fifo":
        os.mkfifo(path)
    elif there == "directory":
        path.mkdir()
    before = whats_there(tmp_path)
    caches = random_caches(8)
    with open_disk(path, caches, persist=False) as off:
        round_trip(off, caches)
        assert whats_there(tmp_path) == before
        assert off.stats().disk_bytes_written > 0
    assert whats_there(tmp_path) == before
    if there in ("file", "symlink"):
        assert path.read_bytes() == b"keep"


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "no-O_TMPFILE"])
@pytest.mark.slow
def test_two_offloaders_without_persistence_share_a_path_without_sharing_a_file(tmp_path, monkeypatch, tmpfile):
    if not tmpfile:  # a file system without O_TMPFILE: a temporary name, unlinked before start() returns
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    path = tmp_path / "kv"
    a_caches, b_caches = random_caches(8, seed=1), random_caches(8, seed=2)
    with open_disk(path, a_caches, persist=False) as a, open_disk(path, b_caches, persist=False) as b:
        round_trip(a, a_caches)
        round_trip(b, b_caches)
        assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.slow
def test_a_process_killed_without_persistence_leaves_no_file(tmp_path, sig):
    path = tmp_path / "kv"
    tests_dir = os.path.dirname(__file__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, kvoffload
            from support.caches import random_caches
            off = kvoffload.Offloader(random_caches(8), host_blocks=0, disk_path=sys.argv[1], disk_blocks=8).start()
            off.store({"k": 1}).result(10)
            print("ready", flush=True)
            sys.stdin.readline()
        """), str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready and child.stdout.readline() == "ready\n", child.stderr.read() if child.poll() is not None else "no answer"
        assert os.listdir(tmp_path) == []
        child.send_signal(sig)
        assert child.wait(30) == -sig
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert os.listdir(tmp_path) == []
