"""tiering inside vLLM 0.33: the offloading spec, the cache policies, a secondary tier.

Every name is loaded on first use, so ``spec_module_path``,
``cache_policy_module_path`` and a ``secondary_tiers`` entry's ``module_path``
can all be ``"tiering.integrations.vllm"``: vLLM imports this package and asks
it for the class it was told to load, and only then is vLLM itself imported
(by the module that holds that class). The config translation
(`build_offloading_config`, `is_kv_cache_tensor_packed`) never imports vLLM.

==========================  =============================================
name                        what vLLM does with it
==========================  =============================================
``TieringSpec``             ``spec_name``: an ``OffloadingSpec``
``ASLRUCachePolicy``, ...   ``eviction_policy``: a CPU-tier ``CachePolicy``
                            (one per policy of ``POLICY_NAMES``)
``RedisSecondaryTier``,     a ``secondary_tiers`` entry's ``type``
``DiskSecondaryTier``
==========================  =============================================
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiering.errors import UnknownNameError
from tiering.policies import POLICY_NAMES

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from tiering.integrations.vllm.config import (
        build_offloading_config,
        from_vllm_offloading_config,
        is_kv_cache_tensor_packed,
    )
    from tiering.integrations.vllm.disk_tier import DiskSecondaryTier
    from tiering.integrations.vllm.manager import TieringOffloadingManager
    from tiering.integrations.vllm.policies import vllm_policy_name
    from tiering.integrations.vllm.redis_tier import RedisSecondaryTier
    from tiering.integrations.vllm.spec import TieringSpec
    from tiering.integrations.vllm.worker import TieringOffloadingWorker

#: The CPU-tier policy of each tiering policy, named as `policies.vllm_policy_name`
#: names it (that module imports vLLM; this one does not).
_POLICY_CLASS_NAMES = [f"{name.upper()}CachePolicy" for name in POLICY_NAMES]

#: Each name this package exposes -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "build_offloading_config": "config",
    "from_vllm_offloading_config": "config",
    "is_kv_cache_tensor_packed": "config",
    "TieringSpec": "spec",
    "TieringOffloadingManager": "manager",
    "TieringOffloadingWorker": "worker",
    **dict.fromkeys(_POLICY_CLASS_NAMES, "policies"),
    "vllm_policy_name": "policies",
    "RedisSecondaryTier": "redis_tier",
    "DiskSecondaryTier": "disk_tier",
}

__all__ = [
    "DiskSecondaryTier",
    "RedisSecondaryTier",
    "TieringOffloadingManager",
    "TieringOffloadingWorker",
    "TieringSpec",
    "build_offloading_config",
    "from_vllm_offloading_config",
    "is_kv_cache_tensor_packed",
    "vllm_policy_name",
]
__all__ += _POLICY_CLASS_NAMES
__all__.sort()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        tiers = sorted(n for n in __all__ if n.endswith("SecondaryTier"))
        policies = sorted(n for n in __all__ if n.endswith("CachePolicy"))
        raise UnknownNameError(
            f"module {__name__!r} has no attribute {name!r}: its secondary tiers (a "
            f"secondary_tiers entry's type) are {', '.join(tiers)}; its spec (spec_name) "
            f"is TieringSpec; its cache policies (eviction_policy) are {', '.join(policies)}"
        )
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
