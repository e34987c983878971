"""Gates and faults on an offloader's copies and disk IO (the ``faults`` fixture of conftest).

Every test that intercepts a copy or a disk IO call goes through them, built on the seams of
kvoffload._testing: ``copy_calls(off)`` (to_host, to_device: called on the worker loops) and
``disk_io(off)`` (pwritev, preadv: called on the IO threads). Both are looked up at every call, so
replacing an attribute intercepts every later call."""

from __future__ import annotations

import asyncio
import inspect
import threading

import kvoffload
from kvoffload._testing import copy_calls, disk_io

from .waiting import HANG_S


PATHS = ("to_host", "to_device", "pwritev", "preadv")


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
