"""What the process holds: kvoffload's threads, open file descriptors, resident memory."""

from __future__ import annotations

import os
import threading


def kvoffload_threads() -> list[str]:
    """Names of live threads the library started."""
    return [t.name for t in threading.enumerate() if t.name.startswith("kvoffload")]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
