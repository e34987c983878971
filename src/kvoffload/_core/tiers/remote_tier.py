"""The remote tier: blocks shared by many serving nodes through a remote store (Redis, Valkey).

Everything that touches the network runs on a loop of its own (a :class:`WorkerLoop` named
``kvoffload-remote``): never on the caller's loop, never on the copy workers'. The tier answers
three things:

- :meth:`RemoteTier.lookup`: after the local tiers' leading hits, how many of the following keys
  the remote holds (one ``exists`` round trip; keys found missing are not asked again for
  :data:`NEGATIVE_TTL_S`). Keys found are remembered for a while (:meth:`RemoteTier.reported`),
  so that a load may name them.
- :meth:`RemoteTier.fetch`: a load's remote keys read into buffers it owns (host slots it reserved,
  or a disk-tier bounce half on the way to disk slots it reserved), waiting for the remote's copies
  to end even when the load is cancelled (nothing writes a buffer once the load gives it back).
- Background writes, counted apart from transfers, waited for by :meth:`RemoteTier.close` up to its
  deadline, then dropped (their pins given back). ``write="through"``
  (:meth:`RemoteTier.write_through`): after a store completes, its copies are pinned and sent, host
  copies straight from their slots, disk copies read a window at a time into the tier's staging
  buffer. ``write="evict"`` (:meth:`RemoteTier.capture_host`, :meth:`RemoteTier.capture_disk`):
  a block is sent when the local tiers evict it: its bytes are copied into the staging buffer
  before its slot is reused (a memcpy in the store's thread for a host slot, a read on the IO
  threads for a disk slot), and sent from there; evicted blocks that find no staging room are
  not sent (counted as dropped).
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

from ..base.async_backends import settled, wakeup
from ..base.cache_identity import CacheIdentity, encode_key
from ..base.deadline import Deadline
from ..base.errors import ClosedError, MissingKeysError, StartError, TransferError
from ..base.sealing import Sealer
from .hostmem import HostBuffer
from .index import DISK, HOST, BlockIndex, Evicted, Pin
from .remote import RemoteRefusedError, RemoteStore, RemoteUnavailableError
from ..workers.worker_loop import WorkerLoop
from .disk import DiskTier

__all__ = ["NEGATIVE_TTL_S", "REMOTE_WRITE_MODES", "REPORTED_TTL_S", "RemoteCounts", "RemoteTier", "StagingSlots"]

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
REMOTE_WRITE_MODES = ("through", "evict", "none")
"""When blocks are sent to the remote: as their store completes, as the local tiers evict them, never."""
START_CHECK_S = 2.0
"""How long :meth:`RemoteTier.start` waits for the remote's answer before it starts without one (a
refused connection, a wrong password or an unknown host answer within milliseconds; a server
that does not answer is not waited for: the check is cancelled and the tier starts)."""


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
    writes_dropped: int = 0
    writes_pending: int = 0


class StagingSlots:
    """Slots of unpinned, page-aligned host memory (``rows``) that background writes copy blocks into
    on their way to the remote: disk copies read for a write-through, evicted blocks captured
    before their slots are reused. Taken and given back from any thread; :meth:`take` waits on the
    remote tier's loop."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.buffer = HostBuffer(slots * slot_bytes, pin=None)
        self.rows: np.ndarray = self.buffer.tensor.numpy().reshape(slots, slot_bytes)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], object]] = []

    def try_take(self, n: int) -> list[int]:
        """Up to ``n`` free slots, at once (maybe none)."""
        with self._lock:
            taken = self._free[len(self._free) - min(n, len(self._free)):]
            del self._free[len(self._free) - len(taken):]
            return taken

    async def take(self, n: int) -> list[int]:
        """Between 1 and ``n`` slots, waiting for one to be given back when none is free."""
        loop = asyncio.get_running_loop()
        while True:
            freed: asyncio.Future[None] = loop.create_future()
            with self._lock:
                taken = self._free[len(self._free) - min(n, len(self._free)):]
                del self._free[len(self._free) - len(taken):]
                if not taken:
                    self._waiters.append(lambda: loop.call_soon_threadsafe(_set_if_pending, freed))
            if taken:
                return taken
            await freed

    def give_back(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)
            waiters, self._waiters = self._waiters, []
        for wake in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed
                wake()

    def close(self) -> None:
        self.buffer.close()


def _set_if_pending(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)


class RemoteTier:
    """The remote store of one cache identity, on its own worker loop (see the module docstring).

    ``target``: a Redis URL or a caller-configured ``redis.asyncio`` client (used on the tier's loop
    only, from then on); ``write``: one of :data:`REMOTE_WRITE_MODES`; ``sealer``: what values are
    signed and encrypted with (``remote_secret=``, ``encryption_key=``). :meth:`attach` tells it the
    local tiers; :meth:`start` checks the remote once.
    """

    def __init__(self, target: object, identity: CacheIdentity, index: BlockIndex, write: str, sealer: Sealer | None = None) -> None:
        assert write in REMOTE_WRITE_MODES
        self.index = index
        self.write = write
        self.host_rows: np.ndarray | None = None
        """The host slots (``uint8[slots, slot_bytes]``), when there is a host tier."""
        self.disk: DiskTier | None = None
        self.staging: StagingSlots | None = None
        """Where disk copies and evicted blocks wait for their write (see :meth:`attach`)."""
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
        from .remote.redis_store import RedisStore  # redis-py is optional: imported only for a remote tier

        self.sealer = sealer if sealer is not None else Sealer()
        self.store: RemoteStore = RedisStore(target, identity.digest, sealer=self.sealer)  # type: ignore[arg-type]  # Options checked the type
        self.worker = WorkerLoop("kvoffload-remote")

    def start(self, timeout_s: float = START_CHECK_S) -> None:
        """Check the remote once, at ``start()``: one round trip doing what this tier will do.
        :class:`StartError` when the remote refuses it for good (a wrong password, a missing
        permission, no such database, a TLS failure, an unknown host), naming the cause and the URL
        without its password; a remote that cannot be reached now (down, refused, timed out) is
        said once and the tier starts anyway, retrying with backoff at the calls that need it."""
        where = getattr(self.store, "where", "the remote store")
        if self.sealer.secrets is None:
            log.warning(
                "kvoffload: the remote tier at %s trusts every writer of that server: any client that can write there can "
                "make this node load blocks of its choosing; give remote_secret= to authenticate values (docs/security.md)", where,
            )
        outcome, cancel = self._run(lambda: self.store.check_access(write=self.write != "none"))
        try:
            outcome.result(timeout_s)
        except RemoteRefusedError as e:
            raise StartError(f"the remote store {where} refused this offloader: {e.cause}; check the URL, password and ACL") from e
        except RemoteUnavailableError:
            pass  # down for now: the store said so, once for the outage; the tier starts and retries with backoff
        except concurrent.futures.TimeoutError:
            cancel()
            log.warning(
                "kvoffload: the remote store %s did not answer within %.0f s at start; starting without it, retrying with backoff",
                where, timeout_s,
            )

    def attach(self, host_rows: np.ndarray | None, disk: DiskTier | None, staging_slots: int) -> None:
        """Tell the tier the local tiers (the storage calls it once, before any transfer): the host
        slots, the disk tier, and how many slots of staging to allocate when writes need one (disk
        copies to write through, evicted blocks to capture)."""
        self.host_rows, self.disk = host_rows, disk
        if self.write == "evict" or (self.write == "through" and disk is not None):
            slot_bytes = host_rows.shape[1] if host_rows is not None else disk.layout.slot_bytes  # type: ignore[union-attr]
            self.staging = StagingSlots(staging_slots, slot_bytes)

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

    async def fetch(self, keys: Sequence[Hashable], buffers: Sequence[np.ndarray]) -> None:
        """Read the blocks of ``keys`` into ``buffers`` (host slots or bounce rows the caller owns),
        pairwise; from a copy worker's loop. ``TransferError`` when a key is no longer there (or its
        value fails a check) or the remote cannot be reached. Cancelled, it returns only once nothing
        writes the buffers."""
        encoded = [encode_key(k) for k in keys]
        outcome, cancel = self._run(lambda: self.store.get_into(encoded, buffers))
        ended = asyncio.wrap_future(outcome)
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            if not ended.done():
                cancel()
                await settled(ended)
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
        """After a store of ``keys`` completed (``write="through"``): pin their copies and send them in
        the background, host copies from their slots, disk copies through the staging buffer (a key
        evicted or discarded since is not sent). Never raises."""
        if self.write != "through" or not keys:
            return
        with self._lock:
            if not self._accepting:
                return
        pins: list[Pin] = []
        try:
            pins = self._pin(keys)
            sendable = [(p.tier == HOST and self.host_rows is not None) or (p.tier == DISK and self.staging is not None) for p in pins]
            self.index.unpin([p for p, ok in zip(pins, sendable) if not ok])
            pins = [p for p, ok in zip(pins, sendable) if ok]
            if pins:
                self._start_write(len(pins), lambda: self._send_pinned(pins))
        except ClosedError:  # the offloader is closing
            self.index.unpin(pins)
        except Exception:
            self.index.unpin(pins)
            log.exception("kvoffload: starting a remote write failed; the blocks stay local")

    async def _send_pinned(self, pins: list[Pin]) -> None:
        """On the tier's loop: send pinned copies (host ones first, then disk ones a staging window at a
        time), unpinning each as it is sent; at the end (also when cancelled) every pin is given back."""
        left = list(pins)
        try:
            on_host = [p for p in left if p.tier == HOST]
            if on_host:
                rows = self.host_rows
                assert rows is not None
                await self._put([p.entry.key for p in on_host], [rows[p.slot] for p in on_host])
                self._unpin_sent(left, on_host)
            on_disk = [p for p in left if p.tier == DISK]
            while on_disk:
                staging, disk = self.staging, self.disk
                assert staging is not None and disk is not None
                slots = await staging.take(len(on_disk))
                window, on_disk = on_disk[: len(slots)], on_disk[len(slots):]
                try:
                    await disk.read_rows(staging.rows, slots, [p.slot for p in window]).wait()
                    await self._put([p.entry.key for p in window], [staging.rows[s] for s in slots])
                except Exception as e:  # a failed disk read: this write and the rest of it fail (counted below)
                    log.warning("kvoffload: reading %d disk copies for the remote failed: %s", len(window), e)
                    raise
                finally:
                    staging.give_back(slots)
                self._unpin_sent(left, window)
        finally:
            self.index.unpin(left)
            self._write_ended(len(left), failed=len(left))

    def _unpin_sent(self, left: list[Pin], sent: list[Pin]) -> None:
        """Give back the pins of ``sent`` (written or failed: counted by :meth:`_put`), off ``left``."""
        gone = {id(p) for p in sent}
        left[:] = [p for p in left if id(p) not in gone]
        self.index.unpin(sent)
        self._write_ended(len(sent))

    async def _put(self, keys: Sequence[Hashable], buffers: Sequence[np.ndarray]) -> None:
        """Send one batch and count it (accepted, refused, unreachable); raises only when cancelled."""
        try:
            accepted = sum(await self.store.put([encode_key(k) for k in keys], buffers))
        except RemoteUnavailableError:
            self._add(unavailable=1, write_failures=len(keys))
            return
        except Exception as e:
            log.warning("kvoffload: a remote write failed: %s", e)
            self._add(write_failures=len(keys))
            return
        self._add(writes=accepted, write_failures=len(keys) - accepted)

    def _start_write(self, blocks: int, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run the write ``make()`` of ``blocks`` blocks in the background, counted pending until it
        ends (``ClosedError`` when the tier is closing)."""
        with self._lock:
            if not self._accepting:
                raise ClosedError("the offloader is closing")
            self._counts["writes_pending"] += blocks
        try:
            outcome, _ = self._run(make)
        except BaseException:
            self._write_ended(blocks)
            raise
        with self._lock:
            self._writes.add(outcome)
        outcome.add_done_callback(self._forget_write)

    def _forget_write(self, outcome: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._writes.discard(outcome)

    def _write_ended(self, blocks: int, failed: int = 0) -> None:
        """``blocks`` of a background write are done with (``failed`` of them never sent)."""
        if blocks:
            self._add(writes_pending=-blocks, write_failures=failed)

    # -- write on eviction ------------------------------------------------------------------

    def capture_host(self, victims: Sequence[Evicted]) -> None:
        """``write="evict"``: copy the bytes of host ``victims`` (just evicted; their slots not yet
        written by their heirs) into staging slots and send them in the background; in the thread of
        the store that evicted them, before its copies start. Victims that find no staging slot are
        dropped (counted). Never raises."""
        rows, staging = self.host_rows, self.staging
        if not victims or rows is None or staging is None:
            return
        slots = self._take_staging(len(victims))
        captured = victims[: len(slots)]
        if captured:
            staging.rows[slots] = rows[[v.slot for v in captured]]
            self._send_captured(captured, slots)

    async def capture_disk(self, victims: Sequence[Evicted]) -> None:
        """``write="evict"``: as :meth:`capture_host` for disk ``victims``, read on the IO threads; from
        the store's task before it writes their slots. A failed read drops them (counted)."""
        staging, disk = self.staging, self.disk
        if not victims or staging is None or disk is None:
            return
        slots = self._take_staging(len(victims))
        captured = victims[: len(slots)]
        if not captured:
            return
        try:
            await disk.read_rows(staging.rows, slots, [v.slot for v in captured]).wait()
        except Exception as e:
            staging.give_back(slots)
            log.warning("kvoffload: reading %d evicted block(s) for the remote failed: %s", len(captured), e)
            self._add(write_failures=len(captured))
            return
        except BaseException:
            staging.give_back(slots)
            raise
        self._send_captured(captured, slots)

    def _take_staging(self, n: int) -> list[int]:
        """Up to ``n`` staging slots for evicted blocks; those of the ``n`` that get none are counted dropped."""
        staging = self.staging
        assert staging is not None
        with self._lock:
            accepting = self._accepting
        slots = staging.try_take(n) if accepting else []
        if len(slots) < n:
            self._add(writes_dropped=n - len(slots))
        return slots

    def _send_captured(self, captured: Sequence[Evicted], slots: list[int]) -> None:
        staging = self.staging
        assert staging is not None
        keys = [v.key for v in captured]

        async def send() -> None:
            try:
                await self._put(keys, [staging.rows[s] for s in slots])
            finally:
                staging.give_back(slots)
                self._write_ended(len(keys))

        try:
            self._start_write(len(keys), send)
        except ClosedError:
            staging.give_back(slots)
            self._add(writes_dropped=len(keys))

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
            if self.staging is not None:
                self.staging.close()
        return stopped

    async def _close_store(self) -> None:
        """On the loop: cancel the writes still running (they end once their copies have), close the store."""
        running = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in running:
            t.cancel()
        if running:
            await asyncio.wait(running)
        await self.store.close()
