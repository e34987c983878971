"""The offloader's options: one frozen, validated value instead of loose keyword arguments."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .sealing import encryption_key_of, secret_keys_of

__all__ = ["DEFAULT_HOST_BYTES", "MAX_SIZE", "Options", "TierSlots", "format_size", "parse_size", "refuse_unknown_keys"]

DEFAULT_HOST_BYTES = 1 << 30
"""The host tier's size when neither ``host_blocks`` nor ``host_bytes`` is given: 1 GiB worth of slots."""

_SIZE_UNITS = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"\s*0*([0-9]+)\s*(KiB|MiB|GiB|TiB)?\s*")  # [0-9], not \d: ASCII digits only
MAX_SIZE = (1 << 64) - 1
"""The largest size :func:`parse_size` takes: 2**64 - 1 bytes."""


def parse_size(name: str, value: object) -> int:
    """Bytes from ``value``: an int >= 0, or a string of ASCII digits with an optional binary suffix
    (``"65536"``, ``"64KiB"``, ``"16GiB"``, ``"1TiB"``), at most :data:`MAX_SIZE`. ``TypeError`` /
    ``ValueError`` naming ``name`` (the option) and the value otherwise: floats, bools, negatives,
    other suffixes, other digits, sizes beyond 64 bits."""
    if isinstance(value, str):
        m = _SIZE.fullmatch(value)
        if m is None:
            hint = " (digits 0-9 only)" if any(c.isdigit() and not c.isascii() for c in value) else ""
            raise ValueError(
                f"{name}={_shown(value)} is not a size{hint}: give bytes as an integer, or digits with KiB, MiB, GiB or TiB ('16GiB')"
            )
        nbytes = int(m[1]) * _SIZE_UNITS[m[2]] if len(m[1]) <= 20 else MAX_SIZE + 1  # 20 digits hold 2**64 - 1
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name}={value!r} ({type(value).__name__}) is not a size: give bytes as an integer, or a string such as '16GiB'"
        )
    elif value < 0:
        raise ValueError(f"{name}={_shown(value)} is negative")
    else:
        nbytes = value
    if nbytes > MAX_SIZE:
        raise ValueError(f"{name}={_shown(value)} is too large: at most 2**64 - 1 bytes, 16 EiB")
    return nbytes


def _shown(value: str | int) -> str:
    """``value`` for a message, cut short if long (an int of thousands of digits has no ``repr``)."""
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<an int of {value.bit_length()} bits>"
    return repr(value) if len(value) <= 48 else repr(value[:40]) + "..."


def format_size(nbytes: int) -> str:
    """``nbytes`` for people: ``"1 GiB"``, ``"1.50 GiB"``, ``"64 KiB"``, ``"100 bytes"``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit]
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}" if nbytes % scale == 0 else f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


@dataclass(frozen=True)
class TierSlots:
    """How many slots each tier has, for one slot size, and how each size was given (for messages)."""

    host: int
    disk: int
    host_given: str
    """``"host_bytes=68719476736 (64 GiB)"``, ``"host_blocks=4096"`` or ``"the default host size (1 GiB)"``."""
    disk_given: str
    """``"disk_bytes=... (...)"``, ``"disk_blocks=..."`` or ``"no disk tier"``."""


@dataclass(frozen=True)
class Options:
    """Everything about an :class:`Offloader` except its caches; validated on construction.

    ``Offloader(kv_caches, host_blocks=1024, ...)`` builds one from its keyword
    arguments; ``off.options`` returns it.
    """

    host_blocks: int | None = None
    """Block slots in (pinned) host memory; 0 for a disk-only offloader. Give this or ``host_bytes``;
    with neither, the host tier holds :data:`DEFAULT_HOST_BYTES` (1 GiB) worth of slots."""
    host_bytes: int | None = None
    """The host tier's size in bytes (an int, or a string such as ``"64GiB"``, kept here as an int):
    ``host_bytes // slot_bytes`` slots. Instead of ``host_blocks``."""
    disk_path: str | None = None
    """File of the disk tier (created fresh, mode 0600, removed on close), or None."""
    disk_blocks: int | None = None
    """Block slots on disk; needs ``disk_path``. Give this or ``disk_bytes``."""
    disk_bytes: int | None = None
    """The disk tier's size in bytes (an int, or a string such as ``"400GiB"``, kept here as an int):
    ``disk_bytes // slot_bytes`` slots. Instead of ``disk_blocks``; needs ``disk_path``."""
    chunk_bytes: int = 128 << 20
    """Bytes per copy chunk: the unit of pipelining and of cancellation. A GPU cache gets two
    staging buffers of this size per direction (512 MiB of GPU memory in all at the default)."""
    bounce_bytes: int | None = None
    """The disk tier's IO unit through its pinned bounce buffers (an int, or a string such as
    ``"32MiB"``, kept here as an int; rounded down to whole slots, at least one; at most
    ``chunk_bytes``): each bounce buffer has two halves of this size, so the disk IO of one half
    overlaps the copy of the other. Default: ``chunk_bytes``. See docs/how-to/sizing.md."""
    gather_ctas: int = 0
    """GPU caches: CTAs per gather/scatter launch; 0 (the default) runs one per piece, the fastest on
    an idle GPU. A small number (8-32) leaves more SMs to the model's kernels and moves less per
    second: ``kvoffload bench`` measures both beside a matmul loop."""
    copy_engine: Literal["kernel", "dma"] = "kernel"
    """GPU caches: who copies the pieces of a chunk. ``"kernel"`` (the default): a copy kernel
    gathers them into a staging buffer that one DMA moves (loads: the reverse), the fastest on an
    idle GPU for every piece size, and loads stop early when cancelled. ``"dma"``: the copy
    engines move each piece with a descriptor of its own, using no SMs; the driver takes about
    a microsecond per piece to enqueue them (in the calling thread), and small pieces copy
    slowly (16 KiB: a few GB/s). ``kvoffload bench`` measures both beside a matmul loop."""
    use_batch_copy: bool = True
    """False forces one ``cuMemcpyAsync`` per copy instead of ``cuMemcpyBatchAsync``: the path drivers
    older than CUDA 12.8 take anyway, for a driver whose batched copy misbehaves (and for the tests,
    which run both)."""
    io_threads: int = 4
    """Disk IO threads."""
    use_page_cache: bool = False
    """Buffered disk IO instead of O_DIRECT."""
    expedited_loads: bool = False
    """Start a third worker for ``load(..., expedited=True)``: small loads the caller waits for then
    queue behind no other load. Its copies are made by a kernel on high-priority streams that reads
    host memory directly, so they overtake a bulk load whose DMAs fill the copy engines' queue.
    Costs one thread. Without it expedited loads run as others. GPU caches only (on CPU caches
    the copies hold the GIL, so a third thread would only wait behind the load worker's: expedited
    loads there take the load worker; docs/design.md has the figures)."""

    promote: bool = True
    """A load of disk-resident keys leaves a copy of them in free host slots (never evicting
    anything for it), so a hot prefix is read from host memory next time. Off where an external
    manager owns the capacity (the vLLM backend)."""
    persist: bool = False
    """Keep the disk file across restarts: every slot is written with a header (key, length, cache
    identity, sequence number, CRC32C of the payload), an index checkpoint is written in the
    background and at close, and a later offloader with the same cache identity at the same
    ``disk_path`` finds the entries again (see docs/how-to/persistence.md). Keys must be
    ``bytes``, ``str`` or ``int``. Without it the disk file never outlives the process."""
    fingerprint: str | bytes | None = None
    """With ``persist``: the model's identity (a weights hash, a name and revision), part of the cache
    identity, so that a restarted offloader never serves blocks another model computed."""
    verify: bool = False
    """Check the CRC32C of every slot read from disk (computed on the IO threads); a slot that fails
    fails its load with ``TransferError`` and is dropped. Needs ``persist``."""
    remote: Any = None
    """The remote tier shared by many serving nodes: a Redis URL (``redis://host:port/0``,
    ``rediss://`` for TLS, ``redis+cluster://host:port`` for a cluster) or a ``redis.asyncio.Redis`` /
    ``RedisCluster`` client configured by the caller (TLS, AUTH, timeouts are then the caller's;
    the offloader uses it on its ``kvoffload-remote`` thread only, and never closes it). Keys must be
    ``bytes``, ``str`` or ``int``. A URL is checked when the ``Offloader`` is made, without connecting
    (scheme, port, db, query arguments). See docs/how-to/remote.md."""
    remote_shard: str = ""
    """Which shard of a sharded cache this offloader holds (the tensor-parallel rank): part of the
    cache identity, so ranks never read each other's blocks."""
    remote_write: Literal["through", "evict", "none"] = "through"
    """When blocks are sent to the remote, in the background: ``"through"``, as their store completes
    (other nodes see them soon after); ``"evict"``, as the local tiers evict them (the remote holds
    what this node let go; evicted blocks wait in a staging buffer of ``bounce_bytes``, and those that
    find it full are not sent); ``"none"``: the remote is only read from."""
    remote_secret: Any = None
    """Authenticates what the shared and persistent tiers hand back (docs/security.md): every remote
    value and persistent slot written carries an HMAC-SHA256 tag of this secret, and one that fails
    its check is never loaded (a counted miss on the remote, a dropped slot on disk). Bytes (at least
    16; 32 random bytes are the advice), ``"env:NAME"`` (read from that environment variable when the
    ``Offloader`` is made), or a list of them for a rotation: the first signs, all are accepted.
    Kept here as :class:`~.sealing.SecretKeys`, which never shows them. Needs ``remote`` or ``persist``."""
    namespace: str = ""
    """The tenant: part of the cache identity, so offloaders of different namespaces never see each
    other's blocks on disk or on the remote, whatever their keys (docs/security.md). Up to 128
    printable characters; ``""``: none."""
    encryption_key: Any = None
    """Encrypts the disk tier's slots and the remote values with AES-256-GCM (needs the
    ``cryptography`` package: ``kvoffload[crypto]``): 32 bytes, ``"env:NAME"`` (64 hex digits or
    base64 in that variable) or ``"file:PATH"`` (a file only its owner can read), read when the
    ``Offloader`` is made; kept as :class:`~.sealing.EncryptionKey`, which never shows it. Needs a
    disk tier or ``remote``."""

    def __post_init__(self) -> None:
        for tier in ("host", "disk"):
            blocks, size = f"{tier}_blocks", f"{tier}_bytes"
            if getattr(self, blocks) is not None:
                _check_count(blocks, getattr(self, blocks), minimum=0)
            if getattr(self, size) is not None:
                object.__setattr__(self, size, parse_size(size, getattr(self, size)))
            if getattr(self, blocks) is not None and getattr(self, size) is not None:
                raise ValueError(
                    f"give {blocks} or {size}, not both (got {blocks}={getattr(self, blocks)!r}, {size}={getattr(self, size)!r})"
                )
        _check_count("chunk_bytes", self.chunk_bytes, minimum=1)
        if self.bounce_bytes is not None:
            object.__setattr__(self, "bounce_bytes", parse_size("bounce_bytes", self.bounce_bytes))
            if not self.bounce_bytes:
                raise ValueError("bounce_bytes must be at least one byte (it is rounded to whole slots, at least one)")
            if self.bounce_bytes > self.chunk_bytes:
                raise ValueError(
                    f"bounce_bytes={self.bounce_bytes} is more than chunk_bytes={self.chunk_bytes}: a bounce half is copied "
                    "to or from the cache as one chunk; give a smaller bounce_bytes or a larger chunk_bytes"
                )
        _check_count("io_threads", self.io_threads, minimum=1)
        _check_count("gather_ctas", self.gather_ctas, minimum=0)
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)):
                raise TypeError(f"disk_path must be a path or None, got {type(self.disk_path).__name__}")
            path = os.fspath(self.disk_path)
            if not isinstance(path, str):
                raise TypeError(f"disk_path must be a str path, got {type(path).__name__}")
            if not path or "\0" in path:
                raise ValueError(f"disk_path is not a valid path: {path!r}")
            object.__setattr__(self, "disk_path", path)
        disk_size = "disk_bytes" if self.disk_bytes is not None else "disk_blocks"
        if getattr(self, disk_size) and self.disk_path is None:
            raise ValueError(f"{disk_size} > 0 needs a disk_path")
        if self.disk_path is not None and not getattr(self, disk_size):
            raise ValueError("disk_path given without a disk size: give disk_bytes (such as '400GiB') or disk_blocks")
        host_size = "host_bytes" if self.host_bytes is not None else "host_blocks"
        if getattr(self, host_size) == 0 and not getattr(self, disk_size):
            raise ValueError(f"no room: {host_size}=0 and no disk tier")
        if self.copy_engine not in ("kernel", "dma"):
            raise ValueError(f"copy_engine must be 'kernel' or 'dma', got {self.copy_engine!r}")
        if self.fingerprint is not None and not isinstance(self.fingerprint, (str, bytes)):
            raise TypeError(f"fingerprint must be a str, bytes or None, got {type(self.fingerprint).__name__}")
        if self.fingerprint is not None and not self.persist and self.remote is None:
            raise ValueError("fingerprint needs persist=True or remote (it belongs to the cache identity of a persistent or remote tier)")
        if self.verify and not self.persist:
            raise ValueError("verify needs persist=True (it belongs to the persistent disk tier)")
        if self.remote is not None:
            _check_remote(self.remote)
        if not isinstance(self.remote_shard, str):
            raise TypeError(f"remote_shard must be a str, got {type(self.remote_shard).__name__}")
        if self.remote_write not in ("through", "evict", "none"):
            raise ValueError(f"remote_write must be 'through', 'evict' or 'none', got {self.remote_write!r}")
        if self.persist and self.disk_path is None:
            raise ValueError("persist=True needs a disk tier: give disk_path and disk_bytes (or disk_blocks)")
        for name in ("use_batch_copy", "use_page_cache", "expedited_loads", "promote", "persist", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        _check_security(self)


    def tier_slots(self, slot_bytes: int) -> TierSlots:
        """The slots of each tier for slots of ``slot_bytes``: counts as given, sizes divided by
        ``slot_bytes``. ``ValueError`` for a size of at least one byte that holds no slot."""
        if self.host_blocks is not None:
            host, host_given = self.host_blocks, f"host_blocks={self.host_blocks}"
        elif self.host_bytes is not None:
            host, host_given = self.host_bytes // slot_bytes, f"host_bytes={self.host_bytes} ({format_size(self.host_bytes)})"
            if self.host_bytes and not host:
                raise ValueError(f"{host_given} holds no slot of {slot_bytes} bytes: give at least {slot_bytes}, or 0 for no host tier")
        else:
            host, host_given = DEFAULT_HOST_BYTES // slot_bytes, f"the default host size ({format_size(DEFAULT_HOST_BYTES)})"
            if not host:
                raise ValueError(
                    f"{host_given} holds no slot of {format_size(slot_bytes)}: give host_bytes or host_blocks"
                )
        if self.disk_bytes is not None:
            disk, disk_given = self.disk_bytes // slot_bytes, f"disk_bytes={self.disk_bytes} ({format_size(self.disk_bytes)})"
            if self.disk_bytes and not disk:
                raise ValueError(f"{disk_given} holds no slot of {slot_bytes} bytes: give at least {slot_bytes}")
        else:
            disk = self.disk_blocks or 0
            disk_given = f"disk_blocks={disk}" if disk else "no disk tier"
        return TierSlots(host, disk, host_given, disk_given)


def _check_security(opts: Options) -> None:
    """``remote_secret``, ``namespace`` and ``encryption_key``, normalised in place."""
    object.__setattr__(opts, "remote_secret", secret_keys_of(opts.remote_secret))
    if opts.remote_secret is not None and opts.remote is None and not opts.persist:
        raise ValueError("remote_secret needs remote or persist=True (it authenticates the remote values and persistent slots)")
    if not isinstance(opts.namespace, str):
        raise TypeError(f"namespace must be a str, got {type(opts.namespace).__name__}")
    if len(opts.namespace) > 128 or not opts.namespace.isprintable():
        raise ValueError(f"namespace is up to 128 printable characters, got {_shown(opts.namespace)} ({len(opts.namespace)} characters)")
    object.__setattr__(opts, "encryption_key", encryption_key_of(opts.encryption_key))
    if opts.encryption_key is not None and opts.remote is None and opts.disk_path is None:
        raise ValueError("encryption_key needs a disk tier or remote (it encrypts disk slots and remote values)")


def _check_remote(remote: object) -> None:
    try:
        from redis.asyncio import Redis
        from redis.asyncio.cluster import RedisCluster
    except ImportError:
        if isinstance(remote, str):
            raise ImportError("remote= needs redis-py: pip install 'kvoffload[redis]'") from None
        raise TypeError(f"remote must be a Redis URL or a redis.asyncio Redis/RedisCluster client, got {type(remote).__name__}") from None
    if isinstance(remote, str):
        if not remote:
            raise ValueError("remote is a Redis URL such as 'redis://host:6379/0', got ''")
        return  # its scheme, host, port and db are checked by the Offloader (check_url of the remote tier)

    if not isinstance(remote, (Redis, RedisCluster)):
        raise TypeError(f"remote must be a Redis URL or a redis.asyncio Redis/RedisCluster client, got {type(remote).__name__}")


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def refuse_unknown_keys(config: str, given: Iterable[str], accepted: frozenset[str], engine: str, engine_keys: frozenset[str]) -> None:
    """``ValueError`` naming the keys of an engine's config (``config``: its name) that neither kvoffload
    (``accepted``) nor the engine itself (``engine_keys``) reads, each with the closest accepted key."""
    unknown = sorted(set(given) - accepted - engine_keys)
    if not unknown:
        return
    hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, accepted, 1)) else repr(k)
             for k in unknown]
    raise ValueError(
        f"{config} has unknown key(s) {', '.join(hints)}; kvoffload accepts {', '.join(sorted(accepted))}, "
        f"beside {engine}'s own {', '.join(sorted(engine_keys))}"
    )
