"""`tiering replay` with KV cache events on, and `tiering events` reading them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tiering.cli import main
from tiering.engine import TieringEngine
from tiering.events import AllBlocksCleared, BlockRemoved, BlockStored, SequencedBatch
from tiering.replay import ReplayOptions, replay
from tiering.workload import chat_workload

pytestmark = pytest.mark.anyio

SMALL = {"bytes_per_token": 16, "block_tokens": 512}  # 8 KiB pages


async def test_stored_minus_removed_is_what_the_tier_holds(
    anyio_backend: str, tmp_path: Path
) -> None:
    """Counting over a whole replay with evictions: the events tell the tier's contents."""
    held: set[int] = set()
    in_tier: list[int] = []
    batches = [0]

    @contextlib.asynccontextmanager
    async def count(engine: TieringEngine) -> AsyncIterator[None]:
        async def consume() -> None:
            async for item in engine.subscribe(max_batches=1 << 20):
                assert isinstance(item, SequencedBatch)
                batches[0] += 1
                for event in item.batch.events:
                    if isinstance(event, BlockStored):
                        assert not held & set(event.block_hashes), "stored twice"
                        held.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        assert set(event.block_hashes) <= held, "removed before stored"
                        held.difference_update(event.block_hashes)
                    else:
                        assert isinstance(event, AllBlocksCleared)
                        held.clear()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            yield
            # Every request is done; wait until the last batch is published and read.
            while engine.manager.statistics().events_pending or batches[0] < published(engine):
                await anyio.wait_all_tasks_blocked()  # the last batch is published and read
            in_tier.append(engine.manager.statistics().used)
            tg.cancel_scope.cancel()

    options = ReplayOptions(
        capacity_tokens=60 * 512,
        events_endpoint=f"ipc://{tmp_path}/events",
        verify=True,
        **SMALL,
    )
    with anyio.fail_after(60):
        result = await replay(chat_workload(300, seed=5), options, on_open=count)
    assert result.evictions > 0
    assert (result.corrupt_chunks, result.events_dropped) == (0, 0)
    assert result.events_published > 0
    assert len(held) == in_tier[0] == result.capacity_chunks


def published(engine: TieringEngine) -> int:
    stats = engine.statistics().events
    assert stats is not None
    return stats.batches_total


def test_replay_json_counts_events(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        [
            "replay", "--workload", "chat", "--requests", "50", "--json",
            "--events-endpoint", f"ipc://{tmp_path}/ev",
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["events_published"] > 0
    assert summary["events_dropped"] == 0
    off = main(["replay", "--workload", "chat", "--requests", "20", "--json"])
    assert off == 0
    assert json.loads(capsys.readouterr().out)["events_published"] == 0


def test_a_late_subscriber_replays_what_the_replay_published(tmp_path: Path) -> None:
    """`tiering replay --hold` keeps its sockets up; `tiering events` joins late and gets it all.

    The replay says how many events it published as its hold begins; the printer
    is read until it has printed that many, and only then does Ctrl-C end the hold:
    no race between the hold's end and a slow printer.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    replayer = subprocess.Popen(
        [
            sys.executable, "-m", "tiering", "replay", "--workload", "chat",
            "--requests", "60", "--json", "--hold", "120",
            "--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", "tcp://127.0.0.1:*",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    printer = None
    reader = None
    printed: list[str] = []
    try:
        assert replayer.stderr is not None
        line = replayer.stderr.readline()
        found = re.search(r"at (tcp://\S+), replay at (tcp://\S+)", line)
        assert found, line
        endpoint, replay_endpoint = found.groups()
        printer = subprocess.Popen(
            [
                sys.executable, "-m", "tiering", "events", endpoint,
                "--replay-endpoint", replay_endpoint, "--json",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        held = replayer.stderr.readline()
        done = re.search(r"replay done; holding the events endpoints \(([\d,]+) KV cache", held)
        assert done, held
        announced = int(done.group(1).replace(",", ""))
        assert printer.stdout is not None
        reader = threading.Thread(target=lambda: printed.extend(printer.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while len(printed) < announced and time.monotonic() < deadline:
            time.sleep(0.05)
        replayer.send_signal(signal.SIGINT)  # ends the hold; the summary follows
        out, _ = replayer.communicate(timeout=60)
        assert replayer.returncode == 0
        published = json.loads(out)["events_published"]
    finally:
        replayer.kill()
        if printer is not None:
            printer.terminate()
    printer.wait(timeout=30)
    assert reader is not None
    assert printer.stderr is not None
    reader.join(timeout=10)
    errors = printer.stderr.read()
    for stream in (printer.stdout, printer.stderr):
        if stream is not None:
            stream.close()
    lines = [json.loads(x) for x in printed]
    assert published == announced
    assert len(lines) == published, errors
    assert [x["seq"] for x in lines] == sorted(x["seq"] for x in lines)
    assert {x["type"] for x in lines} == {"BlockStored"}  # the tier never filled up


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["not-an-endpoint"], "not-an-endpoint"),
        # An unknown host is refused at once, not waited for (RFC 2606: .invalid never resolves).
        (["tcp://no-such-host.invalid:5557"], "cannot resolve host 'no-such-host.invalid'"),
        (
            ["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://no-such-host.invalid:5558"],
            "replay endpoint 'tcp://no-such-host.invalid:5558'",
        ),
    ],
)
def test_events_command_bad_endpoint_is_one_line(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["events", *args, "--limit", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert named in err[0]


def test_replay_endpoint_without_events_endpoint_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--workload", "chat", "--replay-endpoint", "tcp://127.0.0.1:*"])
    assert exit_info.value.code == 2
    assert "events endpoint" in capsys.readouterr().err
