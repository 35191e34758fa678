"""What the operator reads in vLLM's log about the lower tiers under ``TieringOffloadingSpec``.

Logging is configured as ``vllm serve`` configures it (`vllm_log.vllm_logging`),
and the assertions read what vLLM's handler printed: one WARNING per tier that
cannot be reached or used, with the reason and what to check; one line per
change of a tier's state, never one per call; losses at most once an interval,
with counts.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiering.integrations.vllm.polled import LossReport
from tiering.integrations.vllm.tier_report import TierReport
from tiering.secondary.base import TierCounters

from ..secondary import conftest as secondary
from ..secondary.conftest import ACL_USER, free_port
from . import test_tp as tp_tests
from .harness import Engine, disk_entry, redis_entry
from .test_disk_tier import disk_tier
from .test_disk_tier import make_engine as make_disk_engine
from .test_redis_tier import make_engine
from .test_redis_tier import model as model  # a fixture
from .vllm_log import VllmLog, vllm_logging

redis_server = secondary.redis_server
own_redis_server = secondary.own_redis_server
redis_acl_server = secondary.redis_acl_server
redis_tls_server = secondary.redis_tls_server


def prompts(start: int, n: int) -> list[list[int]]:
    return [list(range(start + 1000 * i, start + 1000 * i + 256)) for i in range(n)]


def run(engine: Engine, *batch: list[int]) -> None:
    for prompt in batch:
        engine.add(prompt)
        engine.run()


def tiering_warnings(log: VllmLog) -> list[str]:
    """The WARNING lines of tiering's loggers (vLLM's own say other things)."""
    return [
        line.message
        for line in log.lines("WARNING")
        if line.file in {"tier.py", "polled.py", "shell.py", "redis_tier.py", "disk_tier.py"}
    ]


def settle(engine: Engine) -> None:
    tier = engine.manager.secondary_tiers[0]
    assert tier.wait_idle(10)
    engine.run()


@pytest.mark.parametrize("cause", ["refused", "unresolved", "password", "tls"])
def test_a_redis_tier_that_cannot_be_reached_is_one_warning_with_why_and_what_to_check(
    model, redis_acl_server, redis_tls_server, tmp_path, cause
):
    port = free_port()
    options: dict[str, Any] = {"backoff_s": [0.01, 0.02], "timeout_s": 1.0}
    if cause == "refused":
        url, why, check = f"redis://127.0.0.1:{port}/0", "refused", "server runs and listens"
    elif cause == "unresolved":
        url, why, check = "redis://no-such-host.invalid:6379/0", "", "does not resolve"
    elif cause == "password":
        (tmp_path / "pw").write_text("not-the-password\n")
        tmp_path.joinpath("pw").chmod(0o600)
        options["password_file"] = str(tmp_path / "pw")
        url = f"redis://{ACL_USER}@127.0.0.1:{redis_acl_server.port}/0"
        why, check = "password", "check the user and password"
    else:  # rediss:// to a port that speaks plain TCP
        url = f"rediss://127.0.0.1:{redis_tls_server.port}/0?ssl_ca_certs={redis_tls_server.ca}"
        why, check = "TLS handshake", "use redis://"
    with vllm_logging() as log:
        engine = make_engine(model, url, **options)
        try:
            for batch in range(3):  # lookups and stores while down: each answered without I/O
                run(engine, *prompts(10_000 * (batch + 1), 2))
                time.sleep(0.05)  # past the backoff: probes go, and fail, quietly
            settle(engine)
        finally:
            engine.manager.shutdown()
    down = [m for m in tiering_warnings(log) if "is down" in m]
    assert len(down) == 1, log.text
    assert why in down[0], down[0]
    assert check in down[0], down[0]
    assert "cannot reach the Redis tier" not in down[0]  # the tier and its URL said once
    assert "not-the-password" not in log.text
    assert [m for m in tiering_warnings(log) if "answers again" in m] == []


def test_a_redis_tier_going_down_and_back_is_one_line_each_and_losses_are_counted(
    model, own_redis_server
):
    with vllm_logging() as log:
        engine = make_engine(model, own_redis_server.url, backoff_s=[0.01, 0.05], timeout_s=1.0)
        tier = engine.manager.secondary_tiers[0]
        tier.loss_report_s = 3600.0  # one report, then none within the test
        try:
            run(engine, *prompts(1000, 1))
            settle(engine)
            assert tier.statistics().redis.writes_total == 16
            own_redis_server.kill()
            for batch in range(3):
                run(engine, *prompts(20_000 * (batch + 1), 2))
                time.sleep(0.06)
            settle(engine)
            lost_lines = [m for m in tiering_warnings(log) if "lost, since" in m]
            assert len(lost_lines) == 1, log.text  # at most one an interval
            tier.loss_report_s = 0.0  # the interval has passed: the next loss is said
            run(engine, *prompts(90_000, 1))
            settle(engine)
            lost_lines = [m for m in tiering_warnings(log) if "lost, since" in m]
            assert len(lost_lines) >= 2, log.text
            said = sum(
                int(n.replace(",", ""))
                for line in lost_lines
                for n in re.findall(r"([\d,]+) chunks not written", line)
            )
            assert said == sum(tier.statistics().redis.write_errors_by_reason.values())

            own_redis_server.start()
            deadline = time.monotonic() + 15
            while tier.statistics().redis.state != "up":
                assert time.monotonic() < deadline, repr(tier)
                run(engine, *prompts(200_000 + int(time.monotonic() * 1000) % 100_000, 1))
                time.sleep(0.05)
            settle(engine)
        finally:
            engine.manager.shutdown()
    warnings = tiering_warnings(log)
    assert len([m for m in warnings if "is down" in m]) == 1, log.text
    assert len([m for m in warnings if "answers again" in m]) == 1, log.text
    for line in log.lines("WARNING"):  # vLLM's format, the file of the tier that said it
        if "is down" in line.message or "answers again" in line.message:
            assert line.file == "tier.py"


def test_a_disk_folder_that_cannot_be_used_is_one_warning_with_why_and_what_to_check(
    model, tmp_path
):
    folder = tmp_path / "cache"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with vllm_logging() as log:
        first = make_disk_engine(model, folder)
        second = make_disk_engine(model, folder)  # the same folder: the first one's
        third = make_disk_engine(model, blocker)
        try:
            run(second, *prompts(1000, 2))
            run(third, *prompts(1000, 2))
            settle(second)
            settle(third)
        finally:
            for engine in (third, second, first):
                engine.manager.shutdown()
    unusable = [m for m in tiering_warnings(log) if "cannot be used" in m]
    assert len(unusable) == 2, log.text
    in_use, a_file = sorted(unusable, key=lambda m: str(blocker) in m)
    assert "in use by" in in_use
    assert str(folder) in in_use
    assert "is a file" in a_file
    for message in unusable:
        assert "Check that the folder" in message
        assert "lookups miss" in message


def test_a_tier_raising_the_same_error_at_every_call_is_one_line_and_every_call_counted(
    model, tmp_path
):
    """A bug in a tier (a call that raises) hit at every step is said once, with its
    traceback; a different error is said again; each failed call is counted."""
    raised: list[Exception] = []

    async def contains(keys: list[Any]) -> list[bool]:
        raise raised[-1]

    with vllm_logging() as log:
        engine = make_disk_engine(model, tmp_path / "cache")
        tier = disk_tier(engine)
        try:
            run(engine, *prompts(1000, 1))
            settle(engine)
            tier._tier.contains = contains  # type: ignore[union-attr, method-assign]
            raised.append(RuntimeError("a bug in the tier's lookup"))
            for start in (10_000, 20_000, 30_000):
                run(engine, *prompts(start, 2))
                settle(engine)
            same = tier.statistics().unexpected_errors
            raised.append(KeyError("another bug"))
            run(engine, *prompts(40_000, 2))
            settle(engine)
            statistics = tier.statistics()
        finally:
            engine.manager.shutdown()
    assert same >= 3  # every lookup that raised, counted
    assert statistics.unexpected_errors > same
    assert statistics.last_unexpected_error == "KeyError: 'another bug'"
    said = [line for line in log.records if "failed unexpectedly" in line.message]
    assert len(said) == 2, log.text
    assert "Traceback" in log.text
    assert log.text.count("a bug in the tier's lookup") == 1, log.text  # with its traceback
    assert "another bug" in log.text


def test_losses_are_said_once_an_interval_with_the_counts_since_the_last():
    report = LossReport(interval_s=60.0)
    assert report.take({"not written (down)": 0}, now=0.0) is None  # nothing lost
    assert report.take({"not written (down)": 3}, now=1.0) == {"not written (down)": 3}
    assert report.take({"not written (down)": 9}, now=30.0) is None  # within the minute
    grown = report.take({"not written (down)": 9, "rejected (bad checksum)": 1}, now=61.0)
    assert grown == {"not written (down)": 6, "rejected (bad checksum)": 1}
    assert report.take({"not written (down)": 9, "rejected (bad checksum)": 1}, 500.0) is None


def test_the_lines_are_in_vllms_format_and_not_printed_twice(model, tmp_path: Path):
    with vllm_logging() as log:
        engine = make_disk_engine(model, tmp_path / "cache")
        try:
            run(engine, *prompts(1000, 1))
            settle(engine)
        finally:
            engine.manager.shutdown()
    ours = [line for line in log.records if "disk secondary tier" in line.message]
    assert [line.file for line in ours] == ["disk_tier.py", "disk_tier.py"], log.text
    assert len({line.text for line in log.records}) == len(log.records)


def test_a_disk_folder_removed_under_the_server_is_one_line_down_and_one_back(model, tmp_path):
    folder = tmp_path / "cache"
    with vllm_logging() as log:
        engine = make_disk_engine(model, folder, backoff_s=[0.01, 0.02])
        tier = engine.manager.secondary_tiers[0]
        try:
            run(engine, *prompts(1000, 1))
            settle(engine)
            shutil.rmtree(folder)  # an operator's cleanup, or a disk swapped
            for batch in range(4):
                assert engine.scheduler.reset_prefix_cache()
                run(engine, *prompts(1000, 1), *prompts(50_000 + 1000 * batch, 1))
                time.sleep(0.03)  # past the backoff: the next call makes the folder again
            settle(engine)
            assert tier.statistics().disk.state == "up"
        finally:
            engine.manager.shutdown()
    warnings = tiering_warnings(log)
    assert len([m for m in warnings if "is down" in m]) == 1, log.text
    assert len([m for m in warnings if "answers again" in m]) == 1, log.text
    assert len([m for m in warnings if "made again" in m]) == 1, log.text


def test_a_reason_both_the_tier_and_the_adapter_count_is_said_as_their_sum():
    counters = TierCounters()
    counters.write_errors_by_reason["down"] = 5  # the tier answered 5 writes without I/O
    report = TierReport("vllm:kv_offload_redis_", counters.snapshot("redis", "down"))
    # ... and the adapter dropped 3 more chunks for the same reason before they reached it
    line = report.lost(counters.snapshot("redis", "down"), {"down": 3}, at=0.0)
    assert line == "8 chunks not written (down)"


@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_at_tp_2_a_change_of_a_tiers_state_is_one_line_not_one_per_rank(
    model, own_redis_server, tmp_path, kind
):
    """Each rank has its own adapter over its own connection or folder; the log says each
    change once (rank 0's), while each rank's statistics keep its own state."""
    if kind == "redis":
        entry = redis_entry(
            own_redis_server.url, namespace="tp2-logs", backoff_s=[0.01, 0.05], timeout_s=1.0
        )
    else:
        entry = disk_entry(tmp_path / "cache", tp_tests.disk_room(2), backoff_s=[0.01, 0.05])
    with vllm_logging() as log:
        engine = tp_tests.make_engine(model, 2, [entry])
        try:
            tp_tests.run(engine, tp_tests.PROMPT_A)
            tier = engine.manager.link.tiers[0]  # built at the first lookup
            assert all(rank.wait_idle(10) for rank in tier.ranks)
            engine.run()
            if kind == "redis":
                own_redis_server.kill()
            else:
                shutil.rmtree(tmp_path / "cache")
            for i in range(3):  # every rank's tier finds it gone
                tp_tests.run(engine, [7_000_000 + 1000 * i + t for t in range(256)])
                time.sleep(0.06)
            assert all(rank.wait_idle(10) for rank in tier.ranks)
            for rank in tier.statistics():  # each rank's tier saw the store go
                assert getattr(rank, kind).errors_total > 0, rank
        finally:
            tp_tests.close(engine)
    warnings = tiering_warnings(log)
    down = [m for m in warnings if "is down" in m]
    assert len(down) == 1, log.text
    assert len([m for m in warnings if "answers again" in m]) <= 1, log.text  # disk: made again
    assert "rank1" not in down[0], down[0]  # rank 0's folder or connection says it
