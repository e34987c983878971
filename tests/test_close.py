"""close() keeps its word: it returns within its timeout whatever other threads do inside
``store()``/``load()``, validates its argument before it acts, races safely with ``stats()``, and
leaves every counter where it was."""

from __future__ import annotations

import signal
import threading

import pytest

import kvoffload
from kvoffload._core.workers.copy_worker import CopyWorker

from support.caches import random_caches

BOUND_S = 10.0
"""Far more than any close here needs: only a hang exceeds it."""


@pytest.fixture
def stalled_store(monkeypatch):
    """Makes the next store() stall inside the call, after its slots are reserved (as a GPU store
    does when the driver's queue is full behind a stalled stream), until ``release`` is set."""
    inside, release = threading.Event(), threading.Event()
    real = CopyWorker.start

    def start(self, *args):
        inside.set()
        release.wait(BOUND_S)
        return real(self, *args)

    monkeypatch.setattr(CopyWorker, "start", start)
    return inside, release


def test_close_returns_within_its_timeout_while_a_store_call_is_stuck_then_finishes(stalled_store):
    inside, release = stalled_store
    off = kvoffload.Offloader(random_caches(16), host_blocks=8).start()
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(off.store({"a": 1, "b": 2})))
    caller.start()
    assert inside.wait(BOUND_S)
    try:
        closer_error: list[BaseException] = []

        def close() -> None:
            try:
                off.close(timeout=0.2)
            except BaseException as e:
                closer_error.append(e)

        closer = threading.Thread(target=close)
        closer.start()
        closer.join(BOUND_S)
        assert not closer.is_alive(), "close(timeout=0.2) did not return while a store() call was stuck"
        assert len(closer_error) == 1 and isinstance(closer_error[0], kvoffload.CloseError), closer_error
        assert "store() or load()" in str(closer_error[0])
        assert off.closed
        with pytest.raises(kvoffload.ClosedError):  # closed to new calls at once
            off.lookup(["a"])
    finally:
        release.set()
    caller.join(BOUND_S)
    # The stuck call went through (it was inside before close); close() then finishes the job.
    off.close(timeout=BOUND_S)
    transfer = outcome[0]
    assert isinstance(transfer, kvoffload.Transfer) and transfer.done()
    assert off.stats().in_flight == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]


@pytest.mark.parametrize("timeout, error", [
    (-5, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), ("3", TypeError), (True, TypeError),
])
def test_a_bad_timeout_is_refused_before_anything_is_closed(timeout, error):
    with kvoffload.Offloader(random_caches(8), host_blocks=4) as off:
        with pytest.raises(error, match="timeout"):
            off.close(timeout=timeout)
        assert not off.closed
        off.store({"k": 1}).result(BOUND_S)  # still serving


def test_close_with_no_timeout_waits_as_long_as_it_takes():
    off = kvoffload.Offloader(random_caches(8), host_blocks=4).start()
    off.store({"k": 1}).result(BOUND_S)
    off.close(timeout=None)
    assert off.closed and not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]


def test_close_from_a_signal_handler_inside_a_store_of_the_same_thread_hands_off_and_completes():
    off = kvoffload.Offloader(random_caches(8), host_blocks=4).start()
    index = off._running_storage().index
    reserve = index.reserve
    closed_in_handler: list[bool] = []

    def handler(signum, frame) -> None:
        off.close(timeout=BOUND_S)  # inside this thread's store() call: it cannot wait for the call
        closed_in_handler.append(off.closed)

    def reserve_after_a_signal(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)  # its handler runs in this thread, before the reservation
        return reserve(*args, **kwargs)

    previous = signal.signal(signal.SIGUSR1, handler)
    index.reserve = reserve_after_a_signal  # type: ignore[method-assign]
    try:
        off.store({"k": 1})
    except kvoffload.OffloadError:
        pass  # closed under the call: the store may or may not have started
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert closed_in_handler == [True] and off.closed
    for t in threading.enumerate():
        if t.name == "kvoffload-close":  # the handed-off close: let it finish
            t.join(BOUND_S)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvoffload")]


def test_stats_racing_close_never_raise_and_counters_never_go_down(tmp_path):
    caches = random_caches(64)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    for _ in range(5):
        off = kvoffload.Offloader(caches, host_blocks=4, disk_path=tmp_path / "kv", disk_blocks=32, chunk_bytes=slot).start()
        for i in range(16):  # spills 12 entries, writes the disk file
            off.store({("k", i): i}).result(BOUND_S)
        off.load({("k", 0): 40}).result(BOUND_S)  # reads it
        off.discard([("k", i) for i in range(8, 16)])
        for i in range(16, 48):  # evicts from disk
            off.store({("k", i): i % 64}).result(BOUND_S)
        before = off.stats()
        assert before.evicted and before.spilled and before.disk_bytes_written and before.disk_bytes_read
        seen: list[kvoffload.OffloaderStats] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def scrape() -> None:
            while not stop.is_set():
                try:
                    seen.append(off.stats())
                except BaseException as e:
                    errors.append(e)
                    return

        scrapers = [threading.Thread(target=scrape) for _ in range(2)]
        for t in scrapers:
            t.start()
        off.close()
        stop.set()
        for t in scrapers:
            t.join(BOUND_S)
        assert not errors, errors
        after = off.stats()
        for s in [*seen, after]:
            for name in ("evicted", "evicted_host", "evicted_disk", "spilled", "disk_bytes_written", "disk_bytes_read",
                         "disk_io_errors", "stores", "loads", "lookups"):
                assert getattr(s, name) >= getattr(before, name), (name, getattr(s, name), getattr(before, name))
