"""`TieringSpec`'s ``kv_connector_extra_config``, decoded strictly (`TieringSpecKeys`),
through vLLM 0.33's own connector and scheduler; vLLM's own keys from vLLM's sources."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiering.errors import ConfigError
from tiering.extra_config import VLLM_EXTRA_KEYS
from tiering.integrations.vllm import TieringSpec
from tiering.integrations.vllm.extra import TieringSpecKeys, spec_keys

from .harness import Engine, build_engine, build_vllm_config, tiering_extra, write_model
from .vllm_log import vllm_logging

#: Where vLLM 0.33 reads an offloading connector's ``kv_connector_extra_config``:
#: the connector, its config and scheduler, the spec factory, the specs (CPU and
#: tiering) and their base, and the connector factory. The tier packages under
#: ``v1/kv_offload/tiering/`` (fs, obj, p2p, kvcr, example) read their own
#: ``secondary_tiers`` entry, not the extra config, and are left out.
VLLM_SOURCES = (
    "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
    "distributed/kv_transfer/kv_connector/v1/offloading/*.py",
    "distributed/kv_transfer/kv_connector/factory.py",
    "config/kv_transfer.py",
    "v1/kv_offload/*.py",
    "v1/kv_offload/cpu/**/*.py",
    "v1/kv_offload/tiering/*.py",
)
#: Reads of an extra config: ``extra_config.get("key"``, ``extra_config["key"]``,
#: ``get_from_extra_config("key"`` (across a line break too).
READ = re.compile(
    r"""(?:extra_config\s*(?:\.get\(|\[)|get_from_extra_config\()\s*["']([A-Za-z0-9_]+)["']"""
)
#: Keys those files read that are not an offloading connector's: MultiConnector's list
#: of connectors (config/kv_transfer.py reads it only for kv_connector MultiConnector).
NOT_OFFLOADING = {"connectors"}

PROMPT = list(range(1, 129))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def vllm_reads() -> dict[str, set[str]]:
    """Each key vLLM's offloading path reads from the extra config, and the files."""
    root = Path(vllm.__file__).parent
    found: dict[str, set[str]] = {}
    for pattern in VLLM_SOURCES:
        files = sorted(root.glob(pattern))
        assert files, f"vLLM has no {pattern}: its layout changed, look again"
        for path in files:
            for key in READ.findall(path.read_text(encoding="utf-8")):
                found.setdefault(key, set()).add(str(path.relative_to(root)))
    return {key: files for key, files in found.items() if key not in NOT_OFFLOADING}


def vllm_spec_config(engine: Engine) -> Any:
    """The ``OffloadingConfig`` vLLM's connector built for ``engine``'s spec."""
    return build_offloading_config(engine.vllm_config, engine.kv_cache_config)


def test_vllms_own_keys_are_the_ones_its_sources_read() -> None:
    reads = vllm_reads()
    assert set(reads) == set(VLLM_EXTRA_KEYS), {
        "read by vLLM, not listed": {k: reads[k] for k in set(reads) - set(VLLM_EXTRA_KEYS)},
        "listed, not read by vLLM": set(VLLM_EXTRA_KEYS) - set(reads),
    }
    assert len(VLLM_EXTRA_KEYS) == len(set(VLLM_EXTRA_KEYS))
    # The comment beside each key names a file that reads it.
    source = Path(__file__).parents[2].joinpath("tiering", "extra_config.py").read_text()
    for key in VLLM_EXTRA_KEYS:
        [line] = [line for line in source.splitlines() if line.strip().startswith(f'"{key}",')]
        named = re.findall(r"[\w./]+\.py", line)
        assert named, line
        for name in named:
            tail = name.split(".../")[-1]  # "distributed/.../offloading/config.py"
            assert any(file.endswith(tail) for file in reads[key]), (key, line)


def test_every_vllm_key_is_typed_by_tiering_spec_keys() -> None:
    assert set(VLLM_EXTRA_KEYS) <= set(TieringSpecKeys.__struct_fields__)


def refusal(model: Path, **extra: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build_engine(model, tiering_extra(64 << 20, **extra))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # vLLM cuts 2.7 to 2 (int()); TieringSpec refuses it
        ({"blocks_per_chunk": 2.7}, "['blocks_per_chunk'] must be a positive integer, got 2.7"),
        # vLLM takes the string "false" for true (bool()): the wrong type, said as such
        (
            {"canonical_layout": "false"},
            "['canonical_layout'] must be true or false, got 'false' of type str",
        ),
        (
            {"offload_prompt_only": "no"},
            "['offload_prompt_only'] must be true or false, got 'no' of type str",
        ),
        (
            {"self_describing_kv_events": 1},
            "['self_describing_kv_events'] must be true or false, got 1 of type int",
        ),
        (
            {"evicton_policy": "lru"},
            "unknown key(s) 'evicton_policy'; did you mean 'eviction_policy'?",
        ),
        ({"transfer_backnd": "cpu"}, "did you mean 'transfer_backend'?"),
        ({"hint_share": 1.5}, "['hint_share'] must be a fraction from 0 to 1, got 1.5"),
        ({"hint_share": "0.5"}, "['hint_share'] must be a fraction from 0 to 1"),
        ({"metrics_host": "0.0.0.0"}, "['metrics_host'] is '0.0.0.0' but metrics_port is not set"),
        ({"metrics_port": 9100.5}, "['metrics_port'] must be a port from 0 to 65535"),
        ({"sync_load_budget_bytes": "lots"}, "['sync_load_budget_bytes'] must be a non-negative"),
        ({"store_threshold": "2"}, "['store_threshold']='2': TieringSpec stores every chunk"),
        ({"secondary_tiers": {"type": "x"}}, "['secondary_tiers'] must be a list"),
        ({"cpu_bytes_to_use": 0.5}, "['cpu_bytes_to_use'] must be a positive number of bytes"),
        ({"cpu_bytes_to_use": 1e30}, "['cpu_bytes_to_use'] must be a positive number of bytes"),
        (
            {"eviction_policy": "DSLRUCachePolicy"},
            "a policy class of vLLM's CPUOffloadingSpec; TieringSpec takes tiering's names: "
            "write 'dslru'",
        ),
    ],
)
def test_a_bad_key_is_one_line_naming_it_through_vllms_connector(model, extra, message):
    assert message in refusal(model, **extra)
    assert refusal(model, **extra).startswith("kv_connector_extra_config")


def test_vllm_refuses_a_word_for_blocks_per_chunk_first_and_tiering_spec_names_the_key(model):
    # vLLM's own build_offloading_config reads blocks_per_chunk with int() before any spec
    # is built: its ValueError, not tiering's, is what the operator sees there.
    with pytest.raises(ValueError, match="invalid literal for int"):
        build_engine(model, tiering_extra(64 << 20, blocks_per_chunk="two"))
    # TieringSpec itself, handed the same keys, names the key.
    config = vllm_spec_config(build_engine(model, tiering_extra(64 << 20)))
    config = dataclasses.replace(
        config, extra_config={**config.extra_config, "blocks_per_chunk": "two"}
    )
    with pytest.raises(ConfigError) as info:
        OffloadingSpecFactory.create_spec(config)
    assert str(info.value) == (
        "kv_connector_extra_config['blocks_per_chunk'] must be a positive integer, "
        "got 'two' of type str"
    )


def test_vllms_own_keys_pass_as_vllm_reads_them(model):
    extra = tiering_extra(
        str(64 << 20),  # vLLM's int() takes a string of digits
        blocks_per_chunk="2",
        offload_prompt_only=False,
        self_describing_kv_events=True,
        sync_load_budget_bytes=0,
        store_threshold=1,
        canonical_layout=False,
        eviction_policy="LRU",
    )
    engine = build_engine(model, extra)
    spec = OffloadingSpecFactory.create_spec(vllm_spec_config(engine))
    assert isinstance(spec, TieringSpec)
    assert spec.blocks_per_chunk == 2  # as vLLM read it
    assert (spec.keys.cpu_bytes, spec.policy) == (64 << 20, "lru")
    assert spec.offload_prompt_only is False
    engine.add(PROMPT)
    engine.run()
    assert engine.manager.tier.statistics().ready == 4  # 8 blocks of 16 tokens, 2 a chunk


def test_hint_share_sets_the_share_of_the_cpu_tier_retention_hints_may_protect(model):
    engine = build_engine(model, tiering_extra(64 << 20, hint_share=0.5))
    hints = engine.manager.tier.hints.statistics()
    assert hints.retained_limit == engine.manager.tier.statistics().capacity // 2
    default = build_engine(model, tiering_extra(64 << 20)).manager.tier
    assert default.hints.statistics().retained_limit == int(0.2 * default.statistics().capacity)


def test_cpu_bytes_as_vllms_kv_offloading_size_writes_them_pass(model):
    # `vllm serve --kv-offloading-size 0.0625` (GiB): vLLM's own VllmConfig writes
    # cpu_bytes_to_use as a float, which its spec cuts with int(); so does TieringSpec.
    extra = {"spec_name": "TieringSpec", "spec_module_path": "tiering.integrations.vllm"}
    config = build_vllm_config(model, extra)
    config.cache_config.kv_offloading_size = 0.0625
    config._post_init_kv_transfer_config()
    written = config.kv_transfer_config.kv_connector_extra_config
    assert written["cpu_bytes_to_use"] == 64.0 * (1 << 20)
    assert isinstance(written["cpu_bytes_to_use"], float)
    engine = build_engine(model, written)
    spec = OffloadingSpecFactory.create_spec(vllm_spec_config(engine))
    assert spec.keys.cpu_bytes == 64 << 20
    assert spec_keys({"cpu_bytes_to_use": 1.3 * (1 << 30)}).cpu_bytes == 1395864371  # int()
    engine.add(PROMPT)
    engine.run()
    assert engine.manager.tier.statistics().ready == 8
    engine.scheduler.shutdown()


#: vLLM's keys that only another of its specs reads, with a value each would take.
OTHER_SPECS_KEYS = {
    "cache_policy_module_path": "tiering.integrations.vllm",
    "max_tracker_size": 64000,
    "tier_poll_interval_s": 0.01,
    "backpressure": {"max_inflight": 8},
}


def test_vllms_keys_only_another_spec_reads_pass_with_one_warning_in_vllms_log(model):
    # vLLM's own keys pass untouched (issue 28), but under TieringSpec these do nothing:
    # the operator reads so once in vLLM's log, from the scheduler's side.
    with vllm_logging() as log:
        engine = build_engine(model, tiering_extra(64 << 20, **OTHER_SPECS_KEYS))
        engine.add(PROMPT)
        engine.run()
        engine.scheduler.shutdown()
    warnings = log.lines("WARNING", "not by TieringSpec")
    assert [line.file for line in warnings] == ["spec.py"] * len(OTHER_SPECS_KEYS)
    for key, line in zip(OTHER_SPECS_KEYS, warnings, strict=True):
        assert line.message.startswith(f"kv_connector_extra_config[{key!r}]=")
        assert "it does nothing here" in line.message
    assert "vLLM's TieringOffloadingSpec" in warnings[-1].message
    # Each worker's spec reads them too, and says nothing more.
    spec = OffloadingSpecFactory.create_spec(vllm_spec_config(engine))
    assert len(spec.keys.unread) == len(OTHER_SPECS_KEYS)


REDIS = {"type": "RedisSecondaryTier", "url": "redis://127.0.0.1:1/0"}
DISK = {"type": "DiskSecondaryTier", "capacity_bytes": 1 << 20}


@pytest.mark.parametrize(
    ("entry", "meant"),
    [
        ({**REDIS, "namspace": "a"}, "namespace"),
        ({**REDIS, "timeout": 2}, "timeout_s"),
        ({**DISK, "capacty_bytes": 1}, "capacity_bytes"),
    ],
)
def test_a_tier_entrys_misspelt_key_is_refused_with_the_key_it_misspells(
    model, tmp_path, entry, meant
):
    if entry["type"] == "DiskSecondaryTier":
        entry = {**entry, "path": str(tmp_path / "disk")}
    entry = {**entry, "module_path": "tiering.integrations.vllm"}
    message = refusal(model, secondary_tiers=[entry])
    assert f"did you mean {meant!r}?" in message


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"timeout_s": -1}, "timeout_s must be a positive number of seconds, got -1"),
        ({"connect_timeout_s": 0}, "connect_timeout_s must be a positive number of seconds"),
        ({"ttl_s": -1}, "ttl_s must be None or at least 0.001 seconds"),
    ],
)
def test_a_redis_entrys_durations_are_refused_at_start_not_once_a_worker_builds_it(
    model, bad, says
):
    """Under TieringSpec the tiers are built once the workers share their rows: a duration
    the tier would refuse then is refused when vLLM builds the spec."""
    entry = {**REDIS, **bad, "module_path": "tiering.integrations.vllm"}
    assert says in refusal(model, secondary_tiers=[entry])


def test_the_known_keys_are_named_in_an_unknown_keys_refusal() -> None:
    with pytest.raises(ConfigError) as info:
        spec_keys({"cpu_bytes_to_use": 1, "evictionpolicy": "lru"})
    message = str(info.value)
    for key in ("eviction_policy", "transfer_backend", "metrics_port", *VLLM_EXTRA_KEYS):
        assert key in message


def test_the_readmes_key_table_names_every_key_tiering_spec_reads() -> None:
    readme = Path(__file__).parents[2].joinpath("README.md").read_text(encoding="utf-8")
    section = readme.split("`TieringSpec`'s `kv_connector_extra_config` keys, decoded strictly")[1]
    rows = [line for line in section.splitlines()[:40] if line.startswith("| `")]
    named = {key for row in rows for key in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    others = set(OTHER_SPECS_KEYS)  # named in the prose above the table: they do nothing
    assert named == set(TieringSpecKeys.__struct_fields__) - others
    for key in others:
        assert f"`{key}`" in section.split("| key |")[0]


def test_an_unknown_tier_type_under_vllms_own_spec_is_one_config_error() -> None:
    """vLLM's tier factory asks the module for the entry's ``type``: a misspelling is a
    `ConfigError` naming the tiers there are, not a bare ``AttributeError``."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    with pytest.raises(ConfigError, match=r"its secondary tiers .* are DiskSecondaryTier, Redis"):
        SecondaryTierFactory.get_tier_class(
            {"type": "DiskSecondaryTeir", "module_path": "tiering.integrations.vllm"}
        )


def test_one_folder_for_two_disk_tiers_is_refused_at_start(model, tmp_path) -> None:
    disk = {**DISK, "path": str(tmp_path / "disk"), "module_path": "tiering.integrations.vllm"}
    again = {**disk, "path": str(tmp_path / "." / "disk")}
    message = refusal(model, secondary_tiers=[disk, again])
    assert "[1] and [0] are disk tiers of one folder" in message
