"""Fixtures only: random caches, a factory of offloaders, ``faults`` (gates and faults on copies and
disk IO through the kvoffload._testing seams), ``standin_driver``; and the terminal summary of the
reliability figures. The helpers the tests import are in ``tests/support/``."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import kvoffload
from support.caches import random_caches
from support.faults import Faults
from support.figures import RELIABILITY_FIGURES
from support.standins import StandInDriver


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    return random_caches(64)


@pytest.fixture
def make_offloader():
    """Create started offloaders; closes them and checks no worker thread is left."""
    made: list[kvoffload.Offloader] = []
    before = {t.ident for t in threading.enumerate()}

    def make(caches, **kw):
        off = kvoffload.Offloader(caches, **kw).start()
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvoffload")]
    assert not leftover, f"threads left running: {leftover}"


@pytest.fixture
def faults():
    """Gate or break an offloader's copies and disk IO; everything is restored (gates opened) at teardown.

    ``faults.gate(off, path) -> Gate``: ``wait_entered(timeout, count)``, ``allow(n)``, ``open()``,
    ``entered``/``passed``/``in_flight``/``calls``, ``remove()``.
    ``faults.fail(off, path, exc_or_callable, from_call=1) -> Fault``: ``injected``, ``active``, ``remove()``.
    ``faults.spy(off, path)``; ``faults.restore()``. Paths: "to_host", "to_device", "pwritev", "preadv".
    """
    f = Faults()
    yield f
    f.restore()


@pytest.fixture
def host_allocations(monkeypatch) -> list[int]:
    """The size of every host buffer allocated from here on (host slab, bounce buffers), in order."""
    from kvoffload._core.tiers import hostmem

    allocated: list[int] = []
    real = hostmem.HostBuffer.__init__

    def init(self, nbytes, *, pin):
        allocated.append(nbytes)
        real(self, nbytes, pin=pin)

    monkeypatch.setattr(hostmem.HostBuffer, "__init__", init)
    return allocated


@pytest.fixture
def standin_driver(monkeypatch) -> Iterator[StandInDriver]:
    """A :class:`StandInDriver` behind every ``DriverEvent`` made during the test."""
    from kvoffload._core.base.piece_copies import use_event_calls
    from kvoffload._core.cuda import driver as cuda_driver

    standin = StandInDriver()
    monkeypatch.setattr(cuda_driver, "enqueue_calls", lambda: standin)
    previous = use_event_calls(standin.event_calls)
    yield standin
    use_event_calls(previous)


def pytest_terminal_summary(terminalreporter) -> None:
    if RELIABILITY_FIGURES:
        terminalreporter.section("kvoffload reliability figures")
        for line in RELIABILITY_FIGURES:
            terminalreporter.write_line(line)
