"""`bench/policy.py`: the issue's targets for the default policy, on made-up hit rates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from tiering.policies import POLICY_NAMES
from tiering.sim import OPTIMAL, SimulationResult

BENCH = Path(__file__).resolve().parents[1] / "bench" / "policy.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_policy", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()


def trace_at(lru: float, mine: float, default: str = "aslru") -> dict[int, dict[str, float]]:
    """Every trace capacity, LRU hitting ``lru``; the default hits ``mine`` at the ratio
    targets' capacities and twice LRU's rate elsewhere."""
    rows = {}
    for capacity in bench.TRACE_CAPACITIES:
        rate = mine if capacity in bench.TRACE_MIN_RATIOS else 2 * lru
        rows[capacity] = {"lru": lru, default: rate, OPTIMAL: 0.9}
    return rows


def held_everywhere(default: str = "aslru") -> dict[str, dict[int, dict[str, float]]]:
    """Hit rates meeting every target: 2.5x LRU on the trace, equal to it elsewhere."""
    return {
        "trace": trace_at(0.1, 0.25, default),
        "chat": {25_600: {"lru": 0.3, default: 0.3, OPTIMAL: 0.4}},
    }


def test_targets_held_report_nothing() -> None:
    assert bench.check_targets(held_everywhere(), "aslru") == []


def test_a_row_below_lru_is_reported() -> None:
    rates = held_everywhere()
    rates["chat"][25_600]["aslru"] = 0.29
    assert bench.check_targets(rates, "aslru") == [
        "chat at 25,600 tokens: aslru hits 29.00%, below lru's 30.00%"
    ]


@pytest.mark.parametrize("capacity", [500_000, 10_000_000, 20_000_000])
def test_below_lru_on_the_trace_off_the_ratio_targets_is_reported(capacity: int) -> None:
    rates = held_everywhere()
    rates["trace"][capacity]["aslru"] = 0.099
    (missed,) = bench.check_targets(rates, "aslru")
    assert missed.startswith(f"trace at {capacity:,} tokens: aslru hits 9.90%, below lru")


def test_149x_lru_at_3m_is_reported_and_15x_is_not() -> None:
    rates = held_everywhere()
    rates["trace"][3_000_000]["aslru"] = 0.149
    (missed,) = bench.check_targets(rates, "aslru")
    assert missed.startswith("trace at 3,000,000 tokens: aslru hits 14.90%, 1.490x lru")
    assert missed.endswith("< 1.5x")
    rates["trace"][3_000_000]["aslru"] = 0.15  # 1.5 * 0.1 is 0.15000000000000002
    assert bench.check_targets(rates, "aslru") == []


def test_199x_lru_at_1m_is_reported_and_2x_is_not() -> None:
    rates = held_everywhere()
    rates["trace"][1_000_000]["aslru"] = 0.199
    (missed,) = bench.check_targets(rates, "aslru")
    assert missed.startswith("trace at 1,000,000 tokens: aslru hits 19.90%, 1.990x lru")
    rates["trace"][1_000_000]["aslru"] = 0.2
    assert bench.check_targets(rates, "aslru") == []


def test_the_default_policy_is_whichever_is_named() -> None:
    rates = held_everywhere("arc")
    assert bench.check_targets(rates, "arc") == []
    rates["chat"][25_600]["arc"] = 0.1
    assert [m.split(":")[0] for m in bench.check_targets(rates, "arc")] == ["chat at 25,600 tokens"]


def test_the_trace_targets_wait_for_the_trace_and_a_missing_capacity_is_a_miss() -> None:
    rates = held_everywhere()
    assert bench.check_targets({"chat": rates["chat"]}, "aslru") == []
    del rates["trace"][3_000_000]
    assert bench.check_targets(rates, "aslru") == [
        "trace at 3,000,000 tokens: not run (target 1.5x lru)"
    ]


def test_ratio_and_gap_share_are_none_where_undefined() -> None:
    assert bench.ratio_to(0.2, 0.1) == pytest.approx(2.0)
    assert bench.ratio_to(0.2, 0.0) is None
    assert bench.gap_share(0.3, 0.1, 0.5) == pytest.approx(0.5)
    assert bench.gap_share(0.05, 0.1, 0.5) == pytest.approx(-0.125)
    assert bench.gap_share(0.3, 0.5, 0.5) is None


def test_a_serial_run_fills_every_row_and_its_json() -> None:
    workload = bench.Workload(name="chat", capacities=(25_600, 51_200), requests=60)
    table = bench.run([workload], jobs=1)
    assert list(table) == ["chat"]
    assert list(table["chat"]) == [25_600, 51_200]
    for row in table["chat"].values():
        assert list(row) == [*POLICY_NAMES, OPTIMAL]
    records = [json.loads(line) for line in bench.json_rows("chat", table["chat"])]
    assert [r["capacity_tokens"] for r in records] == [25_600, 51_200]
    for record in records:
        assert record["requests"] == 60
        assert record["ratio_to_lru"]["lru"] in (1.0, None)
        for field in ("hit_rate", "ratio_to_lru", "gap_share", "keys_per_s"):
            assert set(record[field]) == {*POLICY_NAMES, OPTIMAL}


# -- the hints table ---------------------------------------------------------------


def made_up(hit_blocks: int, blocks: int = 1000, evictions: int = 0) -> SimulationResult:
    return SimulationResult.of(policy="dslru", capacity_tokens=512, capacity_chunks=1,
                               requests=1, blocks=blocks, hit_blocks=hit_blocks,
                               store_failures=0, evictions=evictions, seconds=1.0)  # fmt: skip


def tables(
    rates: dict[str, int], none: int = 100
) -> tuple[dict[str, dict[int, dict[str, SimulationResult]]], ...]:
    """A trace table hitting 100 blocks of 1,000 without hints at every capacity, and its
    hinted rows hitting ``rates`` (``none`` for the row without hints)."""
    plain = {"trace": {c: {"dslru": made_up(100)} for c in bench.HINT_TRACE_CAPACITIES}}
    hinted = {
        "trace": {
            c: {**{row: made_up(rates[row]) for row in rates}, "none": made_up(none)}
            for c in bench.HINT_TRACE_CAPACITIES
        }
    }
    return hinted, plain


def test_bench_hint_targets_held_report_nothing_and_misses_are_named() -> None:
    assert bench.DEFAULT_POLICY == "dslru"  # the made-up rows' policy
    held = {"exact": 145, "20% wrong": 120, "50% wrong": 98}
    assert bench.check_hint_targets(*tables(held)) == []
    missed = bench.check_hint_targets(*tables({**held, "exact": 144, "50% wrong": 97}))
    assert len(missed) == 4  # exact at 3M, 50 % wrong at each of three capacities
    assert missed[0] == (
        "trace at 3,000,000 tokens: hints exact hit 14.40%, 1.440x dslru without hints "
        "(10.00%) < 1.45x"
    )
    (differs,) = bench.check_hint_targets(*tables(held, none=101))[:1]
    assert "without hints hits 101 blocks and evicts 0 chunks, 100 and 0 without it" in differs
    hinted, plain = tables(held)  # "none" is exactly no hints: its evictions too
    hinted["trace"][3_000_000]["none"] = made_up(100, evictions=1)
    (differs,) = bench.check_hint_targets(hinted, plain)
    assert differs.startswith("trace at 3,000,000 tokens: dslru through the hinted path")
    assert "evicts 1 chunks, 100 and 0 without it" in differs


def test_bench_hints_table_runs_every_row_serially() -> None:
    workload = bench.Workload(name="chat", capacities=(25_600, 51_200, 102_400), requests=300)
    (hinted,) = bench.hint_workloads([workload])
    assert hinted.capacities == (25_600, 102_400)  # the registry's chat capacities run
    table = bench.run_hints([hinted], jobs=1)
    plain = bench.run([hinted], jobs=1)
    assert bench.check_hint_targets(table, plain) == []  # none == no hints, exactly
    for row in table["chat"].values():
        assert list(row) == list(bench.HINT_ROWS)
        assert (row["20% wrong"].hints, row["20% wrong"].hint_error) == ("continuation", 0.2)
    text = bench.hint_rows("chat", table["chat"], plain["chat"], as_json=False)
    assert [line.split()[0] for line in text[3:]] == ["exact", "20%", "50%", "none"]
    lines = bench.hint_rows("chat", table["chat"], plain["chat"], as_json=True)
    records = [json.loads(line) for line in lines]
    assert len(records) == 2 * len(bench.HINT_ROWS)
    assert [r["ratio"] for r in records if r["row"] == "none"] == [1.0, 1.0]
