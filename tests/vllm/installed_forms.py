"""Each form of `tiering` under vLLM 0.33's scheduler, from whatever copy of it imports.

Run as a script by ``tests/vllm/test_installed.py``, with the python of a fresh
virtual environment the built wheel was installed into (its folder first on
``sys.path``: the harness beside it imports as ``harness``)::

    python installed_forms.py MODEL_FOLDER REDIS_URL NAMESPACE

Prints one JSON object: per form, the prompt tokens vLLM's connector served
from the CPU tier on the repeat, and the file of each tiering class vLLM
loaded, so the test can check that they came from the installed copy.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any

import harness

import tiering

PROMPT_A = list(range(1, 257))  # 16 blocks of 16 tokens
PROMPT_B = list(range(1001, 1257))
CHUNK = harness.attention_spec().page_size_bytes * len(harness.LAYERS)  # one block


def origin(obj: object) -> str:
    """The file of the module that defines ``obj``'s class."""
    return str(sys.modules[type(obj).__module__].__file__)


def repeat(engine: harness.Engine, prompt: list[int]) -> int:
    """Prompt tokens the connector served for ``prompt`` run a second time, with the GPU
    prefix cache (and, with a model, its pages) dropped in between."""
    engine.add(prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    if engine.model is not None:
        engine.model.wipe()
    before = engine.hit_tokens
    engine.add(prompt)
    engine.run()
    return engine.hit_tokens - before


def tiering_spec(model: Path) -> dict[str, Any]:
    """1. TieringSpec (``spec_module_path``): tiering's manager and worker, real bytes."""
    engine = harness.build_engine(model, harness.tiering_extra(64 << 20))
    fake = engine.attach_model()
    try:
        hits = repeat(engine, PROMPT_A)
        return {
            "hits": hits,
            "verified_blocks": fake.verified_blocks,
            "files": [origin(engine.manager), origin(fake.worker)],
        }
    finally:
        engine.scheduler.shutdown()
        fake.connector.shutdown()


def cache_policy(model: Path) -> dict[str, Any]:
    """2. A tiering policy under vLLM's native CPU spec (``cache_policy_module_path``)."""
    extra = harness.native_extra(
        64 << 20,
        eviction_policy="DSLRUCachePolicy",
        cache_policy_module_path="tiering.integrations.vllm",
    )
    engine = harness.build_engine(model, extra)
    try:
        return {"hits": repeat(engine, PROMPT_A), "files": [origin(engine.manager._policy)]}
    finally:
        engine.scheduler.shutdown()


def redis_tier(model: Path, url: str, namespace: str) -> dict[str, Any]:
    """3. tiering's Redis tier under vLLM's ``TieringOffloadingSpec``: a CPU tier of one
    prompt, so the second prompt evicts the first, which comes back from Redis."""
    entry = {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "url": url,
        "namespace": namespace,
    }
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 16 * CHUNK,
        "secondary_tiers": [entry],
    }
    engine = harness.build_engine(model, extra)
    try:
        (tier,) = engine.manager.secondary_tiers
        engine.add(PROMPT_A)
        engine.run()
        engine.add(PROMPT_B)  # the CPU tier holds B now: A is in Redis only
        engine.run()
        assert engine.scheduler.reset_prefix_cache()
        before = engine.hit_tokens
        engine.add(PROMPT_A)
        engine.run()
        return {
            "hits": engine.hit_tokens - before,
            "redis_reads": tier.statistics().redis.reads_total,
            "files": [origin(tier)],
        }
    finally:
        engine.manager.shutdown()


def main(model: str, url: str, namespace: str) -> None:
    folder = Path(model)
    result = {
        "tiering": tiering.__file__,
        "version": importlib.metadata.version("tiering"),
        # The distribution's record that importlib finds first: the wheel's, not editable.
        "distribution": str(importlib.metadata.distribution("tiering").locate_file("")),
        "direct_url": json.loads(
            importlib.metadata.distribution("tiering").read_text("direct_url.json") or "{}"
        ),
        "tiering_spec": tiering_spec(folder),
        "cache_policy": cache_policy(folder),
        "redis_tier": redis_tier(folder, url, namespace),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
