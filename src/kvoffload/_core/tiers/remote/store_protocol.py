"""The interface of a remote key-value engine shared by many serving nodes.

A :class:`RemoteStore` holds blocks under encoded keys (``cache_identity.encode_key``) for one
cache identity (``CacheIdentity.digest``), given to the engine when it is made: an engine never
returns a block stored by a cache of another identity. Every call is async and batched (a whole
batch of keys in as few round trips as the engine allows), and moves bytes between the remote
and caller-provided host buffers (numpy ``uint8`` rows, memoryviews of pinned host slots), so the
caller decides where a block lands and when it goes on to a GPU.

What a caller can rely on, whatever the engine:

- ``get_into`` returns True for a key only when the whole block, checked against the key and the
  identity it was stored with (:mod:`.value_format`), is in its buffer. A key that is absent,
  evicted, half-written, corrupted or of another cache is False (a miss, counted), never an
  exception and never wrong bytes reported as found. The buffer of a miss holds unspecified bytes.
- A remote that cannot be reached (refused, timed out, restarting, resharding beyond what the
  client handles) raises :class:`RemoteUnavailableError` from any call. The engine then fails
  every call at once, without touching the network, until its backoff has passed; the call after
  it tries again, and the first that succeeds counts a reconnect. Callers treat the error as "all
  misses, nothing stored" and go on with their local tiers.
- ``put`` is a cache write: a value the server refuses (out of memory, a read-only replica) is
  False in its answer and counted, not raised; a stored value may be evicted at any time.
- An engine is used from one event loop; :meth:`RemoteStore.counters` may be read from any thread.

A second engine, Mooncake Store (``mooncake.store.MooncakeDistributedStore``), fits the same
interface: its client calls are blocking C++ calls that release the GIL, so the engine runs each
batch in a worker thread (``loop.run_in_executor``) and awaits it. It registers the caller's host
slab once (``register_buffer``) so ``batch_get_into`` / ``batch_put_from`` move blocks by RDMA or
TCP straight between the remote and the slots with no copy in Python; with the scatter/gather
variants (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``) each value is the
same header as here, kept in a small registered header buffer, followed by the slot's bytes, so
the checks of :func:`.value_format.unpack_value` apply unchanged (the payload is checked in the
caller's buffer after it landed, which the "unspecified bytes on a miss" rule allows). Keys are
the same names (:func:`.value_format.key_name`) as text (Mooncake keys are strings: hex of the
binary name); ``batch_is_exist`` answers ``exists``; a negative status for "object not found" is
a miss and a transport or master error is a :class:`RemoteUnavailableError`. Mooncake's own
replication and eviction stay its own; the counters are the same dataclass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...base.errors import OffloadError

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer, TypeAlias

    BlockBuffer: TypeAlias = "Buffer | np.ndarray[Any, Any]"
    """What holds a block's bytes: any C-contiguous object of the buffer protocol (numpy arrays are
    named apart: their stubs declare the protocol only for Python 3.12 and later)."""

__all__ = ["RemoteCounters", "RemoteRefusedError", "RemoteStore", "RemoteUnavailableError"]  # and BlockBuffer, for type checkers


class RemoteUnavailableError(OffloadError):
    """The remote store cannot be reached now (refused, timed out, restarting, backing off after
    such an error). The engine's underlying error, if any, is ``__cause__``; ``retry_in_s`` is how
    long the store will fail calls at once before it tries the network again."""

    def __init__(self, message: str, *, retry_in_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s

    def __reduce__(self) -> tuple[object, ...]:  # keep the attribute through pickling
        return (_unavailable, (str(self), self.retry_in_s))


def _unavailable(message: str, retry_in_s: float) -> RemoteUnavailableError:
    return RemoteUnavailableError(message, retry_in_s=retry_in_s)


class RemoteRefusedError(RemoteUnavailableError):
    """The remote refuses this client for a reason retrying will not fix: a wrong password or user,
    a missing permission (``NOPERM``: an ACL without a command or key pattern the tier needs), no
    such database, a TLS failure, an unknown host. ``cause`` names it in a few words. ``start()``
    fails on it (``StartError``); met later (a password changed on the server), it is handled as
    an outage, so callers that handle :class:`RemoteUnavailableError` need nothing more."""

    def __init__(self, message: str, *, cause: str, retry_in_s: float = 0.0) -> None:
        super().__init__(message, retry_in_s=retry_in_s)
        self.cause = cause

    def __reduce__(self) -> tuple[object, ...]:
        return (_refused, (str(self), self.cause, self.retry_in_s))


def _refused(message: str, cause: str, retry_in_s: float) -> RemoteRefusedError:
    return RemoteRefusedError(message, cause=cause, retry_in_s=retry_in_s)


@dataclass(frozen=True)
class RemoteCounters:
    """A remote store's counters since it was made (a snapshot; every field only grows)."""

    values_put: int = 0
    """Values the remote accepted."""
    bytes_put: int = 0
    """Payload bytes of those values (headers not counted)."""
    puts_refused: int = 0
    """Values the remote refused (out of memory under ``noeviction``, a read-only replica, ...)."""
    values_got: int = 0
    """Keys ``get_into`` found, checked and copied into their buffers."""
    bytes_got: int = 0
    """Payload bytes of those values."""
    misses: int = 0
    """Keys ``get_into`` did not return: absent, evicted or rejected."""
    bad_values: int = 0
    """Values rejected by the checks (corrupted, truncated, foreign, another key's); counted in ``misses`` too."""
    keys_checked: int = 0
    """Keys asked about by ``exists``."""
    keys_found: int = 0
    """Of those, keys the remote holds."""
    connection_errors: int = 0
    """Calls that failed on the network or the server (each raised :class:`RemoteUnavailableError`)."""
    calls_refused: int = 0
    """Calls failed at once, without the network, while backing off after a connection error."""
    security_rejections: int = 0
    """Of ``bad_values``, values that failed their seal: unsigned, signed by an unknown secret, a MAC
    that does not match, failed decryption (forged or altered values, or writers configured apart)."""
    reconnects: int = 0
    """Calls that succeeded again after connection errors (one per outage)."""


@runtime_checkable
class RemoteStore(Protocol):
    """A remote key-value engine for the blocks of one cache identity (see the module docstring).

    Keys are encoded keys (``bytes``, at most ``cache_identity.MAX_KEY_BYTES``); buffers are any
    C-contiguous objects of the buffer protocol, writable for ``get_into``, one per key, each as
    long as the block.
    """

    @property
    def identity_digest(self) -> bytes:
        """The cache identity (``CacheIdentity.digest``) whose blocks this store holds."""
        ...

    async def connect(self) -> None:
        """Reach the remote now (idempotent); :class:`RemoteUnavailableError` if it cannot be reached.
        Other calls connect on their own; this lets a caller check the remote at start."""
        ...

    async def check_access(self, *, write: bool) -> None:
        """One round trip doing what the tier will do (look up, read, and if ``write`` a write that
        the remote checks but that stores nothing): :class:`RemoteRefusedError` if the remote refuses it for good,
        :class:`RemoteUnavailableError` if it cannot be reached now."""
        ...

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the remote holds, in one round trip. A hint: a value found here may be
        evicted, or rejected by ``get_into``, before it is read."""
        ...

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[BlockBuffer]) -> list[bool]:
        """Fill ``buffers[i]`` with the block of ``keys[i]``; True where the block was found and
        passed every check, False for a miss (its buffer then holds unspecified bytes)."""
        ...

    async def put(self, keys: Sequence[bytes], buffers: Sequence[BlockBuffer]) -> list[bool]:
        """Store the bytes of ``buffers[i]`` under ``keys[i]`` (replacing any value there); True
        where the remote accepted the value, False where it refused it."""
        ...

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` from the remote (absent keys are fine)."""
        ...

    async def close(self) -> None:
        """Close the connections this store opened (idempotent). A client the caller passed in is
        the caller's to close."""
        ...

    def counters(self) -> RemoteCounters:
        """The counters so far (any thread)."""
        ...
