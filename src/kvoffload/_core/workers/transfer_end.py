"""How a copy worker's transfer ends, whichever way it ran: the plan's callbacks
(:class:`JobSteps`, :data:`EndHook`) and the one sequence that ends it (:func:`end_transfer`).
What its foreign calls raised was mapped to kvoffload's errors before
(:func:`~..base.foreign.as_transfer_error`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from .transfer import TransferControl, TransferResult

__all__ = ["EndHook", "JobSteps", "end_transfer"]

log = logging.getLogger("kvoffload")

EndHook = Callable[[TransferResult | None, BaseException | None, bool], Any]
"""``on_end(result, exc, cancelled)``: sees a transfer's outcome just before it ends (its plan counts it)."""


class JobSteps(Protocol):
    """A transfer's own bookkeeping, which its worker calls back (the tiers' store and load plans)."""

    reports_landings: bool
    """True: call :meth:`landed` as each copy completes (stores publish chunk by chunk)."""
    taken: float | None
    """When a worker took the transfer (``time.perf_counter()``); the worker sets it."""

    def landed(self, i: int) -> None:
        """Copy ``i`` (and every copy before it) has completed."""
        ...

    def result(self) -> TransferResult:
        """The finished transfer's result."""
        ...

    def cleanup(self) -> None:
        """Undo what did not finish; runs however the transfer ends, once its copies have completed. Idempotent."""
        ...


def end_transfer(
    where: str, control: TransferControl, cleanup: Callable[[], Any] | None, on_end: EndHook,
    result: TransferResult | None, exc: BaseException | None, cancelled: bool,
) -> None:
    """How a worker ends a transfer, whichever way it ran: ``cleanup()`` (what it holds goes back; its
    copies have completed), ``on_end`` sees the outcome, then the transfer ends (its waiters wake).
    Nothing raised here escapes (a ``SystemExit`` would stop the worker's loop for good)."""
    if cleanup is not None:
        try:
            cleanup()
        except BaseException:
            log.exception("%s: transfer cleanup raised", where)
    try:
        on_end(result, exc, cancelled)
    except BaseException:
        log.exception("%s: transfer end hook raised", where)
    control.finish(result, exc, cancelled)
