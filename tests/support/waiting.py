"""Waiting for library state no event announces; ``HANG_S``, the limit that only guards against hangs."""

from __future__ import annotations

import time

import kvoffload


HANG_S = 10.0  # a gate held longer than this fails the call (and so the test): it only guards against hangs


def spin_until(pred, timeout: float = HANG_S, what: str = "condition") -> None:
    """Wait for library state that no event announces (without sleeping: yields the GIL only);
    the timeout only fails the test."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0)


def wait_for_transfers_to_end(off: kvoffload.Offloader, timeout: float = HANG_S) -> None:
    """Wait until ``off`` counts no transfer in flight: those whose handles an interrupt lost end too
    (there is no handle to wait on)."""
    deadline = time.monotonic() + timeout
    while off.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)


def blocked(transfer) -> bool:
    """True once a thread is blocked in ``transfer.result()``: asleep until the driver rings it after
    the last copy (copies at call time, no timeout), or on the transfer's end."""
    job = transfer._job
    return transfer._finished is not None or (job is not None and bool(job.sleepers))
