from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tiering.workload
from tiering.cli import main
from tiering.errors import TieringError, WorkloadError
from tiering.workload import (
    BLOCK_TOKENS,
    Request,
    TraceCheck,
    check_trace,
    iter_trace,
    read_trace,
    write_trace,
)

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.is_file(), reason=f"{CONVERSATION} is absent")

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}'


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_public_names_exist() -> None:
    for name in tiering.workload.__all__:
        assert hasattr(tiering.workload, name), name


@needs_trace
def test_reads_the_conversation_trace() -> None:
    requests = read_trace(CONVERSATION)
    assert len(requests) == 12031
    assert requests[0] == Request(
        timestamp=0,
        input_length=6758,
        output_length=500,
        hash_ids=tuple(range(14)),
    )
    timestamps = [request.timestamp for request in requests]
    assert timestamps == sorted(timestamps)
    for request in requests:
        blocks = len(request.hash_ids)
        assert (blocks - 1) * BLOCK_TOKENS < request.input_length <= blocks * BLOCK_TOKENS
    # Shared prefixes: many requests start with the same block.
    assert sum(request.hash_ids[:1] == (0,) for request in requests) > 100


@needs_trace
def test_limit_reads_a_prefix_of_the_trace() -> None:
    full = read_trace(CONVERSATION)
    assert read_trace(CONVERSATION, limit=100) == full[:100]
    assert read_trace(CONVERSATION, limit=0) == []
    assert read_trace(CONVERSATION, limit=10**9) == full


@needs_trace
def test_iter_trace_matches_read_trace() -> None:
    iterator = iter_trace(CONVERSATION)
    first = [next(iterator) for _ in range(50)]
    iterator.close()
    assert first == read_trace(CONVERSATION, limit=50)


def test_limit_does_not_read_past_the_requests_it_returns(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", GOOD, "not json at all")
    assert len(read_trace(path, limit=1)) == 1
    with pytest.raises(WorkloadError, match="line 2"):
        read_trace(path)


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3"])
def test_bad_limit_is_refused(tmp_path: Path, limit: object) -> None:
    path = write_lines(tmp_path / "t.jsonl", GOOD)
    with pytest.raises(WorkloadError, match="limit"):
        read_trace(path, limit=limit)  # type: ignore[arg-type]


def test_unknown_keys_are_ignored_and_blank_lines_skipped(tmp_path: Path) -> None:
    extra = (
        '{"timestamp": 5, "model": "x", "input_length": 1, "output_length": 0, '
        '"hash_ids": [7], "meta": {"a": [1, 2]}}'
    )
    path = write_lines(tmp_path / "t.jsonl", "", GOOD, "   ", extra, "")
    assert read_trace(path) == [
        Request(timestamp=0, input_length=600, output_length=10, hash_ids=(0, 1)),
        Request(timestamp=5, input_length=1, output_length=0, hash_ids=(7,)),
    ]


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\r\n" + GOOD.encode())
    assert len(read_trace(path)) == 2


def test_empty_file_is_an_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"")
    assert read_trace(path) == []


BAD_LINES = {
    "missing key": ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "hash_ids"),
    "string number": (
        '{"timestamp": "0", "input_length": 1, "output_length": 1, "hash_ids": []}',
        r"\$\.timestamp",
    ),
    "float number": (
        '{"timestamp": 1.5, "input_length": 1, "output_length": 1, "hash_ids": []}',
        r"\$\.timestamp",
    ),
    "bool number": (
        '{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": []}',
        r"\$\.input_length",
    ),
    "negative timestamp": (
        '{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}',
        r">= 0 - at `\$\.timestamp`",
    ),
    "negative input": (
        '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}',
        r"\$\.input_length",
    ),
    "negative output": (
        '{"timestamp": 0, "input_length": 3, "output_length": -1, "hash_ids": []}',
        r"\$\.output_length",
    ),
    "negative hash id": (
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0, -2]}',
        r"\$\.hash_ids\[1\]",
    ),
    "hash ids not a list": (
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 4}',
        r"\$\.hash_ids",
    ),
    "array line": ("[0, 1, 1, [0]]", "object"),
    "number line": ("42", "object"),
    "malformed json": ('{"timestamp": 0 "input_length": 1}', "malformed"),
    "truncated json": ('{"timestamp": 0,', "truncated"),
    "trailing characters": (GOOD + " x", "trailing"),
}


@pytest.mark.parametrize(("line", "what"), BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_bad_line_names_file_line_and_problem(tmp_path: Path, line: str, what: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", GOOD, "", line, GOOD)
    with pytest.raises(WorkloadError, match=what) as info:
        read_trace(path)
    message = str(info.value)
    assert str(path) in message
    assert "line 3" in message


def test_a_bad_line_is_reported_by_iter_trace_too(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", GOOD, "[]")
    iterator = iter_trace(path)
    assert next(iterator).hash_ids == (0, 1)
    with pytest.raises(WorkloadError, match="line 2"):
        next(iterator)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"timestamp": 0, "x": "caf\xe9"}\n')
    with pytest.raises(WorkloadError, match="UTF-8") as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert "line 2" in str(info.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(WorkloadError, match="No such file") as info:
        read_trace(path)
    assert str(path) in str(info.value)
    with pytest.raises(WorkloadError, match=r"nope\.jsonl"):
        next(iter_trace(path))
    with pytest.raises(WorkloadError, match=r"nope\.jsonl"):
        read_trace(path, limit=0)


def test_a_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="directory") as info:
        read_trace(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "secret.jsonl", GOOD)
    path.chmod(0)
    try:
        with pytest.raises(WorkloadError, match=r"secret\.jsonl"):
            read_trace(path)
    finally:
        path.chmod(0o600)


def test_workload_error_is_a_tiering_value_error() -> None:
    assert issubclass(WorkloadError, TieringError)
    assert issubclass(WorkloadError, ValueError)


def test_requests_are_frozen() -> None:
    request = Request(timestamp=0, input_length=1, output_length=1, hash_ids=(0,))
    with pytest.raises(AttributeError):
        request.timestamp = 3  # type: ignore[misc]
    assert hash(request) == hash(
        Request(timestamp=0, input_length=1, output_length=1, hash_ids=(0,))
    )


def test_write_trace_round_trips(tmp_path: Path) -> None:
    requests = [
        Request(timestamp=0, input_length=600, output_length=10, hash_ids=(0, 1)),
        Request(timestamp=12, input_length=0, output_length=3, hash_ids=()),
    ]
    path = tmp_path / "out.jsonl"
    write_trace(path, requests)
    assert read_trace(path) == requests
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first == '{"timestamp":0,"input_length":600,"output_length":10,"hash_ids":[0,1]}'


def test_write_trace_to_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot write"):
        write_trace(tmp_path, [])


def test_an_os_error_on_open_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_lines(tmp_path / "t.jsonl", GOOD)

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(WorkloadError, match="Permission denied") as info:
        read_trace(path)
    assert str(path) in str(info.value)


def test_hash_ids_must_fit_in_64_bits(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    line = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [%d]}\n'
    path.write_text(line % (2**64 - 1) + line % 2**64)
    assert read_trace(path, limit=1)[0].hash_ids == (2**64 - 1,)
    with pytest.raises(WorkloadError, match="line 2: hash id 18446744073709551616 does not fit"):
        read_trace(path)


def test_a_huge_limit_reads_everything(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert len(read_trace(path, limit=10**20)) == 1


def _line(input_length: int, hash_ids: list[int]) -> str:
    return (
        f'{{"timestamp": 0, "input_length": {input_length}, "output_length": 1, '
        f'"hash_ids": {hash_ids}}}'
    )


def test_check_trace_counts_lengths_that_disagree_with_the_ids_and_repeated_ids() -> None:
    def request(input_length: int, hash_ids: list[int]) -> Request:
        return Request(timestamp=0, input_length=input_length, output_length=1,
                       hash_ids=tuple(hash_ids))  # fmt: skip

    requests = [
        request(600, [0, 1]),  # two 512-token blocks: right
        request(100, list(range(10))),  # one block, ten ids
        request(1024, []),  # two blocks, no id
        request(1024, [5, 5]),  # the right count, one id twice
        request(0, []),  # an empty prompt has no block
        request(512, [7]),
    ]
    check = check_trace(requests)
    assert check == TraceCheck(requests=6, length_mismatches=2, repeated_ids=1,
                               first_mismatch=1, first_repeat=3)  # fmt: skip
    assert not check.consistent
    assert check_trace([requests[0], requests[4], requests[5]]).consistent
    # 256-token blocks: 600 tokens make 3 ids, 100 make 1, 1024 make 4, 512 make 2.
    assert check_trace(requests, block_tokens=256).length_mismatches == 5
    with pytest.raises(WorkloadError, match="block tokens must be at least 1, got 0"):
        check_trace(requests, block_tokens=0)


@needs_trace
def test_the_conversation_trace_is_consistent() -> None:
    assert check_trace(read_trace(CONVERSATION)).consistent


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_the_cli_warns_once_with_the_counts_and_runs_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    lines = [_line(100, list(range(10))), _line(1024, []), GOOD, _line(1024, [5, 5])]
    trace = write_lines(tmp_path / "t.jsonl", *lines, *lines)  # each problem twice
    assert main([command, "--trace", str(trace), "--capacity-tokens", "5120", "--policy", "lru",
                 "--json"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[0])["requests"] == 8  # the run went on
    assert err.count("\n") == 1
    assert err.startswith(f"tiering: warning: {trace}: of 8 requests, 4 have a number of hash ")
    assert "(request 1: 100 tokens, 10 ids; 512-token blocks make 1)" in err
    assert "2 repeat a hash id (request 4)" in err
    capsys.readouterr()
    assert main([command, "--trace", str(write_lines(tmp_path / "ok.jsonl", GOOD)),
                 "--capacity-tokens", "5120", "--json"]) == 0  # fmt: skip
    assert capsys.readouterr().err == ""
