"""Sealing what leaves the process: a keyed MAC that proves who wrote a block, AES-256-GCM that hides it.

Two independent keys, one mechanism each:

- **Secrets** (``remote_secret=``): HMAC-SHA256 over a value's header and stored bytes. Only a
  holder of a secret can write a value that a reader with the same secret accepts; a reader
  refuses a value without a tag, with a tag of a secret it does not know, or with a wrong tag.
  Several secrets may be given for a rotation: the first signs, every one is accepted for checking.
  Each tag names its secret by a *key id*, 4 bytes of a hash of it (so checking never tries them
  all, and a secret is never written anywhere). HMAC-SHA256 was measured against keyed BLAKE2b
  (hashlib): 1.7 against 0.9 GB/s per core on the 2-core CI machine, both releasing the GIL.
- **An encryption key** (``encryption_key=``): AES-256-GCM (the ``cryptography`` package), a random
  96-bit nonce per write, the associated data binding the ciphertext to where it belongs (cache
  identity, key, slot). About 12 GB/s per core there, the GIL released.

Every call here runs on an IO thread or the remote tier's helper threads, never a caller's. A
secret or a key is never logged: :class:`SecretKeys` and :class:`EncryptionKey` show only how many
keys they hold and their key ids.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "KEY_BYTES", "KID_BYTES", "MAC_BYTES", "MIN_SECRET_BYTES", "NONCE_BYTES", "TAG_BYTES", "BadSeal", "EncryptionKey",
    "SecretKeys", "Sealer", "encryption_key_of", "secret_keys_of",
]

MAC_BYTES = 32
"""An HMAC-SHA256 tag."""
KID_BYTES = 4
"""A key id: which secret signed."""
NONCE_BYTES = 12
"""An AES-GCM nonce (random per write)."""
TAG_BYTES = 16
"""An AES-GCM tag."""
KEY_BYTES = 32
"""An AES-256 key."""
MIN_SECRET_BYTES = 16
"""The shortest secret taken (32 random bytes are the advice: ``secrets.token_bytes(32)``)."""
_MAX_SECRET_BYTES = 4096
_ENV = "env:"
_FILE = "file:"


class BadSeal(ValueError):
    """A sealed value or slot that fails its check; ``cause`` is a short, fixed phrase (for counting
    and for logging once per cause), the message may say more."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


def _kid(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=KID_BYTES, person=b"kvoffload-kid").digest()


class SecretKeys:
    """The secrets of ``remote_secret=``, first one signing (see the module docstring). Equal when
    they hold the same secrets; shown without them."""

    __slots__ = ("_secrets", "kids", "_macs")

    def __init__(self, secrets: Sequence[bytes]) -> None:
        self._secrets = tuple(bytes(s) for s in secrets)
        self.kids = tuple(_kid(s) for s in self._secrets)
        self._macs = {kid: hmac.new(s, digestmod=hashlib.sha256) for kid, s in zip(self.kids, self._secrets)}

    @property
    def signing_kid(self) -> bytes:
        return self.kids[0]

    def sign(self, parts: Sequence[Buffer]) -> bytes:
        """The tag of the first secret over ``parts`` (the GIL is released for large parts)."""
        return self._tag(self.kids[0], parts)

    def check(self, kid: bytes, tag: bytes, parts: Sequence[Buffer]) -> None:
        """:class:`BadSeal` unless ``tag`` is the tag over ``parts`` of the secret ``kid`` names."""
        if kid not in self._macs:
            raise BadSeal("signed with a secret this offloader does not hold", "unknown secret")
        if not hmac.compare_digest(self._tag(kid, parts), bytes(tag)):
            raise BadSeal("its MAC does not match: written by someone without the secret, or altered", "MAC mismatch")

    def _tag(self, kid: bytes, parts: Sequence[Buffer]) -> bytes:
        h = self._macs[kid].copy()
        for p in parts:
            h.update(p)
        return h.digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretKeys) and len(self._secrets) == len(other._secrets) and all(
            hmac.compare_digest(a, b) for a, b in zip(self._secrets, other._secrets)
        )

    def __hash__(self) -> int:
        return hash(self.kids)

    def __repr__(self) -> str:
        return f"<{len(self.kids)} secret(s), key ids {', '.join(k.hex() for k in self.kids)}>"

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("remote secrets are not pickled")


class EncryptionKey:
    """The AES-256 key of ``encryption_key=``; shown without it."""

    __slots__ = ("_key", "kid", "_aead")

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # optional: kvoffload[crypto]

        self._key = bytes(key)
        self.kid = _kid(self._key)
        self._aead = AESGCM(self._key)

    def encrypt_into(self, nonce: bytes, data: memoryview, aad: bytes, out: memoryview) -> None:
        """``out`` (``len(data) + TAG_BYTES``) := ciphertext then tag."""
        self._aead.encrypt_into(nonce, data, aad, out)

    def decrypt_into(self, nonce: bytes, sealed: memoryview, aad: bytes, out: memoryview) -> None:
        """``out`` := the plaintext of ``sealed`` (ciphertext then tag); :class:`BadSeal` if it fails
        its tag (``out`` then holds unspecified bytes)."""
        from cryptography.exceptions import InvalidTag

        try:
            self._aead.decrypt_into(nonce, sealed, aad, out)
        except InvalidTag:
            raise BadSeal("it fails decryption (another key, or altered)", "decryption failed") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncryptionKey) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.kid)

    def __repr__(self) -> str:
        return f"<AES-256 key, key id {self.kid.hex()}>"

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("encryption keys are not pickled")


class Sealer:
    """What one tier seals with: the secrets (a MAC), the key (encryption), either, both or neither."""

    __slots__ = ("secrets", "key")

    def __init__(self, secrets: SecretKeys | None = None, key: EncryptionKey | None = None) -> None:
        self.secrets = secrets
        self.key = key

    @property
    def active(self) -> bool:
        return self.secrets is not None or self.key is not None

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def __repr__(self) -> str:
        return f"Sealer(secrets={self.secrets!r}, key={self.key!r})"


# -- the options' forms -------------------------------------------------------------------


def secret_keys_of(value: object, name: str = "remote_secret") -> SecretKeys | None:
    """``remote_secret=`` as :class:`SecretKeys`: None; bytes (at least :data:`MIN_SECRET_BYTES`);
    ``"env:NAME"``, the secret being the value of the environment variable ``NAME`` (its UTF-8
    bytes), read now; or a list or tuple of these, the first signing (a rotation). ``TypeError`` /
    ``ValueError`` naming the option otherwise; a secret itself is never shown."""
    if value is None or isinstance(value, SecretKeys):
        return value
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"{name}=[] holds no secret: give bytes, 'env:NAME', or a list of them (the first signs)")
    secrets = [_secret(item, name) for item in items]
    if len({_kid(s) for s in secrets}) != len(secrets):
        raise ValueError(f"{name} lists one secret twice")
    return SecretKeys(secrets)


def _secret(item: object, name: str) -> bytes:
    if isinstance(item, (bytes, bytearray, memoryview)):
        secret, given = bytes(item), f"a secret of {len(bytes(item))} bytes"
    elif isinstance(item, str):
        if not item.startswith(_ENV) or not item[len(_ENV):]:
            raise ValueError(
                f"{name}: a str names an environment variable as 'env:NAME'; give the secret itself as bytes "
                f"(got a str of {len(item)} characters that does not start with 'env:')"
            )
        text = _env(item[len(_ENV):], name)
        secret, given = text.encode(), f"environment variable {item[len(_ENV):]!r} ({len(text.encode())} bytes)"
    else:
        raise TypeError(f"{name} takes bytes, 'env:NAME' or a list of them, got {type(item).__name__}")
    if not MIN_SECRET_BYTES <= len(secret) <= _MAX_SECRET_BYTES:
        raise ValueError(
            f"{name}: {given} is not {MIN_SECRET_BYTES} to {_MAX_SECRET_BYTES} bytes long "
            "(32 random bytes, secrets.token_bytes(32), are the advice)"
        )
    return secret


def encryption_key_of(value: object, name: str = "encryption_key") -> EncryptionKey | None:
    """``encryption_key=`` as an :class:`EncryptionKey`: None; 32 bytes; ``"env:NAME"`` (the variable
    holds the key as 64 hex digits or base64); ``"file:PATH"`` (a regular file, readable by its
    owner only, holding the 32 raw bytes, 64 hex digits or base64), read now. ``TypeError`` /
    ``ValueError`` naming the option otherwise; ``ImportError`` without the ``cryptography`` package."""
    if value is None or isinstance(value, EncryptionKey):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        key = bytes(value)
        if len(key) != KEY_BYTES:
            raise ValueError(f"{name} is {KEY_BYTES} bytes (AES-256), got {len(key)} bytes")
    elif isinstance(value, str) and value.startswith(_ENV) and value[len(_ENV):]:
        key = _decoded(_env(value[len(_ENV):], name).strip().encode(), f"{name}: environment variable {value[len(_ENV):]!r}")
    elif isinstance(value, str) and value.startswith(_FILE) and value[len(_FILE):]:
        key = _key_file(value[len(_FILE):], name)
    elif isinstance(value, str):
        raise ValueError(f"{name}: a str is 'env:NAME' or 'file:PATH'; give the key itself as {KEY_BYTES} bytes")
    else:
        raise TypeError(f"{name} takes {KEY_BYTES} bytes, 'env:NAME' or 'file:PATH', got {type(value).__name__}")
    try:
        return EncryptionKey(key)
    except ImportError:
        raise ImportError(f"{name} needs the cryptography package: pip install 'kvoffload[crypto]'") from None


def _env(var: str, name: str) -> str:
    text = os.environ.get(var)
    if not text:
        raise ValueError(f"{name}: the environment variable {var!r} is not set or empty")
    return text


def _decoded(text: bytes, what: str) -> bytes:
    """A key given as 64 hex digits or base64 of 32 bytes."""
    if len(text) == 2 * KEY_BYTES:
        try:
            return binascii.unhexlify(text)
        except binascii.Error:
            pass
    try:
        key = binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{what} does not hold a {KEY_BYTES}-byte key as 64 hex digits or base64")
    return key


def _key_file(path: str, name: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{name}: cannot open the key file {path!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}: the key file {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{name}: the key file {path!r} is readable or writable by others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(4 * KEY_BYTES + 2)
    finally:
        os.close(fd)
    if len(data) == KEY_BYTES:
        return data
    return _decoded(data.strip(), f"{name}: the key file {path!r}")
