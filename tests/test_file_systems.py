"""``ram_backed_fs``: which paths lie on a file system that keeps its files in memory (tmpfs, ramfs),
checked against ``/proc/mounts`` on this machine, and on mount tables written by the tests (escaped
mount points, stacked mounts, lines it cannot parse)."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest

from kvoffload._core.base import file_systems
from kvoffload._core.base.file_systems import RAM_BACKED, ram_backed_fs


def proc_mounts_type(path: str) -> str | None:
    """The type ``/proc/mounts`` gives the file system holding ``path``: the longest mount point that
    is ``path`` or a parent of it, the last listed of several there (the one mounted on top)."""
    target = os.path.realpath(path)
    best, kind = "", None
    with open("/proc/mounts", "rb") as f:
        for line in f:
            fields = line.split()
            point = os.fsdecode(fields[1]).replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, os.fsdecode(fields[2])
    return kind


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/mounts") or not os.path.exists("/proc/self/mountinfo"), reason="no /proc")
shm_is_tmpfs = os.path.isdir("/dev/shm") and os.path.exists("/proc/mounts") and proc_mounts_type("/dev/shm") == "tmpfs"
needs_shm = pytest.mark.skipif(not shm_is_tmpfs, reason="no /dev/shm on tmpfs")


@needs_shm
def test_dev_shm_and_paths_not_yet_there_inside_it_are_tmpfs():
    assert ram_backed_fs("/dev/shm") == "tmpfs"
    gone = f"/dev/shm/kvoffload-test-{uuid.uuid4().hex}"
    assert not os.path.exists(gone)
    assert ram_backed_fs(gone) == "tmpfs"
    assert ram_backed_fs(os.path.join(gone, "sub", "kv.cache")) == "tmpfs"
    assert not os.path.exists(gone)


@needs_shm
def test_a_file_in_a_tmpfs_directory_with_a_space_in_its_name():
    d = tempfile.mkdtemp(prefix="kvoffload test ", dir="/dev/shm")
    try:
        path = os.path.join(d, "kv cache")
        assert ram_backed_fs(path) == "tmpfs"  # not there yet
        with open(path, "wb"):
            pass
        assert ram_backed_fs(path) == "tmpfs" and ram_backed_fs(d) == "tmpfs"
        link = os.path.join(d, "link")
        os.symlink("/dev/shm", link)
        assert ram_backed_fs(os.path.join(link, "x")) == "tmpfs"
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


@needs_proc
def test_tmp_path_agrees_with_proc_mounts(tmp_path):
    kind = proc_mounts_type(str(tmp_path))
    expected = kind if kind in RAM_BACKED else None
    (tmp_path / "kv").write_bytes(b"")
    for path in (tmp_path, tmp_path / "kv", tmp_path / "not-yet", tmp_path / "not" / "yet"):
        assert ram_backed_fs(str(path)) == expected, (path, kind)
    assert ram_backed_fs(tmp_path) == expected  # a PathLike too


def mountinfo(tmp_path, monkeypatch, *lines: str) -> None:
    """Make ``ram_backed_fs`` read ``lines`` as the mount table."""
    table = tmp_path / "mountinfo"
    table.write_bytes("".join(line + "\n" for line in lines).encode())
    monkeypatch.setattr(file_systems, "_MOUNTINFO", str(table))


def test_escaped_mount_points_and_whole_path_components(tmp_path, monkeypatch):
    mountinfo(
        tmp_path, monkeypatch,
        "1 0 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
        r"20 1 0:40 / /mnt/ram\040disk rw,nosuid shared:7 master:2 - tmpfs tmpfs rw,size=64k",
        "21 1 8:2 / /mnt/ram rw - ext4 /dev/sda2 rw",
        r"22 1 0:41 / /mnt/a\134b\011c rw - ramfs none rw",
        r"23 20 8:3 / /mnt/ram\040disk/on\040disk rw - xfs /dev/sda3 rw",
    )
    assert ram_backed_fs("/mnt/ram disk") == "tmpfs"
    assert ram_backed_fs("/mnt/ram disk/kv") == "tmpfs"
    assert ram_backed_fs("/mnt/ram disk/on disk/kv") is None  # a disk mounted inside the tmpfs
    assert ram_backed_fs("/mnt/ram disk/on diskette") == "tmpfs"
    assert ram_backed_fs("/mnt/ram/kv") is None
    assert ram_backed_fs("/mnt/ramdisk/kv") is None  # '/mnt/ram' is not a parent of it
    assert ram_backed_fs("/mnt/a\\b\tc/kv") == "ramfs"
    assert ram_backed_fs("/mnt/a\\b") is None


@pytest.mark.parametrize("order", [1, -1])
def test_of_mounts_stacked_on_one_point_the_top_one_counts(tmp_path, monkeypatch, order):
    lines = ["30 1 0:50 / /data rw - tmpfs tmpfs rw", "31 30 8:4 / /data rw - ext4 /dev/sdb rw"]  # 31 on top of 30
    mountinfo(tmp_path, monkeypatch, "1 0 8:1 / / rw - ext4 /dev/sda1 rw", *lines[::order])
    assert ram_backed_fs("/data/kv") is None
    lines = ["30 1 8:4 / /data rw - ext4 /dev/sdb rw", "31 30 0:50 / /data rw - tmpfs tmpfs rw"]
    mountinfo(tmp_path, monkeypatch, "1 0 8:1 / / rw - ext4 /dev/sda1 rw", *lines[::order])
    assert ram_backed_fs("/data/kv") == "tmpfs"


GOOD = "1 0 0:50 / /data rw - tmpfs tmpfs rw"  # alone, it makes /data/kv tmpfs


@pytest.mark.parametrize("table", [
    None,  # no /proc
    "",  # no mounts
    f"{GOOD}\n2 1 8:1 / / rw ext4 /dev/sda1 rw",  # no separator
    f"{GOOD}\n2 1 8:1 / /",  # cut short
    f"{GOOD}\nnot a mount table at all",
    f"{GOOD}\n2 1 0:51 / /x\\777 rw - tmpfs tmpfs rw",  # an escape beyond a byte
], ids=["absent", "empty", "no separator", "cut short", "not mountinfo", "bad escape"])
def test_what_cannot_be_told_is_none(tmp_path, monkeypatch, table):
    mountinfo(tmp_path, monkeypatch, GOOD)
    assert ram_backed_fs("/data/kv") == "tmpfs"
    if table is None:
        monkeypatch.setattr(file_systems, "_MOUNTINFO", str(tmp_path / "absent"))
    else:
        mountinfo(tmp_path, monkeypatch, *table.splitlines())
    assert ram_backed_fs("/data/kv") is None
