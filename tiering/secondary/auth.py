"""The shared secret that makes a secondary tier's values writable only by its key holders.

A tier's values are checked (`tiering.secondary.codec`), but an unkeyed check
proves only that a value is whole: whoever can write to the store (the Redis,
the disk tier's folder) can write a whole value of their own. With an
`AuthKey`, every value carries a tag that only holders of the key can make,
and a value without a valid one is never loaded (see the codec's design note).

The key is the same for every engine that shares a tier. It comes from a file
(``auth_key_file``; read once; a regular file of at least `MIN_KEY_BYTES`
bytes, its one trailing newline left out) or from the environment
(``TIERING_AUTH_KEY``), never from a command line (``ps`` shows argv to every
local user). It is never shown: ``repr``, ``str``, statistics and log lines
name it by its id (`AuthKey.key_id`: 8 hex digits of a MAC of a fixed
message, which tells two keys apart and nothing about either).

A key writes its values with one MAC (`MacKind`; the codec's design note says
which and why): AES-GMAC when the ``cryptography`` package imports (the
``auth`` extra), else HMAC-SHA256 from the standard library, with one warning
line at the key's load. A key reads values of both kinds.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

from tiering._extras import install_line
from tiering.errors import ConfigError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "ENV_VAR",
    "MAX_KEY_BYTES",
    "MIN_KEY_BYTES",
    "SALT_BYTES",
    "TAG_BYTES",
    "AuthKey",
    "Gmac",
    "Mac",
    "MacKind",
    "read_secret_file",
]

logger = logging.getLogger(__name__)

#: The environment variable a key may come from.
ENV_VAR = "TIERING_AUTH_KEY"
#: The shortest key taken: 128 bits, if its bytes are random.
MIN_KEY_BYTES = 16
#: The longest: a longer file is most likely not a key (HMAC takes any length).
MAX_KEY_BYTES = 4096
#: Bytes of a value's tag area: a whole HMAC-SHA256, or a GMAC's salt and its 16-byte tag.
TAG_BYTES = 32
#: Bytes of the fresh random salt an AES-GMAC value's subkey is derived with.
SALT_BYTES = 16
#: What an AES-GMAC subkey is derived from, first (no value's bytes start so: TKVC).
_GMAC_LABEL = b"tiering gmac v1"
#: GCM's nonce, fixed: each subkey tags one value only (see the codec's design note).
_GMAC_NONCE = bytes(12)
_EXTRA = install_line("auth")

_MAKE_ONE = "make one with: openssl rand -hex 32 > FILE; chmod 600 FILE"

#: What a value's tag is a MAC of: HMAC-SHA256 (RFC 2104) of the value's bytes.
Mac = hmac.HMAC


class MacKind(enum.IntEnum):
    """The MAC a keyed value's header names (its checksum-kind byte)."""

    HMAC_SHA256 = 1  # HMAC-SHA256 of the header, key and payload: a 32-byte tag
    AES_GMAC = 2  # AES-256-GMAC of the payload under a per-value subkey: salt, then tag


_UNSET = object()
_aesgcm_class: object = _UNSET


def _aesgcm() -> type[AESGCM] | None:
    """``cryptography``'s AESGCM, imported on first use (None: not installed)."""
    global _aesgcm_class
    if _aesgcm_class is _UNSET:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            _aesgcm_class = None
        else:
            _aesgcm_class = AESGCM
    return _aesgcm_class  # type: ignore[return-value]


class Gmac:
    """AES-256-GMAC under one value's subkey: the 16-byte tag of a whole payload.

    GCM with an empty plaintext and the payload as associated data (NIST SP
    800-38D's GMAC). One-shot: the payload must be contiguous. The nonce is
    fixed, so a `Gmac` must tag one payload only (a reader recomputes the
    writer's tag, which reveals nothing new).
    """

    __slots__ = ("_aead",)

    def __init__(self, aead: AESGCM) -> None:
        self._aead = aead

    def tag(self, payload: memoryview) -> bytes:
        """The tag of ``payload`` (releases the GIL while it runs)."""
        return self._aead.encrypt(_GMAC_NONCE, b"", payload)


class AuthKey:
    """A shared secret of a secondary tier; its bytes are never shown (only `key_id`)."""

    __slots__ = ("_aes", "_mac", "_warned", "key_id", "mac_kind", "source")

    def __init__(
        self,
        secret: bytes,
        *,
        source: str = "given",
        mac: Literal["auto", "gmac", "hmac"] = "auto",
    ) -> None:
        if not isinstance(secret, bytes):
            raise ConfigError(f"an auth key must be bytes, got {type(secret).__name__}")
        if not MIN_KEY_BYTES <= len(secret) <= MAX_KEY_BYTES:
            raise ConfigError(
                f"the auth key ({source}) holds {len(secret)} bytes; a key needs "
                f"{MIN_KEY_BYTES} to {MAX_KEY_BYTES} secret bytes ({_MAKE_ONE})"
            )
        #: The keyed state every tag starts from (copied: the key is set up once).
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        #: Where the key came from (a file's path, the variable's name): never the key.
        self.source = source
        ident = self.mac()
        ident.update(b"tiering auth key id")  # no value's bytes start so (they start TKVC)
        #: 8 hex digits that name this key in logs and reports (not the key).
        self.key_id = ident.hexdigest()[:8]
        if mac not in ("auto", "gmac", "hmac"):
            raise ConfigError(f"an auth key's mac must be 'auto', 'gmac' or 'hmac', got {mac!r}")
        self._aes = _aesgcm()
        self._warned = False
        #: The MAC this key writes values with (it reads both kinds).
        self.mac_kind = MacKind.HMAC_SHA256 if mac == "hmac" else MacKind.AES_GMAC
        if self._aes is None and mac != "hmac":
            if mac == "gmac":
                raise ConfigError(
                    f"the auth key ({source}) was asked to write AES-GMAC values, but the "
                    f"'cryptography' package is not installed; {_EXTRA}"
                )
            self.mac_kind = MacKind.HMAC_SHA256
            logger.warning(
                "the 'cryptography' package is not installed: values keyed with %s are "
                "written with the slower HMAC-SHA256 (%s)",
                f"auth key {self.key_id}",
                _EXTRA,
            )

    def mac(self) -> Mac:
        """A fresh MAC state under this key (HMAC-SHA256), to feed a value's bytes."""
        return self._mac.copy()

    def gmac(self, salt: bytes, head: memoryview) -> Gmac | None:
        """The AES-GMAC of one value: its subkey, HMAC-SHA256 under this key of a fixed
        label, the value's ``salt`` and its ``head`` (header, chunk key and padding).

        None when ``cryptography`` is not installed: such a value cannot be
        checked (one warning line, the first time).
        """
        if self._aes is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "an AES-GMAC value was rejected as unauthenticated: the 'cryptography' "
                    "package is not installed, so auth key %s cannot check such values (%s)",
                    self.key_id,
                    _EXTRA,
                )
            return None
        derive = self._mac.copy()
        derive.update(_GMAC_LABEL + salt)
        derive.update(head)
        return Gmac(self._aes(derive.digest()))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AuthKey:
        """The key in the file ``path`` (its one trailing newline left out).

        A `ConfigError` when the file is missing, unreadable, not a regular
        file, or too short or long; one warning line when its group or others
        may read it.
        """
        name = os.fspath(path)
        raw, st = read_secret_file(name, "the auth key file", _MAKE_ONE, MAX_KEY_BYTES + 3)
        if st.st_size > MAX_KEY_BYTES + 2:
            raise ConfigError(
                f"the auth key file {name} holds {st.st_size:,} bytes; a key is at most "
                f"{MAX_KEY_BYTES} bytes (is it the right file?); {_MAKE_ONE}"
            )
        key = cls(_strip_newline(raw), source=f"file {name}")  # a bad key: no warning too
        if st.st_mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
            logger.warning(
                "the auth key file %s may be read by other users (mode %04o); chmod 600 it",
                name,
                stat.S_IMODE(st.st_mode),
            )
        return key

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, name: str = ENV_VAR
    ) -> AuthKey | None:
        """The key in the environment variable ``name`` (None: not set, or empty)."""
        value = (os.environ if environ is None else environ).get(name)
        if not value:
            return None
        return cls(_strip_newline(os.fsencode(value)), source=f"${name}")

    @classmethod
    def load(
        cls, file: str | os.PathLike[str] | None, environ: Mapping[str, str] | None = None
    ) -> AuthKey | None:
        """The key of ``file`` when given, else of ``$TIERING_AUTH_KEY`` (None: neither)."""
        return cls.from_file(file) if file is not None else cls.from_env(environ)

    def __repr__(self) -> str:
        return f"<AuthKey [id {self.key_id}, from {self.source}]>"

    __str__ = __repr__

    def __copy__(self) -> AuthKey:
        return self  # immutable

    def __deepcopy__(self, memo: object) -> AuthKey:
        return self


def read_secret_file(
    path: str | os.PathLike[str], what: str, fix: str, limit: int
) -> tuple[bytes, os.stat_result]:
    """The first ``limit`` bytes of the regular file ``path`` (a key, a password) and its
    status: one `ConfigError` naming ``what`` and the file, never its content, with
    ``fix``, when it is missing, not a regular file (a FIFO never blocks the open: it is
    opened ``O_NONBLOCK``) or unreadable."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            why = "does not exist"
        elif exc.errno == errno.EISDIR:
            why = "is not a regular file (it is a directory)"
        else:
            why = f"cannot be read ({exc.strerror})"
        raise ConfigError(f"{what} {name} {why}; {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = " (it is a directory)" if stat.S_ISDIR(st.st_mode) else ""
            raise ConfigError(f"{what} {name} is not a regular file{kind}; {fix}")
        return os.read(fd, limit), st
    except OSError as exc:
        raise ConfigError(f"{what} {name} cannot be read ({exc.strerror}); {fix}") from None
    finally:
        os.close(fd)


def _strip_newline(raw: bytes) -> bytes:
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw
