"""The exception tree of kvoffload.

Bad arguments are plain ``TypeError`` / ``ValueError``; everything the library
itself reports derives from :class:`OffloadError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = [
    "OffloadError", "TransferError", "TransferCancelled", "CapacityError", "MissingKeysError", "ClosedError", "StartError",
    "CloseError",
]


class OffloadError(Exception):
    """Base class of every error kvoffload raises on its own behalf."""


class TransferError(OffloadError):
    """A transfer failed on an IO or CUDA error; the original error is ``__cause__``.

    The failed transfer publishes none of its unfinished keys; other entries
    stay intact and the offloader keeps serving.
    """


class TransferCancelled(OffloadError):
    """The transfer was cancelled by something other than the task awaiting it: ``Transfer.cancel()``,
    ``close()``, or the garbage collection of its offloader.

    Raised by ``await transfer``, ``transfer.result()`` and ``transfer.exception()``. A task whose own
    cancellation cancelled the transfer gets its framework's cancellation instead
    (``asyncio.CancelledError``, ``trio.Cancelled``). Either way ``transfer.cancelled()`` is True,
    and the transfer published none of its unfinished keys.
    """


class CapacityError(OffloadError):
    """A store could not have the slots it needs; nothing was reserved, spilled or evicted.

    Either the store is larger than the tiers together (``requested > capacity``: it never fits;
    store it in parts) or running transfers hold the slots it would need (it may fit once they end).
    ``requested``: the new blocks the store needed; ``capacity``: the slots of the host and disk
    tiers together.
    """

    def __init__(self, message: str, *, requested: int = 0, capacity: int = 0) -> None:
        super().__init__(message)
        self.requested = requested
        self.capacity = capacity

    def __reduce__(self) -> tuple[object, ...]:  # keep the attributes through pickling
        return (_capacity_error, (str(self), self.requested, self.capacity))


def _capacity_error(message: str, requested: int, capacity: int) -> CapacityError:
    return CapacityError(message, requested=requested, capacity=capacity)


class MissingKeysError(OffloadError, KeyError):
    """A load named keys that are not stored (``missing`` lists them)."""

    def __init__(self, missing: Iterable[Hashable]) -> None:
        self.missing: tuple[Hashable, ...] = tuple(missing)
        shown = ", ".join(repr(k) for k in self.missing[:5])
        more = f" and {len(self.missing) - 5} more" if len(self.missing) > 5 else ""
        super().__init__(f"{len(self.missing)} key(s) not stored: {shown}{more}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ClosedError(OffloadError):
    """The offloader is not running: it was closed, or never started."""


class StartError(OffloadError):
    """``start()`` could not set the offloader up: no memory to pin, no such directory, a read-only
    or full file system, a disk path that is not a regular file or is held by another offloader.

    The underlying error (often an ``OSError``) is ``__cause__``. Nothing is left allocated.
    """


class CloseError(OffloadError):
    """``close()`` could not finish within its timeout: a worker or IO thread is still running.

    Memory and the disk file are kept while a thread may still use them; call ``close()``
    again to finish the shutdown.
    """
