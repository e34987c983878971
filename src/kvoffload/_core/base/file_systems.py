"""Which file system holds a path: RAM-backed ones, where a disk tier saves no memory."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

__all__ = ["ram_backed_fs"]

RAM_BACKED = frozenset({"tmpfs", "ramfs", "devtmpfs", "rootfs"})
"""File-system types (as mountinfo names them) that keep their files in memory."""

_MOUNTINFO = "/proc/self/mountinfo"
_ESCAPE = re.compile(rb"\\([0-7]{3})")


class _Mount(NamedTuple):
    mount_id: bytes
    parent_id: bytes
    mount_point: str
    fs_type: str


def ram_backed_fs(path: str) -> str | None:
    """The type of the file system holding ``path`` (a file, which need not exist yet, or a
    directory) when it keeps its files in memory (``"tmpfs"``, ``"ramfs"``, ...), else None; None
    too when it cannot be told (no ``/proc/self/mountinfo``, a line it cannot parse).

    Read from ``/proc/self/mountinfo`` (the mount whose mount point is the longest prefix of the
    resolved path) rather than ``statfs(2)`` through ctypes: no ``struct statfs`` layout to get
    right per architecture, a path that does not exist yet still has an answer, and the type is
    named as ``/proc/mounts`` and ``df -T`` name it (statfs gives a magic number, tmpfs's for devtmpfs).
    A mount hidden by a later mount on one of its mount point's parents is not told apart."""
    try:
        with open(_MOUNTINFO, "rb") as f:
            table = f.read()
        mounts = [_parse(line) for line in table.splitlines() if line.strip()]
        target = os.path.realpath(os.fspath(path))
    except (OSError, ValueError):
        return None
    mount = _holding(target, mounts)
    return mount.fs_type if mount is not None and mount.fs_type in RAM_BACKED else None


def _parse(line: bytes) -> _Mount:
    """One mountinfo line: ``ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE ...``
    (proc(5)); ``ValueError`` if it is not one."""
    fields = line.split(b" ")
    separator = fields.index(b"-", 6)  # ValueError if missing
    if len(fields) <= separator + 1 or not fields[4].startswith(b"/"):
        raise ValueError(f"not a mountinfo line: {line!r}")
    mount_point = os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), fields[4]))
    return _Mount(fields[0], fields[1], mount_point, os.fsdecode(fields[separator + 1]))


def _holding(target: str, mounts: list[_Mount]) -> _Mount | None:
    """The mount of ``mounts`` holding the absolute path ``target``: the longest mount point that is
    ``target`` or one of its parents; of several mounts there, the one on top of the others."""
    inside = [m for m in mounts if target == m.mount_point or target.startswith(m.mount_point.rstrip("/") + "/")]
    if not inside:
        return None
    longest = max(len(m.mount_point) for m in inside)
    here = [m for m in inside if len(m.mount_point) == longest]
    below = {m.parent_id for m in here}  # a mount stacked on another at the same point has it as its parent
    return ([m for m in here if m.mount_id not in below] or here)[-1]
