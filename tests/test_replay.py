"""`tiering replay`: the whole engine over a workload, moving real bytes."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from tiering.cli import main
from tiering.errors import CapacityError
from tiering.policies import DEFAULT_POLICY, POLICY_NAMES
from tiering.replay import ReplayOptions, replay
from tiering.sim import simulate
from tiering.transfer.mock import MockJob
from tiering.workload import chat_workload, read_trace, write_trace

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


def test_cli_table_has_decimal_units_a_legend_and_says_how_it_compares_with_simulate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["replay", "--workload", "chat", "--requests", "80", "--cpu-bytes", "4000000",
                 "--bytes-per-token", "16", "--concurrency", "3"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0]: line for line in lines}
    assert "MiB" not in "\n".join(lines)
    assert "GiB" not in "\n".join(lines)
    assert rows["CPU tier"].endswith(
        f" 488 chunks, 4.00 MB, {DEFAULT_POLICY}"
    )  # of 8,192 bytes each
    assert "80 requests of the chat workload, 3 at once" in rows["requests"]
    compare, legend = lines[-2:]
    assert compare.startswith("3 requests at once: ")
    assert "`tiering simulate --requests 80`" in compare
    assert legend.startswith("block: 512 tokens of KV, 8.19 kB, one a chunk; hit rate: ")
    assert "1 GB = 10^9 bytes" in legend


def test_cli_one_at_a_time_says_it_hits_as_simulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, chat_workload(40, seed=2))
    assert main(["replay", "--trace", str(trace), "--cpu-bytes", "4000000",
                 "--bytes-per-token", "16", "--concurrency", "1"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("  ")[-1].startswith("all 40 requests of t.jsonl, 1 at once")
    assert lines[-2].startswith("one request at a time: the hit rate is `tiering simulate`'s")


def test_a_kv_cache_larger_than_memory_is_refused_before_it_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tiering.replay

    requests = chat_workload(20, seed=1)
    longest = max(len(r.hash_ids) for r in requests)
    kv_bytes = 2 * longest * 16 * 512
    monkeypatch.setattr(tiering.replay, "available_host_bytes", lambda: kv_bytes - 1)

    def no_allocation(*args: object, **kwargs: object) -> None:
        raise AssertionError("allocated")

    monkeypatch.setattr(tiering.replay.torch, "zeros", no_allocation)
    options = ReplayOptions(capacity_tokens=51200, bytes_per_token=16, concurrency=2)
    with pytest.raises(CapacityError, match=f"concurrency 2 x {longest} blocks"):
        anyio.run(replay, requests, options)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--capacity-tokens", "100"], "100 tokens"),
        (["--cpu-bytes", "10"], "holds no chunk"),
        (["--bytes-per-token", "3", "--block-tokens", "3"], "multiple of 8"),
        (["--concurrency", "0"], "0"),
        (["--policy", "mru"], "mru"),
        (["--capacity-tokens", "1000", "--cpu-bytes", "1000"], "not allowed with"),
        (["--concurrency", "1000000"], "concurrency 1,000,000 x "),
        (["--bytes-per-token", "1000000000000"], "lower concurrency or bytes-per-token"),
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
