"""`tiering simulate`: hit rates against an independent LRU, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.cli import main
from tiering.policies import POLICY_NAMES
from tiering.sim import OPTIMAL, expand_policies, simulate, simulate_keys, simulate_optimal
from tiering.workload import Request, chat_workload, documents_workload, read_trace, write_trace

TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "conversation_trace.jsonl"
)


def plain_lru_hits(requests: Sequence[Request], capacity: int) -> tuple[int, int, int]:
    """Hit blocks, evictions and store failures of a textbook LRU cache of ``capacity`` blocks.

    Per request: the leading present blocks are hits; the hits stay pinned while
    the missing blocks are stored (evicting the least recent other blocks); then
    the request's blocks become most recent, head most recent of all.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = evictions = failures = 0
    for request in requests:
        ids = list(request.hash_ids)
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        hits += n
        keep = set(ids)
        missing = [i for i in dict.fromkeys(ids[n:]) if i not in cache]
        need = len(missing) - (capacity - len(cache))
        victims = [i for i in cache if i not in keep][: max(need, 0)]
        if len(victims) < need:
            failures += 1
        else:
            for i in victims:
                del cache[i]
            evictions += len(victims)
            for i in reversed(missing):
                cache[i] = None
        for i in reversed(ids):
            if i in cache:
                cache.move_to_end(i)
    return hits, evictions, failures


@pytest.mark.parametrize("capacity_blocks", [1, 7, 64, 400])
def test_lru_hit_rate_matches_an_independent_lru_on_chat(capacity_blocks: int) -> None:
    requests = chat_workload(600, seed=3)
    result = simulate(requests, capacity_tokens=capacity_blocks * 512, policy="lru")
    hits, evictions, failures = plain_lru_hits(requests, capacity_blocks)
    assert (result.hit_blocks, result.evictions, result.store_failures) == (
        hits,
        evictions,
        failures,
    )
    assert result.blocks == sum(len(r.hash_ids) for r in requests)
    assert result.hit_rate == pytest.approx(hits / result.blocks)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared conversation trace is absent")
def test_lru_hit_rate_matches_an_independent_lru_on_the_trace() -> None:
    requests = read_trace(TRACE, limit=1500)
    result = simulate(requests, capacity_tokens=500 * 512, policy="lru")
    assert result.hit_blocks == plain_lru_hits(requests, 500)[0]
    assert 0 < result.hit_blocks < result.blocks


def test_arc_runs_and_counts_blocks() -> None:
    requests = chat_workload(300, seed=1)
    lru = simulate(requests, capacity_tokens=50 * 512, policy="lru")
    arc = simulate(requests, capacity_tokens=50 * 512, policy="arc")
    assert (arc.blocks, arc.requests) == (lru.blocks, lru.requests)
    assert 0 < arc.hit_blocks < arc.blocks


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "chat", "--requests", "200",
                 "--capacity-tokens", "51200,512000", "--policy", "lru,arc"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["policy", "capacity", "tokens"]
    assert out.count("\nlru ") == 2
    assert out.count("\narc ") == 2
    assert "200 requests" in out


def test_cli_json_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, chat_workload(120, seed=5))
    assert main(["simulate", "--trace", str(trace), "--capacity-tokens", "25600",
                 "--policy", "lru,arc", "--json", "--requests", "100"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["policy"] for r in records] == ["lru", "arc"]
    for r in records:
        assert r["requests"] == 100
        assert r["capacity_tokens"] == 25600
        for field in ("blocks", "hit_blocks", "hit_rate", "store_failures", "evictions",
                      "seconds", "keys_per_s"):  # fmt: skip
            assert field in r
        assert r["hit_rate"] == pytest.approx(r["hit_blocks"] / r["blocks"])


def _bad_trace(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": [2]}\n'
    )
    return path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", "--trace", "/nonexistent/t.jsonl"], "/nonexistent/t.jsonl"),
        (["simulate", "--trace", "BAD"], "line 2"),
        (["simulate", "--workload", "chat", "--capacity-tokens", "-1"], "-1"),
        (["simulate", "--workload", "chat", "--capacity-tokens", "100"], "100 tokens"),
        (["simulate", "--workload", "chat", "--capacity-tokens", "1,x"], "'x'"),
        (["simulate", "--workload", "chat", "--policy", "mru"], "'mru'"),
        (["simulate", "--workload", "chat", "--policy", "all,fifo"], "'fifo'"),
        (
            [
                "simulate",
                "--workload",
                "chat",
                "--plot",
                "/nonexistent/dir/p.png",
                "--requests",
                "20",
                "--capacity-tokens",
                "5120",
                "--policy",
                "lru",
            ],
            "cannot write plot",
        ),
        (["simulate", "--workload", "nope"], "nope"),
        (["simulate", "--workload", "chat", "--requests", "0"], "0"),
        (["simulate"], "--trace"),
        (["frobnicate"], "frobnicate"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    argv = [str(_bad_trace(tmp_path)) if a == "BAD" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = [line for line in captured.err.splitlines() if not line.startswith("usage:")]
    lines = [line for line in lines if line.startswith("tiering")]
    assert len(lines) == 1
    assert expected in lines[0]
    assert "Traceback" not in captured.err


def test_python_dash_m_runs_and_bad_input_has_no_traceback(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "tiering", "simulate", "--workload", "chat",
         "--requests", "50", "--capacity-tokens", "51200", "--policy", "lru", "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["requests"] == 50
    bad = subprocess.run(
        [sys.executable, "-m", "tiering", "simulate", "--trace", str(tmp_path / "missing")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "Traceback" not in bad.stderr


def ids_to_keys(*requests: list[int]) -> list[list[OffloadKey]]:
    return [[make_offload_key(i.to_bytes(8, "big")) for i in ids] for ids in requests]


def test_optimal_keeps_what_is_used_soonest() -> None:
    # A loop of three chunks through a tier of two: LRU always misses; the
    # optimum keeps the chunk used soonest.
    loop = ids_to_keys([1], [2], [3], [1], [2], [3], [1])
    lru = simulate_keys(loop, capacity_tokens=2 * 512, policy="lru")
    best = simulate_optimal(loop, capacity_tokens=2 * 512)
    assert (lru.hit_blocks, best.hit_blocks) == (0, 2)
    assert (lru.evictions, best.evictions) == (5, 3)
    assert best.policy == OPTIMAL
    assert simulate_keys(loop, capacity_tokens=1024, policy=OPTIMAL).hit_blocks == 2


def test_optimal_respects_pins_and_the_keys_of_the_store() -> None:
    # Tier of 2: request 3 hits 1 (pinned) and must store 4: the only other
    # chunk, 2, is evicted though it is used next; a request of 3 new chunks
    # finds no room at all and stores nothing.
    requests = ids_to_keys([1, 2], [1, 4], [2], [7, 8, 9], [1])
    best = simulate_optimal(requests, capacity_tokens=2 * 512)
    assert best.hit_blocks == 1 + 0 + 0 + 1  # 1; then 2 was evicted; then 1 again
    assert best.store_failures == 1
    lru = simulate_keys(requests, capacity_tokens=2 * 512, policy="lru")
    assert lru.store_failures == 1


@pytest.mark.parametrize("workload", [chat_workload, documents_workload], ids=["chat", "docs"])
def test_no_policy_beats_the_optimum(workload: Callable[..., list[Request]]) -> None:
    requests = workload(400, seed=2)
    for capacity in (20, 80):
        best = simulate(requests, capacity_tokens=capacity * 512, policy=OPTIMAL)
        for policy in POLICY_NAMES:
            result = simulate(requests, capacity_tokens=capacity * 512, policy=policy)
            assert result.hit_blocks <= best.hit_blocks, (policy, capacity)
            assert result.blocks == best.blocks


def test_a_result_derives_its_rate_speed_and_tiers_from_its_counts() -> None:
    # `SimulationResult.of`, public on a public class, as before `tiering.sim`.
    from tiering.sim import SimulationResult

    r = SimulationResult.of(
        policy="lru",
        capacity_tokens=1024,
        capacity_chunks=2,
        requests=3,
        blocks=8,
        hit_blocks=6,
        store_failures=1,
        evictions=4,
        seconds=2.0,
        disk_tokens=2048,
        disk_capacity_chunks=4,
        disk_hit_blocks=2,
    )
    assert (r.hit_rate, r.keys_per_s) == (0.75, 4.0)
    assert r.hit_blocks_by_tier == {"cpu": 4, "disk": 2}
    one = SimulationResult.of(
        policy="lru",
        capacity_tokens=1024,
        capacity_chunks=2,
        requests=0,
        blocks=0,
        hit_blocks=0,
        store_failures=0,
        evictions=0,
        seconds=0.0,
    )
    assert (one.hit_rate, one.keys_per_s, one.hit_blocks_by_tier) == (0.0, 0.0, {"cpu": 0})


def test_expand_policies() -> None:
    assert expand_policies(["all"]) == [*POLICY_NAMES, OPTIMAL]
    assert expand_policies(["lru", "all", "lru"]) == [*POLICY_NAMES, OPTIMAL]
    assert expand_policies(["arc"]) == ["arc"]


def test_cli_policy_all_compares_every_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "documents", "--requests", "150",
                 "--capacity-tokens", "25600,51200", "--policy", "all", "--json"]) == 0  # fmt: skip
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in records] == [p for p in (*POLICY_NAMES, OPTIMAL) for _ in "ab"]
    best = {r["capacity_tokens"]: r["hit_blocks"] for r in records if r["policy"] == OPTIMAL}
    for r in records:
        assert r["hit_blocks"] <= best[r["capacity_tokens"]]
    assert main(["simulate", "--workload", "chat", "--requests", "100",
                 "--capacity-tokens", "25600", "--policy", "all"]) == 0  # fmt: skip
    table = capsys.readouterr().out
    for policy in (*POLICY_NAMES, OPTIMAL):
        assert f"\n{policy} " in table


def test_cli_plot_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # in the dev extra: present in CI
    out = tmp_path / "policies.png"
    assert main(["simulate", "--workload", "chat", "--requests", "120", "--policy", "lru,aslru",
                 "--capacity-tokens", "10240,40960", "--plot", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 5000
    assert OPTIMAL not in capsys.readouterr().out  # drawn, not asked for in the table


def test_cli_plot_without_matplotlib_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--workload", "chat", "--requests", "50",
              "--plot", str(tmp_path / "p.png")])  # fmt: skip
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "matplotlib" in captured.err
    assert not (tmp_path / "p.png").exists()


def test_cli_shows_progress_per_policy_and_capacity_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["simulate", "--workload", "chat", "--requests", "60", "--policy", "lru,optimal",
            "--capacity-tokens", "5120,10240"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    runs = ["lru at 5,120 tokens (1/4)", "lru at 10,240 tokens (2/4)",
            "optimal at 5,120 tokens (3/4)", "optimal at 10,240 tokens (4/4)"]  # fmt: skip
    drawn = err.split("\r")[1:]
    for run in runs:
        assert any(line.startswith(run + " [") for line in drawn), run
    assert drawn[-1].startswith(runs[-1] + " [" + "#" * 30 + "] 240/240 requests")
    assert err.endswith("\n")
    assert err.count("\n") == 1
    assert out.startswith("policy ")  # the table is on stdout, apart from the bar
    assert main([*argv, "--json"]) == 0
    assert capsys.readouterr().err == ""  # --json: no bar


def test_simulate_keys_reports_progress_and_its_end() -> None:
    keys = ids_to_keys(*([i, i + 1] for i in range(2500)))
    for policy in ("lru", OPTIMAL):
        calls: list[tuple[int, int, int, int]] = []
        result = simulate_keys(keys, capacity_tokens=8 * 512, policy=policy,
                               progress=lambda *a, calls=calls: calls.append(a))  # fmt: skip
        assert [c[:2] for c in calls] == [(1024, 2500), (2048, 2500), (2500, 2500)]
        assert calls[-1][2:] == (result.hit_blocks, result.blocks)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (["--workload", "chat"], [25_600, 102_400, 409_600]),
        (["--workload", "documents"], [51_200, 153_600, 512_000, 1_536_000]),
        (["--trace", "TRACE"], [1_000_000, 3_000_000, 10_000_000]),
    ],
)
def test_default_capacities_fit_the_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: list[str], expected: list[int]
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, chat_workload(50, seed=1))
    source = [str(trace) if a == "TRACE" else a for a in source]
    assert main(["simulate", *source, "--requests", "400", "--policy", "lru", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["capacity_tokens"] for r in records] == expected
    if source[0] == "--workload":  # the curve rises: not every capacity holds it all
        rates = [r["hit_rate"] for r in records]
        assert rates == sorted(rates)
        assert rates[0] < rates[-1]


def test_cli_table_says_what_ran_and_has_a_legend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, chat_workload(70, seed=1))
    scopes = [([], "all 70 requests"), (["--requests", "50"], "the first 50 requests")]
    for extra, scope in scopes:
        assert main(["simulate", "--trace", str(trace), "--capacity-tokens", "25600",
                     "--policy", "lru", *extra]) == 0  # fmt: skip
        lines = capsys.readouterr().out.splitlines()
        assert lines[-2].startswith(f"{scope} of t.jsonl, ")
        assert "blocks of 512 tokens, one request at a time" in lines[-2]
        assert "`tiering replay --concurrency 1`" in lines[-2]
        legend = lines[-1]
        for column in ("hit rate:", "chunks:", "store failures:", "keys/s:"):
            assert column in legend


@pytest.mark.parametrize(("suffix", "magic"), [(".png", b"\x89PNG"), (".SVG", b"<?xml"),
                                               (".pdf", b"%PDF")])  # fmt: skip
def test_cli_plot_writes_the_format_its_suffix_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str, magic: bytes
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"plot{suffix}"
    assert main(["simulate", "--workload", "chat", "--requests", "60", "--policy", "lru",
                 "--capacity-tokens", "5120,10240", "--plot", str(out)]) == 0  # fmt: skip
    assert out.read_bytes().startswith(magic)
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}"
    assert main(["simulate", "--workload", "chat", "--requests", "60", "--policy", "lru",
                 "--capacity-tokens", "5120", "--plot", str(out), "--json"]) == 0  # fmt: skip
    out_json, err = capsys.readouterr()
    assert [json.loads(line)["policy"] for line in out_json.splitlines()] == ["lru"]
    assert err == f"wrote {out}\n"  # stdout stays JSON lines


@pytest.mark.parametrize(("name", "what"), [("plot.txt", "'.txt'"), ("plot", "no suffix")])
def test_cli_plot_to_a_name_of_no_format_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, what: str
) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--workload", "chat", "--requests", "60",
              "--plot", str(tmp_path / name)])  # fmt: skip
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert what in captured.err
    assert ".png, .svg or .pdf" in captured.err
    assert not (tmp_path / name).exists()
