"""What goes wrong talking to Redis, as redis-py's exception classes, sorted by meaning.

The tier's own connections raise redis-py's public exception classes
(``redis.exceptions``) with redis-py's messages, so that what the tier counts
and shows (``last_error``, ``last_refusal``) reads the same
whichever client made the call: the tier's connections, or redis-py's cluster
client refreshing its slot map. An error reply becomes the class redis-py
gives that code (`error_from_reply`); which of them take the tier down, count
as a refusal or move a slot is `RedisErrors`.
"""

from __future__ import annotations

from typing import Any

from tiering._extras import require
from tiering.errors import ConfigError
from tiering.secondary.base import describe
from tiering.secondary.redis.resp import ErrorReply

__all__ = ["RedisErrors", "config_error", "error_from_reply", "errors", "what_to_check"]

#: An error code and the ``redis.exceptions`` class redis-py gives it.
_CLASSES = {
    "OOM": "OutOfMemoryError",
    "WRONGPASS": "AuthenticationError",
    "EXECABORT": "ExecAbortError",
    "LOADING": "BusyLoadingError",
    "NOSCRIPT": "NoScriptError",
    "READONLY": "ReadOnlyError",
    "NOAUTH": "AuthenticationError",
    "NOPERM": "NoPermissionError",
    "ASK": "AskError",
    "TRYAGAIN": "TryAgainError",
    "MOVED": "MovedError",
    "CLUSTERDOWN": "ClusterDownError",
    "CROSSSLOT": "ClusterCrossSlotError",
    "MASTERDOWN": "MasterDownError",
}
#: ``ERR`` replies redis-py gives a class of their own (by their whole message).
_ERR_CLASSES = {
    "max number of clients reached": "ConnectionError",
    "invalid password": "AuthenticationError",
}

_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "invalid username-password", "invalid password")
#: What a plain-TCP client reads from a server that expects a TLS handshake.
_CLOSED_WORDS = ("Connection closed by server", "Connection reset by peer")


class RedisErrors:
    """redis-py's exception classes, sorted by what they mean for the tier."""

    def __init__(self) -> None:
        rx = require("redis.exceptions", "redis", "the Redis tier")
        self.rx = rx
        #: The store is away: the tier goes down.
        self.unavailable: tuple[type[BaseException], ...] = (
            rx.ConnectionError,
            rx.TimeoutError,
            rx.ClusterError,
            rx.ClusterDownError,
            rx.SlotNotCoveredError,
            rx.InvalidResponse,
            rx.RedisClusterException,  # cannot build or refresh the cluster's slot map
            OSError,
        )
        #: ... because a socket timed out.
        self.timeout: tuple[type[BaseException], ...] = (rx.TimeoutError, TimeoutError)
        #: Anything redis-py raises on purpose.
        self.any: tuple[type[BaseException], ...] = (rx.RedisError,)
        #: ... because the cluster's slot map changed.
        self.moved: tuple[type[BaseException], ...] = (rx.AskError, rx.TryAgainError)
        self.auth: tuple[type[BaseException], ...] = (rx.AuthenticationError,)
        self.permission: tuple[type[BaseException], ...] = (rx.NoPermissionError,)


_ERRORS: RedisErrors | None = None


def errors() -> RedisErrors:
    """redis-py's exception classes (imported on first use)."""
    global _ERRORS
    if _ERRORS is None:
        _ERRORS = RedisErrors()
    return _ERRORS


def error_from_reply(reply: ErrorReply) -> Any:
    """The exception redis-py makes of an error reply (not raised): its class, its message.

    As redis-py does, a code it knows is cut off the message: ``OOM command
    not allowed...`` is ``OutOfMemoryError('command not allowed...')``.
    """
    rx = errors().rx
    text = reply.text
    code = text.split(" ", 1)[0]
    if code == "ERR":
        name = _ERR_CLASSES.get(text[4:])
        if name is not None:
            return getattr(rx, name)(text[4:])
        return rx.ResponseError(text)
    name = _CLASSES.get(code)
    if name is None:
        return rx.ResponseError(text)
    try:
        return getattr(rx, name, rx.ResponseError)(text[len(code) + 1 :])
    except (TypeError, ValueError):  # a MOVED or ASK that names no slot and node
        return rx.ResponseError(text)


def config_error(url: str, exc: BaseException, password: str | None = None) -> ConfigError:
    """One line saying why the tier at ``url`` (no password) could not be opened; the
    ``password``, should redis-py's text hold it, is hidden there too."""
    e = errors()
    text = describe(exc)
    if password:
        text = text.replace(password, "***")
    if isinstance(exc, e.auth) or any(w in str(exc) for w in _AUTH_WORDS):
        return ConfigError(
            f"cannot open the Redis tier at {url}: the server refused the user name or "
            f"password ({text})"
        )
    if isinstance(exc, e.permission):
        return ConfigError(
            f"cannot open the Redis tier at {url}: the user may not run the commands the tier "
            f"needs: PING, EXISTS, GET, SET, PEXPIRE, PERSIST, INFO ({text})"
        )
    hint = ""
    if url.startswith("rediss://") and (isinstance(exc, e.timeout) or "SSL" in text):
        hint = (
            "; the TLS handshake did not complete: if the server speaks plain TCP on this "
            "port, use redis:// instead of rediss://"
        )
    elif url.startswith("redis://") and any(w in text for w in _CLOSED_WORDS):
        hint = "; if the server speaks TLS on this port, use rediss:// instead of redis://"
    return ConfigError(f"cannot reach the Redis tier at {url}: {text}{hint}")


#: Words of a host name that does not resolve, as the C library says it.
_UNRESOLVED_WORDS = ("Name or service not known", "nodename nor servname", "name resolution")


def what_to_check(url: str, text: str) -> str:
    """What an operator should check, for the failure ``text`` of the tier at ``url``
    (empty where ``text`` says it already: `config_error`'s hints)."""
    if "instead of redis" in text:
        return ""
    if any(w in text for w in _AUTH_WORDS) or "AuthenticationError" in text:
        return "check the user and password (password_file, or the URL in url_env)"
    if any(w in text for w in _UNRESOLVED_WORDS):
        return "the host name does not resolve: check the host in the URL"
    if "refused" in text.lower():
        return "check that the server runs and listens at the URL's host and port"
    if url.startswith("rediss://") and ("SSL" in text or "Timeout" in text):
        return "the TLS handshake failed: check that the port speaks TLS (redis:// if not)"
    if url.startswith("redis://") and any(w in text for w in _CLOSED_WORDS):
        return "the server closed the connection: if it speaks TLS, use rediss://"
    return "check the server, the network path to it and timeout_s"
