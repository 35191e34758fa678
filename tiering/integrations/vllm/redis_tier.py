"""tiering's Redis tier as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

A ``secondary_tiers`` entry loads it; its keys are decoded by
`tiering.integrations.vllm.extra.RedisEntry`, whose module shows one (vLLM logs
``--kv-transfer-config`` at startup: give the URL by ``url_env``, or the password
by ``password_file``; a ``url`` with a password is warned of).

What it adds to vLLM: a shared store whose values check themselves
(`tiering.secondary.codec`: header, namespace digest, key and checksum, all
verified before a value is accepted), whose keys are namespaced by what makes
chunk bytes interchangeable (model, KV dtype, row size, blocks per chunk,
tokens per block, the parallel layout, an operator's ``namespace``), and that
goes down and comes back without costing the engine anything (health gating
with backoff: while Redis is away, calls are answered at once, without I/O).
All of that is `tiering.secondary.redis.RedisTier`; this module only maps
vLLM's calls onto it.

The adapter (threads, lookups, jobs, metrics, what reaches vLLM's log) is
`tiering.integrations.vllm.polled.PolledSecondaryTier`'s, as for the disk tier.

At start the adapter connects in the background: a server that cannot be
reached (refused, host not resolved, password refused, TLS mismatch) takes the
tier down with one WARNING of the Redis tier naming why and what to check;
calls then miss without I/O until a probe finds the server (one line when it
answers again). ``connect_on_start`` connects in the constructor instead and
raises that `ConfigError`.

Medium and locality: vLLM knows two media, ``CPU`` (the engine's own host
memory) and ``STORAGE`` (everything else); Redis is another process's memory,
often another host's, so it is ``STORAGE``, and ``REMOTE`` by default (other
engines on the same store see its chunks; ``"locality": "LOCAL"`` for a
server of this engine alone). Its hits are reported as
``CacheHitSource.EXTERNAL_UNSPECIFIED`` (vLLM's name for a remote store), not
``DISK``, which ``STORAGE`` would imply.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering._extras import require
from tiering.errors import ConfigError
from tiering.integrations.vllm import tier_report
from tiering.integrations.vllm.extra import VLLM_ENTRY_KEYS, redis_options, remote_namespace
from tiering.integrations.vllm.polled import PolledSecondaryTier, PolledTierStatistics, TierSetup
from tiering.secondary.base import SecondaryStatistics
from tiering.secondary.redis import RedisTier
from tiering.secondary.refusals import Unwritten

__all__ = ["RedisSecondaryTier", "RedisSecondaryTierStatistics", "remote_namespace"]

logger = logging.getLogger(__name__)

#: Why chunks handed to `submit_store` were not written, beside `RedisTier`'s reasons.
DROPPED_QUEUE_FULL = Unwritten.QUEUE_FULL.value
DROPPED_CLOSED = Unwritten.CLOSED.value

_PREFIX = "vllm:kv_offload_redis_"
METRIC_FAILURES = _PREFIX + tier_report.FAILURES
METRIC_TIMEOUTS = _PREFIX + tier_report.TIMEOUTS
METRIC_UNAVAILABLE = _PREFIX + tier_report.UNAVAILABLE
METRIC_REFUSALS = _PREFIX + tier_report.REFUSALS
METRIC_REJECTED = _PREFIX + tier_report.REJECTED
METRIC_READ_MISSES = _PREFIX + tier_report.READ_MISSES
METRIC_WRITES_DROPPED = _PREFIX + tier_report.WRITES_DROPPED
METRIC_LOOKUPS_DEFERRED = _PREFIX + tier_report.LOOKUPS_DEFERRED
METRIC_UP = _PREFIX + tier_report.UP

_INFO_KEYS = ("redis_url", "redis_namespace", "redis_checksum")


class RedisSecondaryTierStatistics(PolledTierStatistics, frozen=True, kw_only=True):
    """A snapshot of the tier: the adapter's counts and ``redis``, the snapshot of its
    `RedisTier` the loop thread took after its last call."""

    redis: SecondaryStatistics


class RedisSecondaryTier(PolledSecondaryTier):
    """A vLLM ``SecondaryTierManager`` over tiering's `RedisTier` (see the module docstring).

    Its entry's keys, and what each means: `tiering.integrations.vllm.extra.RedisEntry`.
    """

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    store: ClassVar[str] = "Redis tier"
    metric_prefix: ClassVar[str] = _PREFIX
    refusal_examples: ClassVar[str] = "OOM, READONLY..."
    _tier: RedisTier

    def _setup(self, offloading_spec: Any, tier_type: str, entry: dict[str, Any]) -> TierSetup:
        options = redis_options(tier_type, entry)
        self.namespace = remote_namespace(
            offloading_spec.config, self.block_size_bytes, options.keys.namespace
        )
        if options.password_in_entry:
            logger.warning(
                "secondary tier %r: its 'url' holds a password, and vLLM logs "
                "--kv-transfer-config at startup: give 'url_env' (an environment variable "
                "holding the URL) or 'password_file' instead",
                tier_type,
            )
        try:
            tier = RedisTier(options.url, self.namespace, **options.redis)
        except ConfigError as exc:
            raise ConfigError(f"secondary tier {tier_type!r}: {exc}") from exc
        self.url = tier.url  # no password
        self._connect_on_start = options.keys.connect_on_start
        logger.info(
            "Redis secondary tier %r at %s, namespace %s (%s)",
            tier_type,
            self.url,
            self.namespace.digest().hex()[:16],
            self.namespace.namespace or "no operator namespace",
        )
        return TierSetup(
            tier=tier,
            locality=Locality(options.locality.value),
            max_lookups_in_flight=options.keys.max_lookups_in_flight,
            max_store_jobs=options.keys.max_store_jobs,
            enable_kv_events=options.keys.enable_kv_events,
            start_now=options.keys.connect_on_start,
        )

    async def _start_tier(self) -> None:
        """Connect; a server that cannot be reached took the tier down, and the tier said
        why in the log: it is probed again with backoff (``connect_on_start``: raised)."""
        try:
            await self._tier.connect(warn=not self._connect_on_start)
        except ConfigError:
            if self._connect_on_start:
                raise

    def _where(self) -> str:
        return self.url

    def statistics(self) -> RedisSecondaryTierStatistics:
        return RedisSecondaryTierStatistics(redis=self._latest, **self._statistics())

    @classmethod
    def check_entry(cls, tier_type: str, entry: Mapping[str, Any]) -> None:
        """Refuse a bad ``secondary_tiers`` entry before anything is built (one `ConfigError`
        naming the key); vLLM's own keys of an entry are not the tier's to check."""
        require("redis", "redis", f"secondary tier {tier_type!r}: the Redis tier")
        redis_options(tier_type, {k: v for k, v in entry.items() if k not in VLLM_ENTRY_KEYS})

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return dict(
            zip(
                _INFO_KEYS,
                (self.url, self.namespace.digest().hex()[:16], self._tier.codec.checksum.name),
                strict=True,
            )
        )
