"""The remote store on the Redis protocol (Redis, Valkey, Redis Cluster) through ``redis.asyncio``.

How bytes move, as measured on loopback with 2 MiB values: one value per Redis key (values split
into 512 KiB or 1 MiB parts were no faster, and slower with several connections); a batch is cut into windows of about ``window_bytes``
(two 2 MiB values by default), each sent as one pipeline, with ``connections`` windows in flight
at once, each on its own connection. Small windows let the server work on one window while the
client builds or parses another; one pipeline holding a whole batch of MB values was 2-4 times
slower. Values are built (header, checksum, payload copy) in memory kept from one window to the
next (fresh memory per value cost its page faults every time), and replies are checked and
copied into the caller's buffers, on helper threads: checksums and copies release the GIL, so the
event loop goes on with the network meanwhile. A reply is read once by redis-py into a ``bytes``
object and copied once more, into the caller's buffer; a stored value is copied once into the
packing memory (a Redis value is one bulk string: header and payload must be contiguous).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar, Union
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError, AuthenticationError, ClusterDownError, MovedError, NoPermissionError, RedisClusterException, RedisError, ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from ...base.async_backends import settled
from ...base.cache_identity import MAX_KEY_BYTES
from ...base.errors import ClosedError
from ...base.helper_threads import mark_own_thread
from ...base.sealing import Sealer
from .store_protocol import RemoteCounters, RemoteRefusedError, RemoteUnavailableError
from .value_format import (
    HEADER_BYTES, BadValue, byte_view, check_namespace, key_name, name_prefix, pack_value_into, unpack_value_into, value_bytes,
)

if TYPE_CHECKING:
    from .store_protocol import BlockBuffer

__all__ = ["RedisStore", "check_url"]

log = logging.getLogger("kvoffload.remote")

RedisClient = Union["aredis.Redis", RedisCluster]
_T = TypeVar("_T")

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SCHEMES = {"redis", "rediss", "unix"}
_USERINFO = re.compile(r"//[^/@]*@")
"""The user and password part of a URL (masked in messages)."""
_MAX_WINDOW_KEYS = 512
# Errors that mean "the remote cannot serve this call": the network, the server's state, the
# cluster's topology. A per-command ResponseError (WRONGTYPE, OOM) is an answer about one key.
_UNAVAILABLE = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)
# Replies that are ResponseErrors but say the cluster is moving or down, not that a key is bad.
_CLUSTER_IN_FLUX = (ClusterDownError, MovedError, AskError, TryAgainError)
_PROBE_KEY = b"p\0kvoffload-access-probe"
"""The encoded key :meth:`RedisStore.check_access` reads and writes (no encoded key of a block
starts with ``p``: see ``encode_key``)."""


class RedisStore:
    """A :class:`~.store_protocol.RemoteStore` on a Redis-protocol server or cluster.

    ``url_or_client``: a URL (``redis://host:port/0``, ``rediss://`` for TLS, ``unix://``,
    ``redis+cluster://host:port`` or ``rediss+cluster://`` for a cluster given by any of its
    nodes; a plain ``redis://`` URL of a cluster node is detected as a cluster at the first call,
    by ``INFO cluster``), or a ``redis.asyncio.Redis`` / ``RedisCluster`` client configured by the
    caller (TLS, AUTH, timeouts, retries are then the caller's, and closing it too).
    ``identity_digest``: the ``CacheIdentity.digest`` of the cache whose blocks this store holds.

    ``namespace``: the first part of every key name (see :mod:`.value_format`); ``connections``:
    windows in flight at once (each on its own connection); ``window_bytes``: about how many value
    bytes one pipeline carries; ``ttl_s``: an expiry for stored values (None: none; rely on the
    server's eviction policy, e.g. ``maxmemory-policy allkeys-lru``). For clients made from a URL:
    ``timeout_s`` for each socket read or write, ``connect_timeout_s`` for connecting; a call
    that finds an idle connection closed by the server retries once on a new one. After a
    connection error, calls fail at once for ``backoff_s`` (doubling per failed retry up to
    ``max_backoff_s``, with jitter so that many nodes do not retry in step).

    ``sealer``: seals every value written and checks every value read (``remote_secret=``,
    ``encryption_key=``; :mod:`.value_format`).

    ``where`` names the server in messages (the URL without its password).
    """

    def __init__(
        self,
        url_or_client: str | RedisClient,
        identity_digest: bytes,
        *,
        namespace: str = "kvoffload",
        connections: int = 4,
        window_bytes: int = 4 << 20,
        ttl_s: float | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
        sealer: Sealer | None = None,
    ) -> None:
        self._prefix = name_prefix(check_namespace(namespace), identity_digest)
        self._digest = identity_digest
        self._sealer = sealer if sealer is not None and sealer.active else None
        if not isinstance(connections, int) or connections < 1:
            raise ValueError(f"connections is a positive int, got {connections!r}")
        if not isinstance(window_bytes, int) or window_bytes < 1:
            raise ValueError(f"window_bytes is a positive int, got {window_bytes!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s is positive or None, got {ttl_s!r}")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s), ("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} is a number of seconds >= 0, got {value!r}")
        self._connections = connections
        self._window_bytes = window_bytes
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._counters = _Counters()
        self._value_memory = _ValueMemory(connections)
        # Checksums and copies of values run here, beside the loop's network work.
        self._helpers = concurrent.futures.ThreadPoolExecutor(connections, "kvoffload-remote", initializer=mark_own_thread)
        self._backoff = _Backoff(float(backoff_s), float(max_backoff_s))
        self._closed = False
        self._warned_causes: set[str] = set()  # the first rejected value of each cause is logged as a warning, the rest at debug level
        self._detect_lock = asyncio.Lock()
        self._client: RedisClient
        # For a plain URL: how to make the cluster client, should the server turn out to be a cluster node.
        self._cluster_client_if_needed: Callable[[], RedisCluster] | None = None
        if isinstance(url_or_client, str):
            self._owns_client = True
            self._client, self._cluster_client_if_needed = _client_from_url(url_or_client, timeout_s, connect_timeout_s)
            self.where = _redacted(url_or_client)
        elif isinstance(url_or_client, (aredis.Redis, RedisCluster)):
            self._owns_client = False
            self._client = url_or_client
            self.where = f"the caller's {type(url_or_client).__name__} client"
        else:
            raise TypeError(f"a Redis URL or a redis.asyncio Redis/RedisCluster client, got {type(url_or_client).__name__}")

    # -- the RemoteStore interface -----------------------------------------------------------

    @property
    def identity_digest(self) -> bytes:
        """The cache identity whose blocks this store holds."""
        return self._digest

    @property
    def is_cluster(self) -> bool:
        """Whether the store talks to a Redis Cluster (known once a call reached it, for a plain URL)."""
        return isinstance(self._client, RedisCluster)

    async def connect(self) -> None:
        """Reach the server now (detecting a cluster behind a plain URL); :class:`RemoteUnavailableError` if it cannot be reached."""

        async def ping() -> None:
            if isinstance(self._client, RedisCluster):
                await self._client.initialize()
            else:
                await self._client.ping()

        await self._call(ping)

    async def check_access(self, *, write: bool) -> None:
        """One pipeline doing what the tier does (EXISTS, GET, and if ``write`` a SET ... XX, which
        the server checks against the ACL but, the probe key being absent, stores nothing) under the
        tier's own key names:
        :class:`RemoteRefusedError` for a wrong password or user, a missing permission (an ACL without
        one of these commands or the key pattern), no such database, a TLS failure, an unknown host;
        :class:`RemoteUnavailableError` when the server cannot be reached now."""
        name = key_name(self._prefix, _PROBE_KEY)

        async def probe() -> None:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(name)
            pipe.get(name)
            if write:
                pipe.set(name, b"", xx=True)
            for reply in await pipe.execute(raise_on_error=False):
                if isinstance(reply, NoPermissionError):
                    raise reply  # other per-command answers (a read-only replica, OOM) are the calls' to count
                if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
                    raise reply

        await self._call(probe)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` the server holds (one pipeline; per node of a cluster, all at once)."""
        names = self._names(keys)
        if not names:
            return []

        async def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            replies = await pipe.execute(raise_on_error=False)
            return [_reply(r) == 1 for r in replies]

        found = await self._call(run)
        self._counters.add(keys_checked=len(found), keys_found=sum(found))
        return found

    async def get_into(self, keys: Sequence[bytes], buffers: Sequence[BlockBuffer]) -> list[bool]:
        """Fill ``buffers`` with the blocks of ``keys``; True where found and checked (see the protocol)."""
        names = self._names(keys)
        views = _views(buffers, len(names), writable=True)
        if not names:
            return []
        found = [False] * len(names)
        rejected = security = 0

        async def window(indices: range) -> None:
            nonlocal rejected, security
            pipe = self._client.pipeline(transaction=False)
            for i in indices:
                pipe.get(names[i])
            replies = [_reply(r, per_key=True) for r in await pipe.execute(raise_on_error=False)]

            def check_and_copy() -> list[BadValue | None]:  # on a helper thread: checksums and copies release the GIL
                outcome: list[BadValue | None] = []
                for i, value in zip(indices, replies):
                    try:
                        if isinstance(value, ResponseError):
                            raise BadValue(f"not a string value ({value})")
                        if value is not None:
                            unpack_value_into(value, self._digest, keys[i], views[i], self._sealer)  # checked, then copied
                            found[i] = True
                        outcome.append(None)
                    except BadValue as e:
                        outcome.append(e)
                return outcome

            for i, error in zip(indices, await self._off_loop(check_and_copy)):
                if error is not None:
                    rejected += 1
                    security += error.security
                    self._log_bad(keys[i], error)

        await self._call(lambda: self._in_windows([v.nbytes for v in views], window))
        hits = sum(found)
        self._counters.add(
            values_got=hits, bytes_got=sum(v.nbytes for v, f in zip(views, found) if f), misses=len(found) - hits, bad_values=rejected,
            security_rejections=security,
        )
        return found

    async def put(self, keys: Sequence[bytes], buffers: Sequence[BlockBuffer]) -> list[bool]:
        """Store ``buffers`` under ``keys``; True where the server accepted the value."""
        names = self._names(keys)
        views = _views(buffers, len(names), writable=False)
        if not names:
            return []
        stored = [False] * len(names)

        async def window(indices: range) -> None:
            lengths = [value_bytes(keys[i], views[i].nbytes, self._sealer) for i in indices]
            memory = self._value_memory.take(sum(lengths))
            try:
                values, start = [], 0
                for length in lengths:
                    values.append(memoryview(memory)[start:start + length])
                    start += length

                def pack() -> None:  # on a helper thread: checksums, MACs, encryption and copies release the GIL
                    for i, value in zip(indices, values):
                        pack_value_into(value, self._digest, keys[i], views[i], self._sealer)

                await self._off_loop(pack)
                pipe = self._client.pipeline(transaction=False)
                for i, value in zip(indices, values):
                    pipe.set(names[i], value, px=self._ttl_ms)  # sent (copied into the socket's buffer) within execute()
                replies = await pipe.execute(raise_on_error=False)
            finally:
                self._value_memory.give(memory)
            for i, reply in zip(indices, replies):
                stored[i] = _reply(reply, per_key=True) is True

        await self._call(lambda: self._in_windows([v.nbytes for v in views], window))
        accepted = sum(stored)
        self._counters.add(
            values_put=accepted, bytes_put=sum(v.nbytes for v, s in zip(views, stored) if s), puts_refused=len(stored) - accepted,
        )
        return stored

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` (UNLINK: the server frees large values in the background)."""
        names = self._names(keys)
        if not names:
            return

        async def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.execute_command("UNLINK", name)  # ClusterPipeline.unlink is its own multi-key coroutine
            for reply in await pipe.execute(raise_on_error=False):
                _reply(reply)

        await self._call(run)

    async def close(self) -> None:
        """Close the connections of a client this store made from a URL (idempotent); later calls raise ``ClosedError``."""
        if self._closed:
            return
        self._closed = True
        self._helpers.shutdown(wait=True, cancel_futures=True)  # at most one window's work to finish
        if self._owns_client:
            await self._client.aclose()

    def counters(self) -> RemoteCounters:
        """The counters so far (any thread)."""
        return self._counters.snapshot()

    def name_of(self, key: bytes) -> bytes:
        """The Redis key name holding the encoded ``key`` (for operators and tests)."""
        return self._names([key])[0]

    def __repr__(self) -> str:
        return f"RedisStore({self.where}, identity {self._digest.hex()[:12]}..., {'cluster' if self.is_cluster else 'standalone'})"

    # -- machinery ---------------------------------------------------------------------------

    def _names(self, keys: Sequence[bytes]) -> list[bytes]:
        if self._closed:
            raise ClosedError("the remote store is closed")
        names = []
        for key in keys:
            if not isinstance(key, bytes):
                raise TypeError(f"remote keys are encoded keys (bytes, see encode_key), got {type(key).__name__}")
            if not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"an encoded key is 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
            names.append(key_name(self._prefix, key))
        return names

    async def _call(self, work: Callable[[], Awaitable[_T]]) -> _T:
        """Run ``work`` against the server unless backing off; a connection error becomes
        :class:`RemoteUnavailableError` and starts (or extends) the backoff."""
        attempt = self._backoff.admit(self._counters, self.where)
        try:
            await self._detect()
            result = await work()
        except _UNAVAILABLE as e:
            outage_begins = not self._backoff.failing
            first, wait = self._backoff.failed(attempt, e)
            self._counters.add(connection_errors=1)
            cause = permanent_cause(e)
            what = f"refused this client ({cause})" if cause else "unavailable"
            if first:
                # one warning per outage; its later retries that fail again at debug level
                log.log(
                    logging.WARNING if outage_begins else logging.DEBUG, "remote store %s %s: %s: %s; retrying in %.2f s",
                    self.where, what, type(e).__name__, e, wait,
                )
                await self._drop_idle_connections()
            message = f"remote store {self.where} {what}: {type(e).__name__}: {e}; retrying in {wait:.2f} s"
            if cause:
                raise RemoteRefusedError(message, cause=cause, retry_in_s=wait) from e
            raise RemoteUnavailableError(message, retry_in_s=wait) from e
        if self._backoff.succeeded(attempt):
            self._counters.add(reconnects=1)
            log.info("remote store %s reachable again", self.where)
        return result

    async def _detect(self) -> None:
        """Swap the standalone client of a plain URL for a cluster client if the server is a cluster node."""
        if self._cluster_client_if_needed is None:
            return
        async with self._detect_lock:
            make_cluster_client = self._cluster_client_if_needed
            if make_cluster_client is None:
                return
            standalone = self._client
            try:
                info = await standalone.info("cluster")
            except ResponseError:  # INFO refused (a proxy, a restricted user): taken as a standalone server
                info = {}
            if info.get("cluster_enabled"):
                self._client = make_cluster_client()
                await standalone.aclose()
            self._cluster_client_if_needed = None

    async def _off_loop(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` on a helper thread, keeping the loop free. The work touches the caller's
        buffers, so a cancelled call still waits for it to end (one window's checksums and copies)
        before its cancellation goes on: the caller may reuse its buffers once the call is over."""
        if self._closed:
            raise ClosedError("the remote store is closed")
        done = asyncio.get_running_loop().run_in_executor(self._helpers, work)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            await settled(done)
            raise

    async def _drop_idle_connections(self) -> None:
        """Forget connections that may be stale after a connection error (a restarted server, a
        moved node); the next call after the backoff opens fresh ones."""
        try:
            if isinstance(self._client, RedisCluster):
                await self._client.aclose()  # the next call rediscovers the nodes and slots
            else:
                await self._client.connection_pool.disconnect(inuse_connections=False)
        except _UNAVAILABLE as e:
            log.debug("closing connections after an error failed: %s", e)

    async def _in_windows(self, sizes: list[int], run: Callable[[range], Awaitable[None]]) -> None:
        """Run ``run`` on consecutive index windows of about ``window_bytes`` each, up to
        ``connections`` at once; the first error cancels the rest and is raised."""
        windows = _windows(sizes, self._window_bytes)
        if len(windows) <= 1:
            for w in windows:
                await run(w)
            return
        pending = iter(windows)

        async def worker() -> None:
            for w in pending:
                await run(w)

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(self._connections, len(windows)))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r

    def _log_bad(self, key: bytes, error: BadValue) -> None:
        level = logging.DEBUG if error.cause in self._warned_causes else logging.WARNING
        self._warned_causes.add(error.cause)
        if error.security:
            log.log(
                level, "remote store %s: SECURITY: value of key %r refused: %s (a writer without this offloader's secret or key, "
                "or one configured apart); counted as a miss, never loaded", self.where, key[:64], error.reason,
            )
        else:
            log.log(level, "remote store %s: value of key %r rejected (%s); counted as a miss", self.where, key[:64], error.reason)


def _reply(reply: object, *, per_key: bool = False) -> Any:
    """``reply`` from a pipeline run with ``raise_on_error=False``: an error that concerns the
    connection or the cluster is raised; a per-key ``ResponseError`` is returned if ``per_key``."""
    if isinstance(reply, BaseException):
        if per_key and isinstance(reply, ResponseError) and not isinstance(reply, _CLUSTER_IN_FLUX):
            return reply
        raise reply
    return reply


def _views(buffers: Sequence[BlockBuffer], count: int, *, writable: bool) -> list[memoryview]:
    if len(buffers) != count:
        raise ValueError(f"{count} keys but {len(buffers)} buffers")
    views = []
    for i, buffer in enumerate(buffers):
        try:
            view = byte_view(buffer)
        except TypeError as e:
            raise TypeError(f"buffer {i} is not a C-contiguous buffer ({e})") from None
        if writable and view.readonly:
            raise ValueError(f"buffer {i} is read-only")
        views.append(view)
    return views


def _windows(sizes: Sequence[int], window_bytes: int) -> list[range]:
    """Consecutive index ranges of about ``window_bytes`` of values each (at least one value)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size + HEADER_BYTES
        if total >= window_bytes or i + 1 - start >= _MAX_WINDOW_KEYS:
            out.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _client_from_url(url: str, timeout_s: float, connect_timeout_s: float) -> tuple[RedisClient, Callable[[], RedisCluster] | None]:
    """The client for ``url``, and how to make a cluster client instead if a cluster is to be detected behind it."""
    scheme = urlsplit(url).scheme
    if scheme in _CLUSTER_SCHEMES:
        return _cluster_client(url, timeout_s, connect_timeout_s), None
    if scheme not in _SCHEMES:
        raise ValueError(f"a remote URL is redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://, got {_redacted(url)!r}")
    client = aredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
        # one retry, at once, on a fresh connection: absorbs an idle connection the server closed
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    if scheme == "unix":  # a cluster has no unix sockets
        return client, None
    return client, lambda: _cluster_client(url, timeout_s, connect_timeout_s)


def _cluster_client(url: str, timeout_s: float, connect_timeout_s: float) -> RedisCluster:
    parts = urlsplit(url)
    plain = urlunsplit(parts._replace(scheme=_CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)))
    # No retries of the cluster client's own (it sleeps 0.25 s between them): our backoff decides.
    return RedisCluster.from_url(plain, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, retry=Retry(NoBackoff(), 0))


def _redacted(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class _ValueMemory:
    """Memory that values are built in before they are sent, kept from one window to the next.

    A new 2 MiB object per value costs its page faults each time (memory freed goes back to the
    system): measured, that doubled the client's CPU time per stored byte. Holds up to ``keep``
    pieces of about a window each.
    """

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []

    def take(self, nbytes: int) -> bytearray:
        """A piece of at least ``nbytes`` (never resized: views of it may outlive its use)."""
        while self._free:
            memory = self._free.pop()
            if len(memory) >= nbytes:
                return memory
        return bytearray(nbytes)

    def give(self, memory: bytearray) -> None:
        if len(self._free) < self._keep:
            self._free.append(memory)


class _Counters:
    """The store's counters (the fields of :class:`RemoteCounters`): updated on its loop, read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys((f.name for f in fields(RemoteCounters)), 0)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def snapshot(self) -> RemoteCounters:
        with self._lock:
            return RemoteCounters(**self._counts)


def permanent_cause(error: BaseException) -> str:
    """What makes ``error`` (raised by a call to the server) permanent, in a few words; ``""`` for an
    error that retrying may fix (refused, reset, timed out, a server loading or failing over)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, AuthenticationError):
            return "authentication failed: wrong password or user"
        if isinstance(e, NoPermissionError):
            return f"missing permission (NOPERM): {e}"
        if isinstance(e, ResponseError) and "DB index" in str(e):
            return f"no such database: {e}"
        if isinstance(e, ssl.SSLError):
            return f"TLS failure: {e}"
        if isinstance(e, socket.gaierror) and e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return f"unknown host: {e.strerror}"
        e = e.__cause__ or e.__context__
    return ""


class _Backoff:
    """When the store may try the network again after connection errors.

    Calls are numbered by the outage round they start in: the first failure of a round starts the
    wait (doubling the last one, up to the maximum); calls of the same round failing after it add
    nothing. While waiting, calls are refused at once.
    """

    def __init__(self, first_s: float, max_s: float) -> None:
        self._first_s = first_s
        self._max_s = max(first_s, max_s)
        self._round = 0
        self._wait_s = 0.0
        self._retry_at = 0.0
        self._failing = False
        self._last_error = ""

    @property
    def failing(self) -> bool:
        """Whether an outage is on (a call failed, none succeeded since)."""
        return self._failing

    def admit(self, counters: _Counters, where: str) -> int:
        """The round a call starts in; :class:`RemoteUnavailableError` while waiting."""
        if self._failing:
            left = self._retry_at - time.monotonic()
            if left > 0:
                counters.add(calls_refused=1)
                raise RemoteUnavailableError(
                    f"remote store {where} unavailable ({self._last_error}); retrying in {left:.2f} s", retry_in_s=left,
                )
        return self._round

    def failed(self, attempt: int, error: BaseException) -> tuple[bool, float]:
        """Record a failed call of round ``attempt``: (whether it started the wait, the wait left)."""
        now = time.monotonic()
        if attempt != self._round:
            return False, max(0.0, self._retry_at - now)
        self._round += 1
        self._failing = True
        self._last_error = f"{type(error).__name__}: {error}"
        self._wait_s = self._first_s if self._wait_s == 0 else min(self._max_s, self._wait_s * 2)
        wait = self._wait_s * random.uniform(0.5, 1.0)
        self._retry_at = now + wait
        return True, wait

    def succeeded(self, attempt: int) -> bool:
        """Record a successful call of round ``attempt``; True if it ended an outage (a call that
        started before the last failure ends nothing)."""
        if not self._failing or attempt != self._round:
            return False
        self._failing = False
        self._wait_s = 0.0
        self._round += 1
        return True


def check_url(url: str) -> None:
    """``url`` as the remote tier takes it at start(), checked now without connecting: its scheme, then
    the client made from it as the store makes it (host, port, db, query arguments), then dropped."""
    schemes = ", ".join(f"{s}://" for s in (*sorted(_SCHEMES), *sorted(_CLUSTER_SCHEMES)))
    try:
        shown, scheme = repr(_redacted(url)), urlsplit(url).scheme
    except ValueError as e:  # such as an unclosed '[' of an IPv6 host
        raise ValueError(f"remote={_USERINFO.sub('//***@', url)!r} is not a URL ({e}): the remote tier takes {schemes} URLs") from None
    if scheme not in _SCHEMES and scheme not in _CLUSTER_SCHEMES:
        what = f"the scheme {scheme!r}" if scheme else "no scheme"
        raise ValueError(f"remote={shown} has {what}: the remote tier takes {schemes} URLs")
    try:
        _client_from_url(url, 5.0, 1.0)  # no connection is opened until a command is sent
    except (ValueError, TypeError, RedisError, RedisClusterException) as e:
        raise ValueError(f"remote={shown} is not a Redis URL the remote tier can use ({e}); it takes {schemes} URLs") from None
