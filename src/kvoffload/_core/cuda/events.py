"""What copies complete with (:class:`CopyEvent`) and the two ways to ask about one.

Who follows copies until they land is :class:`~..workers.landings.LandingWatcher`; every reader of
copy events asks through :func:`completed` and :func:`wait_completed`.

A copy that fails on the device (its event's ``query()`` or ``synchronize()`` raises a CUDA
error, such as an illegal address) is reported as :class:`ForeignCallError` (the CUDA error as
``__cause__``): the event is settled, nothing more is written,
and what it covers did not land. Both functions say so the same way.
"""

from __future__ import annotations

from typing import Protocol

from ..base.foreign import ForeignCallError

__all__ = ["CopyEvent", "completed", "copy_failed", "wait_completed"]


class CopyEvent(Protocol):
    """What copies complete with: a :class:`~.driver.DriverEvent`, a ``torch.cuda.Event``, a test's
    stand-in. Both calls raise (the copy failed on the device) as the driver reports it."""

    def query(self) -> bool:
        """True once the work recorded before the event has completed."""
        ...

    def synchronize(self) -> None:
        """Block until it has completed."""
        ...


def completed(event: CopyEvent) -> bool:
    """``event.query()``: True once the copies recorded before ``event`` have completed.

    Raises :class:`ForeignCallError` (what the event raised as ``__cause__``: a CUDA error) if they
    failed on the device: the event is settled, and what it covers did not land. Only ``Exception``
    is taken for the copy's: a ``KeyboardInterrupt`` in a waiting thread is its own and propagates."""
    try:
        return bool(event.query())
    except Exception as e:
        raise copy_failed(e) from e


def wait_completed(event: CopyEvent) -> None:
    """``event.synchronize()``: block until the copies recorded before ``event`` have completed.
    Raises as :func:`completed` does if they failed."""
    try:
        event.synchronize()
    except Exception as e:
        raise copy_failed(e) from e


def copy_failed(e: Exception) -> ForeignCallError:
    """The error a transfer gets for ``e``, raised by a copy's completion event (:func:`completed`), ``e``
    as its cause."""
    try:
        text = str(e)  # foreign: its __str__ may raise
    except Exception:
        text = ""
    err = ForeignCallError(f"a copy failed on the device: {type(e).__name__}" + (f": {text}" if text else ""))
    err.__cause__ = e
    return err
