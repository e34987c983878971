"""Time limits that span several waits (``close(timeout)``: every step shares one limit)."""

from __future__ import annotations

import time

__all__ = ["Deadline", "check_timeout"]


class Deadline:
    """A time limit for a sequence of waits: each step gets what is left. ``None``: no limit."""

    __slots__ = ("timeout", "_end")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self._end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        """Seconds left (never negative), or None without a limit: for ``join`` and ``Event.wait``."""
        return None if self._end is None else max(self._end - time.monotonic(), 0.0)

    def lock_timeout(self) -> float:
        """Seconds left as ``Lock.acquire`` takes them (-1: no limit)."""
        left = self.left()
        return -1 if left is None else left


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as close() takes it: seconds (a real number >= 0) or None (no limit); else TypeError/ValueError."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    if not timeout >= 0 or timeout == float("inf"):  # also refuses nan
        raise ValueError(f"timeout must be a finite number of seconds >= 0 (or None: no limit), got {timeout!r}")
    return float(timeout)
