"""What tiering reads from vLLM's ``kv_connector_extra_config``, as msgspec Structs.

vLLM hands a spec its ``kv_connector_extra_config`` and each ``secondary_tiers``
entry as a dict parsed from ``--kv-transfer-config``. The parts tiering reads
are decoded here (`tiering._decode`): one `ConfigError` line per bad value,
naming the key, the value and what would be right, and an unknown key refused
with the key it may misspell. `TieringSpecKeys` is the whole extra config of
`TieringSpec`: tiering's keys and vLLM's own (`tiering.extra_config.VLLM_EXTRA_KEYS`),
each typed as vLLM reads it. An entry's keys are its tier's own.

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

from tiering._decode import closest_key, decode, shown
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.integrations.vllm.config import extra_int
from tiering.policies import POLICY_NAMES
from tiering.policies.hints import DEFAULT_HINT_SHARE
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import Locality
from tiering.secondary.codec import RemoteNamespace
from tiering.secondary.redis import redact_url
from tiering.secondary.redis.address import holds_password, resolve_url
from tiering.secondary.redis.options import RedisOptions

__all__ = [
    "VLLM_ENTRY_KEYS",
    "RedisEntry",
    "RedisEntryOptions",
    "TieringSpecKeys",
    "entry_auth_key",
    "extra_key",
    "redis_options",
    "remote_namespace",
    "spec_keys",
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
    ``namespace`` (an operator's split of one store), ``ttl_s``, ``release_ttl_s``
    (how soon a value a hint released expires; None: a release changes
    nothing), ``timeout_s``,
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
    release_ttl_s: _SecondsOrNone = None
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
        for key in ("ttl_s", "release_ttl_s", "timeout_s", "connect_timeout_s")
        if getattr(keys, key) is not None
    }
    for key in ("max_batch", "max_concurrency", "cluster", "backoff_s", "checksum"):
        if getattr(keys, key) is not UNSET:
            redis[key] = getattr(keys, key)
    try:  # the tier's own rules for its durations, now: not once a worker builds it
        RedisOptions(**{k: v for k, v in redis.items() if k.endswith("_s")})
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    redis["auth_key"] = entry_auth_key(where, keys.auth_key_file)
    locality = Locality((keys.locality or "REMOTE").upper())
    redis["locality"] = locality
    return RedisEntryOptions(
        keys=keys, url=url, redis=redis, locality=locality, password_in_entry=password_in_entry
    )


def entry_auth_key(where: str, auth_key_file: str | None) -> AuthKey | None:
    """A tier entry's MAC key: from its ``auth_key_file``, else ``$TIERING_AUTH_KEY`` if set
    (never a secret in the entry, which vLLM logs); a bad one is a `ConfigError` with
    ``where`` (the tier) in front."""
    try:
        return AuthKey.load(auth_key_file)
    except ConfigError as exc:
        source = "'auth_key_file'" if auth_key_file is not None else "$TIERING_AUTH_KEY"
        raise ConfigError(f"{where}{source}: {exc}") from None


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
        in_entry = holds_password(url)
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


#: The key path of a ``kv_connector_extra_config`` key, as errors name it.
_EXTRA = "kv_connector_extra_config"
#: The cache policies and transfer backends of `TieringSpec`.
_POLICIES = f"one of {', '.join(POLICY_NAMES)}"
_BACKENDS = ("auto", "cpu", "cuda")
_PORT = "a port from 0 to 65535 (0: any free one)"
#: An integer as vLLM reads one with ``int()``: an int, or a string of one (not a
#: float: vLLM would cut 2.7 to 2).
_VllmCount = Annotated[
    Annotated[int, Meta(ge=1)] | str | None, Meta(description="a positive integer")
]
_VllmSize = Annotated[Annotated[int, Meta(ge=0)] | str, Meta(description="a non-negative integer")]
_BYTES = "a positive number of bytes"
#: vLLM's own ``--kv-offloading-size`` (GiB) writes ``cpu_bytes_to_use`` as a float
#: (``size * (1 << 30)``), which its spec cuts with ``int()``: a float is taken so too.
_VllmBytes = Annotated[
    Annotated[int, Meta(ge=1)] | Annotated[float, Meta(ge=1, le=2.0**63)] | str | None,
    Meta(description=_BYTES),
]
#: vLLM's integer keys: the least value, and what a right one is in words.
_VLLM_INTS = {
    "block_size": (1, "a positive integer"),
    "blocks_per_chunk": (1, "a positive integer"),
    "cpu_bytes_to_use": (1, _BYTES),
    "sync_load_budget_bytes": (0, "a non-negative integer"),
    "store_threshold": (0, "a non-negative integer"),
}
#: vLLM's keys that another spec reads, not `TieringSpec`: what reads each.
_OTHER_SPECS = {
    "cache_policy_module_path": "vLLM's CPUOffloadingSpec (the module of its policy class)",
    "max_tracker_size": "vLLM's CPUOffloadingSpec (the tracker of its store_threshold)",
    "tier_poll_interval_s": "vLLM's TieringOffloadingSpec (its tier-poll thread)",
    "backpressure": "vLLM's TieringOffloadingSpec (its tiers' back-pressure)",
}


class TieringSpecKeys(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole ``kv_connector_extra_config`` of `TieringSpec`, decoded strictly.

    tiering's own keys: ``eviction_policy`` (one of `POLICY_NAMES`; vLLM's
    ``CPUOffloadingSpec`` reads the same key as the name of one of *its*
    policies), ``hint_share`` (the share of the CPU tier that chunks retained by
    requests' hints may hold, protected: a fraction from 0 to 1, 0.2 by
    default), ``transfer_backend``, ``metrics_port`` and ``metrics_host``.
    vLLM's own keys (`tiering.extra_config.VLLM_EXTRA_KEYS`) are typed as vLLM
    reads them: an integer is an int or a string of one (vLLM's ``int()``; a
    float, which vLLM would cut, is refused, but for ``cpu_bytes_to_use``, which
    vLLM's own ``--kv-offloading-size`` writes as one), a flag is ``true`` or
    ``false`` (vLLM's ``bool()`` takes the string ``"false"`` for true). Those
    that only another spec reads (`_OTHER_SPECS`) pass untouched, as vLLM's own
    keys do; `unread` says which are set, for `TieringSpec` to warn that under
    it they do nothing. An unknown key is refused with the key it may misspell.
    ``secondary_tiers`` is a list of entries, each decoded by `TieringSpec` (its
    tier's own Struct).
    """

    # tiering's own
    eviction_policy: Annotated[str, Meta(description=_POLICIES)] = DEFAULT_POLICY
    hint_share: Annotated[float, Meta(ge=0, le=1, description="a fraction from 0 to 1")] = (
        DEFAULT_HINT_SHARE
    )
    transfer_backend: Annotated[str, Meta(description="'auto', 'cpu' or 'cuda'")] = "auto"
    metrics_port: Annotated[int, Meta(ge=0, le=65535, description=_PORT)] | None = None
    metrics_host: Annotated[str, Meta(min_length=1, description="a host address")] | (
        UnsetType
    ) = UNSET
    # vLLM's own, in VLLM_EXTRA_KEYS' order
    spec_name: str = "CPUOffloadingSpec"
    spec_module_path: str | None = None
    block_size: _VllmCount = None
    blocks_per_chunk: _VllmCount = None
    canonical_layout: bool = False
    sync_load_budget_bytes: _VllmSize = 0
    self_describing_kv_events: bool = False
    offload_prompt_only: bool = True
    cpu_bytes_to_use: _VllmBytes = None
    cache_policy_module_path: Any = None
    store_threshold: _VllmSize = 0
    max_tracker_size: Any = None
    secondary_tiers: list[dict[str, Any]] | None = None
    tier_poll_interval_s: Any = None
    backpressure: Any = None

    def __post_init__(self) -> None:
        for key in _VLLM_INTS:
            if not isinstance(getattr(self, key), float):  # cpu_bytes_to_use's, checked
                _vllm_int(key, getattr(self, key))
        if self.cpu_bytes_to_use is None:
            raise ConfigError(
                f"{extra_key('cpu_bytes_to_use')} is missing; TieringSpec needs the host bytes of "
                "its CPU tier, e.g. 8000000000 for 8 GB"
            )
        if _vllm_int("store_threshold", self.store_threshold) not in (0, 1):
            raise ConfigError(
                f"{extra_key('store_threshold')}={self.store_threshold!r}: TieringSpec stores "
                "every chunk it is offered (its policies decide what stays); remove "
                "store_threshold, or use vLLM's CPUOffloadingSpec for admission by reuse count"
            )
        policy = self.eviction_policy.removesuffix("CachePolicy")
        if policy != self.eviction_policy and policy.lower() in POLICY_NAMES:
            # vLLM's CPUOffloadingSpec reads this key as the name of one of its policies
            raise ConfigError(
                f"{extra_key('eviction_policy')} is {self.eviction_policy!r}, a policy class of "
                f"vLLM's CPUOffloadingSpec; TieringSpec takes tiering's names: write "
                f"{policy.lower()!r}"
            )
        _choice("eviction_policy", self.eviction_policy, POLICY_NAMES)
        _choice("transfer_backend", self.transfer_backend, _BACKENDS)
        if self.metrics_host is not UNSET and self.metrics_port is None:
            raise ConfigError(
                f"{extra_key('metrics_host')} is {self.metrics_host!r} but metrics_port is not "
                "set, and without it no metrics are served: add metrics_port (e.g. 9100, or "
                "0 for any free port), or remove metrics_host"
            )

    @property
    def cpu_bytes(self) -> int:
        """``cpu_bytes_to_use`` as a number of bytes (a float cut as vLLM's ``int()`` does)."""
        if isinstance(self.cpu_bytes_to_use, float):
            return int(self.cpu_bytes_to_use)
        return _vllm_int("cpu_bytes_to_use", self.cpu_bytes_to_use) or 0

    @property
    def unread(self) -> tuple[str, ...]:
        """One line for each of vLLM's keys set here that only another spec reads
        (`_OTHER_SPECS`): under `TieringSpec` it does nothing."""
        return tuple(
            f"{extra_key(key)}={shown(getattr(self, key), key)} is read by {reader}, not by "
            "TieringSpec: it does nothing here (remove it, or use that spec)"
            for key, reader in _OTHER_SPECS.items()
            if getattr(self, key) is not None
        )

    @property
    def policy(self) -> str:
        """``eviction_policy``, one of `POLICY_NAMES`."""
        return self.eviction_policy.lower()

    @property
    def backend(self) -> str:
        """``transfer_backend``: ``auto``, ``cpu`` or ``cuda``."""
        return self.transfer_backend.lower()

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where tiering's metrics are served (``metrics_host`` is loopback by default);
        None without ``metrics_port``."""
        if self.metrics_port is None:
            return None
        host = "127.0.0.1" if self.metrics_host is UNSET else self.metrics_host
        return host, self.metrics_port


def spec_keys(extra: Mapping[str, Any]) -> TieringSpecKeys:
    """``extra`` (vLLM's ``kv_connector_extra_config``) checked as `TieringSpec` reads it:
    one `ConfigError` line naming the key, the value and what would be right."""
    return decode(TieringSpecKeys, dict(extra), where=_EXTRA)


def extra_key(key: str) -> str:
    """How a message names ``key`` of vLLM's ``kv_connector_extra_config``."""
    return f"{_EXTRA}[{key!r}]"


def _vllm_int(key: str, value: int | str | None) -> int | None:
    """``value`` of vLLM's integer key ``key`` as vLLM's ``int()`` reads it, checked."""
    minimum, right = _VLLM_INTS[key]
    return extra_int(value, key, minimum, right)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value.lower() in choices:
        return
    close = closest_key(value, choices, cutoff=0.6)
    hint = f"did you mean {close!r}? " if close else ""
    raise ConfigError(f"{extra_key(key)} is {value!r}; {hint}choose one of {', '.join(choices)}")


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
