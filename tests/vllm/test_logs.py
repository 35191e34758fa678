"""tiering's log lines in vLLM's log, in vLLM's format (`tiering.integrations.vllm.logs`),
read from what vLLM's own handler printed (`vllm_log.vllm_logging`)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tiering.integrations.vllm.logs import VllmHandlers, adopt_vllm_logging

from .harness import build_engine, tiering_extra, write_model
from .vllm_log import VllmLog, vllm_logging

PROMPT = list(range(1, 129))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def test_the_metrics_url_is_one_info_line_of_vllms_log_and_is_served(model):
    with vllm_logging() as log:
        engine = build_engine(model, tiering_extra(64 << 20, metrics_port=0))
        url = engine.manager.metrics_url
        engine.add(PROMPT)
        engine.run()
        engine.scheduler.shutdown()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url)  # not .../metrics/metrics
    [line] = log.lines(containing="CPU-tier metrics")
    assert (line.level, line.file) == ("INFO", "spec.py")
    assert line.message.endswith(f"are served at {url}")
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d:\d\d", line.time)


def test_metrics_on_every_interface_are_one_warning(model):
    with vllm_logging() as log:
        engine = build_engine(
            model, tiering_extra(64 << 20, metrics_port=0, metrics_host="0.0.0.0")
        )
        engine.scheduler.shutdown()
    [line] = log.lines(containing="served on every interface")
    assert (line.level, line.file) == ("WARNING", "spec.py")
    assert "give metrics_host 127.0.0.1" in line.message


def test_the_metrics_url_is_served_where_it_says(model):
    engine = build_engine(model, tiering_extra(64 << 20, metrics_port=0))
    try:
        with urllib.request.urlopen(engine.manager.metrics_url, timeout=5) as response:
            assert b"tiering_chunks_capacity" in response.read()
    finally:
        engine.scheduler.shutdown()


def test_a_tier_warning_is_one_line_of_vllms_format_on_vllms_stream(model):
    # vLLM's own spec with tiering's Redis tier: the tier warns that the URL holds a
    # password (vLLM logs the config). No server: nothing here connects to it.
    entry = {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "url": "redis://user:s3cret@127.0.0.1:1/0",
    }
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 64 << 20,
        "secondary_tiers": [entry],
    }
    with vllm_logging() as log:
        engine = build_engine(model, extra)
        engine.scheduler.shutdown()
    [line] = log.lines("WARNING", "holds a password")
    assert line.file == "redis_tier.py"
    assert "s3cret" not in log.text


def test_tiering_warnings_are_lost_or_bare_without_it() -> None:
    # What the module is for: under vLLM's configuration alone, a tiering INFO line is
    # dropped and a warning is not printed by vLLM's handler.
    with vllm_logging() as log:
        logging.getLogger("tiering.secondary").warning("bare")
    assert log.text == ""


def test_adopting_is_idempotent_and_never_prints_a_line_twice() -> None:
    with vllm_logging() as log:
        assert adopt_vllm_logging()
        assert adopt_vllm_logging()
        tiering = logging.getLogger("tiering")
        assert [type(h) for h in tiering.handlers] == [VllmHandlers]
        assert tiering.propagate is False
        logging.getLogger().addHandler(logging.NullHandler())  # added later: not used
        logging.getLogger("tiering.secondary.redis").warning("the tier is %s", "down")
        logging.getLogger("tiering.secondary.redis").debug("not at INFO")
    [line] = log.records
    assert (line.level, line.message, line.file) == ("WARNING", "the tier is down", "test_logs.py")


def test_vllms_level_is_followed() -> None:
    with vllm_logging("WARNING") as log:
        assert adopt_vllm_logging()
        logging.getLogger("tiering.x").info("not shown at WARNING")
        logging.getLogger("tiering.x").error("shown")
    assert [line.message for line in log.records] == ["shown"]


@pytest.mark.parametrize("operator", ["tiering", "root"])
def test_a_logger_the_operator_configured_is_left_alone(operator: str) -> None:
    with vllm_logging() as log:
        handler = logging.NullHandler()
        target = logging.getLogger("tiering" if operator == "tiering" else None)
        target.addHandler(handler)
        try:
            assert not adopt_vllm_logging()
            assert logging.getLogger("tiering").propagate
            logging.getLogger("tiering.x").warning("the operator's")
        finally:
            target.removeHandler(handler)
    assert log.text == ""


def test_a_tiering_logger_the_operator_silenced_stays_silent() -> None:
    # A VLLM_LOGGING_CONFIG_PATH file with "tiering": {"propagate": false} and no handler:
    # the operator turned tiering's lines off; building tiering's pieces does not undo it.
    with vllm_logging() as log:
        logging.getLogger("tiering").propagate = False
        assert not adopt_vllm_logging()
        assert logging.getLogger("tiering").handlers == []
        logging.getLogger("tiering.x").warning("silenced")
    assert log.text == ""


def test_nothing_is_adopted_where_vllm_configured_no_logging() -> None:
    vllm_logger = logging.getLogger("vllm")
    saved = list(vllm_logger.handlers)
    for handler in saved:
        vllm_logger.removeHandler(handler)
    try:
        root = logging.getLogger()
        kept = list(root.handlers)
        for handler in kept:
            root.removeHandler(handler)
        try:
            assert not adopt_vllm_logging()  # VLLM_CONFIGURE_LOGGING=0: Python's defaults
        finally:
            for handler in kept:
                root.addHandler(handler)
    finally:
        for handler in saved:
            vllm_logger.addHandler(handler)
    assert not any(isinstance(h, VllmHandlers) for h in logging.getLogger("tiering").handlers)


def test_tierings_policy_under_vllms_own_manager_adopts_vllms_logging_too(model):
    extra = {
        "cpu_bytes_to_use": 64 << 20,
        "eviction_policy": "DSLRUCachePolicy",
        "cache_policy_module_path": "tiering.integrations.vllm",
    }
    with vllm_logging():
        engine = build_engine(model, extra)
        handlers = list(logging.getLogger("tiering").handlers)
        engine.scheduler.shutdown()
    assert [type(h) for h in handlers] == [VllmHandlers]


#: A vLLM worker process as `MultiprocExecutor.worker_main` starts one: tiering imported
#: before vLLM's logging is configured (``configure_logging``), then a piece of tiering
#: built (a cache policy), then tiering's lines.
WORKER = """
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, set_vllm_process_name
from tiering.integrations.vllm.policies import CACHE_POLICIES

configure_logging(LoggingConfig())
set_vllm_process_name("Worker_TP1")
CACHE_POLICIES["DSLRUCachePolicy"](4)
CACHE_POLICIES["LRUCachePolicy"](4)  # adopting again adds nothing
logging.getLogger("tiering.secondary.redis").info("the tier answers again")
logging.getLogger("tiering.secondary.disk").warning("the folder is not writable")
"""


def test_a_worker_process_prints_tierings_lines_once_in_vllms_format(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    env = {**os.environ, "NO_COLOR": "1", "VLLM_CONFIGURE_LOGGING": "1"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    log = VllmLog(io.StringIO(done.stdout))  # every line in vLLM's format
    ours = [line for line in log.records if line.file == "worker.py"]
    assert [(line.process, line.level, line.message) for line in ours] == [
        ("Worker_TP1", "INFO", "the tier answers again"),
        ("Worker_TP1", "WARNING", "the folder is not writable"),
    ]
    assert "the folder is not writable" not in done.stderr  # not also bare (lastResort)
