"""Interrupting at a chosen or random point: a cancellation noted as it lands (``NotingCancel``),
Ctrl-C at a random point (``interrupter``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal


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
