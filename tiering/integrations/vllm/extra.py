"""What tiering reads from vLLM's ``kv_connector_extra_config``, as msgspec Structs.

vLLM hands a spec its ``kv_connector_extra_config`` and each ``secondary_tiers``
entry as a dict parsed from ``--kv-transfer-config``. The parts tiering reads
are decoded here (`tiering._decode`): one `ConfigError` line per bad value,
naming the key, the value and what would be right. An entry's keys are
tiering's own (an unknown key is refused, with the key it may misspell); the
extra config itself is shared with vLLM, so only the keys read are decoded.

A ``secondary_tiers`` entry of `RedisSecondaryTier`::

    {"type": "RedisSecondaryTier", "module_path": "tiering.integrations.vllm",
     "url_env": "TIERING_REMOTE_URL", "namespace": "prod", "timeout_s": 2.0}

``url`` and ``url_env`` are read by hand (`redis_options`): the message for a
wrong one explains the URL forms, and never shows a password.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from tiering._decode import decode, shown
from tiering.errors import ConfigError
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import Locality
from tiering.secondary.codec import RemoteNamespace
from tiering.secondary.redis import redact_url
from tiering.secondary.redis.address import resolve_url

__all__ = [
    "VLLM_ENTRY_KEYS",
    "MetricsExtra",
    "RedisEntry",
    "RedisEntryOptions",
    "metrics_extra",
    "redis_options",
    "remote_namespace",
]

#: The keys of a ``secondary_tiers`` entry that vLLM's factory reads, not the tier.
VLLM_ENTRY_KEYS = frozenset({"type", "module_path", "backpressure"})

_Count = Annotated[int, Meta(ge=1, description="an integer of at least 1")]
_SecondsOrNone = Annotated[float | None, Meta(description="a number of seconds")]
_BACKOFF = "[first, longest] seconds, 0 < first <= longest"
_Backoff = Annotated[tuple[float, float], Meta(description=_BACKOFF)]


class RedisEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A `RedisSecondaryTier` entry's keys, less vLLM's (``type``, ``module_path``,
    ``backpressure``).

    ``url_env`` (the name of an environment variable holding the URL) or ``url``
    (``redis://`` or ``rediss://``, as `RedisTier` takes it), ``password_file``
    (the password, read from a file's first line, for a URL that holds none),
    ``namespace`` (an operator's split of one store), ``ttl_s``, ``timeout_s``,
    ``connect_timeout_s``, ``cluster``, ``max_batch``, ``max_concurrency``,
    ``backoff_s`` (``[first, longest]``), ``checksum`` (``xxh3`` or ``ml64``),
    ``auth_key_file`` (a file holding the secret shared by every engine of the
    store: values are written with a MAC under it and only values with a valid
    one are loaded; without it, the variable ``TIERING_AUTH_KEY`` if set),
    ``locality`` (``REMOTE`` or ``LOCAL``), ``max_lookups_in_flight``,
    ``max_store_jobs``, ``enable_kv_events`` (``BlockStored`` events for
    chunks written; Redis evicts and expires values on its own, so no removal
    is ever announced) and ``connect_on_start`` (connect in the constructor and
    raise `ConfigError` for a wrong URL, credentials or server; by default
    the first call connects, and a server that is away is only counted).

    The numbers `RedisTier` checks (``timeout_s`` > 0, ...) are only typed here; a
    key left out (UNSET) leaves `RedisTier`'s default.
    """

    url: object = None  # read by hand: `redis_options`
    url_env: Annotated[str | None, Meta(description="a string")] = None
    password_file: Annotated[str | None, Meta(description="a string")] = None
    namespace: Annotated[str, Meta(description="a string (an operator's split of one store)")] = ""
    ttl_s: _SecondsOrNone = None
    timeout_s: _SecondsOrNone = None
    connect_timeout_s: _SecondsOrNone = None
    max_batch: _Count | UnsetType = UNSET
    max_concurrency: _Count | UnsetType = UNSET
    cluster: Annotated[bool | None, Meta(description="true, false or null (detect it)")] | (
        UnsetType
    ) = UNSET
    backoff_s: _Backoff | UnsetType = UNSET
    checksum: Annotated[str, Meta(description="'xxh3' or 'ml64'")] | UnsetType = UNSET
    auth_key_file: Annotated[str | None, Meta(description="the path of a file holding the key")] = (
        None
    )
    locality: Annotated[
        str | None, Meta(description="'REMOTE' (shared with other engines) or 'LOCAL'")
    ] = None
    max_lookups_in_flight: _Count = 4096
    max_store_jobs: _Count = 64
    enable_kv_events: bool = False
    connect_on_start: bool = False

    def __post_init__(self) -> None:
        if self.backoff_s is not UNSET and not 0 < self.backoff_s[0] <= self.backoff_s[1]:
            _bad("backoff_s", list(self.backoff_s), _BACKOFF)
        if self.checksum is not UNSET and self.checksum.lower() not in ("xxh3", "ml64"):
            _bad("checksum", self.checksum, "'xxh3' or 'ml64'")
        if self.locality and self.locality.upper() not in ("LOCAL", "REMOTE"):
            _bad("locality", self.locality, "'REMOTE' (shared with other engines) or 'LOCAL'")


def _bad(key: str, value: object, right: str) -> None:
    raise ConfigError(f"{key!r} must be {right}, got {shown(value, key)}")


class RedisEntryOptions(msgspec.Struct, frozen=True, kw_only=True):
    """A checked entry: its keys, the URL they lead to (password included: never log
    it), `RedisTier`'s keyword options, and the tier's locality."""

    keys: RedisEntry
    url: str
    redis: dict[str, Any]
    locality: Locality
    #: Whether the entry itself holds a password: vLLM logs the entry at startup.
    password_in_entry: bool


def redis_options(tier_type: str, entry: Mapping[str, Any]) -> RedisEntryOptions:
    """``entry`` (a ``secondary_tiers`` entry less vLLM's keys) checked: one `ConfigError`
    naming the key per bad value, the tier in front."""
    where = f"secondary tier {tier_type!r} (RedisSecondaryTier): "
    keys = decode(RedisEntry, dict(entry), context=where, root="the entry")
    url, password_in_entry = _url(where, keys)
    redis: dict[str, Any] = {
        key: getattr(keys, key)
        for key in ("ttl_s", "timeout_s", "connect_timeout_s")
        if getattr(keys, key) is not None
    }
    for key in ("max_batch", "max_concurrency", "cluster", "backoff_s", "checksum"):
        if getattr(keys, key) is not UNSET:
            redis[key] = getattr(keys, key)
    try:  # else $TIERING_AUTH_KEY, if set: no secret in the entry, which vLLM logs
        redis["auth_key"] = AuthKey.load(keys.auth_key_file)
    except ConfigError as exc:
        source = "'auth_key_file'" if keys.auth_key_file is not None else "$TIERING_AUTH_KEY"
        raise ConfigError(f"{where}{source}: {exc}") from None
    locality = Locality((keys.locality or "REMOTE").upper())
    redis["locality"] = locality
    return RedisEntryOptions(
        keys=keys, url=url, redis=redis, locality=locality, password_in_entry=password_in_entry
    )


def _url(where: str, keys: RedisEntry) -> tuple[str, bool]:
    """The entry's Redis URL (from ``url``, or the variable ``url_env`` names, with
    ``password_file``), and whether ``url`` itself holds a password."""
    url, url_env = keys.url, keys.url_env
    in_entry = False
    if url_env is None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            given = "no url" if url is None else shown(url, typed=True)
            if isinstance(url, str):  # never a password
                given = repr(redact_url(url))
            raise ConfigError(
                f"{where}'url' must be a Redis URL, redis://[user@]host[:port][/db] or "
                "rediss://... for TLS (with 'password_file' for the password), or 'url_env' "
                f"the name of an environment variable holding it; got {given}"
            )
        in_entry = ":" in url.partition("://")[2].rpartition("@")[0]
    try:
        resolved = resolve_url(url, url_env=url_env, password_file=keys.password_file)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    if not resolved.startswith(("redis://", "rediss://")):
        raise ConfigError(
            f"{where}the environment variable {url_env} must hold a Redis URL, "
            f"redis://[user[:password]@]host[:port][/db] or rediss://..., got "
            f"{redact_url(resolved)!r}"
        )
    return resolved, in_entry


class MetricsExtra(msgspec.Struct, frozen=True, kw_only=True):
    """``metrics_port`` (None: no metrics server) and ``metrics_host`` (loopback)."""

    metrics_port: (
        Annotated[int, Meta(ge=0, le=65535, description="a port from 0 to 65535 (0: any free one)")]
        | None
    ) = None
    metrics_host: Annotated[str, Meta(min_length=1, description="a host address")] = "127.0.0.1"


def metrics_extra(extra: Mapping[str, Any]) -> MetricsExtra:
    """The metrics keys of ``extra`` (vLLM's ``kv_connector_extra_config``), checked;
    ``metrics_host`` only with a ``metrics_port`` (without one it is not read)."""
    names = ("metrics_port", "metrics_host") if extra.get("metrics_port") is not None else ()
    keys = {key: extra[key] for key in names if key in extra}
    return decode(MetricsExtra, keys, where="kv_connector_extra_config")


def remote_namespace(config: Any, row_bytes: int, namespace: str = "") -> RemoteNamespace:
    """The namespace of the rows vLLM's scheduler-side CPU tier holds for ``config``.

    ``config`` is vLLM's ``OffloadingConfig``. A row of that tier holds a
    chunk's bytes of every worker, so the shard is the whole parallel layout
    (sizes and the host layout), not one rank's place in it.
    """
    p = config.parallel
    shard = (
        f"all{p.world_size}.tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}"
        f".{config.kv_cache_layout or 'default'}"
        f"{'.canonical' if config.canonical_layout else ''}"
        f"{'.replicated' if config.replicated_layout else ''}"
    )
    return RemoteNamespace(
        model=config.model.name,
        dtype=config.model.dtype,
        row_bytes=row_bytes,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        page_bytes=(config.worker_kv_bytes_per_block,),
        tokens_per_block=tuple(g.tokens_per_block for g in config.groups),
        shard=shard,
        namespace=namespace,
    )
