"""The one boundary around code kvoffload does not own: the disk IO calls and the block copies.

Whatever such a call raises must fail its transfer and nothing else. Raised
as is, some exceptions would not: asyncio refuses ``StopIteration`` in a
future (the transfer would hang), a ``CancelledError`` would read as a
cancellation, an ``OffloadError`` would pass as the library's own, and
``SystemExit`` & co. would stop a worker loop. :func:`call_foreign` turns
them all into :class:`ForeignCallError` (:func:`foreign_error` where the call is made inline); :func:`as_transfer_error` is the other half, what a
transfer reports for whatever reached its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from .errors import OffloadError, TransferError

__all__ = ["ForeignCallError", "as_transfer_error", "call_foreign", "foreign_error"]

R = TypeVar("R")


class ForeignCallError(TransferError):
    """A foreign call raised something other than ``OSError``; the original is ``__cause__``.

    A :class:`TransferError` already, so the offloader reports it as it is.
    """


def call_foreign(what: str, fn: Callable[..., R], *args: object) -> R:
    """Return ``fn(*args)``.

    An ``OSError`` propagates unchanged (its errno stays available); any other
    ``BaseException`` becomes :class:`ForeignCallError` with it as ``__cause__``.
    """
    try:
        return fn(*args)
    except OSError:
        raise
    except BaseException as e:
        raise foreign_error(what, e) from e


def foreign_error(what: str, e: BaseException) -> ForeignCallError:
    """The :class:`ForeignCallError` for ``e`` (not an ``OSError``), raised by ``what``, for callers that
    make the foreign call inline (a call fewer per copy) and raise it ``from e``."""
    return ForeignCallError(f"{what} raised {_describe(e)}")


def _describe(e: BaseException) -> str:
    try:
        text = str(e)  # foreign too: its __str__ may raise
    except BaseException:
        text = ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def as_transfer_error(kind: str, e: BaseException) -> BaseException:
    """What a transfer reports for ``e``: the library's own errors and cancellation as they are,
    anything else (the user's, the driver's, ``SystemExit``) as :class:`TransferError` with it as
    the cause. The one place where foreign exceptions become kvoffload's."""
    if isinstance(e, ForeignCallError):  # the original exception becomes the cause
        err = TransferError(f"{kind} failed: {e}")
        err.__cause__ = e.__cause__
        return err
    if isinstance(e, (asyncio.CancelledError, OffloadError, GeneratorExit)):
        return e
    err = TransferError(f"{kind} failed: {e if isinstance(e, Exception) else repr(e)}")
    err.__cause__ = e
    return err
