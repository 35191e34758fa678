"""The examples run as they are, and the README quotes them as they are."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    load_config,
)
from tiering.scheduler import SchedulerLimits

ROOT = Path(__file__).resolve().parent.parent
EMBED = ROOT / "examples" / "embed.py"
SERVER = ROOT / "examples" / "server.py"
CONFIG = ROOT / "examples" / "tiering.toml"


def test_the_embedding_example_runs_and_verifies_the_bytes() -> None:
    done = subprocess.run(
        [sys.executable, str(EMBED)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stored and loaded 3 chunks (196608 bytes): bytes verified\n"
    assert done.stderr == ""


def test_the_readme_quotes_the_embedding_example() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "`examples/embed.py`" in readme
    section = readme[readme.index("`examples/embed.py`") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert snippet is not None
    example = {line.strip() for line in EMBED.read_text().splitlines()}
    for line in snippet.group(1).splitlines():
        assert not line.strip() or line.strip() in example, f"not in examples/embed.py: {line}"


# -- examples/tiering.toml: a complete load_config file ----------------------------------

#: The file's tables and the record each holds ("": the top level).
TABLES: dict[str, type[msgspec.Struct]] = {
    "": OffloadingConfig,
    "groups": OffloadingGroupConfig,
    "model": OffloadingModelConfig,
    "cache": OffloadingCacheConfig,
    "parallel": OffloadingParallelConfig,
}
#: An optional key the file shows commented out (TOML has no null): ``# key = value``.
OPTIONAL = re.compile(r"# (\w+) = (.+)")


def _keys_by_table(text: str) -> dict[str, dict[str, bool]]:
    """Per table, every key the file sets (True) or shows commented out (False)."""
    tables: dict[str, dict[str, bool]] = {"": {}}
    table = ""
    for line in text.splitlines():
        if header := re.fullmatch(r"\[\[?(\w+)\]\]?", line):
            table = header.group(1)
            tables.setdefault(table, {})
        elif key := re.fullmatch(r"(\w+) = .+", line):
            tables[table][key.group(1)] = True
        elif key := OPTIONAL.fullmatch(line):
            tables[table][key.group(1)] = False
    return tables


def test_the_example_config_loads_and_shows_every_key_of_every_record() -> None:
    config = load_config(CONFIG)
    tables = _keys_by_table(CONFIG.read_text())
    for table, record in TABLES.items():
        fields = set(record.__struct_fields__)
        if not table:
            fields -= set(TABLES) | {"extra_config"}  # tables of their own
        assert set(tables[table]) == fields, f"[{table}]"
    # The engine's bounds from extra_config, every one of them.
    assert set(tables["extra_config"]) == set(SchedulerLimits.__struct_fields__)
    assert config.extra_config == msgspec.structs.asdict(SchedulerLimits())
    assert (config.engine_id, config.model.name, config.model.dtype) == (
        "example-0",
        "example/tiny",
        "bfloat16",
    )
    assert config.groups[0].layer_names == ("model.layers.0.attn", "model.layers.1.attn")


def test_the_example_configs_optional_keys_load_when_set(tmp_path: Path) -> None:
    text = CONFIG.read_text()
    optional = {m.group(1): m.group(2) for m in map(OPTIONAL.fullmatch, text.splitlines()) if m}
    assert set(optional) == {
        "kv_cache_layout",
        "sliding_window_size_in_chunks",
        "data_parallel_rank_local",
    }
    path = tmp_path / "all.toml"
    path.write_text(re.sub(r"(?m)^# (\w+ = )", r"\1", text))
    config = load_config(path)
    got = {
        "kv_cache_layout": config.kv_cache_layout,
        "sliding_window_size_in_chunks": config.groups[0].sliding_window_size_in_chunks,
        "data_parallel_rank_local": config.parallel.data_parallel_rank_local,
    }
    assert got == {key: json.loads(value) for key, value in optional.items()}


def test_the_example_configs_parallel_table_is_the_default_and_says_what_it_needs(
    tmp_path: Path,
) -> None:
    text = CONFIG.read_text()
    path = tmp_path / "no-parallel.toml"
    path.write_text(text[: text.index("[parallel]")])  # the last table, left out
    assert load_config(path).parallel == load_config(CONFIG).parallel  # rank 0 of 1...
    # "Given, it needs every key but the last two", as the file lists them.
    fields = msgspec.structs.fields(OffloadingParallelConfig)
    assert [field.required for field in fields] == [True] * (len(fields) - 2) + [False] * 2
    assert list(_keys_by_table(text)["parallel"])[-2:] == [f.name for f in fields[-2:]]


# -- examples/server.py: an HTTP server embedding the engine with a disk tier --------------

PROMPT = "The quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 8 full blocks


class Server:
    """examples/server.py in a process of its own, on a free loopback port; ``started``
    holds its process from the start, so that a server that fails to come up is stopped
    too."""

    def __init__(self, disk: Path, started: list[subprocess.Popen[str]]) -> None:
        argv = [sys.executable, str(SERVER), "--disk", str(disk), "--port", "0"]
        self.process = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(self.process)
        assert self.process.stdout is not None
        self.found = self.process.stdout.readline()
        serving = re.fullmatch(r"serving on (http://127\.0\.0\.1:\d+)\n", self._line())
        assert serving is not None, self.process.stderr.read() if self.process.stderr else ""
        self.url = serving.group(1)

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline()

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        request = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def generate(self, prompt: str) -> dict[str, Any]:
        status, body = self.get("/generate?" + urllib.parse.urlencode({"prompt": prompt}))
        assert status == 200, body
        answer: dict[str, Any] = json.loads(body)
        return answer

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, body = self.get("/metrics")
        assert status == 200
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
        }

    def stop(self) -> str:
        """SIGTERM by pid; what it printed after serving."""
        os.kill(self.process.pid, signal.SIGTERM)
        out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, err
        assert err == ""  # nothing logged: no error, no traceback
        return out


def _value(
    series: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return series[(name, frozenset({"engine": "example-0", **labels}.items()))]


@pytest.fixture
def servers(tmp_path: Path) -> Any:
    started: list[subprocess.Popen[str]] = []
    yield lambda: Server(tmp_path / "disk", started)
    for process in started:  # by pid, each one this test started
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_the_server_example_stores_loads_and_promotes_from_disk_after_a_restart(
    servers: Any, tmp_path: Path
) -> None:
    first = servers()
    assert first.found == f"disk tier at {tmp_path / 'disk'}: 0 chunks from earlier runs\n"
    computed = first.generate(PROMPT)
    assert computed == {"blocks": 8, "cpu_hits": 0, "disk_hits": 0, "computed": 8,
                        "loaded": False, "stored": True, "verified": None}  # fmt: skip
    again = first.generate(PROMPT)
    assert again == {"blocks": 8, "cpu_hits": 8, "disk_hits": 0, "computed": 0,
                     "loaded": True, "stored": False, "verified": True}  # fmt: skip
    series = first.metrics()
    cpu = {"tier": "cpu"}
    assert _value(series, "tiering_jobs_total", direction="store", outcome="ok", **cpu) == 1
    assert _value(series, "tiering_jobs_total", direction="load", outcome="ok", **cpu) == 1
    assert _value(series, "tiering_chunks_used", **cpu) == 8
    assert first.get("/elsewhere")[0] == 404
    # Refused, each with why: a prompt that can never fit (not "try again"), none at all.
    too_long = first.get("/generate?" + urllib.parse.urlencode({"prompt": "x" * 16 * 257}))
    assert too_long == (
        413,
        b'{"error": "the prompt takes 257 GPU blocks; the GPU KV cache has 256"}',
    )
    assert first.get("/generate") == (400, b'{"error": "no prompt: GET /generate?prompt=TEXT"}')
    assert first.generate("")["blocks"] == 0  # an empty prompt is a request of no block
    assert first.stop() == "stopped: 8 chunks written through to the disk tier\n"

    second = servers()  # a new process over the same folder: the CPU tier is empty
    assert second.found == f"disk tier at {tmp_path / 'disk'}: 8 chunks from earlier runs\n"
    promoted = second.generate(PROMPT)
    assert promoted == {"blocks": 8, "cpu_hits": 0, "disk_hits": 8, "computed": 0,
                        "loaded": True, "stored": False, "verified": True}  # fmt: skip
    series = second.metrics()
    disk = {"tier": "disk"}
    assert _value(series, "tiering_lookups_total", result="hit", **disk) == 8
    assert _value(series, "tiering_jobs_total", direction="load", outcome="ok", **disk) == 8
    assert _value(series, "tiering_transfer_bytes_total", direction="load", **disk) == 8 * 65536
    assert _value(series, "tiering_tier_up", **disk) == 1
    # The engine's metrics, whole: every family's name.
    names = {name for (name, _) in series}
    assert {"tiering_info", "tiering_chunks_capacity", "tiering_transfer_seconds_count"} <= names
    assert second.stop() == "stopped: 0 chunks written through to the disk tier\n"


def test_the_server_example_stops_cleanly_with_a_request_half_read(servers: Any) -> None:
    server = servers()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as half:
        half.sendall(b"GET /generate?prompt=" + b"x" * 64 + b" HTTP/1.1\r\n")  # no blank line
        # A connection after it, answered: the server has taken the first one (accepted
        # in order, its task started first) and is reading the rest of its request.
        assert server.get("/metrics")[0] == 200
        os.kill(server.process.pid, signal.SIGTERM)
        out, err = server.process.communicate(timeout=60)
        assert half.recv(1) == b""  # dropped, unanswered: its request never came whole
    assert server.process.returncode == 0, err
    assert err == ""  # no traceback of the dropped connection's task
    assert out == "stopped: 0 chunks written through to the disk tier\n"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--port", "99999"], "argument --port: expected a port in 0-65535, got '99999'"),
        (["--cpu-bytes", "10"], "cpu_bytes=10 holds no chunk"),
        (["--config", "/absent/tiering.toml"], "cannot read config file '/absent/tiering.toml'"),
        (["--port", "BUSY"], "cannot listen on 127.0.0.1:"),
    ],
)
def test_the_server_example_refuses_bad_input_in_one_line(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    with socket.socket() as busy:  # a port in use, held by this test
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags = [str(busy.getsockname()[1]) if f == "BUSY" else f for f in flags]
        argv = [sys.executable, str(SERVER), "--disk", str(tmp_path / "disk"), *flags]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    *usage, line = done.stderr.splitlines()  # argparse's usage line first, for a bad flag
    assert line.startswith("server.py: error: ")
    assert said in line, line
    assert bool(usage) == said.startswith("argument ")  # a flag argparse refused: its usage


def test_the_readme_points_at_the_server_example_and_its_config() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "`examples/server.py`" in readme
    assert "`examples/tiering.toml`" in readme
