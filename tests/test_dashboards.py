"""dashboards/: the Grafana dashboard and the alert rules, checked by promtool and run
against a real Prometheus scraping a real `tiering replay`."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiering.engine import TieringEngine
from tiering.metrics import FAMILIES, UNDASHBOARDED, render_metrics
from tiering.replay import ReplayOptions, replay_config

from .conftest import require_binary

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = ROOT / "dashboards"
DASHBOARD = DASHBOARDS / "tiering.json"
ALERTS = DASHBOARDS / "alerts.yml"
ALERTS_TEST = DASHBOARDS / "alerts_test.yml"
PROMETHEUS_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NAME = re.compile(r"\btiering_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
EVENT_FAMILIES = {"tiering_events_published_total", "tiering_events_dropped_total"}

T = TypeVar("T")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside a collapsed row


def dashboard_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in panels(board)
        for target in panel.get("targets", [])
    ]


def families_in(text: str) -> set[str]:
    """Metric families named in ``text`` (histogram series names folded into their family)."""
    found = set()
    for name in NAME.findall(text):
        for suffix in HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and name.removesuffix(suffix) in FAMILIES:
                name = name.removesuffix(suffix)
        found.add(name)
    return found


def exposition() -> str:
    config = replay_config(ReplayOptions(bytes_per_token=16, block_tokens=512))
    kv = {"kv": torch.zeros((8, 16 * 512 // 8), dtype=torch.int64)}
    return render_metrics(TieringEngine(config, kv, cpu_bytes=4 * 16 * 512)).decode()


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


# -- the dashboard on its own ----------------------------------------------------


def test_the_dashboard_json_is_what_the_generator_makes() -> None:
    assert DASHBOARD.read_text() == generator().render(), "stale: run make dashboards"


def test_the_dashboard_is_importable_and_names_no_datasource_uid() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 39
    assert (board["uid"], board["title"]) == ("tiering-kv-cache", "tiering: KV-cache CPU tier")
    assert board["id"] is None  # import and provisioning assign it
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "instance", "engine"]
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == (
        "datasource",
        "prometheus",
    )
    engine = variables["engine"]
    assert engine["type"] == "query"
    assert engine["datasource"] == PROMETHEUS_DATASOURCE
    assert re.fullmatch(r"label_values\(tiering_info(\{.*\})?, engine\)", engine["definition"])
    assert engine["query"]["query"] == engine["definition"]
    # Every datasource reference is the variable (the annotations' built-in one aside).
    for key, value in walk(board):
        if key == "datasource" and isinstance(value, dict) and value.get("type") != "grafana":
            assert value == PROMETHEUS_DATASOURCE
    # Every panel queries, by code, with the selectors of the variables.
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == PROMETHEUS_DATASOURCE, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) > 0, panel["title"]
        for target in panel["targets"]:
            assert 'engine=~"$engine"' in target["expr"], target["expr"]
            assert 'instance=~"$instance"' in target["expr"], target["expr"]


def test_the_dashboard_layout_has_unique_ids_and_no_overlap() -> None:
    board = dashboard()
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels(board):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] < grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_dashboard_has_the_panels_operators_need() -> None:
    titles = {p["title"] for p in panels(dashboard())}
    assert {
        "CPU tier occupancy",
        "Occupancy ratio",
        "Writing, pinned and evictable chunks",
        "Lookup hit ratio",
        "Transfer throughput",
        "Job latency p50 / p99",
        "Jobs queued and in flight",
        "Evictions/s",
        "Allocation failures/s",
        "Failed jobs",
        "Events published/s",
        "Events dropped",
    } <= titles


def test_every_name_in_dashboards_is_exported_and_every_family_is_used() -> None:
    exported = {line.split()[2] for line in exposition().splitlines() if line.startswith("# HELP")}
    assert exported == set(FAMILIES)
    for path in sorted(DASHBOARDS.iterdir()):
        unknown = families_in(path.read_text()) - set(FAMILIES)
        assert not unknown, f"{path.name} names metrics that are not exported: {unknown}"
    used = families_in(DASHBOARD.read_text()) | families_in(ALERTS.read_text())
    assert set(FAMILIES) >= UNDASHBOARDED
    assert not UNDASHBOARDED & used, "listed as undashboarded, but used"
    assert set(FAMILIES) - UNDASHBOARDED - used == set(), "in no panel and no rule"


# -- the rules, with promtool ------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    promtool = require_binary("promtool", "prometheus")
    out = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {ALERTS.read_text().count('- alert:')} rules found" in out.stdout


def test_promtool_unit_tests_fire_the_tier_full_alert() -> None:
    promtool = require_binary("promtool", "prometheus")
    assert "alertname: TieringTierFull" in ALERTS_TEST.read_text()
    out = subprocess.run(
        [promtool, "test", "rules", str(ALERTS_TEST)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- every query against a real Prometheus scraping a real replay -------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fetch(url: str) -> bytes:
    with _OPENER.open(url, timeout=5) as response:
        body: bytes = response.read()
        return body


def api(base: str, path: str, **params: str) -> Any:
    """A Prometheus HTTP API call; its ``data``, or a failure with the error it gave."""
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        reply = json.loads(fetch(url))
    except urllib.error.HTTPError as exc:
        reply = json.loads(exc.read())
    assert reply["status"] == "success", f"{params}: {reply.get('error')}"
    return reply["data"]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_every_query_runs_against_a_real_prometheus(tmp_path: Path) -> None:
    prometheus = require_binary("prometheus", "prometheus")
    metrics_port, web_port = free_port(), free_port()
    base = f"http://127.0.0.1:{web_port}"
    target = f"127.0.0.1:{metrics_port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {ALERTS}\n"
        "scrape_configs:\n  - job_name: tiering\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("prometheus", "replay")}
    replay_args = ["--workload", "chat", "--requests", "1000", "--bytes-per-token", "16",
                   "--capacity-tokens", str(100 * 512), "--metrics-port", str(metrics_port),
                   "--hold", "300", "--json"]  # fmt: skip
    prometheus_args = [
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{web_port}",
        "--log.level=warn",
    ]
    processes = {
        "prometheus": subprocess.Popen(
            [prometheus, *prometheus_args], stdout=logs["prometheus"], stderr=subprocess.STDOUT
        ),
        "replay": subprocess.Popen(
            [sys.executable, "-m", "tiering", "replay", *replay_args],
            stdout=logs["replay"],
            stderr=subprocess.STDOUT,
        ),
    }

    def wait_for(
        what: str, check: Callable[[], T | None], seconds: float = 60, detail: object = ""
    ) -> T:
        deadline = time.monotonic() + seconds
        while True:
            for name, process in processes.items():
                if process.poll() is not None:
                    log = (tmp_path / f"{name}.log").read_text()[-2000:]
                    pytest.fail(
                        f"{name} exited ({process.returncode}) while waiting for {what}:\n{log}"
                    )
            try:
                found = check()
            except (urllib.error.URLError, ConnectionError):
                found = None
            if found:
                return found
            if time.monotonic() > deadline:
                still = f"; still waiting for {detail}" if detail else ""
                pytest.fail(f"timed out after {seconds} s waiting for {what}{still}")
            time.sleep(0.2)

    try:
        wait_for("prometheus to be ready", lambda: fetch(f"{base}/-/ready"))

        def target_up() -> bool:
            active = api(base, "/api/v1/targets")["activeTargets"]
            return any(t["labels"]["job"] == "tiering" and t["health"] == "up" for t in active)

        wait_for("the replay's metrics to be scraped", target_up)

        # The families the target exports with samples (event ones only with events on).
        text = fetch(f"http://{target}/metrics").decode()
        sampled = {
            family.name + ("_total" if family.type == "counter" else "")
            for family in text_string_to_metric_families(text)
            if family.samples
        }
        assert "tiering_chunks_used" in sampled

        # The dashboard's variables.
        instances = api(base, "/api/v1/label/instance/values", **{"match[]": "tiering_info"})
        assert instances == [target]
        engines = api(
            base,
            "/api/v1/label/engine/values",
            **{"match[]": f'tiering_info{{instance=~"{target}"}}'},
        )
        assert engines == ["0"]  # the first engine of the replay's process

        def substitute(expr: str) -> str:
            return (
                expr.replace("$__rate_interval", "5s")
                .replace("$instance", target)
                .replace("$engine", engines[0])
            )

        queries = dashboard_queries(dashboard())
        # A query may return no data only when every family it reads has no
        # sample at the target: the event families while events are off.
        excused = {expr for _, expr in queries if not families_in(expr) & sampled}
        assert all(families_in(expr) <= EVENT_FAMILIES for expr in excused), excused
        waiting = {expr for _, expr in queries} - excused

        def all_return_data() -> bool:
            for _, expr in queries:  # each must parse and run, every time
                if api(base, "/api/v1/query", query=substitute(expr))["result"]:
                    waiting.discard(expr)
            return not waiting

        wait_for("every dashboard query to return data", all_return_data, 30, waiting)

        capacity = api(base, "/api/v1/query", query=substitute(
            'tiering_chunks_capacity{instance=~"$instance", engine=~"$engine"}'
        ))["result"]  # fmt: skip
        assert [float(s["value"][1]) for s in capacity] == [100.0]

        # Every rule: loaded, evaluated without error, and its query runs.
        def rules_evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
            return rules if all(r["health"] == "ok" for r in rules) else None

        rules = wait_for("every rule to be evaluated", rules_evaluated, 30)
        assert sorted(r["name"] for r in rules) == sorted(
            re.findall(r"- alert: (\w+)", ALERTS.read_text())
        )
        for rule in rules:
            api(base, "/api/v1/query", query=rule["query"])
    finally:
        for process in processes.values():
            stop(process)
        for log in logs.values():
            log.close()
