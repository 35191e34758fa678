"""The harness itself, with vLLM's native CPU spec: what the other vLLM tests stand on."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from .harness import build_engine, native_extra, write_model


def test_vllms_native_spec_loads_a_repeated_prefix_from_the_cpu_tier(tmp_path):
    engine = build_engine(write_model(tmp_path / "model"), native_extra(64 << 20))
    prompt = list(range(1, 257))  # 16 blocks of 16 tokens
    engine.add(prompt)
    engine.run()
    # The GPU prefix cache is dropped: only the CPU tier can serve the repeat.
    assert engine.scheduler.reset_prefix_cache()
    assert engine.hit_tokens == 0
    second = engine.add(prompt)
    engine.run()
    assert second.request_id in engine.finished
    # All 16 blocks come from the CPU tier (vLLM then recomputes the last token).
    assert engine.hit_tokens == 256
