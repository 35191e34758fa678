"""`tiering replay`: the whole engine over a workload, moving real bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiering.cli import main
from tiering.policies import POLICY_NAMES
from tiering.replay import ReplayOptions, replay
from tiering.simulate import simulate
from tiering.transfer.mock import MockJob
from tiering.workload import chat_workload, read_trace

pytestmark = pytest.mark.anyio

TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "conversation_trace.jsonl"
)
SMALL = {"bytes_per_token": 16, "block_tokens": 512}  # 8 KiB pages


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_one_at_a_time_it_hits_like_simulate(anyio_backend: str, policy: str) -> None:
    requests = chat_workload(400, seed=11)
    capacity = 80 * 512
    result = await replay(
        requests,
        ReplayOptions(capacity_tokens=capacity, policy=policy, concurrency=1, verify=True, **SMALL),
    )
    expected = simulate(requests, capacity_tokens=capacity, policy=policy)
    assert (result.hit_blocks, result.blocks, result.evictions) == (
        expected.hit_blocks,
        expected.blocks,
        expected.evictions,
    )
    assert result.hit_rate == expected.hit_rate
    assert result.loaded_chunks == result.hit_blocks
    assert (result.corrupt_chunks, result.failed_jobs) == (0, 0)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is absent")
async def test_one_at_a_time_it_hits_like_simulate_on_the_trace(anyio_backend: str) -> None:
    requests = read_trace(TRACE, limit=600)
    result = await replay(
        requests, ReplayOptions(capacity_tokens=300 * 512, concurrency=1, **SMALL)
    )
    assert result.hit_blocks == simulate(requests, capacity_tokens=300 * 512).hit_blocks


async def test_many_concurrent_requests_load_back_exact_bytes(anyio_backend: str) -> None:
    result = await replay(
        chat_workload(500, seed=2),
        ReplayOptions(capacity_tokens=150 * 512, concurrency=16, verify=True, **SMALL),
    )
    assert result.backend == "cpu"
    assert result.loaded_chunks > 100
    assert result.evictions > 0
    assert (result.corrupt_chunks, result.failed_jobs) == (0, 0)
    assert result.store_bytes == result.stored_chunks * 8192
    assert result.job_latency_p99_ms >= result.job_latency_p50_ms > 0


async def test_verify_finds_bytes_that_did_not_land(anyio_backend: str) -> None:
    # A backend that moves nothing: loads leave the blocks as the last request left them.
    result = await replay(
        chat_workload(200, seed=4),
        ReplayOptions(
            capacity_tokens=200 * 512, concurrency=2, verify=True, backend="mock", **SMALL
        ),
        backend_options={"copy": False},
    )
    assert result.loaded_chunks > 0
    assert result.corrupt_chunks == result.loaded_chunks  # every one, even a same-key block


async def test_failed_transfers_are_counted_and_the_replay_goes_on(anyio_backend: str) -> None:
    def every_fifth(job: MockJob) -> bool:
        return job.job_id % 5 == 0

    result = await replay(
        chat_workload(300, seed=6),
        ReplayOptions(
            capacity_tokens=100 * 512, concurrency=4, verify=True, backend="mock", **SMALL
        ),
        backend_options={"fail": every_fifth},
    )
    assert result.failed_jobs > 0
    assert result.requests == 300
    assert result.corrupt_chunks == 0  # failed loads are not checked; landed ones are exact


def test_cli_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--workload", "chat", "--requests", "150", "--capacity-tokens", "51200",
            "--bytes-per-token", "16", "--verify", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    for field in ("requests", "blocks", "hit_blocks", "hit_rate", "stored_chunks",
                  "loaded_chunks", "evictions", "store_bytes", "load_bytes", "store_gbps",
                  "load_gbps", "failed_jobs", "corrupt_chunks", "job_latency_p50_ms",
                  "job_latency_p99_ms", "seconds"):  # fmt: skip
        assert field in summary, field
    assert summary["requests"] == 150
    assert summary["corrupt_chunks"] == 0


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--workload", "chat", "--requests", "80", "--cpu-bytes", "4000000",
                 "--bytes-per-token", "16"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "hit rate" in out
    assert "not checked (--verify)" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--capacity-tokens", "100"], "100 tokens"),
        (["--cpu-bytes", "10"], "holds no chunk"),
        (["--bytes-per-token", "3", "--block-tokens", "3"], "multiple of 8"),
        (["--concurrency", "0"], "0"),
        (["--policy", "mru"], "mru"),
        (["--capacity-tokens", "1000", "--cpu-bytes", "1000"], "not allowed with"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "--workload", "chat", "--requests", "5", *argv])
    assert info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tiering")]
    assert len(err) == 1
    assert expected in err[0]
