"""tiering's disk tier as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

A ``secondary_tiers`` entry loads it::

    {"type": "DiskSecondaryTier", "module_path": "tiering.integrations.vllm",
     "path": "/var/cache/tiering", "capacity_bytes": 107374182400}

What it adds to vLLM's own ``fs`` tier: a capacity it keeps to (evicting by a
tiering policy, and holding less where its file system holds less), values
that check themselves (`tiering.secondary.codec`: header, namespace digest,
key, checksum; with ``auth_key_file``, a MAC), a folder that survives a
restart of the server (the next one scans it and serves what the last one
wrote), and a folder it alone owns (locked; nothing in it followed through a
link). All of that is `tiering.secondary.disk.DiskTier`; the adapter (threads,
lookups, jobs, metrics, the log) is
`tiering.integrations.vllm.polled.PolledSecondaryTier`'s, as for Redis.

The namespace is `tiering.integrations.vllm.extra.remote_namespace`'s, as the
Redis tier's: values another model, KV dtype or parallel layout wrote in the
same folder are misses (left alone, never loaded), as are those of another
operator ``namespace``.

At start the tier scans its folder in the background: lookups answer
``RETRY`` until the scan has ended, then ``HIT`` or ``MISS``. A folder that
cannot be used (not writable, used by another process, a link where its lock
belongs) is one WARNING naming why and what to check, and the tier is then a
tier of misses until vLLM restarts (``open_on_start``: raised as a
`ConfigError` in the constructor instead, and the scan done there).

Medium ``STORAGE``, locality ``LOCAL`` (a folder of this server); its hits are
vLLM's ``CacheHitSource.DISK``.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import UNSET, Meta, UnsetType
from vllm.v1.kv_offload.base import Locality, OffloadingEvent, OffloadKey

from tiering._decode import decode
from tiering.errors import ConfigError
from tiering.integrations.vllm import tier_report
from tiering.integrations.vllm.extra import VLLM_ENTRY_KEYS, entry_auth_key, remote_namespace
from tiering.integrations.vllm.polled import PolledSecondaryTier, PolledTierStatistics, TierSetup
from tiering.policies import POLICY_NAMES
from tiering.secondary.base import SecondaryStatistics
from tiering.secondary.checksum import Checksum
from tiering.secondary.disk import FSYNC_POLICIES, DiskTier

__all__ = ["DiskEntry", "DiskSecondaryTier", "DiskSecondaryTierStatistics", "disk_options"]

logger = logging.getLogger(__name__)

_PREFIX = "vllm:kv_offload_disk_"
METRIC_REJECTED = _PREFIX + tier_report.REJECTED
METRIC_WRITES_DROPPED = _PREFIX + tier_report.WRITES_DROPPED
METRIC_UP = _PREFIX + tier_report.UP

_INFO_KEYS = ("disk_path", "disk_namespace", "disk_capacity_bytes")

_Count = Annotated[int, Meta(ge=1, description="an integer of at least 1")]
_Seconds = Annotated[float, Meta(gt=0, description="a number of seconds above 0")]
_Text = Annotated[str, Meta(description="a string")]
_Share = Annotated[float, Meta(ge=0, le=1, description="a fraction from 0 to 1")]


class DiskEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A `DiskSecondaryTier` entry's keys, less vLLM's (``type``, ``module_path``,
    ``backpressure``).

    ``path`` (the tier's folder, made if missing; one server's alone) and
    ``capacity_bytes`` (what its value files take at most); ``namespace`` (an
    operator's split of one folder's values); ``fsync`` (``none``, ``data`` or
    ``full``: what survives a power loss), ``direct_io`` (``null``: where the
    file system takes it and it helps), ``policy`` (what it evicts first: a
    tiering policy's name), ``hint_share`` (the share of the capacity values
    retained by a hint may hold, spared from evictions: a fraction from 0 to
    1), ``timeout_s`` (each call), ``max_concurrency``
    (worker threads), ``backoff_s`` (``[first, longest]`` retry delay while the
    folder is gone or writes are refused), ``checksum`` (``xxh3`` or
    ``ml64``), ``auth_key_file`` (a file holding a key: values are written with
    a MAC under it and only values with a valid one are loaded; without it, the
    variable ``TIERING_AUTH_KEY`` if set, never a secret in the entry, which
    vLLM logs), ``file_mode`` (0o600 by default), ``max_lookups_in_flight``,
    ``max_store_jobs``, ``enable_kv_events`` (stored and evicted chunks as KV
    events) and ``open_on_start`` (scan in the constructor and raise a folder
    that cannot be used as `ConfigError`, instead of one WARNING and a tier of
    misses). A key left out (UNSET) leaves `DiskTier`'s default.
    """

    path: Annotated[str, Meta(min_length=1, description="the path of the tier's folder")]
    capacity_bytes: _Count
    namespace: Annotated[str, Meta(description="a string (an operator's split of one folder)")] = ""
    fsync: Annotated[str, Meta(description="'none', 'data' or 'full'")] = "none"
    direct_io: Annotated[bool | None, Meta(description="true, false or null")] = None
    policy: _Text | UnsetType = UNSET
    hint_share: _Share | UnsetType = UNSET
    timeout_s: _Seconds | UnsetType = UNSET
    max_concurrency: _Count | UnsetType = UNSET
    backoff_s: (
        Annotated[tuple[float, float], Meta(description="[first, longest] seconds")] | UnsetType
    ) = UNSET
    checksum: Annotated[str, Meta(description="'xxh3' or 'ml64'")] = "xxh3"
    auth_key_file: Annotated[str | None, Meta(description="the path of a file holding the key")] = (
        None
    )
    file_mode: Annotated[
        int,
        Meta(
            ge=0o600,
            le=0o777,
            description="a mode from 0o600 to 0o777, in decimal as JSON has no octal: "
            "384 for 0o600 (the default), 416 for 0o640",
        ),
    ] = 0o600
    max_lookups_in_flight: _Count = 4096
    max_store_jobs: _Count = 64
    enable_kv_events: bool = False
    open_on_start: bool = False

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            _bad("fsync", self.fsync, " or ".join(map(repr, FSYNC_POLICIES)))
        if self.checksum.lower() not in ("xxh3", "ml64"):
            _bad("checksum", self.checksum, "'xxh3' or 'ml64'")
        if self.policy is not UNSET and self.policy not in POLICY_NAMES:
            _bad("policy", self.policy, "one of " + ", ".join(map(repr, POLICY_NAMES)))
        if self.backoff_s is not UNSET and not 0 < self.backoff_s[0] <= self.backoff_s[1]:
            _bad(
                "backoff_s", list(self.backoff_s), "[first, longest] seconds, 0 < first <= longest"
            )


def _bad(key: str, value: object, right: str) -> None:
    raise ConfigError(f"{key!r} must be {right}, got {value!r}")


def disk_options(tier_type: str, entry: Mapping[str, Any]) -> tuple[DiskEntry, dict[str, Any]]:
    """``entry`` (less vLLM's keys) checked, and `DiskTier`'s keyword options from it:
    one `ConfigError` naming the key per bad value, the tier in front."""
    where = f"secondary tier {tier_type!r} (DiskSecondaryTier): "
    keys = decode(DiskEntry, dict(entry), context=where, root="the entry")
    options: dict[str, Any] = {
        "fsync": keys.fsync,
        "direct_io": keys.direct_io,
        "checksum": Checksum[keys.checksum.upper()],
        "file_mode": keys.file_mode,
    }
    for key in ("policy", "hint_share", "timeout_s", "max_concurrency", "backoff_s"):
        if getattr(keys, key) is not UNSET:
            options[key] = getattr(keys, key)
    options["auth_key"] = entry_auth_key(where, keys.auth_key_file)
    return keys, options


class DiskSecondaryTierStatistics(PolledTierStatistics, frozen=True, kw_only=True):
    """A snapshot of the tier: the adapter's counts and ``disk``, the snapshot of its
    `DiskTier` the loop thread took after its last call."""

    disk: SecondaryStatistics


class DiskSecondaryTier(PolledSecondaryTier):
    """A vLLM ``SecondaryTierManager`` over tiering's `DiskTier` (see the module docstring).

    Its entry's keys, and what each means: `DiskEntry`.
    """

    store: ClassVar[str] = "disk tier"
    metric_prefix: ClassVar[str] = _PREFIX
    refusal_examples: ClassVar[str] = "ENOSPC, EROFS, EACCES..."
    _tier: DiskTier | None

    def _setup(self, offloading_spec: Any, tier_type: str, entry: dict[str, Any]) -> TierSetup:
        keys, options = disk_options(tier_type, entry)
        self.path = keys.path
        self.capacity_bytes = keys.capacity_bytes
        self.namespace = remote_namespace(
            offloading_spec.config, self.block_size_bytes, keys.namespace
        )
        self._removed: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self._open_on_start = keys.open_on_start
        setup = TierSetup(
            tier=None,
            locality=Locality.LOCAL,
            max_lookups_in_flight=keys.max_lookups_in_flight,
            max_store_jobs=keys.max_store_jobs,
            enable_kv_events=keys.enable_kv_events,
            start_now=keys.open_on_start,
        )
        try:
            tier = DiskTier(keys.path, keys.capacity_bytes, self.namespace, **options)
        except ConfigError as exc:
            if keys.open_on_start or str(Path(keys.path)) not in str(exc):
                raise ConfigError(f"secondary tier {tier_type!r}: {exc}") from exc
            return msgspec.structs.replace(setup, unusable=str(exc))  # its folder: warned of
        if keys.enable_kv_events:
            tier.on_removed = self._announce_removed  # evicted, or found damaged or gone
        logger.info(
            "disk secondary tier %r at %s, %s bytes, namespace %s (%s)",
            tier_type,
            keys.path,
            f"{keys.capacity_bytes:,}",
            self.namespace.digest().hex()[:16],
            self.namespace.namespace or "no operator namespace",
        )
        return msgspec.structs.replace(setup, tier=tier)

    def _announce_removed(self, keys: Sequence[OffloadKey]) -> None:
        self._removed.put(list(keys))  # on the tier's loop: taken by `take_events`

    async def _start_tier(self) -> None:
        """Scan the folder (however long it takes): until then lookups answer ``RETRY``."""
        assert self._tier is not None
        report = await self._tier.open()
        logger.info(
            "disk secondary tier %r: found %s values (%s bytes) in %s",
            self.tier_type,
            f"{len(report.values):,}",
            f"{self._tier.statistics().used_bytes or 0:,}",
            self.path,
        )

    def _where(self) -> str:
        return self.path

    def _check(self) -> str:
        return (
            "that the folder (or the folder it would be made in) exists and is writable by "
            "this user, and that no other process uses it (each server its own folder)"
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored chunks (`PolledSecondaryTier`'s), then those that left the folder."""
        events = list(super().take_events())
        if self._events is not None:
            while True:
                try:
                    keys: Sequence[OffloadKey] = self._removed.get_nowait()
                except queue.Empty:
                    break
                events.append(
                    OffloadingEvent(
                        keys=list(keys), medium=self.medium, removed=True, locality=self.locality
                    )
                )
        return events

    def statistics(self) -> DiskSecondaryTierStatistics:
        return DiskSecondaryTierStatistics(disk=self._latest, **self._statistics())

    @classmethod
    def check_entry(cls, tier_type: str, entry: Mapping[str, Any]) -> None:
        """Refuse a bad ``secondary_tiers`` entry before anything is built (one `ConfigError`
        naming the key); vLLM's own keys of an entry are not the tier's to check."""
        disk_options(tier_type, {k: v for k, v in entry.items() if k not in VLLM_ENTRY_KEYS})

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        values = (self.path, self.namespace.digest().hex()[:16], self.capacity_bytes)
        return dict(zip(_INFO_KEYS, values, strict=True))
