"""Real Redis servers for the tests: a standalone server or a three-node cluster on 127.0.0.1.

Each server runs from its own temporary directory on a free port, answers PING before it is
handed out, and is stopped (its directory removed) at teardown. ``redis-server`` is installed
with apt when it is missing and the tests run as root (as in CI); :func:`redis_binaries` returns
None only when it can neither be found nor installed, and the tests skip then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

__all__ = ["RedisBinaries", "RedisServer", "TcpProxy", "redis_binaries", "redis_cluster", "redis_server"]

_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisBinaries:
    server: str
    cli: str


@functools.lru_cache(maxsize=1)
def redis_binaries() -> RedisBinaries | None:
    """``redis-server`` and ``redis-cli``, installed with apt if missing (as root); None if neither works."""
    found = _which()
    if found is None and os.name == "posix" and os.geteuid() == 0 and shutil.which("apt-get"):
        # RUNLEVEL=1: the package's init script is not started, so no server is left on port 6379.
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
        for commands in ([install], [["apt-get", "update", "-q"], install]):
            if all(subprocess.run(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode == 0 for c in commands):
                found = _which()
                if found is not None:
                    break
    return found


def _which() -> RedisBinaries | None:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return RedisBinaries(server, cli) if server and cli else None


def command(port: int, *args: bytes | str, timeout_s: float = 5.0) -> object:
    """Send one command to the server on ``port`` over a fresh socket; its reply (RESP2, decoded
    minimally: simple strings and bulk strings as bytes, integers as int, arrays as lists; an error
    reply as an ``RuntimeError``). Independent of redis-py, so the tests' view of a server never
    depends on the client under test."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    request = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        reader = sock.makefile("rb")
        return _read_reply(reader)


def _read_reply(reader: object) -> object:
    line = reader.readline()  # type: ignore[attr-defined]
    if not line:
        raise ConnectionError("connection closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RuntimeError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = reader.read(n + 2)  # type: ignore[attr-defined]
        return data[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_read_reply(reader) for _ in range(n)]
    raise RuntimeError(f"unexpected reply {line!r}")


def free_port(*, with_bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and its cluster bus port, ``port + 10000``, if ``with_bus``)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 < 65536 and _port_is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    """One ``redis-server`` process in ``directory`` on ``port``; :meth:`stop` and :meth:`start` again
    keep the port (a restart, as clients see it)."""

    def __init__(self, binaries: RedisBinaries, directory: str, port: int, extra_args: Sequence[str] = ()) -> None:
        self.binaries = binaries
        self.directory = directory
        self.port = port
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        args = [
            self.binaries.server, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
            "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
            "--logfile", os.path.join(self.directory, "redis.log"), *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                if command(self.port, "PING", timeout_s=1.0) == b"PONG":
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self._log_tail()
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {log}")
            time.sleep(0.005)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until the process has gone."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def command(self, *args: bytes | str) -> object:
        """One command to this server (see :func:`command`)."""
        return command(self.port, *args)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return "(no log)"


@contextlib.contextmanager
def redis_server(binaries: RedisBinaries, extra_args: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A started standalone server; stopped and its directory removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-redis-") as directory:
        server = RedisServer(binaries, directory, free_port(), extra_args)
        try:
            yield server.start()
        finally:
            server.stop()


@contextlib.contextmanager
def redis_cluster(binaries: RedisBinaries, nodes: int = 3) -> Iterator[list[RedisServer]]:
    """``nodes`` started cluster nodes holding every slot between them (no replicas), once every
    node reports ``cluster_state:ok``; stopped and their directories removed on exit."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-redis-cluster-") as root:
        servers: list[RedisServer] = []
        try:
            for i in range(nodes):
                directory = os.path.join(root, f"node{i}")
                os.mkdir(directory)
                servers.append(RedisServer(binaries, directory, free_port(with_bus=True), [
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000",
                ]).start())
            # Slots in equal ranges, then MEET: faster than redis-cli --cluster create (no fixed waits).
            for i, server in enumerate(servers):
                first, last = i * 16384 // nodes, (i + 1) * 16384 // nodes - 1
                server.command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last))
            for server in servers:  # every node meets every other: no waiting for gossip to spread
                for other in servers:
                    if other is not server:
                        server.command("CLUSTER", "MEET", "127.0.0.1", str(other.port))
            # A new master reports cluster_state:ok no sooner than 2 s after it started (Redis's writable delay).
            deadline = time.monotonic() + _START_TIMEOUT_S * 2
            while not all(_cluster_ready(s, nodes) for s in servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.02)
            yield servers
        finally:
            for server in servers:
                server.stop()


def _cluster_ready(server: RedisServer, nodes: int) -> bool:
    info = server.command("CLUSTER", "INFO")
    assert isinstance(info, bytes)
    fields = dict(line.split(":", 1) for line in info.decode().split("\r\n") if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(nodes) and fields.get("cluster_slots_ok") == "16384"


class TcpProxy:
    """Forwards connections on its own port to ``target_port`` on 127.0.0.1, in the running event loop.

    After :meth:`hold_replies_after` it stops passing replies on once that many reply bytes went
    through, and sets ``holding``: a client is then known to be in the middle of reading a batch.
    :meth:`release` lets replies flow again; :meth:`cut` also closes every connection (as a
    server's death looks to its clients). New connections are always accepted and forwarded
    (closed at once if the target refuses them).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = asyncio.Event()
        self._resume = asyncio.Event()
        self._hold_after: int | None = None
        self._forwarded = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hold_replies_after(self, nbytes: int) -> None:
        self._forwarded, self._hold_after = 0, nbytes
        self.holding.clear()
        self._resume.clear()

    def release(self) -> None:
        """Stop holding: held replies flow on."""
        self._hold_after = None
        self._resume.set()

    def cut(self) -> None:
        """Close every connection now, and stop holding."""
        self.release()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        for pump in (self._pump(reader, up_writer, replies=False), self._pump(up_reader, writer, replies=True)):
            task = asyncio.ensure_future(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if replies and self._hold_after is not None:
                    if self._forwarded >= self._hold_after:
                        self.holding.set()
                        await self._resume.wait()
                    self._forwarded += len(data)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)


# -- fixtures (imported by the test modules that need a server) ----------------------------------


@pytest.fixture(scope="module")
def binaries() -> RedisBinaries:
    """The redis binaries, installed if missing; the module's tests are skipped if that cannot be done."""
    found = redis_binaries()
    if found is None:
        pytest.skip("redis-server is not installed and could not be installed")
    return found


@pytest.fixture(scope="module")
def cluster(binaries: RedisBinaries) -> Iterator[list[RedisServer]]:
    """A three-node Redis Cluster for the module's tests."""
    with redis_cluster(binaries) as nodes:
        yield nodes
