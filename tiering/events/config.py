"""Settings of the KV event stream: the ZMQ publisher's sockets and buffers, and the hash form.

`KVEventsConfig` mirrors vLLM's ``KVEventsConfig`` (same names, and vLLM's
rule for which side binds) so a server can pass its own values through; one
default differs on purpose. vLLM's endpoint ``tcp://*:5557`` binds every
interface, and the stream has no authentication: anyone who reaches the port
reads every block hash (and, self-describing, every token id). Tiering's
default, `DEFAULT_ENDPOINT`, binds the same port on loopback only; a
publisher that binds every interface (`binds_every_interface`) logs one
warning line saying so. It is checked in
``__post_init__``: a record that exists is a possible one, and a bad value
raises a `ConfigError` that names the field, the value and what would do. A
``tcp://`` endpoint must name ``host:port`` with a port in 1-65535 or ``*``
(ZeroMQ itself would silently take ``99999`` modulo 65536 when binding, and
retry a connect to it forever), and the replay endpoint must not name the
address of the PUB endpoint.
"""

from __future__ import annotations

import enum

import msgspec

from tiering._checks import is_int
from tiering.errors import ConfigError

__all__ = [
    "ANY_HOSTS",
    "DEFAULT_ENDPOINT",
    "ZMQ_TRANSPORTS",
    "HashFormat",
    "KVEventsConfig",
    "binds_every_interface",
    "check_endpoint",
    "check_replay_endpoint",
    "is_ipv6",
    "loopback_of",
    "offset_endpoint",
    "tcp_address",
    "wildcard_of",
]

#: ZeroMQ transports an endpoint may name (``<transport>://<address>``).
ZMQ_TRANSPORTS: tuple[str, ...] = ("tcp", "ipc", "inproc", "pgm", "epgm", "ws", "wss", "vmci")


class HashFormat(enum.StrEnum):
    """How block hashes travel: vLLM's default ``int`` (the low 64 bits) or the raw ``bytes``."""

    INT = "int"
    BYTES = "bytes"


#: Hosts that stand for every interface of the machine: a bind there takes all of them.
ANY_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})

#: Tiering's default PUB endpoint: bound (``KVEventsConfig.bind``), on loopback only.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def tcp_address(endpoint: str) -> tuple[str, str] | None:
    """``(host, port)`` of a ``tcp://[source;]host:port`` endpoint (an IPv6 host keeps its
    brackets); None for another transport or an address without ``:``."""
    if not endpoint.startswith("tcp://"):
        return None
    address = endpoint[len("tcp://") :].rpartition(";")[2]  # after an optional source
    host, sep, port = address.rpartition(":")
    return (host, port) if sep else None


def binds_every_interface(endpoint: str) -> bool:
    """Whether binding ``endpoint`` takes every interface of the machine (a ``tcp://``
    host in `ANY_HOSTS`): then anyone who can reach the port can use the socket."""
    address = tcp_address(endpoint)
    return address is not None and address[0] in ANY_HOSTS


def is_ipv6(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``tcp://`` to an IPv6 address (``[::1]``, ``[::]``): ZeroMQ
    takes one only on a socket with its ``IPV6`` option set."""
    address = tcp_address(endpoint)
    return address is not None and ":" in address[0]


def loopback_of(endpoint: str) -> str:
    """``endpoint`` with an every-interface host (`ANY_HOSTS`) as loopback, same port:
    where a local peer reaches a socket bound there, or where to bind it privately."""
    address = tcp_address(endpoint)
    if address is None or address[0] not in ANY_HOSTS:
        return endpoint
    host = "[::1]" if ":" in address[0] else "127.0.0.1"
    return f"tcp://{host}:{address[1]}"


def wildcard_of(endpoint: str) -> str | None:
    """The endpoint that binds every interface on ``endpoint``'s port (``tcp://*:5557``), or
    None when it is not a ``tcp://`` endpoint with a port."""
    address = tcp_address(endpoint)
    return None if address is None or not address[1] else f"tcp://*:{address[1]}"


def check_endpoint(where: str, value: object) -> None:
    """Raise a `ConfigError` naming ``where`` unless ``value`` is a usable ZeroMQ endpoint.

    A known transport and an address; for ``tcp://``, ``host:port`` with a
    host and a port in 1-65535 or ``*``. ZeroMQ itself binds ``99999`` as
    ``99999 % 65536`` and retries a connect to it (or to port 0) for ever.
    """
    endpoint = value if isinstance(value, str) else ""
    transport, sep, address = endpoint.partition("://")
    if not sep or not address or transport not in ZMQ_TRANSPORTS:
        raise ConfigError(
            f"{where} must be a ZeroMQ endpoint such as 'tcp://*:5557' or "
            f"'ipc:///tmp/kv-events' (transports: {', '.join(ZMQ_TRANSPORTS)}), got {value!r}"
        )
    if transport != "tcp":
        return
    host, port = tcp_address(endpoint) or ("", "")
    if not host or not _port_ok(port):
        raise ConfigError(
            f"{where} must be tcp://HOST:PORT with a port in 1-65535, or '*' "
            f"for a free one (e.g. 'tcp://*:5557', 'tcp://127.0.0.1:*'), got {value!r}"
        )


def check_replay_endpoint(where: str, replay_endpoint: str, endpoint: str, fix: str) -> None:
    """Raise a `ConfigError` naming ``where`` unless ``replay_endpoint`` is a usable
    endpoint (`check_endpoint`) of its own: not the address of ``endpoint`` (the same
    port, on the same host or on every interface); ``fix`` says what to give instead."""
    check_endpoint(where, replay_endpoint)
    if _same_address(endpoint, replay_endpoint):
        raise ConfigError(
            f"{where} {replay_endpoint!r} names the address of endpoint {endpoint!r}: {fix}"
        )


def offset_endpoint(where: str, endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` for data-parallel rank ``data_parallel_rank``, as vLLM's publisher moves it.

    Rank 0 keeps it; otherwise a ``tcp://`` port grows by the rank (a ``*`` port
    stays: the system picks a free one, as vLLM leaves port 0) and an
    ``inproc://`` name gets ``_dp<rank>``. vLLM refuses to offset any other
    transport, and so does this (`ConfigError`), as it does a port past 65535.
    """
    if not is_int(data_parallel_rank):
        raise ConfigError(
            f"the data-parallel rank must be an integer >= 0, got {data_parallel_rank!r}"
        )
    if data_parallel_rank < 0:
        raise ConfigError(f"the data-parallel rank must be >= 0, got {data_parallel_rank}")
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    address = tcp_address(endpoint)
    if address is None:
        raise ConfigError(
            f"{where} {endpoint!r} cannot be moved for data-parallel rank {data_parallel_rank}: "
            "as in vLLM, each rank offsets a tcp:// port or an inproc:// name by its rank; "
            "give a tcp:// or inproc:// endpoint"
        )
    port = address[1]
    if port == "*":
        return endpoint
    moved = int(port) + data_parallel_rank
    if moved > 65535:
        raise ConfigError(
            f"{where} {endpoint!r} moved by data-parallel rank {data_parallel_rank} would be "
            f"port {moved}, past 65535; give a port <= {65535 - data_parallel_rank}"
        )
    return f"{endpoint[: endpoint.rfind(':')]}:{moved}"


def _port_ok(port: str) -> bool:
    return port == "*" or (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)


def _same_address(a: str, b: str) -> bool:
    """Whether endpoints ``a`` and ``b`` name one address (a free port ``*`` never does)."""
    tcp_a, tcp_b = tcp_address(a), tcp_address(b)
    if tcp_a is None or tcp_b is None:
        return a == b
    (host_a, port_a), (host_b, port_b) = tcp_a, tcp_b
    if port_a == "*" or port_b == "*" or int(port_a) != int(port_b):
        return False
    return host_a == host_b or host_a in ANY_HOSTS or host_b in ANY_HOSTS


def _check_count(name: str, value: object, minimum: int, meaning: str) -> None:
    # Python's int only: the field keeps it, and msgspec cannot encode numpy's.
    if not (is_int(value) and isinstance(value, int)) or value < minimum:
        raise ConfigError(
            f"KVEventsConfig.{name} must be an integer >= {minimum} ({meaning}), got {value!r}"
        )


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where and how the ZMQ publisher sends KV event batches.

    - ``endpoint``: the PUB socket (default `DEFAULT_ENDPOINT`, loopback).
    - ``bind``: whether the PUB socket binds ``endpoint`` (True) or connects
      to it (False). None (what vLLM's config gives): vLLM's rule, bound when
      it has a ``*`` wildcard or a ``::`` address, or is ``ipc://`` or
      ``inproc://``, connected otherwise. The default endpoint left with None
      is bound (True): ``bind=False`` connects there instead.
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

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    hash_format: HashFormat = HashFormat.INT
    bind: bool | None = None

    def __post_init__(self) -> None:
        check_endpoint("KVEventsConfig.endpoint", self.endpoint)
        if self.bind is not None and not isinstance(self.bind, bool):
            raise ConfigError(
                "KVEventsConfig.bind must be true (bind the endpoint), false (connect to it) "
                f"or null (vLLM's rule), got {self.bind!r}"
            )
        if self.bind is None and self.endpoint == DEFAULT_ENDPOINT:
            msgspec.structs.force_setattr(self, "bind", True)  # loopback: nothing to connect to
        if self.replay_endpoint is not None:
            check_replay_endpoint(
                "KVEventsConfig.replay_endpoint",
                self.replay_endpoint,
                self.endpoint,
                "the replay socket needs an address of its own (another port, or '*' for a "
                "free one)",
            )
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
