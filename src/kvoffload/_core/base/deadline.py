"""Time limits that span several waits (``close(timeout)``: every step shares one limit)."""

from __future__ import annotations

import time

__all__ = ["Deadline", "check_seconds", "check_timeout"]


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


def check_seconds(name: str, value: object, *, infinite: bool = False) -> float:
    """``value`` as a duration in seconds: a finite real number >= 0 (``infinite``: also ``inf``, for
    "no deadline"); else ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not value >= 0:  # also refuses nan
        raise ValueError(f"{name} must be a number of seconds >= 0{' (inf: no deadline)' if infinite else ''}, got {value!r}")
    if value == float("inf") and not infinite:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{name} must be a number of seconds >= 0 that a float holds, got an int too large for one") from None


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as close() takes it: seconds (:func:`check_seconds`) or None (no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    return check_seconds("timeout (or None: no limit)", timeout)
