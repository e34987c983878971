"""Shared fixtures: random caches in several dtypes and piece sizes, a factory of offloaders, and
``faults`` (gates and faults on copies and disk IO through the kvoffload._testing seams)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import signal
import threading
import time

import pytest
import torch

import kvoffload
from kvoffload._testing import copy_calls, disk_io


def random_caches(num_blocks: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Several tensors with different dtypes and bytes per block, filled with random bits."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "k0": ((num_blocks, 4, 16), torch.float32),  # 256 B per block
        "v0": ((num_blocks, 3, 5), torch.int16),  # 30 B per block: odd sizes exercise slot padding
        "k1": ((num_blocks, 2, 8, 8), torch.bfloat16),  # 256 B
        "v1": ((num_blocks, 1000), torch.uint8),  # 1000 B
    }
    out = {}
    for name, (shape, dtype) in shapes.items():
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        out[name] = raw.view(dtype).view(shape).to(device)
    return out


def block_bytes(caches: dict[str, torch.Tensor], block: int) -> bytes:
    """Every byte of one block, across tensors."""
    return b"".join(t[block].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() for t in caches.values())


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


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (random bits include NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- reliability figures -------------------------------------------------------------------
# The reliability tests (test_model, test_faults, test_stress, test_shutdown) record how much
# they did (operations, faults injected, transfers cancelled); pytest prints the lines at the end.

RELIABILITY_FIGURES: list[str] = []


def report_figure(line: str) -> None:
    """Record one summary line; it is printed in the terminal summary (and now, under ``-s``)."""
    RELIABILITY_FIGURES.append(line)
    print(line)


def pytest_terminal_summary(terminalreporter) -> None:
    if RELIABILITY_FIGURES:
        terminalreporter.section("kvoffload reliability figures")
        for line in RELIABILITY_FIGURES:
            terminalreporter.write_line(line)


def kvoffload_threads() -> list[str]:
    """Names of live threads the library started."""
    return [t.name for t in threading.enumerate() if t.name.startswith("kvoffload")]



async def check_every_visible_key(off, caches, orig, keys_to_blocks) -> list:
    """Load every visible key into blocks 0..n-1 and compare with the block it was stored from.

    ``orig`` is a copy of the cache taken before the stores; returns the visible keys.
    """
    visible = [k for k in keys_to_blocks if k in off]
    for t in caches.values():
        t.zero_()
    if visible:
        await off.load({k: i for i, k in enumerate(visible)})
    for i, k in enumerate(visible):
        for n in caches:
            assert same_bytes(caches[n][i], orig[n][keys_to_blocks[k]]), (k, n)
    return visible


# -- fault injection and gated copies ------------------------------------------------------
# Every test that intercepts a copy or a disk IO call goes through the ``faults`` fixture, built on
# the seams of kvoffload._testing: ``copy_calls(off)`` (to_host, to_device: called on the worker
# loops) and ``disk_io(off)`` (pwritev, preadv: called on the IO threads). Both are looked up at
# every call, so replacing an attribute intercepts every later call.


PATHS = ("to_host", "to_device", "pwritev", "preadv")
HANG_S = 10.0  # a gate held longer than this fails the call (and so the test): it only guards against hangs


def _target(off: kvoffload.Offloader, path: str):
    if path in ("to_host", "to_device"):
        return copy_calls(off)
    if path in ("pwritev", "preadv"):
        io = disk_io(off)
        assert io is not None, f"{path}: this offloader has no disk tier"
        return io
    raise ValueError(f"unknown path {path!r}; one of {PATHS}")


class Intercept:
    """One intercepted path of one offloader; counts the calls that reached it and got through."""

    def __init__(self, obj, path: str) -> None:
        self.path = path
        self.cond = threading.Condition()
        self.entered = 0  # calls that reached the intercept
        self.passed = 0  # calls that returned or raised
        self.calls: list[tuple] = []  # the arguments of each call, in order
        self._obj = obj
        self._real = getattr(obj, path)
        setattr(obj, path, self._call)

    @property
    def in_flight(self) -> int:
        """Calls that reached the intercept and have not returned yet."""
        with self.cond:
            return self.entered - self.passed

    def _call(self, *args):
        with self.cond:
            self.entered += 1
            self.calls.append(args)
            n = self.entered
            self.cond.notify_all()
        try:
            return self._handle(n, args)
        finally:
            with self.cond:
                self.passed += 1
                self.cond.notify_all()

    def _handle(self, n: int, args: tuple):
        return self._real(*args)

    def _wait(self, what: str, pred, timeout: float) -> None:
        with self.cond:
            assert self.cond.wait_for(pred, timeout), f"{self.path}: {what} within {timeout} s (entered {self.entered}, passed {self.passed})"

    def wait_entered(self, timeout: float = HANG_S, count: int = 1) -> None:
        """Block until ``count`` calls in all have reached the intercept (fails the test after ``timeout``)."""
        self._wait(f"fewer than {count} call(s) arrived", lambda: self.entered >= count, timeout)

    def wait_passed(self, timeout: float = HANG_S, count: int = 1) -> None:
        """Block until ``count`` calls in all have got through (returned or raised)."""
        self._wait(f"fewer than {count} call(s) got through", lambda: self.passed >= count, timeout)

    async def entered_async(self, count: int = 1, timeout: float = HANG_S) -> None:
        await asyncio.to_thread(self.wait_entered, timeout, count)

    async def passed_async(self, count: int = 1, timeout: float = HANG_S) -> None:
        await asyncio.to_thread(self.wait_passed, timeout, count)

    def remove(self) -> None:
        """Put the real call back (idempotent)."""
        if getattr(self._obj, self.path) == self._call:
            setattr(self._obj, self.path, self._real)


class Gate(Intercept):
    """Holds every call on its path until the test lets it through (``allow(n)``, ``open()``)."""

    def __init__(self, obj, path: str) -> None:
        super().__init__(obj, path)
        self._permits = 0
        self._open = False

    def allow(self, n: int = 1) -> None:
        """Let ``n`` more calls through (ones waiting now first)."""
        with self.cond:
            self._permits += n
            self.cond.notify_all()

    def open(self) -> None:
        """Let every call through from now on."""
        with self.cond:
            self._open = True
            self.cond.notify_all()

    def _handle(self, n: int, args: tuple):
        with self.cond:
            if not self.cond.wait_for(lambda: self._open or self._permits > 0, HANG_S):
                raise AssertionError(f"{self.path}: the test never let call {n} through the gate")
            if not self._open:
                self._permits -= 1
        return self._real(*args)

    def remove(self) -> None:
        self.open()
        super().remove()


class Fault(Intercept):
    """Breaks its path from call ``from_call`` on: raises ``what`` (an exception or its class), or
    returns ``what(real, *args)`` (a short write, a slow call, a spy). ``active = False`` heals it."""

    def __init__(self, obj, path: str, what, from_call: int = 1) -> None:
        super().__init__(obj, path)
        self.what = what
        self.from_call = from_call
        self.active = True
        self.injected = 0  # calls that got the fault

    def _handle(self, n: int, args: tuple):
        with self.cond:
            due = self.active and n >= self.from_call
            if due:
                self.injected += 1
        if not due:
            return self._real(*args)
        what = self.what
        if isinstance(what, BaseException) or (inspect.isclass(what) and issubclass(what, BaseException)):
            raise what
        return what(self._real, *args)


class Faults:
    """Gates and faults on an offloader's copies and disk IO; ``restore()`` undoes them all."""

    def __init__(self) -> None:
        self.installed: list[Intercept] = []

    def _add(self, icpt: Intercept) -> Intercept:
        self.installed.append(icpt)
        return icpt

    def gate(self, off: kvoffload.Offloader, path: str) -> Gate:
        """Hold every call on ``path`` ("to_host", "to_device", "pwritev", "preadv") until allowed."""
        return self._add(Gate(_target(off, path), path))

    def fail(self, off: kvoffload.Offloader, path: str, what, from_call: int = 1) -> Fault:
        """From the ``from_call``-th call on (1: every call), raise ``what`` (an exception or its class)
        or, if ``what`` is any other callable, return ``what(real, *args)`` instead of the real call."""
        return self._add(Fault(_target(off, path), path, what, from_call))

    def spy(self, off: kvoffload.Offloader, path: str) -> Intercept:
        """Count and record the calls on ``path``, changing nothing."""
        return self._add(Intercept(_target(off, path), path))

    def restore(self) -> None:
        """Open every gate (no worker thread stays blocked) and put every real call back."""
        for icpt in self.installed:
            if isinstance(icpt, Gate):
                icpt.open()
        for icpt in reversed(self.installed):
            icpt.remove()
        self.installed.clear()


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


class NotingCancel:
    """Awaits ``aw`` exactly as ``await aw`` does, and calls ``on_cancel()`` right after the awaiting
    task's first cancellation has been delivered into it (for a Transfer: once it was told to stop).

    Lets a test react to a cancellation that asyncio itself makes (a timeout firing, ``task.cancel()``)
    at the moment it happens, instead of guessing with a timer.
    """

    def __init__(self, aw, on_cancel) -> None:
        self.aw = aw
        self.on_cancel = on_cancel

    def __await__(self):
        it = self.aw.__await__()
        to_send, to_throw, noted = None, None, False
        while True:
            try:
                if to_throw is None:
                    out = it.send(to_send)
                else:
                    exc, to_throw = to_throw, None
                    out = it.throw(exc)
                    if isinstance(exc, asyncio.CancelledError) and not noted:
                        noted = True
                        self.on_cancel()
            except StopIteration as stop:
                return stop.value
            try:
                to_send = yield out
            except BaseException as e:  # noqa: BLE001 - forwarded into the awaitable
                to_throw = e


def spin_until(pred, timeout: float = HANG_S, what: str = "condition") -> None:
    """Wait for library state that no event announces (without sleeping: yields the GIL only);
    the timeout only fails the test."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- stand-ins for the CUDA copier, to drive the GPU path's worker logic on any machine ----------


class StandInEvent:
    """Stands in for a CUDA copy's completion event: the test completes it by hand."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self.waited = threading.Event()
        """Set once a thread sleeps in :meth:`synchronize`."""
        self.alarms: list = []
        """Alarms to ring on completion (the copier's ``ring_when_complete``)."""
        self.alarmed = threading.Event()
        """Set once an alarm is to ring on completion."""
        self._lock = threading.Lock()
        if done:
            self._done.set()

    def complete(self) -> None:
        with self._lock:
            self._done.set()
            alarms, self.alarms = self.alarms, []
        for alarm in alarms:
            alarm.ring()

    def ring_on_completion(self, alarm) -> None:
        with self._lock:
            if not self._done.is_set():
                self.alarms.append(alarm)
                self.alarmed.set()
                return
        alarm.ring()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waited.set()
        assert self._done.wait(10)


class StandInFlag:
    """A cancel flag whose raise lands on the 'device' when the test says so."""

    def __init__(self, raise_lands_at_once: bool) -> None:
        self.raised: StandInEvent | None = None
        self._at_once = raise_lands_at_once
        self.released = threading.Event()

    def raise_flag(self) -> None:
        self.raised = StandInEvent(done=self._at_once)

    def release(self) -> None:  # idempotent, as the real flag's
        self.released.set()


class StandInCopier:
    """Stands in for the CUDA copier: each chunk's copy returns an event the test completes."""

    chunk_blocks = 4

    def __init__(self, flag: StandInFlag) -> None:
        self.flag = flag
        self.events: list[StandInEvent] = []
        self.stopping: object = None
        self.flagged_chunks = 0

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: object) -> None:
        pass

    def take_cancel_flag(self) -> StandInFlag:
        return self.flag

    def stops_on(self, flag: StandInFlag):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.stopping = flag
            try:
                yield
            finally:
                self.stopping = None

        return scope()

    def ring_when_complete(self, event: StandInEvent, alarm) -> None:
        event.ring_on_completion(alarm)

    def to_device(self, host, rows, block_ids) -> StandInEvent:
        self.flagged_chunks += self.stopping is self.flag
        self.events.append(StandInEvent())
        return self.events[-1]

    def close(self) -> None:
        pass


class StandInDriver:
    """Stands in for the CUDA driver under the real ``DriverEvent`` (the ``enqueue_calls()`` function
    table it calls): each event completes when the test says, successfully or with a CUDA error
    (``ILLEGAL_ADDRESS``: error 700, an asynchronous fault). Install it with the ``standin_driver`` fixture."""

    NOT_READY = 600
    ILLEGAL_ADDRESS = 700
    blocking_sync = 0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._outcome: dict[int, int | None] = {}  # handle -> None while running, then the code it completed with
        self._alarms: dict[int, list] = {}
        self.handles: list[int] = []
        """Every event made, in order."""
        self.synchronizing = threading.Event()
        """Set once a thread sleeps in ``cuEventSynchronize``."""
        self.alarmed = threading.Event()
        """Set once an alarm is to ring at an event's completion."""

    # -- the function table (returns CUDA error codes, as the driver's entry points do)

    def event_create(self, out_address: int, flags: int) -> int:
        import ctypes

        with self._cond:
            handle = len(self.handles) + 1
            self.handles.append(handle)
            self._outcome[handle] = None
        ctypes.c_void_p.from_address(out_address).value = handle
        return 0

    def event_record(self, handle: int, stream: int) -> int:
        return 0

    def event_destroy(self, handle: int) -> int:
        return 0

    def ensure_context(self, device_index: int) -> None:
        pass

    def event_query(self, handle: int) -> int:
        with self._cond:
            outcome = self._outcome[handle]
        return self.NOT_READY if outcome is None else outcome

    def event_synchronize(self, handle: int) -> int:
        self.synchronizing.set()
        with self._cond:
            if not self._cond.wait_for(lambda: self._outcome[handle] is not None, HANG_S):
                return 999  # never completed: the waiter fails instead of hanging the test
            return self._outcome[handle]

    # -- the test's side

    def complete(self, event, error: int = 0) -> None:
        """Complete ``event`` (a ``DriverEvent``): successfully, or with CUDA error ``error``."""
        with self._cond:
            self._outcome[event.handle] = error
            self._cond.notify_all()
            alarms = self._alarms.pop(event.handle, [])
        for alarm in alarms:
            alarm.ring()

    def ring_when_complete(self, event, alarm) -> None:
        """What the CUDA copier's ``ring_when_complete`` asks of the driver: ring ``alarm`` once ``event`` completes."""
        with self._cond:
            if self._outcome[event.handle] is None:
                self._alarms.setdefault(event.handle, []).append(alarm)
                self.alarmed.set()
                return
        alarm.ring()


@pytest.fixture
def standin_driver(monkeypatch) -> StandInDriver:
    """A :class:`StandInDriver` behind every ``DriverEvent`` made during the test."""
    from kvoffload._core.cuda import driver as cuda_driver

    standin = StandInDriver()
    monkeypatch.setattr(cuda_driver, "enqueue_calls", lambda: standin)
    return standin


class Named:
    """A key with ``__hash__`` and ``__eq__`` of its own: equal to its name and to any ``Named`` of that name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return other == self.name if isinstance(other, str) else isinstance(other, Named) and other.name == self.name

    def __repr__(self) -> str:
        return f"Named({self.name!r})"


class Interrupter:
    """Ctrl-C at a random point: :meth:`arm` makes ``SIGALRM`` raise ``KeyboardInterrupt`` once, within
    ``max_delay_s`` (or not at all, if ``armed`` is set False first: by an assignment, not a call,
    which would itself be a point where the interrupt lands). One interrupt per arming, as one
    Ctrl-C: a second one could cut the clean-up of the first short."""

    def __init__(self, seed: int) -> None:
        self.armed = False
        self._delays = random.Random(seed)

    def _interrupt(self, signum, frame) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt

    def arm(self, max_delay_s: float = 2e-4) -> None:
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, self._delays.uniform(1e-6, max_delay_s))



@contextlib.contextmanager
def interrupter(seed: int):
    """An :class:`Interrupter` whose ``SIGALRM`` handler is installed for the ``with`` block."""
    ctrl_c = Interrupter(seed)
    previous = signal.signal(signal.SIGALRM, ctrl_c._interrupt)
    try:
        yield ctrl_c
    finally:
        ctrl_c.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)


def wait_for_transfers_to_end(off: kvoffload.Offloader, timeout: float = HANG_S) -> None:
    """Wait until ``off`` counts no transfer in flight: those whose handles an interrupt lost end too
    (there is no handle to wait on)."""
    deadline = time.monotonic() + timeout
    while off.stats().in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
