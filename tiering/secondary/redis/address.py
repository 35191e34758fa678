"""Where a Redis tier connects, read from its URL: host, port, database, credentials, TLS.

``redis://[user[:password]@]host[:port][/db]``, or ``rediss://`` for TLS, with
query options: ``cluster=yes|no|auto`` (the tier's own), ``db``, and the TLS
options redis-py's URLs take (``ssl_ca_certs``, ``ssl_ca_path``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_password``, ``ssl_cert_reqs``,
``ssl_check_hostname``, ``ssl_ciphers``). Everything is checked when the tier
is built, so a wrong URL is one `ConfigError` before any I/O, naming what is
wrong and never the password.
"""

from __future__ import annotations

import os
import re
import ssl
import urllib.parse
from collections.abc import Mapping
from typing import Any

import msgspec

from tiering.errors import ConfigError
from tiering.secondary.auth import read_secret_file

__all__ = [
    "URL_ENV",
    "RedisAddress",
    "holds_password",
    "parse_url",
    "read_password",
    "redact_url",
    "resolve_url",
]

#: The environment variable that holds the Redis tier's URL by default.
URL_ENV = "TIERING_REMOTE_URL"

_SCHEMES = ("redis", "rediss")
_TRUE = ("1", "yes", "true", "on")
_FALSE = ("0", "no", "false", "off")
_FILES = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password")
_CERT_REQS = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}
_OPTIONS = ("cluster", "db", *_FILES, "ssl_cert_reqs", "ssl_check_hostname", "ssl_ciphers")
# What `redact_url` shows as it is: a scheme, a user name, a host and port, a path.
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,15}")
_USER = re.compile(r"[A-Za-z0-9._~+-]{1,64}")
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9._-]{0,253})(?::[0-9]{0,5})?")
_DB_PATH = re.compile(r"/[0-9]{0,5}")
_UNIX_PATH = re.compile(r"/[A-Za-z0-9._/+-]{0,255}")
_DB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")  # a wrong database, named in its error
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_SECRETS = ("password", "ssl_password")  # fields of RedisAddress never shown
_PASSWORD_FILE_BYTES = 64 << 10  # a password is a line, not a file's worth


class RedisAddress(msgspec.Struct, frozen=True, kw_only=True):
    """One server's address and how to log in (the same for every node of a cluster)."""

    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_ca_path: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True
    ssl_ciphers: str | None = None

    def at(self, host: str, port: int) -> RedisAddress:
        """The same login on another node."""
        return msgspec.structs.replace(self, host=host, port=port)

    @property
    def name(self) -> str:
        """``host:port``, as errors name a server."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context of a ``rediss://`` connection (files are read now)."""
        context = ssl.create_default_context(cafile=self.ssl_ca_certs, capath=self.ssl_ca_path)
        context.check_hostname = self.ssl_check_hostname and self.ssl_cert_reqs != "none"
        context.verify_mode = _CERT_REQS[self.ssl_cert_reqs]
        if self.ssl_certfile is not None:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, self.ssl_password)
        if self.ssl_ciphers is not None:
            context.set_ciphers(self.ssl_ciphers)
        return context

    def __repr__(self) -> str:  # never the password
        return f"<RedisAddress [{'rediss' if self.tls else 'redis'}://{self.name}/{self.db}]>"

    def __rich_repr__(self) -> list[tuple[str, Any]]:  # as msgspec's, the passwords hidden
        return [
            (name, "***" if name in _SECRETS and getattr(self, name) else getattr(self, name))
            for name in self.__struct_fields__
        ]


def holds_password(url: str) -> bool:
    """Whether ``url``'s userinfo holds a password (``redis://[user]:password@host``): a
    secret where it should not be, on a command line or in a config that is logged."""
    return ":" in url.partition("://")[2].rpartition("@")[0]


def redact_url(url: str) -> str:
    """``url`` as it may be shown: its userinfo replaced (``redis://user:***@host:6379/0``),
    its query and fragment left out (they may hold a password), whatever its shape.

    Everything between ``://`` and the last ``@`` is the userinfo, so a password
    with an unencoded ``/``, ``#``, ``?``, ``@`` or ``:`` is hidden whole; only a
    user name of plain characters before the first ``:`` is kept. A host, port or
    database that does not read as one (a URL that does not parse, or a password
    where the host belongs) is shown as ``***``: never the raw text; so is a value
    with neither ``://`` nor ``@`` (a password given where the URL belongs). Never
    raises.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        if "@" not in url:  # no URL at all: maybe the password itself, given for one
            return "***"
        scheme, rest = "", url
    elif not _SCHEME.fullmatch(scheme):
        return "***"
    prefix = f"{scheme}://" if sep else ""
    userinfo, at, hostpart = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    plain_user = colon and (not user or _USER.fullmatch(user))
    shown_user = "" if not at else f"{user}:***@" if plain_user else "***@"
    host, _, tail = _split_host(hostpart)
    if not _HOST.fullmatch(host):
        return f"{prefix}{shown_user}***"
    path = tail.partition("?")[0].partition("#")[0] if tail.startswith("/") else ""
    if path and not (_UNIX_PATH if scheme == "unix" else _DB_PATH).fullmatch(path):
        path = "/***"
    return f"{prefix}{shown_user}{host}{path}"


def _split_host(hostpart: str) -> tuple[str, str, str]:
    """``host[:port]``, the separator and what follows (``/db?query#fragment``)."""
    for index, char in enumerate(hostpart):
        if char in "/?#":
            return hostpart[:index], char, hostpart[index:]
    return hostpart, "", ""


def resolve_url(
    url: str | None = None,
    *,
    url_env: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """The Redis URL to connect to, from ``url`` or from the environment variable
    ``url_env`` (exactly one of them), with the password read from ``password_file``
    (its first line, stripped) when one is given.

    So that no secret need be on a command line or in a config file that is
    logged: the URL names only the server (``redis://user@host:6379/0``) and the
    password comes from a file, or the whole URL from the environment. A URL that
    holds a password and a password file as well is a `ConfigError`, as are an
    unset variable (named, never its value) and a file that is missing, empty or
    not a regular file. The URL returned holds the password: give it to
    `RedisTier` and show only `redact_url` of it.
    """
    if (url is None) == (url_env is None):
        raise ConfigError(
            "give the Redis tier's URL one way: either the URL itself or url_env, the name "
            f"of an environment variable that holds it (got {'both' if url else 'neither'})"
        )
    if url_env is not None:
        if not _ENV_NAME.fullmatch(url_env):  # never shown: it may be the URL itself
            url_given = " (a URL: give the name of the variable that holds it)"
            raise ConfigError(
                f"url_env must name an environment variable (letters, digits and _), got "
                f"{len(url_env)} characters that are not one{url_given if '://' in url_env else ''}"
            )
        url = (os.environ if environ is None else environ).get(url_env, "").strip()
        if not url:
            raise ConfigError(
                f"the environment variable {url_env} is not set (or empty): it must hold the "
                "Redis tier's URL, redis://[user[:password]@]host[:port][/db] or rediss://..."
            )
    assert url is not None
    if password_file is None:
        return url
    password = read_password(password_file)
    try:
        parts = urllib.parse.urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        parse_url(url, None)  # raises the URL's own error
        raise
    if has_password:
        raise ConfigError(
            f"the Redis tier URL {redact_url(url)!r} holds a password, and the password file "
            f"{os.fspath(password_file)} gives one too: give the password once (drop it from "
            "the URL)"
        )
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}:{urllib.parse.quote(password, safe='')}@{hostport}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def read_password(path: str | os.PathLike[str]) -> str:
    """The first line of the file at ``path``, stripped; `ConfigError` naming the file
    (never its content) when it is missing, not a regular file, unreadable or empty."""
    name = os.fspath(path)
    fix = "give a file whose first line is the Redis password"
    data, _ = read_secret_file(name, "the password file", fix, _PASSWORD_FILE_BYTES)
    try:
        password = data.decode().partition("\n")[0].strip()
    except UnicodeDecodeError:
        raise ConfigError(f"the password file {name} is not UTF-8 text") from None
    if not password:
        raise ConfigError(
            f"the password file {name} is empty: its first line must be the Redis password"
        )
    return password


def parse_url(url: str, cluster: bool | None) -> tuple[RedisAddress, str, bool | None]:
    """The address of ``url``, the URL without the ``cluster`` option (for redis-py's
    cluster client), and whether it is a cluster (``cluster`` or the URL's option)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # its text may quote the URL: never shown
        raise ConfigError(
            f"the Redis tier URL {redact_url(url)!r} is not a valid URL; give "
            f"redis://[user[:password]@]host[:port][/db]{_encoding_hint(url)}"
        ) from None
    if parts.scheme not in _SCHEMES:
        # no scheme: not a URL, and maybe a bare password (a variable set to one): not shown
        got = repr(redact_url(url)) if "://" in url else "a value without one (not shown)"
        raise ConfigError(f"a Redis tier URL must start with redis:// or rediss://, got {got}")
    port, db = _check_address(parts, url)
    hint = _encoding_hint(url)
    if hint:  # else a password's text is taken for the host, an option or a fragment
        raise ConfigError(
            f"the Redis tier URL {redact_url(url)!r} has an @ after a /, ? or #, so where its "
            f"user name and password end cannot be told{hint}; an @ in an option's value is %40"
        )
    options: dict[str, str] = {}
    kept = []
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if name not in _OPTIONS:
            shown = repr(name) if _ENV_NAME.fullmatch(name) else "of an unknown name"
            raise ConfigError(
                f"the Redis tier URL {redact_url(url)!r} has the option {shown}, which the "
                f"tier does not take; it takes {', '.join(_OPTIONS)} (timeouts are the tier's "
                "timeout_s and connect_timeout_s)"
            )
        if name == "cluster":
            cluster = _cluster_option(value, cluster, url)
            continue
        kept.append((name, value))
        options[name] = value
    plain = urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept)))
    if "db" in options:
        if not options["db"].isdigit():
            raise ConfigError(f"the URL option db must be a number, got {_shown(options['db'])}")
        db = int(options.pop("db"))
    reqs = options.pop("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ConfigError(
            f"the URL option ssl_cert_reqs must be none, optional or required, got {_shown(reqs)}"
        )
    check = options.pop("ssl_check_hostname", "true").lower()
    if check not in (*_TRUE, *_FALSE):
        raise ConfigError(
            f"the URL option ssl_check_hostname must be true or false, got {_shown(check)}"
        )
    address = RedisAddress(
        host=parts.hostname or "",
        port=port,
        db=db,
        username=urllib.parse.unquote(parts.username) if parts.username else None,
        password=urllib.parse.unquote(parts.password) if parts.password else None,
        tls=parts.scheme == "rediss",
        ssl_cert_reqs=reqs,
        ssl_check_hostname=check in _TRUE,
        **options,
    )
    return address, plain, cluster


def _cluster_option(value: str, cluster: bool | None, url: str) -> bool | None:
    word = value.lower()
    option = True if word in _TRUE else False if word in _FALSE else None
    if option is None and word != "auto":
        raise ConfigError(f"the URL option cluster must be yes, no or auto, got {_shown(value)}")
    if cluster is not None and option is not None and option != cluster:
        raise ConfigError(
            f"cluster={cluster} contradicts the URL option cluster={value} in {redact_url(url)!r}"
        )
    return option if cluster is None else cluster


def _check_address(parts: urllib.parse.SplitResult, url: str) -> tuple[int, int]:
    """The port and database; refuse a URL without a host, with a port out of range or
    a database that is no number."""
    shown = redact_url(url)
    form = f"{parts.scheme}://[user[:password]@]host[:port][/db]{_encoding_hint(url)}"
    if not parts.hostname:
        raise ConfigError(f"the Redis tier URL {shown!r} names no host; give {form}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"the Redis tier URL {shown!r} has a port out of range or not a number; give a "
            f"port from 1 to 65535{_encoding_hint(url)}"
        )
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        plain = _DB_NAME.fullmatch(db) and not _encoding_hint(url)
        named = repr(db) if plain else "that is no number"
        raise ConfigError(
            f"the Redis tier URL {shown!r} names database {named}; a Redis database is a "
            f"number ({form}, e.g. /0)"
        )
    return port or 6379, int(db or 0)


def _shown(value: str) -> str:
    """An option's wrong value as its error shows it: a plain word, else only its length
    (``?cluster=yes?ssl_password=...``, a ``?`` where ``&`` belongs, makes a password
    part of another option's value)."""
    if _DB_NAME.fullmatch(value):
        return repr(value)
    return f"{len(value)} characters that are not one (not shown: they may hold a secret)"


def _encoding_hint(url: str) -> str:
    """A hint for a URL whose last ``@`` comes after a ``/``, ``?`` or ``#``: a
    password with one of them unencoded, which ends the userinfo too early."""
    rest = url.partition("://")[2]
    at = rest.rfind("@")
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=-1)
    if 0 <= cut < at:
        return (
            " (a password with / ? # or @ must be percent-encoded: %2F %3F %23 %40; or give "
            "it in a password file)"
        )
    return ""
