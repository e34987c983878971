"""Shared-tier security on real Redis servers and real disk files: values forged by a raw client are
refused when a secret is set (and counted), secrets rotate, namespaces never share a block, the
encrypted disk file and remote values hold no plaintext of any stored block, permanent remote
errors fail ``start()`` with a clear ``StartError`` while a down server still starts, and the
options are checked strictly and never shown."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

redis = pytest.importorskip("redis", reason="the shared tier's security tests need redis-py (the redis extra)")
import torch  # noqa: E402

import kvoffload
from kvoffload import StartError, TransferError
from kvoffload._core.base.cache_identity import encode_key
from kvoffload._core.base.sealing import Sealer, SecretKeys
from kvoffload._core.tiers.remote import pack_value
from support.caches import block_bytes, random_caches
from support.redis_servers import binaries, free_port, redis_server  # binaries: a fixture

pytestmark = pytest.mark.timeout(60)

BLOCKS = 8
SECRET = b"s" * 16 + os.urandom(16)
OTHER = b"o" * 16 + os.urandom(16)
KEY = os.urandom(32)


@pytest.fixture
def server(binaries):
    with redis_server(binaries) as s:
        yield s


def writer(url: str, seed: int = 7, **kw: object) -> kvoffload.Offloader:
    return kvoffload.Offloader(random_caches(BLOCKS, seed=seed), remote=url, **{"host_blocks": BLOCKS, **kw}).start()


def store_and_close(url: str, keys: list[str], **kw: object) -> kvoffload.OffloaderStats:
    off = writer(url, **kw)
    try:
        off.store({k: i for i, k in enumerate(keys)}).result(10)
    finally:
        off.close()
    s = off.stats()
    assert s.remote_writes == len(keys), s
    return s


def reader(url: str, **kw: object) -> kvoffload.Offloader:
    return kvoffload.Offloader(random_caches(BLOCKS, seed=99), host_blocks=BLOCKS, remote=url, remote_write="none", **kw).start()


def caches_now(off: kvoffload.Offloader) -> dict[int, bytes]:
    return {b: block_bytes(off._caches, b) for b in range(BLOCKS)}


def written(block: int, seed: int = 7) -> bytes:
    return block_bytes(random_caches(BLOCKS, seed=seed), block)


# -- authenticated values ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_value_forged_with_a_correct_crc_and_identity_is_refused_and_counted(server, caplog):
    store_and_close(server.url, ["f0", "f1"], remote_secret=SECRET)
    off = reader(server.url, remote_secret=SECRET)
    try:
        store = off._runtime.remote.store
        digest, name = store.identity_digest, store.name_of(encode_key("f0"))
        forged = np.frombuffer(os.urandom(off.layout.slot_bytes), np.uint8)
        raw = redis.Redis(port=server.port)
        try:
            raw.set(name, pack_value(digest, encode_key("f0"), forged))  # CRC and identity right, no MAC
            raw.set(store.name_of(encode_key("f1")), pack_value(digest, encode_key("f1"), forged, Sealer(SecretKeys([OTHER]))))
        finally:
            raw.close()
        before = caches_now(off)
        assert await off.alookup(["f0", "f1"]) == 2  # EXISTS is a hint
        with caplog.at_level(logging.WARNING, "kvoffload.remote"), pytest.raises(TransferError):
            await off.load({"f0": 0})
        with pytest.raises(TransferError):
            await off.load({"f1": 1})
        assert caches_now(off) == before
        s = off.stats()
        assert (s.remote_bad_values, s.remote_hits) == (2, 0)
        assert store.counters().security_rejections == 2
        assert off.lookup(["f0"]) == 0 and off.lookup(["f1"]) == 0
        assert any("SECURITY" in r.getMessage() and "unsealed" in r.getMessage() for r in caplog.records)
    finally:
        off.close()


@pytest.mark.asyncio
async def test_two_secrets_rotate_the_first_signs_every_one_checks(server):
    store_and_close(server.url, ["old"], remote_secret=SECRET)  # before the rotation
    store_and_close(server.url, ["new"], remote_secret=[OTHER, SECRET])  # during it: OTHER signs
    both = reader(server.url, remote_secret=[OTHER, SECRET])
    try:
        assert await both.alookup(["old", "new"]) == 2
        await both.load({"old": 0, "new": 1})
        assert (block_bytes(both._caches, 0), block_bytes(both._caches, 1)) == (written(0), written(0))
    finally:
        both.close()
    for secret, loads, refuses in ((SECRET, "old", "new"), (OTHER, "new", "old")):
        off = reader(server.url, remote_secret=secret)
        try:
            assert await off.alookup([loads, refuses]) == 2
            await off.load({loads: 2})
            assert block_bytes(off._caches, 2) == written(0)
            with pytest.raises(TransferError):
                await off.load({refuses: 3})
            assert off.stats().remote_bad_values == 1
        finally:
            off.close()


@pytest.mark.asyncio
async def test_without_a_secret_the_tier_warns_once_that_it_trusts_every_writer(server, caplog):
    with caplog.at_level(logging.WARNING, "kvoffload"):
        off = reader(server.url)
        off.close()
    assert sum("trusts every writer" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvoffload"):
        reader(server.url, remote_secret=SECRET).close()
    assert not any("trusts every writer" in r.getMessage() for r in caplog.records)


def test_a_persistent_file_written_without_the_secret_is_refused(tmp_path):
    path = str(tmp_path / "kv")
    kw = {"host_blocks": 0, "disk_path": path, "disk_blocks": BLOCKS, "persist": True}
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), **kw) as off:  # another process, no secret
        off.store({f"k{i}": i for i in range(4)}).result(10)
    with kvoffload.Offloader(random_caches(BLOCKS, seed=99), remote_secret=SECRET, **kw) as off:
        assert off.lookup(["k0"]) == 0
        assert off.stats().recovered == 0 and off.stats().dropped_at_open == 4
        off.store({"k0": 0}).result(10)  # rebuilt, signed from here on
    with kvoffload.Offloader(random_caches(BLOCKS, seed=98), remote_secret=SECRET, **kw) as off:
        assert off.stats().recovered == 1
        off.load({"k0": 1}).result(10)
        assert block_bytes(off._caches, 1) == written(0, seed=99)


def test_a_signed_persistent_slot_altered_on_disk_is_never_loaded(tmp_path):
    path = str(tmp_path / "kv")
    kw = {"host_blocks": 0, "disk_path": path, "disk_blocks": BLOCKS, "persist": True, "remote_secret": SECRET}
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), **kw) as off:
        off.store({"a": 0}).result(10)
    data = bytearray(open(path, "rb").read())
    at = data.find(written(0)[:64])
    assert at > 0  # signed, not encrypted: the payload is there as stored
    data[at + 100] ^= 1  # a payload byte changed; a writer without the secret cannot fix the MAC
    with open(path, "r+b") as f:
        f.write(data)
    with kvoffload.Offloader(random_caches(BLOCKS, seed=99), **kw) as off:
        before = block_bytes(off._caches, 3)
        with pytest.raises(TransferError):
            off.load({"a": 3}).result(10)
        assert block_bytes(off._caches, 3) == before
        assert off.stats().checksum_failures == 1 and off.lookup(["a"]) == 0


# -- namespaces ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_two_namespaces_with_equal_keys_never_share_a_remote_block(server):
    store_and_close(server.url, ["k0", "k1"], namespace="tenant-a")
    for ns, expected in (("tenant-b", 0), ("", 0), ("tenant-a", 2)):
        off = reader(server.url, namespace=ns)
        try:
            assert await off.alookup(["k0", "k1"]) == expected, ns
            if expected:
                await off.load({"k0": 0, "k1": 1})
                assert block_bytes(off._caches, 1) == written(1)
            else:
                with pytest.raises(kvoffload.MissingKeysError):
                    await off.load({"k0": 0})
        finally:
            off.close()


def test_two_namespaces_with_equal_keys_never_share_a_disk_block(tmp_path):
    kw = {"host_blocks": 0, "disk_path": str(tmp_path), "disk_blocks": BLOCKS, "persist": True}
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), namespace="tenant-a", **kw) as off:
        off.store({"k0": 0}).result(10)
    with kvoffload.Offloader(random_caches(BLOCKS, seed=99), namespace="tenant-b", **kw) as off:
        assert off.lookup(["k0"]) == 0 and off.stats().recovered == 0
    with kvoffload.Offloader(random_caches(BLOCKS, seed=99), namespace="tenant-a", **kw) as off:
        off.load({"k0": 2}).result(10)
        assert block_bytes(off._caches, 2) == written(0)
    assert len([n for n in os.listdir(tmp_path) if not n.endswith(".checkpoint")]) == 2
    one_file = {**kw, "disk_path": str(tmp_path / "one")}
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), namespace="tenant-a", **one_file):
        pass
    with pytest.raises(StartError, match="namespace"):  # one file, another tenant: refused, left as it is
        kvoffload.Offloader(random_caches(BLOCKS, seed=7), namespace="tenant-b", **one_file).start()


# -- encryption at rest --------------------------------------------------------------------


def contains_any_block(data: bytes, seed: int = 7, n: int = 4) -> bool:
    """Whether ``data`` holds any 32-byte run of the pieces of blocks 0..n-1 of ``random_caches(BLOCKS, seed)``
    (each tensor's piece of a block is contiguous in a slot)."""
    caches = random_caches(BLOCKS, seed=seed)
    pieces = [t[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for b in range(n) for t in caches.values()]
    return any(p[at : at + 32] in data for p in pieces for at in range(0, max(1, len(p) - 32), 16))


def test_the_plaintext_search_finds_plaintext(tmp_path):
    """The control of the searches below: an unencrypted file holds the blocks it stores."""
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=0, disk_path=str(tmp_path / "kv"), disk_blocks=BLOCKS, persist=True) as off:
        off.store({"p0": 0}).result(10)
    data = open(tmp_path / "kv", "rb").read()
    assert contains_any_block(data, n=1)


@pytest.mark.asyncio
async def test_encrypted_disk_file_and_remote_values_hold_no_plaintext(server, tmp_path):
    path = str(tmp_path / "kv")
    kw = {"host_blocks": 0, "disk_path": path, "disk_blocks": BLOCKS, "persist": True, "encryption_key": KEY, "remote_secret": SECRET}
    off = writer(server.url, **kw)
    try:
        off.store({f"e{i}": i for i in range(4)}).result(10)
    finally:
        off.close()
    assert off.stats().remote_writes == 4
    assert not contains_any_block(open(path, "rb").read())
    raw = redis.Redis(port=server.port)
    try:
        values = [raw.get(k) for k in raw.keys("*")]
    finally:
        raw.close()
    assert len(values) == 4 and not any(contains_any_block(v) for v in values)
    # both read back byte-exact with the key: the disk file reopened, the remote by another node
    with kvoffload.Offloader(random_caches(BLOCKS, seed=99), **kw) as again:
        again.load({"e1": 5}).result(10)
        assert block_bytes(again._caches, 5) == written(1)
    other = reader(server.url, encryption_key=KEY, remote_secret=SECRET)
    try:
        assert await other.alookup([f"e{i}" for i in range(4)]) == 4
        await other.load({f"e{i}": i for i in range(4)})
        assert all(block_bytes(other._caches, i) == written(i) for i in range(4))
    finally:
        other.close()
    plain = reader(server.url, remote_secret=SECRET)  # without the key: refused, never ciphertext as a block
    try:
        assert await plain.alookup(["e0"]) == 1
        with pytest.raises(TransferError):
            await plain.load({"e0": 0})
        assert plain.stats().remote_bad_values == 1
    finally:
        plain.close()


def test_a_non_persistent_disk_tier_encrypts_its_file(tmp_path):
    with kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=1, disk_path=str(tmp_path), disk_blocks=BLOCKS, encryption_key=KEY) as off:
        off.store({f"d{i}": i for i in range(4)}).result(10)  # three spill to disk
        fd = off._running_storage().disk.file.fd
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            data = f.read()
        assert len(data) >= BLOCKS * len(written(0)) and not contains_any_block(data)
        off.load({f"d{i}": 7 - i for i in range(4)}).result(10)
        assert all(block_bytes(off._caches, 7 - i) == written(i) for i in range(4))


# -- fail fast on permanent remote errors --------------------------------------------------


@pytest.fixture
def guarded(server):
    """The server with a password and a user that may read but not write."""
    server.command("ACL", "SETUSER", "reader", "on", ">readpw", "~*", "+ping", "+exists", "+get", "+info")
    server.command("CONFIG", "SET", "requirepass", "rightpw")
    return server


@pytest.mark.parametrize("userinfo, cause", [
    (":wrongpw@", "authentication failed"),
    ("", "authentication failed"),
    ("reader:wrongpw@", "authentication failed"),
])
def test_a_wrong_password_fails_start_with_a_clear_start_error(guarded, userinfo, cause):
    url = f"redis://{userinfo}127.0.0.1:{guarded.port}/0"
    off = kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=url)
    with pytest.raises(StartError, match=cause) as e:
        off.start()
    assert "wrongpw" not in str(e.value) and f"127.0.0.1:{guarded.port}" in str(e.value)
    assert not [t for t in __import__("threading").enumerate() if t.name.startswith("kvoffload")]


def test_a_missing_acl_permission_fails_start_unless_the_tier_only_reads(guarded):
    url = f"redis://reader:readpw@127.0.0.1:{guarded.port}/0"
    with pytest.raises(StartError, match="NOPERM.*set") as e:
        kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=url).start()
    assert "readpw" not in str(e.value) and "reader:***@" in str(e.value)
    kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=url, remote_write="none").start().close()
    kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=f"redis://:rightpw@127.0.0.1:{guarded.port}/0").start().close()


def test_a_wrong_database_and_an_unknown_host_fail_start(server):
    with pytest.raises(StartError, match="no such database"):
        kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=f"redis://127.0.0.1:{server.port}/99").start()
    with pytest.raises(StartError, match="unknown host"):
        kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote="redis://no-such-host.invalid:6379/0").start()


def test_a_tls_failure_fails_start(binaries, tmp_path):
    """A server whose certificate the client cannot verify (self-signed here) is a permanent error:
    ``start()`` raises StartError naming the TLS failure, not retrying forever."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to serve")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(redis_server(binaries, tls))
        except RuntimeError as e:
            pytest.skip(f"this redis-server serves no TLS: {e}")
        off = kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=f"rediss://127.0.0.1:{tls_port}/0")
        with pytest.raises(StartError, match="TLS failure") as e:
            off.start()
        assert f"127.0.0.1:{tls_port}" in str(e.value)


def test_a_down_server_still_starts_and_says_so_once(binaries, caplog):
    with redis_server(binaries) as s:
        url = s.url
    with caplog.at_level(logging.WARNING, "kvoffload.remote"):
        off = kvoffload.Offloader(random_caches(BLOCKS, seed=7), host_blocks=BLOCKS, remote=url, remote_secret=SECRET).start()
        try:
            for i in range(3):
                off.store({f"x{i}": i}).result(10)
            assert off.lookup(["x0", "x1", "x2"]) == 3
        finally:
            off.close()
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1


# -- the options ------------------------------------------------------------------------------


def test_security_options_are_checked_strictly_and_never_shown(tmp_path, monkeypatch):
    caches = random_caches(BLOCKS)
    remote = "redis://127.0.0.1:1/0"
    bad = [
        ({"remote_secret": b"short"}, ValueError, "16 to"),
        ({"remote_secret": "a literal password"}, ValueError, "env:NAME"),
        ({"remote_secret": 12345}, TypeError, "remote_secret"),
        ({"remote_secret": []}, ValueError, "no secret"),
        ({"remote_secret": [SECRET, SECRET]}, ValueError, "twice"),
        ({"remote_secret": "env:KVOFFLOAD_TEST_UNSET"}, ValueError, "KVOFFLOAD_TEST_UNSET"),
        ({"encryption_key": b"x" * 31}, ValueError, "32 bytes"),
        ({"encryption_key": 7}, TypeError, "encryption_key"),
        ({"encryption_key": "hexhex"}, ValueError, "env:NAME"),
        ({"namespace": 3}, TypeError, "namespace"),
        ({"namespace": "a\nb"}, ValueError, "printable"),
        ({"namespace": "x" * 129}, ValueError, "128"),
    ]
    for kw, error, words in bad:
        with pytest.raises(error, match=words):
            kvoffload.Offloader(caches, host_blocks=BLOCKS, remote=remote, **kw)
    with pytest.raises(ValueError, match="needs remote or persist"):
        kvoffload.Offloader(caches, host_blocks=BLOCKS, remote_secret=SECRET)
    with pytest.raises(ValueError, match="needs a disk tier or remote"):
        kvoffload.Offloader(caches, host_blocks=BLOCKS, encryption_key=KEY)
    monkeypatch.setenv("KVOFFLOAD_TEST_SECRET", SECRET.hex())
    monkeypatch.setenv("KVOFFLOAD_TEST_KEY", KEY.hex())
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        kvoffload.Offloader(caches, host_blocks=BLOCKS, remote=remote, encryption_key=f"file:{key_file}")
    key_file.chmod(0o600)
    for key in (KEY, "env:KVOFFLOAD_TEST_KEY", f"file:{key_file}"):
        off = kvoffload.Offloader(caches, host_blocks=BLOCKS, remote=remote, remote_secret=["env:KVOFFLOAD_TEST_SECRET", OTHER], encryption_key=key)
        assert off.options.encryption_key == kvoffload.Offloader(caches, host_blocks=BLOCKS, remote=remote, encryption_key=KEY).options.encryption_key
        shown = repr(off.options)
        for secret in (SECRET.hex(), KEY, KEY.hex(), OTHER):
            assert str(secret) not in shown and repr(secret) not in shown
        assert "2 secret(s)" in shown
