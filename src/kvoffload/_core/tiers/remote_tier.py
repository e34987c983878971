"""The remote tier: blocks shared by many serving nodes through a remote store (Redis, Valkey).

Everything that touches the network runs on a loop of its own (a :class:`WorkerLoop` named
``kvoffload-remote``): never on the caller's loop, never on the copy workers'. The tier answers
three things:

- :meth:`RemoteTier.lookup`: after the local tiers' leading hits, how many of the following keys
  the remote holds (one ``exists`` round trip; keys found missing are not asked again for
  :data:`NEGATIVE_TTL_S`). Keys found are remembered for a while (:meth:`RemoteTier.reported`),
  so that a load may name them.
- :meth:`RemoteTier.fetch`: a load's remote keys read into host slots it reserved, waiting for the
  remote's copies to end even when the load is cancelled (nothing writes a slot once the load
  gives it back).
- :meth:`RemoteTier.write_through`: after a store completes, its host copies are pinned and sent
  in the background; counted apart from transfers, waited for by :meth:`RemoteTier.close` up to its
  deadline, then dropped (their pins given back).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..async_backends import wakeup
from ..cache_identity import CacheIdentity, encode_key
from ..deadline import Deadline
from ..errors import ClosedError, MissingKeysError, TransferError
from ..index import HOST, BlockIndex, Pin
from ..remote import RemoteStore, RemoteUnavailableError
from ..worker_loop import WorkerLoop

__all__ = ["NEGATIVE_TTL_S", "REPORTED_TTL_S", "RemoteCounts", "RemoteTier"]

log = logging.getLogger("kvoffload")

_T = TypeVar("_T")

NEGATIVE_TTL_S = 1.0
"""How long a key the remote did not hold is taken as missing without asking again."""
REPORTED_TTL_S = 60.0
"""How long a key :meth:`RemoteTier.lookup` found on the remote may be named by a load."""
_CLOSE_GRACE_S = 2.0
"""How long close waits for cancelled writes and the store's close when its deadline has passed."""
_MAX_REMEMBERED = 1 << 16
"""The most keys remembered as found (or as missing); the oldest go first."""


@dataclass(frozen=True)
class RemoteCounts:
    """The remote tier's counters (every field only grows, but ``writes_pending``)."""

    lookup_hits: int = 0
    hits: int = 0
    misses: int = 0
    bad_values: int = 0
    unavailable: int = 0
    writes: int = 0
    write_failures: int = 0
    writes_pending: int = 0


class RemoteTier:
    """The remote store of one cache identity, on its own worker loop (see the module docstring).

    ``target``: a Redis URL or a caller-configured ``redis.asyncio`` client (used on the tier's loop
    only, from then on); ``write``: ``"through"`` (every completed store is sent) or ``"none"``.
    """

    def __init__(self, target: object, identity: CacheIdentity, index: BlockIndex, write: str) -> None:
        self.index = index
        self.write = write
        self.host_rows: np.ndarray | None = None
        """The host slots (``uint8[slots, slot_bytes]``), set by the storage when it has a host tier."""
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(RemoteCounts.__dataclass_fields__, 0)
        self._reported: OrderedDict[Hashable, float] = OrderedDict()
        self._missing: OrderedDict[bytes, float] = OrderedDict()
        self._writes: set[concurrent.futures.Future[Any]] = set()
        self._accepting = True
        self._final: RemoteCounts | None = None
        self._outcomes: set[concurrent.futures.Future[Any]] = set()
        """The outcomes of the coroutines started on the loop and not ended yet."""
        self._stopped = False
        from ..remote.redis_store import RedisStore  # redis-py is optional: imported only for a remote tier

        self.store: RemoteStore = RedisStore(target, identity.digest)  # type: ignore[arg-type]  # Options checked the type
        self.worker = WorkerLoop("kvoffload-remote")

    # -- running coroutines on the tier's loop ---------------------------------------------

    def _run(self, make: Callable[[], Coroutine[Any, Any, _T]]) -> tuple[concurrent.futures.Future[_T], Callable[[], None]]:
        """Run ``make()`` as a task on the tier's loop: its outcome (done once the task has really
        ended, however it ends) and how to cancel it (from any thread)."""
        outcome: concurrent.futures.Future[_T] = concurrent.futures.Future()
        tasks: list[asyncio.Task[_T]] = []

        def done(task: asyncio.Task[_T]) -> None:
            if task.cancelled():
                outcome.cancel()
            elif task.exception() is not None:
                outcome.set_exception(task.exception())
            else:
                outcome.set_result(task.result())

        def create() -> None:
            task = self.worker.loop.create_task(make())
            tasks.append(task)
            task.add_done_callback(done)

        def cancel() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has stopped: its stop cancelled the task
                self.worker.loop.call_soon_threadsafe(lambda: tasks[0].cancel())

        with self._lock:
            if self._stopped:
                raise ClosedError("the offloader is closed")
            self._outcomes.add(outcome)
        outcome.add_done_callback(self._outcomes.discard)
        self.worker.loop.call_soon_threadsafe(create)
        return outcome, cancel

    def _add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    # -- lookups ------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[Hashable], encoded: Sequence[bytes]) -> int:
        """How many leading ``keys`` (``encoded`` their encodings) the remote holds; 0 when it cannot
        be reached (counted as unavailable). One round trip, or none when the first key was found
        missing just now. Runs on the caller's loop (asyncio, or what anyio runs); awaits the tier's."""
        now = time.monotonic()
        asked = len(encoded)
        with self._lock:
            for i, k in enumerate(encoded):
                until = self._missing.get(k)
                if until is not None and until > now:
                    asked = i
                    break
        if not asked:
            return 0
        query = list(encoded[:asked])
        outcome, cancel = self._run(lambda: self.store.exists(query))
        woken = wakeup()
        outcome.add_done_callback(woken.wake)
        try:
            await woken.wait()
        except BaseException:
            cancel()
            raise
        try:
            found = outcome.result()
        except RemoteUnavailableError:
            self._add(unavailable=1)
            return 0
        hits = 0
        while hits < len(found) and found[hits]:
            hits += 1
        now = time.monotonic()
        with self._lock:
            self._counts["lookup_hits"] += hits
            for key in keys[:hits]:
                self._reported[key] = now + REPORTED_TTL_S
                self._reported.move_to_end(key)
            for k, there in zip(query, found):
                if not there:
                    self._missing[k] = now + NEGATIVE_TTL_S
                    self._missing.move_to_end(k)
            for remembered in (self._reported, self._missing):
                while len(remembered) > _MAX_REMEMBERED:
                    remembered.popitem(last=False)
        return hits

    def reported(self, key: Hashable) -> bool:
        """Whether :meth:`lookup` found ``key`` on the remote within :data:`REPORTED_TTL_S`."""
        with self._lock:
            until = self._reported.get(key)
            return until is not None and until > time.monotonic()

    # -- loads --------------------------------------------------------------------------

    async def fetch(self, keys: Sequence[Hashable], slots: Sequence[int]) -> None:
        """Read the blocks of ``keys`` into host ``slots`` (owned by the caller); from a copy worker's
        loop. ``TransferError`` when a key is no longer there (or its value fails a check) or the
        remote cannot be reached. Cancelled, it returns only once nothing writes the slots."""
        rows = self.host_rows
        assert rows is not None
        encoded = [encode_key(k) for k in keys]
        buffers = [rows[s] for s in slots]
        outcome, cancel = self._run(lambda: self.store.get_into(encoded, buffers))
        ended = asyncio.wrap_future(outcome)
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            if not ended.done():
                cancel()
                while not ended.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([ended])
            raise
        except RemoteUnavailableError as e:
            self._add(unavailable=1)
            raise TransferError(f"load failed: {e}") from e
        found = ended.result()
        hits = sum(found)
        self._add(hits=hits, misses=len(found) - hits)
        if hits < len(found):
            gone = [k for k, f in zip(keys, found) if not f]
            with self._lock:
                for k in gone:
                    self._reported.pop(k, None)
            raise TransferError(f"load failed: {len(gone)} key(s) no longer on the remote store") from MissingKeysError(gone)

    # -- background writes ------------------------------------------------------------------

    def write_through(self, keys: Sequence[Hashable]) -> None:
        """After a store of ``keys`` completed: pin their host copies and send them in the background
        (a key evicted or discarded since, or only on disk, is not sent). Never raises."""
        rows = self.host_rows
        if self.write != "through" or rows is None or not keys:
            return
        try:
            with self._lock:
                if not self._accepting:
                    return
            pins = self._pin(keys)
            on_host = [p for p in pins if p.tier == HOST]
            self.index.unpin([p for p in pins if p.tier != HOST])
            if not on_host:
                return
            encoded = [encode_key(p.entry.key) for p in on_host]
            buffers = [rows[p.slot] for p in on_host]
            with self._lock:
                accepting = self._accepting
            if not accepting:
                self.index.unpin(on_host)
                return
            outcome, _ = self._run(lambda: self.store.put(encoded, buffers))
        except ClosedError:  # the offloader is closing
            self.index.unpin(on_host)
            return
        except Exception:
            log.exception("kvoffload: starting a remote write failed; the blocks stay local")
            return
        with self._lock:
            self._counts["writes_pending"] += len(on_host)
            self._writes.add(outcome)

        def ended(f: concurrent.futures.Future[list[bool]]) -> None:
            self.index.unpin(on_host)
            accepted = 0 if f.cancelled() or f.exception() is not None else sum(f.result())
            unavailable = not f.cancelled() and isinstance(f.exception(), RemoteUnavailableError)
            if not f.cancelled() and f.exception() is not None and not unavailable:
                log.warning("kvoffload: a remote write failed: %s", f.exception())
            with self._lock:
                self._writes.discard(f)
                self._counts["writes_pending"] -= len(on_host)
                self._counts["writes"] += accepted
                self._counts["write_failures"] += len(on_host) - accepted
                self._counts["unavailable"] += unavailable

        outcome.add_done_callback(ended)

    def _pin(self, keys: Sequence[Hashable]) -> list[Pin]:
        """Pins of those ``keys`` still stored (each pinned alone when some are gone)."""
        try:
            return self.index.pin(list(keys))
        except MissingKeysError:
            pins: list[Pin] = []
            for k in keys:
                with contextlib.suppress(MissingKeysError):
                    pins += self.index.pin([k])
            return pins

    # -- counters and close -------------------------------------------------------------

    def counts(self) -> RemoteCounts:
        """The counters so far (any thread; as they were at close, after it)."""
        if self._final is not None:
            return self._final
        bad_values = self.store.counters().bad_values
        with self._lock:
            return RemoteCounts(**(self._counts | {"bad_values": bad_values}))

    def close(self, deadline: Deadline) -> bool:
        """Wait for background writes within ``deadline``, then drop the rest (their pins given back),
        close the store and stop the loop; False if the loop's thread did not stop."""
        with self._lock:
            self._accepting = False
            writes = list(self._writes)
        if writes:
            concurrent.futures.wait(writes, deadline.left())
        with self._lock:
            left = list(self._writes)
        if left:
            log.warning("kvoffload: %d remote write(s) still running at close are dropped", len(left))
        grace = deadline.left()
        grace = None if grace is None else max(grace, _CLOSE_GRACE_S)  # cancelled writes end within one window's copy
        if not self._stopped:  # a second close (after a thread did not stop) only waits for the loop
            closing, _ = self._run(self._close_store)
            with contextlib.suppress(Exception):
                closing.result(grace)
            with self._lock:
                self._stopped = True  # from here on nothing starts on the loop
        stopped = self.worker.stop(grace)
        if stopped:
            for outcome in list(self._outcomes):  # started as the loop stopped, never run: their waiters wake
                outcome.cancel()
            self._final = self.counts()
        return stopped

    async def _close_store(self) -> None:
        """On the loop: cancel the writes still running (they end once their copies have), close the store."""
        running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in running:
            t.cancel()
        if running:
            await asyncio.wait(running)
        await self.store.close()
