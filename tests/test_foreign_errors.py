"""Whatever a disk IO call or a block copy raises or returns, only its transfer fails, with TransferError.

Every exception type (including the ones asyncio treats specially: StopIteration, CancelledError,
and BaseExceptions such as SystemExit) raised from every foreign call (pwritev in a disk store and in
a spill, preadv in a disk load, the copy to host in a store, the copy to the device in a load) fails
that transfer with ``kvoffload.TransferError`` -- not cancelled, not hanging -- with the raised
exception as ``__cause__``; then the offloader works as before. Likewise an IO call that returns
anything but the byte count it was asked for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno

import pytest

import kvoffload
from support.caches import block_bytes, random_caches
from kvoffload._testing import copy_calls, disk_io


def _raisers():
    return {
        "OSError(EIO)": lambda: OSError(errno.EIO, "Input/output error"),
        "RuntimeError": lambda: RuntimeError("injected"),
        "StopIteration": lambda: StopIteration("injected"),
        "StopAsyncIteration": lambda: StopAsyncIteration("injected"),
        "concurrent.futures.CancelledError": lambda: concurrent.futures.CancelledError(),
        "asyncio.CancelledError": lambda: asyncio.CancelledError(),
        "OffloadError": lambda: kvoffload.OffloadError("injected"),
        "TransferError": lambda: kvoffload.TransferError("injected"),
        "SystemExit": lambda: SystemExit("injected"),
        "KeyboardInterrupt": lambda: KeyboardInterrupt(),
        "GeneratorExit": lambda: GeneratorExit(),
    }


RAISERS = _raisers()

# where the fault is injected -> (offloader options, seam attribute)
SITES = {
    "pwritev-disk-store": (dict(host_blocks=0, disk_blocks=8), "pwritev"),
    "pwritev-spill": (dict(host_blocks=2, disk_blocks=8), "pwritev"),
    "preadv-disk-load": (dict(host_blocks=0, disk_blocks=8), "preadv"),
    "to_host-store": (dict(host_blocks=8), "to_host"),
    "to_device-load": (dict(host_blocks=8), "to_device"),
}


def _seam(off, attr):
    return disk_io(off) if attr in ("pwritev", "preadv") else copy_calls(off)


def _setup(make_offloader, tmp_path, site):
    """A started offloader with keys 0 and 1 stored; returns it, its caches and the transfer to break."""
    opts, attr = SITES[site]
    caches = random_caches(16, seed=7)
    if "disk_blocks" in opts:
        opts = dict(opts, disk_path=tmp_path / "kv")
    off = make_offloader(caches, **opts)
    off.store({0: 0, 1: 1}).result(10)  # with 2 host slots, the next store spills
    if site == "pwritev-spill":
        return off, caches, lambda: off.store({2: 2})
    if attr in ("preadv", "to_device"):
        return off, caches, lambda: off.load({0: 8})
    return off, caches, lambda: off.store({2: 2})


def _check_still_works(off, caches, old_keys):
    """Nothing stays pending, pinned or spilling; old keys and a fresh round trip load byte for byte."""
    s = off.stats()
    assert (s.pending, s.pinned, s.spilling, s.in_flight) == (0, 0, 0, 0), s
    want = {k: block_bytes(caches, k) for k in old_keys}
    r = off.store({"fresh": 5}).result(10)
    assert r.keys == ("fresh",)
    want["fresh"] = block_bytes(caches, 5)
    dests = {k: 8 + i for i, k in enumerate(want)}
    for t in caches.values():
        t[8:].zero_()
    off.load(dests).result(10)
    for k, d in dests.items():
        assert block_bytes(caches, d) == want[k], k
    s = off.stats()
    assert (s.pending, s.pinned, s.spilling, s.in_flight) == (0, 0, 0, 0), s


@pytest.mark.parametrize("raised", list(RAISERS))
@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.slow
def test_any_exception_from_a_foreign_call_fails_only_its_transfer(make_offloader, tmp_path, site, raised):
    off, caches, transfer = _setup(make_offloader, tmp_path, site)
    attr = SITES[site][1]
    seam = _seam(off, attr)
    real = getattr(seam, attr)
    injected = []

    def broken(*args):
        injected.append(RAISERS[raised]())
        raise injected[-1]

    setattr(seam, attr, broken)
    t = transfer()
    try:
        with pytest.raises(kvoffload.TransferError) as ei:
            t.result(10)  # a hang is a TimeoutError, a cancellation a CancelledError: both fail the test
    finally:
        setattr(seam, attr, real)
    assert not t.cancelled() and isinstance(t.exception(), kvoffload.TransferError)
    assert injected and ei.value.__cause__ is injected[0], repr(ei.value.__cause__)
    assert off.stats().failed == 1
    _check_still_works(off, caches, [0, 1])


def _bad_returns():
    class Weird:
        """Comparing it raises: the check must not call into what an IO call returns."""

        def __eq__(self, other):
            raise StopIteration

        __ne__ = __eq__
        __hash__ = object.__hash__

    return {
        "short": lambda n: n - 4096,
        "zero": lambda n: 0,
        "longer": lambda n: n + 4096,
        "None": lambda n: None,
        "str": lambda n: "x",
        "minus-one": lambda n: -1,
        "float": lambda n: float(n),
        "bool": lambda n: True,
        "comparison-raises": lambda n: Weird(),
    }


BAD_RETURNS = _bad_returns()


@pytest.mark.parametrize("returned", list(BAD_RETURNS))
@pytest.mark.parametrize("site", ["pwritev-disk-store", "pwritev-spill", "preadv-disk-load"])
@pytest.mark.slow
def test_io_call_returning_anything_but_the_byte_count_fails_the_transfer(make_offloader, tmp_path, site, returned):
    off, caches, transfer = _setup(make_offloader, tmp_path, site)
    attr = SITES[site][1]
    io = disk_io(off)
    real = getattr(io, attr)

    def lying(fd, buffers, offset):
        n = real(fd, buffers, offset)  # the IO itself happens
        return BAD_RETURNS[returned](n)

    setattr(io, attr, lying)
    t = transfer()
    try:
        with pytest.raises(kvoffload.TransferError) as ei:
            t.result(10)
    finally:
        setattr(io, attr, real)
    assert not t.cancelled()
    cause = ei.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.EIO, repr(cause)
    _check_still_works(off, caches, [0, 1])
