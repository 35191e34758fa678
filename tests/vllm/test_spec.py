"""`TieringSpec` loaded by vLLM 0.33 by name, driven by vLLM's real scheduler on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiering.errors import ConfigError
from tiering.integrations.vllm import TieringOffloadingManager, TieringSpec

from .harness import build_engine, native_extra, tiering_extra, write_model

PROMPT = list(range(1, 257))  # 16 blocks of 16 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def test_vllm_loads_tiering_spec_by_name_and_module_path(model):
    assert OffloadingSpecFactory.get_spec_cls(tiering_extra(1 << 20)) is TieringSpec
    engine = build_engine(model, tiering_extra(64 << 20))
    assert isinstance(engine.manager, TieringOffloadingManager)


def test_a_repeated_prompt_gets_its_prefix_from_the_cpu_tier(model):
    engine = build_engine(model, tiering_extra(64 << 20))
    engine.add(PROMPT)
    engine.run()
    assert engine.manager.tier.statistics().ready == 16
    assert engine.scheduler.reset_prefix_cache()  # only the CPU tier has it now
    engine.add(PROMPT)
    engine.run()
    assert engine.hit_tokens == 256
    stats = engine.manager.tier.statistics()
    assert stats.loaded_total == 16
    assert stats.pinned == 0
    assert stats.open_load_jobs == 0


def test_the_same_bytes_give_the_same_number_of_chunks_as_vllms_native_spec(model):
    for cpu_bytes in (1 << 20, 64 << 20, 12_345_678):
        native = build_engine(model, native_extra(cpu_bytes))
        tiering = build_engine(model, tiering_extra(cpu_bytes))
        assert tiering.manager.tier.capacity == native.manager._num_chunks


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use'] is missing"),
        ({"cpu_bytes_to_use": -5}, "must be a positive number of bytes, got -5"),
        ({"cpu_bytes_to_use": "lots"}, "got 'lots'"),
        ({"cpu_bytes_to_use": 100}, "holds no chunk"),
        ({"eviction_policy": "aslur"}, "did you mean 'aslru'"),
        ({"transfer_backend": "gpu"}, "choose one of auto, cpu, cuda$"),
        ({"canonical_layout": True}, "canonical"),
    ],
)
def test_a_bad_extra_config_value_is_one_clear_config_error(model, extra, message):
    config = tiering_extra(64 << 20)
    config.update(extra)
    if config["cpu_bytes_to_use"] is None:
        del config["cpu_bytes_to_use"]
    with pytest.raises(ConfigError, match=message):
        build_engine(model, config)
