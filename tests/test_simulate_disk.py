"""`tiering simulate` with a disk tier below the CPU tier (``disk_tokens``, ``--disk-tokens``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.cli import main
from tiering.errors import CapacityError, ConfigError
from tiering.policies import POLICY_NAMES
from tiering.sim import OPTIMAL, requests_to_keys, simulate, simulate_keys
from tiering.workload import Request, chat_workload, documents_workload

BLOCK = 512


def ids_to_keys(*requests: list[int]) -> list[list[OffloadKey]]:
    return [[make_offload_key(i.to_bytes(8, "big")) for i in ids] for ids in requests]


def distinct_chunks(keys: list[list[OffloadKey]]) -> int:
    return len({key for request in keys for key in request})


# The one-tier results of the code before the disk tier (blocks, hit blocks,
# evictions, store failures of 600 requests, seed 4, at 60 chunks): a disk tier left out
# must change nothing.
ONE_TIER = {
    ("chat", "lru"): (5544, 1951, 3533, 0),
    ("chat", "arc"): (5544, 2468, 3016, 0),
    ("chat", "aslru"): (5544, 2433, 3051, 0),
    ("chat", OPTIMAL): (5544, 2855, 2629, 0),
    ("documents", "lru"): (16960, 3527, 13129, 4),
    ("documents", "arc"): (16960, 3499, 13074, 4),
    ("documents", "aslru"): (16960, 3670, 12986, 4),
    ("documents", OPTIMAL): (16960, 5035, 11621, 4),
}
WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "chat": chat_workload,
    "documents": documents_workload,
}


@pytest.mark.parametrize(("workload", "policy"), sorted(ONE_TIER))
def test_without_a_disk_tier_nothing_changes(workload: str, policy: str) -> None:
    r = simulate(WORKLOADS[workload](600, seed=4), capacity_tokens=60 * BLOCK, policy=policy,
                 disk_tokens=None)  # fmt: skip
    assert (r.blocks, r.hit_blocks, r.evictions, r.store_failures) == ONE_TIER[workload, policy]
    assert r.hit_blocks_by_tier == {"cpu": r.hit_blocks}
    assert (r.disk_tokens, r.disk_capacity_chunks, r.disk_evictions) == (None, 0, 0)
    assert (r.disk_writes_failed, r.disk_writes_dropped) == (0, 0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("workload", ["chat", "documents"])
def test_a_disk_holding_everything_hits_every_repeat(workload: str, policy: str) -> None:
    # A CPU tier of twice the longest request (so no promotion or write-through
    # is ever too big for it) over a disk that never evicts: every chunk seen
    # before hits, from one tier or the other, as in an unbounded CPU tier.
    requests = WORKLOADS[workload](300, seed=3)
    keys = requests_to_keys(requests)
    cpu = 2 * max(map(len, keys)) * BLOCK
    everything = (distinct_chunks(keys) + 1) * BLOCK
    assert cpu < everything // 4
    unbounded = simulate_keys(keys, capacity_tokens=everything, policy=policy)
    r = simulate_keys(keys, capacity_tokens=cpu, policy=policy, disk_tokens=everything)
    assert r.disk_evictions == r.disk_writes_failed == r.disk_writes_dropped == 0
    if policy == "lru":  # a chunk the CPU tier holds follows one it holds: one run to promote
        assert r.hit_blocks == unbounded.hit_blocks
    else:  # a run can end at a chunk the CPU tier kept, and what follows it recomputes
        assert 0.99 * unbounded.hit_blocks <= r.hit_blocks <= unbounded.hit_blocks
    assert r.hit_blocks_by_tier["disk"] > 0
    assert r.hit_blocks_by_tier["cpu"] + r.hit_blocks_by_tier["disk"] == r.hit_blocks
    one_tier = simulate_keys(keys, capacity_tokens=cpu, policy=policy)
    assert r.hit_blocks > one_tier.hit_blocks


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_hits_by_tier_add_up_and_more_disk_never_hits_less(policy: str) -> None:
    # From the CPU tier's size up. A smaller disk can hit a little more than a
    # slightly bigger one: what reaches a disk depends on what it held, so the
    # inclusion of LRU's stack does not hold from one size to the next.
    keys = requests_to_keys(documents_workload(400, seed=2))
    cpu = 60
    hits = []
    for chunks in (cpu, 2 * cpu, 4 * cpu, 8 * cpu, 32 * cpu):
        r = simulate_keys(keys, capacity_tokens=cpu * BLOCK, policy=policy,
                          disk_tokens=chunks * BLOCK)  # fmt: skip
        assert (r.disk_tokens, r.disk_capacity_chunks) == (chunks * BLOCK, chunks)
        assert set(r.hit_blocks_by_tier) == {"cpu", "disk"}
        assert sum(r.hit_blocks_by_tier.values()) == r.hit_blocks
        assert r.hit_rate == r.hit_blocks / r.blocks
        hits.append(r.hit_blocks)
    assert hits == sorted(hits)
    assert hits[0] < hits[-1]


def test_a_promoted_run_that_finds_no_room_is_halved() -> None:
    # CPU tier of 8 chunks (write-through of stores of up to 4). Request 3 hits
    # 10-14 in the CPU tier; 1-4 are on the disk, but with 10-14 protected only
    # 3 chunks can be evicted: half the run (1, 2) is promoted, and the store of
    # 3 and 4 then finds no room.
    keys = ids_to_keys([1, 2, 3, 4], list(range(10, 18)), [10, 11, 12, 13, 14, 1, 2, 3, 4])
    r = simulate_keys(keys, capacity_tokens=8 * BLOCK, policy="lru", disk_tokens=100 * BLOCK)
    assert r.hit_blocks_by_tier == {"cpu": 5, "disk": 2}
    assert r.store_failures == 1
    assert r.disk_writes_dropped == 8  # request 2's eight chunks: more than half the CPU tier


def test_hits_go_on_past_the_promoted_run_over_what_the_cpu_tier_holds() -> None:
    # Request 5: chunk 1 is on the disk only, chunk 2 in the CPU tier: 1 is
    # promoted and both hit, one from each tier (as the engine counts them).
    keys = ids_to_keys([1, 2], [2], list(range(20, 27)), [2], [1, 2])
    r = simulate_keys(keys, capacity_tokens=8 * BLOCK, policy="lru", disk_tokens=100 * BLOCK)
    assert r.hit_blocks_by_tier == {"cpu": 3, "disk": 1}
    assert r.hit_blocks == 4


def test_a_write_through_with_no_room_for_all_keeps_the_head_of_the_batch() -> None:
    # A disk of 2 chunks takes only chunk 1 of request 1's three (the head, as
    # DiskTier.write keeps); request 3 gets it back from there, and 2 and 3
    # recompute.
    keys = ids_to_keys([1, 2, 3], list(range(10, 18)), [1, 2, 3])
    r = simulate_keys(keys, capacity_tokens=8 * BLOCK, policy="lru", disk_tokens=2 * BLOCK)
    assert r.hit_blocks_by_tier == {"cpu": 0, "disk": 1}
    assert r.disk_writes_failed == 2
    assert r.disk_writes_dropped == 8
    assert r.disk_evictions == 1  # 1 makes room for 2 and 3


def test_a_disk_of_one_chunk_works_and_counts_the_writes_it_has_no_room_for() -> None:
    keys = requests_to_keys(chat_workload(200, seed=1))
    r = simulate_keys(keys, capacity_tokens=40 * BLOCK, policy="lru", disk_tokens=BLOCK)
    assert r.disk_capacity_chunks == 1
    assert r.disk_writes_failed > 0  # stores of two chunks or more
    assert sum(r.hit_blocks_by_tier.values()) == r.hit_blocks
    one_tier = simulate_keys(keys, capacity_tokens=40 * BLOCK, policy="lru")
    assert r.hit_blocks >= one_tier.hit_blocks


def test_the_disk_tier_can_have_a_policy_of_its_own() -> None:
    keys = requests_to_keys(documents_workload(300, seed=5))
    runs = {
        disk_policy: simulate_keys(keys, capacity_tokens=40 * BLOCK, policy="aslru",
                                   disk_tokens=200 * BLOCK, disk_policy=disk_policy)
        for disk_policy in (None, "aslru", "lru")
    }  # fmt: skip
    assert runs[None].hit_blocks_by_tier == runs["aslru"].hit_blocks_by_tier  # the default
    assert runs["lru"].hit_blocks_by_tier != runs["aslru"].hit_blocks_by_tier


@pytest.mark.parametrize(
    ("kwargs", "error", "expected"),
    [
        ({"disk_tokens": 100}, CapacityError,
         "a disk tier capacity of 100 tokens holds no chunk of 512 tokens; give at least 512"),
        ({"disk_tokens": 0}, CapacityError, "disk tier capacity of 0 tokens"),
        ({"disk_tokens": 5120, "disk_policy": "mru"}, ConfigError, "'mru'; choose one of lru"),
        ({"disk_policy": "lru"}, ConfigError, "give disk_tokens too"),
        ({"disk_tokens": 5120, "policy": OPTIMAL}, ConfigError, "the offline optimum models one"),
        ({"disk_tokens": 5120, "policy": "mru"}, ConfigError, "'mru'"),
    ],
)  # fmt: skip
def test_bad_disk_arguments_say_what_would_be_right(
    kwargs: dict[str, object], error: type[Exception], expected: str
) -> None:
    args: dict[str, object] = {"capacity_tokens": 5120, **kwargs}
    with pytest.raises(error) as info:
        simulate_keys(ids_to_keys([1, 2]), **args)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_a_numpy_disk_capacity_is_taken_as_the_integer_it_holds() -> None:
    # numpy's integers are integers (`tiering._checks.is_int`): the run is the int's,
    # not a refusal of the disk tier's chunk count that the caller never gave.
    import numpy as np

    keys = requests_to_keys(chat_workload(200, seed=3))
    want = simulate_keys(keys, capacity_tokens=20 * BLOCK, disk_tokens=200 * BLOCK)
    got = simulate_keys(keys, capacity_tokens=20 * BLOCK, disk_tokens=np.int64(200 * BLOCK))
    assert type(got.disk_tokens) is int
    assert got.hit_blocks_by_tier == want.hit_blocks_by_tier
    assert got.disk_capacity_chunks == want.disk_capacity_chunks == 200


@pytest.mark.parametrize("policy", ["lru", "aslru"])
async def test_the_engine_over_a_disk_tier_hits_by_tier_as_simulate_predicts(
    anyio_backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    # `tiering replay --disk --concurrency 1`, each promotion waiting for the
    # write-throughs before it (the engine does not wait: simulate's premise),
    # over a disk tier that never evicts: the same hits, from the same tiers.
    from tiering.engine import TieringEngine
    from tiering.replay import ReplayOptions, replay

    promote = TieringEngine.promote

    async def promote_after_writes(self: TieringEngine, keys: Any, start: int = 0) -> Any:
        await self.wait_written_through()
        return await promote(self, keys, start)

    monkeypatch.setattr(TieringEngine, "promote", promote_after_writes)
    requests = documents_workload(150, seed=7)
    options = ReplayOptions(capacity_tokens=40 * BLOCK, policy=policy, concurrency=1,
                            bytes_per_token=16, disk=str(tmp_path), disk_bytes=1 << 30)  # fmt: skip
    result = await replay(requests, options)
    # The replay's disk tier has the default policy, whatever the CPU tier's.
    expected = simulate(requests, capacity_tokens=40 * BLOCK, policy=policy,
                        disk_tokens=10**6 * BLOCK, disk_policy="aslru")  # fmt: skip
    assert expected.hit_blocks_by_tier["disk"] > 0
    assert result.hit_blocks == expected.hit_blocks
    assert result.hit_blocks_by_tier == expected.hit_blocks_by_tier


# -- the command line -----------------------------------------------------------

SIM = ["simulate", "--workload", "chat", "--requests", "150", "--capacity-tokens", "10240"]


def test_cli_table_has_the_tiers_only_with_a_disk(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--policy", "lru"]) == 0
    plain = capsys.readouterr().out
    assert "disk" not in plain.splitlines()[0]
    assert main([*SIM, "--policy", "lru,aslru", "--disk-tokens", "51200,204800"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split("  ")
    columns = [c.strip() for c in header if c.strip()]
    assert columns[:7] == ["policy", "capacity tokens", "chunks", "disk tokens", "hit rate",
                           "cpu hits", "disk hits"]  # fmt: skip
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[3]) for r in rows] == [("lru", "51,200"), ("lru", "204,800"),
                                            ("aslru", "51,200"), ("aslru", "204,800")]  # fmt: skip
    for row in rows:  # hit rate = cpu hits + disk hits (rounded)
        total, cpu, disk = (float(cell.rstrip("%")) for cell in row[4:7])
        assert abs(total - cpu - disk) <= 0.011
    assert lines[6].startswith("150 requests of the chat workload")
    assert "`tiering replay --disk --concurrency 1`" in lines[6]
    assert lines[7].startswith("disk hits: ")
    assert lines[8].startswith("hit rate: blocks found in either tier")


def test_cli_json_rows_carry_the_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--policy", "lru", "--json"]) == 0
    (plain,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert plain["hit_blocks_by_tier"] == {"cpu": plain["hit_blocks"]}
    assert plain["disk_tokens"] is None
    assert main([*SIM, "--policy", "lru,arc", "--disk-tokens", "5120,40960", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r["disk_tokens"]) for r in records] == [
        ("lru", 5120), ("lru", 40960), ("arc", 5120), ("arc", 40960)]  # fmt: skip
    for r in records:
        assert r["disk_capacity_chunks"] == r["disk_tokens"] // 512
        assert set(r["hit_blocks_by_tier"]) == {"cpu", "disk"}
        assert sum(r["hit_blocks_by_tier"].values()) == r["hit_blocks"]
        for field in ("disk_writes_failed", "disk_writes_dropped", "disk_evictions"):
            assert r[field] >= 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--disk-tokens", "100"], "disk tier capacity of 100 tokens"),
        (["--disk-tokens", "51200,100"], "disk tier capacity of 100 tokens"),
        (["--disk-tokens", "0"], "positive integer, got 0"),
        (["--disk-tokens", "1,x"], "'x'"),
        (["--disk-tokens", "51200", "--policy", "optimal"], "the offline optimum models one tier"),
        (["--disk-tokens", "51200", "--policy", "all"], "--policy all includes it"),
    ],
)
def test_cli_bad_disk_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SIM, *extra])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if line.startswith("tiering")]
    assert len(lines) == 1
    assert expected in lines[0]
    assert "Traceback" not in captured.err


def test_cli_progress_names_the_disk(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([*SIM, "--policy", "lru", "--disk-tokens", "51200"]) == 0
    err = capsys.readouterr().err
    assert "lru at 10,240 tokens, disk 51,200 (1/1) [" in err


def test_cli_plot_with_a_disk_draws_the_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "tiers.png"
    assert main(["simulate", "--workload", "chat", "--requests", "120", "--policy", "lru,aslru",
                 "--capacity-tokens", "10240,20480", "--disk-tokens", "20480,81920,327680",
                 "--plot", str(out), "--json"]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
    stdout, err = capsys.readouterr()
    policies = {json.loads(line)["policy"] for line in stdout.splitlines()}
    assert policies == {"lru", "aslru"}  # no optimum: it models one tier
    assert err == f"wrote {out}\n"
