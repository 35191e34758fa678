"""The options of a Redis tier, decoded and checked before anything is built.

`RedisTier(url, namespace, **options)`, `RedisTier.open` and `RedisTier.from_env`
take the same keyword options; `RedisOptions` is their one schema: unknown
keys, values of the wrong type and out-of-range numbers are each refused with
one `ConfigError` line naming the option, the value and what would be right
(`tiering._decode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tiering._decode import PositiveInt, decode
from tiering.errors import ConfigError
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import Locality
from tiering.secondary.checksum import Checksum

__all__ = ["RedisOptions", "decode_options"]


#: A number of seconds, kept as given (an ``int`` stays one): messages show it so,
#: "no answer within 2 s", as they did before the options were decoded.
_Seconds = Annotated[int | float, Meta(description="a number of seconds")]


class RedisOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A `RedisTier`'s keyword options (what each means: `RedisTier`)."""

    ttl_s: _Seconds | None = None
    release_ttl_s: _Seconds | None = None
    timeout_s: _Seconds = 2.0
    connect_timeout_s: _Seconds | None = None
    cluster: bool | None = None
    max_batch: PositiveInt = 1024
    max_concurrency: PositiveInt = 8
    backoff_s: tuple[_Seconds, _Seconds] = (0.05, 5.0)  # its order: `HealthGate` checks it
    socket_read_size: PositiveInt = 256 << 10
    locality: Locality = Locality.REMOTE
    checksum: Checksum | str = Checksum.XXH3  # or its name, in any case: `checksum_kind`
    auth_key: AuthKey | None = None

    def __post_init__(self) -> None:
        # The durations are checked here, not by ``Meta``, in the words that vLLM's
        # tier entries have always shown for them.
        for label, value in (
            ("timeout_s", self.timeout_s),
            ("connect_timeout_s", self.connect_timeout_s),
        ):
            if value is not None and not value > 0:
                raise ConfigError(f"{label} must be a positive number of seconds, got {value!r}")
        if self.ttl_s is not None and not self.ttl_s >= 0.001:
            raise ConfigError(f"ttl_s must be None or at least 0.001 seconds, got {self.ttl_s!r}")
        if self.release_ttl_s is not None and not self.release_ttl_s >= 0.001:
            raise ConfigError(
                f"release_ttl_s must be None or at least 0.001 seconds, got {self.release_ttl_s!r}"
            )
        _checksum(self.checksum)

    @property
    def connect_s(self) -> float:
        """Each connect's timeout: ``connect_timeout_s``, or ``timeout_s`` when not given."""
        return self.connect_timeout_s or self.timeout_s

    @property
    def checksum_kind(self) -> Checksum:
        """``checksum`` as a `Checksum`."""
        return _checksum(self.checksum)


def _checksum(value: Checksum | str) -> Checksum:
    if isinstance(value, Checksum):
        return value
    name = value.upper()
    if name not in Checksum.__members__:
        names = ", ".join(k.lower() for k in Checksum.__members__)
        raise ConfigError(f"checksum must be one of {names}, got {value!r}")
    return Checksum[name]


def decode_options(options: Mapping[str, Any]) -> RedisOptions:
    """``options`` (keyword arguments of `RedisTier`) as `RedisOptions`; `ConfigError` if not."""
    return decode(RedisOptions, dict(options), context="the Redis tier's options: ")
