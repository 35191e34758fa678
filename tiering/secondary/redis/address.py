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

import ssl
import urllib.parse

import msgspec

from tiering.errors import ConfigError

__all__ = ["RedisAddress", "parse_url", "redact_url"]

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


def redact_url(url: str) -> str:
    """``url`` without its password (nor its query, which may hold one)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # not a URL at all: keep the scheme and the host, never a password
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2].partition('?')[0]}"
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}@" if parts.username else ""
    return urllib.parse.urlunsplit((parts.scheme, user + host, parts.path, "", ""))


def parse_url(url: str, cluster: bool | None) -> tuple[RedisAddress, str, bool | None]:
    """The address of ``url``, the URL without the ``cluster`` option (for redis-py's
    cluster client), and whether it is a cluster (``cluster`` or the URL's option)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ConfigError(
            f"the Redis tier URL {redact_url(url)!r} is not a valid URL ({exc}); give "
            "redis://[user[:password]@]host[:port][/db]"
        ) from None
    if parts.scheme not in _SCHEMES:
        raise ConfigError(
            f"a Redis tier URL must start with redis:// or rediss://, got {redact_url(url)!r}"
        )
    port, db = _check_address(parts, url)
    options: dict[str, str] = {}
    kept = []
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if name not in _OPTIONS:
            raise ConfigError(
                f"the Redis tier URL {redact_url(url)!r} has the option {name!r}, which the "
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
            raise ConfigError(f"the URL option db must be a number, got {options['db']!r}")
        db = int(options.pop("db"))
    reqs = options.pop("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ConfigError(
            f"the URL option ssl_cert_reqs must be none, optional or required, got {reqs!r}"
        )
    check = options.pop("ssl_check_hostname", "true").lower()
    if check not in (*_TRUE, *_FALSE):
        raise ConfigError(f"the URL option ssl_check_hostname must be true or false, got {check!r}")
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
        raise ConfigError(f"the URL option cluster must be yes, no or auto, got {value!r}")
    if cluster is not None and option is not None and option != cluster:
        raise ConfigError(
            f"cluster={cluster} contradicts the URL option cluster={value} in {redact_url(url)!r}"
        )
    return option if cluster is None else cluster


def _check_address(parts: urllib.parse.SplitResult, url: str) -> tuple[int, int]:
    """The port and database; refuse a URL without a host, with a port out of range or
    a database that is no number."""
    shown = redact_url(url) if parts.password else url
    form = f"{parts.scheme}://[user[:password]@]host[:port][/db]"
    if not parts.hostname:
        raise ConfigError(f"the Redis tier URL {shown!r} names no host; give {form}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(
            f"the Redis tier URL {shown!r} has a port out of range or not a number; give a "
            "port from 1 to 65535"
        )
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ConfigError(
            f"the Redis tier URL {shown!r} names database {db!r}; a Redis database is a "
            f"number ({form}, e.g. /0)"
        )
    return port or 6379, int(db or 0)
