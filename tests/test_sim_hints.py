"""Retention hints measured, not assumed: the continuation rule, `tiering simulate --hints`
and `tiering replay --hints` (`tiering.workload.hints`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from tiering.cli import main
from tiering.cli.tables import _replay_hints
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError, WorkloadError
from tiering.hints import Hint
from tiering.policies import POLICY_NAMES, create_policy
from tiering.replay import ReplayOptions, _Retention, replay
from tiering.sim import OPTIMAL, requests_to_keys, simulate_keys
from tiering.sim.chain import Chain
from tiering.sim.result import TraceClock
from tiering.workload import Request, chat_workload, documents_workload, write_trace
from tiering.workload.hints import (
    CONTINUATION_RETAIN_S,
    arrival_times_s,
    continuation_delays,
    continuation_hints,
    continues,
    flip_mask,
    workload_hints,
)

from .test_cli import _usage_error

B = 512  # tokens per block
RETAIN = Hint(retain_s=CONTINUATION_RETAIN_S)
RELEASE = Hint(release=True)


def req(ms: int, tokens: int, *ids: int) -> Request:
    return Request(timestamp=ms, input_length=tokens, output_length=1, hash_ids=ids)


# -- the rule ----------------------------------------------------------------------


def test_a_request_continues_when_a_later_prompt_begins_with_all_its_complete_blocks() -> None:
    trace = [
        req(0, 3 * B, 1, 2, 3),  # its three blocks begin request 2
        req(1_000, 2 * B, 1, 5),  # shares only block 1 with any later request
        req(5_000, 4 * B, 1, 2, 3, 4),  # the next turn of request 0; nothing after it
    ]
    assert continues(trace) == [True, False, False]
    assert continuation_delays(trace) == [5.0, None, None]
    assert continuation_hints(trace) == [RETAIN, RELEASE, RELEASE]


def test_only_later_requests_count_and_the_nearest_one_gives_the_delay() -> None:
    trace = [
        req(0, 2 * B, 1, 2),
        req(2_000, 2 * B, 1, 2),  # a repeat: continues request 0 (and is continued by 3)
        req(3_000, 1 * B, 9),
        req(7_500, 3 * B, 1, 2, 3),
    ]
    assert continuation_delays(trace) == [2.0, 5.5, None, None]


def test_a_partial_last_block_is_not_needed_and_no_complete_block_never_continues() -> None:
    trace = [
        req(0, B + 100, 1, 2),  # one complete block (1); block 2 is partial
        req(0, 100, 7),  # no complete block
        req(10, 3 * B, 1, 8, 9),  # begins with block 1, not with the partial 2
        req(20, 2 * B, 7, 10),  # begins with 7, which request 1 never completed
    ]
    assert continues(trace) == [True, False, False, False]


def test_a_head_every_request_shares_continues_a_one_block_request() -> None:
    # The rule's letter (the module's docstring): block 0, a system prompt every later
    # request begins with, continues a one-block request whatever its conversation does.
    trace = [req(0, B + 100, 0, 1), req(10, 2 * B + 100, 0, 2, 3), req(20, B, 0)]
    assert continues(trace) == [True, False, False]  # request 1 needs its block 2 again
    assert continuation_delays(trace) == [0.01, None, None]


def test_a_share_of_the_blocks_continues_a_request_for_documents() -> None:
    trace = [req(0, 4 * B, 1, 2, 3, 4), req(10, 3 * B, 1, 2, 6)]
    assert continues(trace) == [False, False]
    assert continues(trace, share=0.5) == [True, False]  # ceil(0.5 * 4) = 2 blocks
    assert continues(trace, share=0.75) == [False, False]  # 3 blocks
    for share in (0.0, 1.5, math.nan):
        with pytest.raises(WorkloadError, match="continuation share"):
            continues(trace, share=share)


def test_the_rule_uses_the_block_size_given() -> None:
    # In blocks of 2 * B tokens, 4 * B tokens are 2 complete blocks: ids 1 and 2.
    trace = [req(0, 4 * B, 1, 2, 3, 4), req(10, 4 * B, 1, 2, 6, 7)]
    assert continues(trace) == [False, False]
    assert continues(trace, block_tokens=2 * B) == [True, False]
    with pytest.raises(WorkloadError, match="block_tokens must be a positive integer"):
        continues(trace, block_tokens=0)


def test_every_workload_gets_the_conversation_rule() -> None:
    chat = chat_workload(400, seed=1)
    assert workload_hints(chat, "continuation") == continuation_hints(chat)
    documents = documents_workload(400, seed=1)
    strict = continues(documents)
    mine = continuation_hints(documents)  # the conversation rule (module docstring)
    assert [h.retains for h in mine] == strict
    # The looser rule, measured and kept for whoever wants it, retains more.
    assert sum(h.retains for h in continuation_hints(documents, share=0.5)) > sum(strict)
    assert workload_hints(chat, "none") is None


# -- errors ------------------------------------------------------------------------


def test_errors_flip_nested_sets_across_rates_for_one_seed() -> None:
    masks = {rate: flip_mask(5_000, rate, 7) for rate in (0.0, 0.1, 0.2, 0.5, 1.0)}
    assert not masks[0.0].any()
    assert masks[1.0].all()
    for low, high in ((0.1, 0.2), (0.2, 0.5), (0.5, 1.0)):
        assert not (masks[low] & ~masks[high]).any()  # flipped at low: flipped at high
    assert abs(masks[0.2].mean() - 0.2) < 0.03
    assert np.array_equal(masks[0.2], np.random.default_rng(7).random(5_000) < 0.2)
    assert not np.array_equal(masks[0.2], flip_mask(5_000, 0.2, 8))  # the seed matters


def test_a_flipped_request_gets_the_other_hint() -> None:
    requests = chat_workload(500, seed=2)
    exact = continuation_hints(requests)
    wrong = continuation_hints(requests, error=0.3, seed=4)
    mask = flip_mask(len(requests), 0.3, 4)
    for e, w, flipped in zip(exact, wrong, mask, strict=True):
        assert (e == w) != flipped
        assert w in (RETAIN, RELEASE)


@pytest.mark.parametrize(("error", "seed"), [(-0.1, 0), (1.01, 0), (math.nan, 0), (0.2, -1)])
def test_a_bad_error_or_seed_is_refused(error: float, seed: int) -> None:
    with pytest.raises(WorkloadError, match="hint"):
        continuation_hints(chat_workload(10), error=error, seed=seed)


def test_an_error_without_hints_and_an_unknown_source_are_refused() -> None:
    with pytest.raises(WorkloadError, match="needs hints to spoil"):
        workload_hints(chat_workload(10), "none", error=0.2)
    with pytest.raises(WorkloadError, match="unknown hint source 'oracle'; choose one of"):
        workload_hints(chat_workload(10), "oracle")


# -- the simulation ----------------------------------------------------------------

# `simulate_keys` without hints on `chat_workload(3000)`, as the code before hints
# (commit 2540cc4) gave them: hit blocks and evictions.
BEFORE_HINTS = {
    ("lru", 25_600): (8555, 22132), ("lru", 102_400): (12705, 17881),
    ("arc", 25_600): (11380, 19307), ("arc", 102_400): (13907, 16679),
    ("aslru", 25_600): (11090, 19597), ("aslru", 102_400): (14122, 16456),
    ("dslru", 25_600): (11145, 19542), ("dslru", 102_400): (14321, 16260),
}  # fmt: skip


@pytest.mark.parametrize(("policy", "capacity"), sorted(BEFORE_HINTS))
def test_without_hints_a_run_is_exactly_the_run_before_hints(policy: str, capacity: int) -> None:
    requests = chat_workload(3000)
    keys = requests_to_keys(requests)
    times = arrival_times_s(requests)
    plain = simulate_keys(keys, capacity_tokens=capacity, policy=policy)
    clocked = simulate_keys(keys, capacity_tokens=capacity, policy=policy, times_s=times)
    empty = simulate_keys(
        keys, capacity_tokens=capacity, policy=policy, hints=[None] * len(keys), times_s=times
    )
    for r in (plain, clocked, empty):
        assert (r.hit_blocks, r.evictions) == BEFORE_HINTS[policy, capacity]
        assert (r.hints, r.hint_error) == ("none", 0.0)


def test_without_hints_a_disk_tier_below_runs_as_before() -> None:
    requests = chat_workload(1500, seed=5)
    keys = requests_to_keys(requests)
    times = arrival_times_s(requests)
    for policy in POLICY_NAMES:
        plain = simulate_keys(keys, capacity_tokens=60 * B, policy=policy, disk_tokens=300 * B)
        empty = simulate_keys(keys, capacity_tokens=60 * B, policy=policy, disk_tokens=300 * B,
                              hints=[None] * len(keys), times_s=times)  # fmt: skip
        assert plain.hit_blocks_by_tier == empty.hit_blocks_by_tier
        assert plain.disk_evictions == empty.disk_evictions


def flood(retained: bool, start_ms: int = 1_000) -> tuple[list[Request], list[Hint | None] | None]:
    """A conversation's first turn, 40 one-off requests from ``start_ms`` that fill the
    tier (without hints: only the retention can keep the first turn), its next turn."""
    requests = [req(0, 4 * B, 1, 2, 3, 4)]
    requests += [req(start_ms + i, 2 * B, 100 + 2 * i, 101 + 2 * i) for i in range(40)]
    requests.append(req(start_ms + 60_000, 5 * B, 1, 2, 3, 4, 5))
    hints: list[Hint | None] = [RETAIN, *[None] * 40, RELEASE]
    assert continuation_hints(requests)[0] == RETAIN
    return requests, hints if retained else None


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_continuing_request_survives_a_flood_that_evicts_it_without_hints(policy: str) -> None:
    for retained, expected in ((False, 0), (True, 4)):
        requests, hints = flood(retained)
        times = arrival_times_s(requests)
        keys = requests_to_keys(requests)
        result = simulate_keys(keys, capacity_tokens=40 * B, policy=policy, hints=hints,
                               times_s=times)  # fmt: skip
        assert result.hit_blocks == expected, (policy, retained)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_the_disk_tier_below_keeps_what_the_cpu_tier_could_not(policy: str) -> None:
    # A CPU tier of 8 chunks retains 1 (its share); the disk index of 40 is hinted too.
    for retained, expected in ((False, {"cpu": 0, "disk": 0}), (True, {"cpu": 1, "disk": 3})):
        requests, hints = flood(retained)
        result = simulate_keys(requests_to_keys(requests), capacity_tokens=8 * B,
                               policy=policy, disk_tokens=40 * B, hints=hints,
                               times_s=arrival_times_s(requests))  # fmt: skip
        assert result.hit_blocks_by_tier == expected


def test_the_disk_index_gets_hints_as_the_engine_gives_them() -> None:
    # As `DiskIndex`: each chunk written is noted once with its store's hint (a use, so
    # a later read of it counts as a reuse of a retained chunk), and a read from the
    # disk is a use without the reading request's hint (the engine's touch does no I/O).
    clock = TraceClock()
    cpu = CPUOffloadingManager(8, create_policy("lru", 8), clock=clock)
    disk = CPUOffloadingManager(40, create_policy("lru", 40), clock=clock)
    chain = Chain(cpu, disk, policy="lru", capacity_tokens=8 * B, disk_tokens=40 * B)
    first, *others, again = requests_to_keys(
        [req(0, 3 * B, 1, 2, 3), *(req(i, 2 * B, 10 * i, 10 * i + 1) for i in range(1, 5)),
         req(9, 3 * B, 1, 2, 3)]
    )  # fmt: skip
    chain(first, RETAIN)
    for keys in others:  # evict the first request's chunks from the CPU tier
        chain(keys, None)
    assert chain(again, RELEASE) == 3  # all three read back from the disk
    stats = disk.hints.statistics()
    assert stats.released == 0  # the reading request's release stayed in the CPU tier
    assert stats.reuse_retained > 0  # the retained chunks written were used again


def test_hints_need_the_workload_clock() -> None:
    keys = requests_to_keys(chat_workload(20))
    with pytest.raises(ConfigError, match="hints need the requests' arrivals: give times_s"):
        simulate_keys(keys, capacity_tokens=20 * B, hints=[RETAIN] * len(keys))


def test_released_requests_go_first() -> None:
    requests, _ = flood(False)
    hints = continuation_hints(requests)  # the first turn retained, the flood released
    assert hints[1:] == [RELEASE] * 41
    times = arrival_times_s(requests)
    keys = requests_to_keys(requests)
    for retain in (hints[0], None):  # its own retention or not, the flood goes first
        result = simulate_keys(keys, capacity_tokens=40 * B, policy="lru",
                               hints=[retain, *hints[1:]], times_s=times)  # fmt: skip
        assert result.hit_blocks == 4


def test_a_retention_expires_on_the_workload_clock() -> None:
    for start_s, expected in ((CONTINUATION_RETAIN_S - 1, 4), (CONTINUATION_RETAIN_S, 0)):
        requests, hints = flood(True, int(start_s * 1000))
        times = arrival_times_s(requests)
        keys = requests_to_keys(requests)
        result = simulate_keys(keys, capacity_tokens=40 * B, policy="lru", hints=hints,
                               times_s=times)  # fmt: skip
        assert result.hit_blocks == expected  # a flood after the deadline evicts it


def test_the_optimum_ignores_hints() -> None:
    requests = chat_workload(800, seed=3)
    keys = requests_to_keys(requests)
    hints = continuation_hints(requests)
    best = simulate_keys(keys, capacity_tokens=40 * B, policy=OPTIMAL)
    hinted = simulate_keys(keys, capacity_tokens=40 * B, policy=OPTIMAL, hints=hints,
                           times_s=arrival_times_s(requests))  # fmt: skip
    assert (hinted.hit_blocks, hinted.hints) == (best.hit_blocks, "none")


def test_hints_and_times_must_have_one_entry_per_request() -> None:
    keys = requests_to_keys(chat_workload(20))
    with pytest.raises(ConfigError, match="one entry per request"):
        simulate_keys(keys, capacity_tokens=20 * B, hints=[None])
    with pytest.raises(ConfigError, match="times_s must hold one entry per request"):
        simulate_keys(keys, capacity_tokens=20 * B, times_s=[0.0])


# -- the command line --------------------------------------------------------------


def simulate_json(capsys: pytest.CaptureFixture[str], *flags: str) -> list[dict[str, object]]:
    argv = ["simulate", "--workload", "chat", "--requests", "600", "--capacity-tokens",
            "20480,51200", "--policy", "lru,dslru", "--json", *flags]  # fmt: skip
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_simulate_json_rows_carry_the_hints_their_error_and_the_hit_rate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = simulate_json(capsys)
    assert [(r["hints"], r["hint_error"]) for r in plain] == [("none", 0.0)] * 4
    hinted = simulate_json(capsys, "--hints", "continuation", "--hint-error", "0.2")
    assert [(r["hints"], r["hint_error"]) for r in hinted] == [("continuation", 0.2)] * 4
    requests = chat_workload(600)
    hints = continuation_hints(requests, error=0.2)
    for row in hinted:
        expected = simulate_keys(
            requests_to_keys(requests), capacity_tokens=int(str(row["capacity_tokens"])),
            policy=str(row["policy"]), hints=hints,
            times_s=arrival_times_s(requests),
        )  # fmt: skip
        assert row["hit_rate"] == expected.hit_rate
    other_seed = simulate_json(
        capsys, "--hints", "continuation", "--hint-error", "0.5", "--hint-seed", "3"
    )
    assert all(r["hint_error"] == 0.5 for r in other_seed)


def test_simulate_without_hints_hits_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    rows = simulate_json(capsys, "--hints", "none")
    keys = requests_to_keys(chat_workload(600))
    for row in rows:
        r = simulate_keys(keys, capacity_tokens=int(str(row["capacity_tokens"])),
                          policy=str(row["policy"]))  # fmt: skip
        assert row["hit_blocks"] == r.hit_blocks


def test_simulate_table_shows_the_hints(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--workload", "chat", "--requests", "300", "--capacity-tokens",
            "20480", "--policy", "dslru,optimal", "--hints", "continuation",
            "--hint-error", "0.2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "continuation, 20% wrong" in out
    assert "none (ignored)" in out  # the optimum's row
    assert "the offline optimum ignores hints" in out
    assert main(argv[:-4]) == 0
    assert "hints" not in capsys.readouterr().out.splitlines()[0]  # today's header


@pytest.mark.parametrize(
    ("command", "flags", "expected"),
    [
        ("simulate", ["--hint-error", "0.2"], "--hint-error 0.2 spoils retention hints"),
        ("simulate", ["--hint-seed", "3"], "--hint-seed 3 picks the retention hints --hint-error"),
        ("simulate", ["--hint-seed", "1234567"], "--hint-seed 1234567 picks"),  # as given
        ("simulate", ["--hint-error", "0.123456789"], "--hint-error 0.123456789 spoils"),
        ("simulate", ["--hints", "continuation", "--hint-error", "1.5"], "fraction from 0 to 1"),
        ("simulate", ["--hints", "continuation", "--hint-error", "-0.1"], "got '-0.1'"),
        ("simulate", ["--hints", "continuation", "--hint-error", "nan"], "got 'nan'"),
        ("simulate", ["--hints", "continuation", "--hint-seed", "-1"], "integer >= 0"),
        ("simulate", ["--hints", "continuation", "--hint-seed", "x"], "got 'x'"),
        ("simulate", ["--hints", "oracle"], "invalid choice: 'oracle'"),
        ("replay", ["--hint-error", "0.2"], "--hint-error 0.2 spoils retention hints"),
        ("replay", ["--hints", "continuation", "--hint-error", "2"], "fraction from 0 to 1"),
        ("replay", ["--hints", "continuation", "--hint-seed", "1.5"], "got '1.5'"),
    ],
)
def test_bad_hint_flags_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], command: str, flags: list[str], expected: str
) -> None:
    err = _usage_error(capsys, [command, "--workload", "chat", "--requests", "5", *flags])
    assert expected in err


# -- the replay --------------------------------------------------------------------

SMALL = {"bytes_per_token": 16, "block_tokens": 512}


@pytest.mark.anyio
@pytest.mark.parametrize("concurrency", [1, 4])
async def test_replay_with_hints_loads_back_exact_bytes(
    anyio_backend: str, concurrency: int
) -> None:
    requests = chat_workload(500, seed=2)
    options = ReplayOptions(capacity_tokens=60 * B, concurrency=concurrency, verify=True,
                            hints="continuation", hint_error=0.2,
                            **SMALL)  # fmt: skip
    result = await replay(requests, options)
    assert (result.hints, result.hint_error) == ("continuation", 0.2)
    assert result.hinted_keys > 0
    assert result.released_evicted > 0
    assert result.loaded_chunks == result.hit_blocks > 0
    assert (result.corrupt_chunks, result.failed_jobs) == (0, 0)


@pytest.mark.anyio
async def test_replay_without_hints_takes_none(anyio_backend: str) -> None:
    result = await replay(
        chat_workload(200, seed=2), ReplayOptions(capacity_tokens=60 * B, concurrency=1, **SMALL)
    )
    assert (result.hints, result.hinted_keys, result.released_evicted) == ("none", 0, 0)


# 600 requests over 400 chunks: exact hints carry information, so the CPU tier follows
# both kinds; half of them wrong carry none, and it ignores both (`tiering.policies.hints`).
FOLLOWED = {"capacity_tokens": 400 * B, "concurrency": 1, "hints": "continuation", **SMALL}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("options", "following"),
    [
        (FOLLOWED, True),
        ({**FOLLOWED, "hint_error": 0.5}, False),
        ({**FOLLOWED, "hints": "none"}, None),
    ],
)
async def test_the_replay_says_whether_the_cpu_tier_followed_the_hints(
    anyio_backend: str, options: dict[str, Any], following: bool | None
) -> None:
    result = await replay(chat_workload(600, seed=2), ReplayOptions(**options))
    assert (result.following_releases, result.following_retentions) == (following, following)
    line = _replay_hints(result)
    if following is None:
        assert line == "none (--hints)"
    elif following:
        assert "; releases and retentions followed; TTLs scaled" in line
        one = msgspec.structs.replace(result, following_retentions=False)
        assert "; releases followed, retentions ignored (measured no better than chance); " in (
            _replay_hints(one)
        )
    else:
        assert "; releases and retentions ignored (measured no better than chance); " in line


def test_replay_options_refuse_bad_hints() -> None:
    with pytest.raises(ConfigError, match="unknown hints 'oracle'"):
        ReplayOptions(hints="oracle")
    with pytest.raises(ConfigError, match="spoils hints, and none were asked for"):
        ReplayOptions(hint_error=0.2)
    with pytest.raises(ConfigError, match=r"a hint error of 0\.123456789 spoils"):
        ReplayOptions(hint_error=0.123456789)  # as given
    with pytest.raises(WorkloadError, match="hint error must be a fraction"):
        ReplayOptions(hints="continuation", hint_error=1.5)


def test_replay_cli_json_carries_the_hints(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--workload", "chat", "--requests", "150", "--capacity-tokens", "51200",
            "--bytes-per-token", "16", "--verify", "--json", "--hints", "continuation",
            "--hint-error", "0.5", "--hint-seed", "2"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["hints"], summary["hint_error"]) == ("continuation", 0.5)
    assert summary["corrupt_chunks"] == 0
    assert 0 < summary["hit_rate"] < 1
    assert main(argv[:-7]) == 0  # and the table says so
    assert main([*argv[:-7], "--hints", "continuation"]) == 0
    out = capsys.readouterr().out
    assert "none (--hints)" in out
    assert "continuation: " in out


def test_the_replay_and_simulate_tables_point_at_each_other_with_the_same_hints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A hinted replay's table named `tiering simulate --requests 150` (no hints: another
    # run) as the one it matches, and simulate's said a hinted replay hits the same.
    argv = ["replay", "--workload", "chat", "--requests", "150", "--capacity-tokens", "51200",
            "--bytes-per-token", "16", "--concurrency", "1", "--hints", "continuation",
            "--hint-error", "0.5", "--hint-seed", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "one request at a time: the hit rate is close to `tiering simulate --requests 150 "
        "--hints continuation --hint-error 0.5 --hint-seed 2`'s" in out
    )
    assert main([*argv[:9], "--hints", "continuation", "--concurrency", "4"]) == 0
    assert "can be below `tiering simulate --requests 150 --hints continuation`'s" in (
        capsys.readouterr().out
    )
    simulate = ["simulate", *argv[1:7], "--policy", "dslru", *argv[11:]]
    assert main(simulate) == 0
    out = capsys.readouterr().out
    assert "(as `tiering replay --concurrency 1`, with the same hints, which hits close" in out
    assert main(simulate[:-6]) == 0
    assert "(as `tiering replay --concurrency 1`, which hits the same)" in (capsys.readouterr().out)


def test_retention_is_scaled_to_the_replay_pace_after_a_minute() -> None:
    now = [100.0]
    retention = _Retention(0.0, timer=lambda: now[0])
    assert retention.scaled(RETAIN, 0.0) == RETAIN  # the replay starts: no pace yet
    now[0] = 101.0
    assert retention.scaled(RETAIN, 30.0) == RETAIN  # under a minute of workload time
    now[0] = 106.0  # 6 s for 120 workload seconds: the replay runs 20 times faster
    assert retention.scaled(RETAIN, 120.0) == Hint(retain_s=CONTINUATION_RETAIN_S / 20)
    assert retention.scaled(RELEASE, 120.0) is RELEASE
    assert retention.scaled(None, 120.0) is None


def test_simulate_hints_the_requests_of_a_trace_given_by_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    requests = documents_workload(300, seed=1)
    write_trace(trace, requests)
    argv = ["simulate", "--trace", str(trace), "--capacity-tokens", "51200", "--policy",
            "dslru", "--json", "--hints", "continuation"]  # fmt: skip
    assert main(argv) == 0
    row = json.loads(capsys.readouterr().out)
    strict = simulate_keys(requests_to_keys(requests), capacity_tokens=51200, policy="dslru",
                           hints=continuation_hints(requests),
                           times_s=arrival_times_s(requests))  # fmt: skip
    assert row["hit_blocks"] == strict.hit_blocks
