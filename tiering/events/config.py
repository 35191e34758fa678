"""Settings of the KV event stream: the ZMQ publisher's sockets and buffers, and the hash form.

`KVEventsConfig` mirrors vLLM's ``KVEventsConfig`` (same names, same
defaults) so a server can pass its own values through. It is checked in
``__post_init__``: a record that exists is a possible one, and a bad value
raises a `ConfigError` that names the field, the value and what would do.
"""

from __future__ import annotations

import enum

import msgspec

from tiering.errors import ConfigError

__all__ = ["ZMQ_TRANSPORTS", "HashFormat", "KVEventsConfig"]

#: ZeroMQ transports an endpoint may name (``<transport>://<address>``).
ZMQ_TRANSPORTS: tuple[str, ...] = ("tcp", "ipc", "inproc", "pgm", "epgm", "ws", "wss", "vmci")


class HashFormat(enum.StrEnum):
    """How block hashes travel: vLLM's default ``int`` (the low 64 bits) or the raw ``bytes``."""

    INT = "int"
    BYTES = "bytes"


def _check_endpoint(name: str, value: object) -> None:
    transport, sep, address = value.partition("://") if isinstance(value, str) else ("", "", "")
    if not sep or not address or transport not in ZMQ_TRANSPORTS:
        raise ConfigError(
            f"KVEventsConfig.{name} must be a ZeroMQ endpoint such as 'tcp://*:5557' or "
            f"'ipc:///tmp/kv-events' (transports: {', '.join(ZMQ_TRANSPORTS)}), got {value!r}"
        )


def _check_count(name: str, value: object, minimum: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"KVEventsConfig.{name} must be an integer >= {minimum} ({meaning}), got {value!r}"
        )


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where and how the ZMQ publisher sends KV event batches.

    - ``endpoint``: the PUB socket. Bound when it has a ``*`` wildcard or a
      ``::`` address, or is ``ipc://`` or ``inproc://``; connected otherwise.
    - ``replay_endpoint``: an optional ROUTER socket (always bound) that
      resends buffered batches from a requested sequence number.
    - ``topic``: the first frame of every message; subscribers filter on it.
    - ``buffer_steps``: batches kept for replay, the most recent ones.
    - ``hwm``: the PUB socket's high-water mark in messages (0: no limit);
      past it ZeroMQ drops messages for that subscriber.
    - ``max_queue_size``: batches waiting for the publisher thread; past it
      new batches are dropped and counted, the caller never waits.
    - ``hash_format``: ``"int"`` (vLLM's default) or ``"bytes"``.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    hash_format: HashFormat = HashFormat.INT

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        if not isinstance(self.topic, str):
            raise ConfigError(f"KVEventsConfig.topic must be a string, got {self.topic!r}")
        _check_count("buffer_steps", self.buffer_steps, 1, "batches kept for replay")
        _check_count("hwm", self.hwm, 0, "PUB high-water mark in messages, 0 for none")
        _check_count("max_queue_size", self.max_queue_size, 1, "batches waiting to be sent")
        try:
            hash_format = HashFormat(self.hash_format)
        except ValueError:
            raise ConfigError(
                f"KVEventsConfig.hash_format must be 'int' or 'bytes', got {self.hash_format!r}"
            ) from None
        msgspec.structs.force_setattr(self, "hash_format", hash_format)
