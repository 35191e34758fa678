"""dashboards/: the Grafana dashboard and the alert rules, checked by promtool and run
against a real Prometheus scraping a real `tiering replay`."""

from __future__ import annotations

import contextlib
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
from typing import IO, Any, TypeVar

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiering.engine import TieringEngine
from tiering.hint_metrics import HINT_FAMILIES
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
#: Families with no sample while what they count is off: the events' while events are
#: off, the retention hints' until a hint was given.
QUIET_FAMILIES = EVENT_FAMILIES | set(HINT_FAMILIES)

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
    assert list(variables) == ["datasource", "instance", "engine", "tier"]
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


def tier_row(board: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The repeated row of the tiers below the CPU tier, and the panels under it."""
    items = board["panels"]
    start = next(i for i, p in enumerate(items) if p["type"] == "row" and p.get("repeat"))
    end = next((i for i in range(start + 1, len(items)) if items[i]["type"] == "row"), len(items))
    return items[start], items[start + 1 : end]


def test_a_row_repeats_per_tier_below_the_cpu_tier_and_answers_whether_it_pays_off() -> None:
    board = dashboard()
    row, under = tier_row(board)
    assert row["repeat"] == "tier"
    assert "$tier" in row["title"]
    assert not row["collapsed"]  # its panels follow it in the list, as Grafana repeats them
    assert {p["title"] for p in under} == {
        "Tier hit ratio",
        "Hits served/s",
        "Tier throughput",
        "Write-throughs/s",
        "Tier errors/s",
        "Tier up",
        "Tier occupancy",
        "Tier chunks",
        "Tier evictions/s",
    }
    # One row per tier on one screen: two lines of panels, no taller than 14 units.
    top = min(p["gridPos"]["y"] for p in under)
    assert max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in under) - top <= 14
    # Every query of the row selects its tier, and only queries of the row do.
    for panel in panels(board):
        for target in panel.get("targets", []):
            assert ('tier=~"$tier"' in target["expr"]) == (panel in under), panel["title"]
    tier = next(v for v in board["templating"]["list"] if v["name"] == "tier")
    assert tier["type"] == "query"
    assert tier["definition"] == (
        'label_values(tiering_tier_up{instance=~"$instance", engine=~"$engine"}, tier)'
    )
    assert tier["query"]["query"] == tier["definition"]
    # All by default, and All means the tiers listed (never a regex that takes cpu in).
    assert (tier["multi"], tier["includeAll"], tier["allValue"]) == (True, True, None)
    assert tier["current"]["value"] == ["$__all"]


def test_the_cpu_tier_panels_read_the_cpu_tier_only() -> None:
    """Families that tiers below also export: a CPU-tier panel selects tier="cpu" or
    splits by tier, never sums the tiers together."""
    shared = {"tiering_evictions_total", "tiering_chunks_used", "tiering_occupancy_ratio",
              "tiering_tier_bytes"}  # fmt: skip
    _, under = tier_row(dashboard())
    for panel in panels(dashboard()):
        if panel in under:
            continue
        for target in panel.get("targets", []):
            expr = target["expr"]
            if families_in(expr) & shared:
                assert 'tier="cpu"' in expr or "tier)" in expr, (panel["title"], expr)


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


def test_the_readme_lists_every_family_and_every_alert() -> None:
    readme = (DASHBOARDS / "README.md").read_text()
    assert set(re.findall(r"^\| `(tiering_[a-z0-9_]+)` \|", readme, re.M)) == set(FAMILIES)
    alerts = set(re.findall(r"- alert: (\w+)", ALERTS.read_text()))
    assert set(re.findall(r"^\| `(Tiering\w+)` \|", readme, re.M)) == alerts


# -- the rules, with promtool ------------------------------------------------------


def test_promtool_checks_the_rules() -> None:
    promtool = require_binary("promtool", "prometheus")
    out = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {ALERTS.read_text().count('- alert:')} rules found" in out.stdout


def test_promtool_unit_tests_fire_every_alert() -> None:
    promtool = require_binary("promtool", "prometheus")
    cases = ALERTS_TEST.read_text()
    for name in re.findall(r"- alert: (\w+)", ALERTS.read_text()):
        assert f"alertname: {name}" in cases, f"no promtool case for {name}"
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


class Servers:
    """Server processes of one test (Prometheus, a replay), with their logs under ``tmp_path``.

    `wait_for` fails the test, with the log, as soon as one of them exits.
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, args: list[str]) -> None:
        log = (self.tmp_path / f"{name}.log").open("wb")
        self._logs.append(log)
        self.processes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def start_prometheus(self, target: str) -> str:
        """A Prometheus scraping ``target`` every second as job ``tiering``, with the
        rules loaded; its API's base URL once it is ready."""
        prometheus = require_binary("prometheus", "prometheus")
        web_port = free_port()
        config = self.tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {ALERTS}\n"
            "scrape_configs:\n  - job_name: tiering\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.start(
            "prometheus",
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web_port}",
                "--log.level=warn",
            ],
        )
        base = f"http://127.0.0.1:{web_port}"
        self.wait_for("prometheus to be ready", lambda: fetch(f"{base}/-/ready"))
        return base

    def wait_for(
        self, what: str, check: Callable[[], T | None], seconds: float = 60, detail: object = ""
    ) -> T:
        deadline = time.monotonic() + seconds
        while True:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    log = (self.tmp_path / f"{name}.log").read_text()[-2000:]
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

    def close(self) -> None:
        for process in self.processes.values():
            stop(process)
        for log in self._logs:
            log.close()


@contextlib.contextmanager
def servers(tmp_path: Path) -> Iterator[Servers]:
    running = Servers(tmp_path)
    try:
        yield running
    finally:
        running.close()


def sampled_families(text: str) -> dict[str | None, set[str]]:
    """The families an exposition has samples of: all (key None) and per ``tier`` label."""
    sampled: dict[str | None, set[str]] = {None: set()}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            sampled[None].add(name)
            if "tier" in sample.labels:
                sampled.setdefault(sample.labels["tier"], set()).add(name)
    return sampled


def check_every_query_and_rule(
    running: Servers, base: str, target: str, *, engine: str, tiers: list[str]
) -> set[str]:
    """Every dashboard query and rule against the Prometheus at ``base`` scraping ``target``;
    the queries that never had a sample to read (the caller says which may not).

    The variables list ``target``, ``engine`` and ``tiers`` (the tiers below the CPU
    tier). A query of the tier row runs once per tier, ``$tier`` set to it. Each
    must parse and run; each must return data except where every family it reads
    has no sample at the target (of that tier, for a tier row's query): the
    event families while events are off, what a tier that does not say what it
    holds leaves out, every tier row's query when there is no tier below.
    """
    text = fetch(f"http://{target}/metrics").decode()
    sampled = sampled_families(text)
    assert "tiering_chunks_used" in sampled[None]

    # The dashboard's variables.
    instances = api(base, "/api/v1/label/instance/values", **{"match[]": "tiering_info"})
    assert instances == [target]
    engines = api(
        base,
        "/api/v1/label/engine/values",
        **{"match[]": f'tiering_info{{instance=~"{target}"}}'},
    )
    assert engines == [engine]
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    tier_query = re.fullmatch(r"label_values\((.*), tier\)", variables["tier"]["definition"])
    assert tier_query is not None

    def substitute(expr: str, tier: str = "") -> str:
        return (
            expr.replace("$__rate_interval", "5s")
            .replace("$instance", target)
            .replace("$engine", engine)
            .replace("$tier", tier)
        )

    found = api(base, "/api/v1/label/tier/values", **{"match[]": substitute(tier_query[1])})
    assert found == sorted(tiers)

    # (query, tier) pairs to run; the tier is "" for a query outside the tier row.
    runs = {
        (expr, tier)
        for _, expr in dashboard_queries(dashboard())
        for tier in (tiers if "$tier" in expr else [""])
    }
    excused = {(e, t) for e, t in runs if not families_in(e) & sampled.get(t or None, set())}
    untested = {e for _, e in dashboard_queries(dashboard())} - {e for e, t in runs - excused}
    waiting = runs - excused

    def all_return_data() -> bool:
        for expr, tier in sorted(runs):  # each must parse and run, every time
            if api(base, "/api/v1/query", query=substitute(expr, tier))["result"]:
                waiting.discard((expr, tier))
        return not waiting

    running.wait_for("every dashboard query to return data", all_return_data, 30, waiting)

    # Every rule: loaded, evaluated without error, and its query runs.
    def rules_evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
        return rules if all(r["health"] == "ok" for r in rules) else None

    rules = running.wait_for("every rule to be evaluated", rules_evaluated, 30)
    assert sorted(r["name"] for r in rules) == sorted(
        re.findall(r"- alert: (\w+)", ALERTS.read_text())
    )
    for rule in rules:
        api(base, "/api/v1/query", query=rule["query"])
    return untested


def event_queries_only(untested: set[str]) -> bool:
    return all(families_in(expr) <= EVENT_FAMILIES for expr in untested)


def quiet_queries_only(untested: set[str]) -> bool:
    """Only queries of events (off) and of retention hints (none given) had no data."""
    return all(families_in(expr) <= QUIET_FAMILIES for expr in untested)


def wait_until_scraped(running: Servers, base: str) -> None:
    def target_up() -> bool:
        active = api(base, "/api/v1/targets")["activeTargets"]
        return any(t["labels"]["job"] == "tiering" and t["health"] == "up" for t in active)

    running.wait_for("the target's metrics to be scraped", target_up)


def test_every_query_runs_against_a_real_prometheus(tmp_path: Path) -> None:
    require_binary("prometheus", "prometheus")
    metrics_port = free_port()
    target = f"127.0.0.1:{metrics_port}"
    replay_args = ["--workload", "chat", "--requests", "1000", "--bytes-per-token", "16",
                   "--capacity-tokens", str(100 * 512), "--metrics-port", str(metrics_port),
                   "--hold", "300", "--hints", "continuation", "--json"]  # fmt: skip
    with servers(tmp_path) as running:
        running.start("replay", [sys.executable, "-m", "tiering", "replay", *replay_args])
        base = running.start_prometheus(target)
        wait_until_scraped(running, base)
        # The replay's engine, labelled with its engine id ("replay"), no tier below its
        # CPU tier (the tier row is checked against two in tests/test_dashboards_tiers.py),
        # its requests hinted (so every query of the hints' row has data to read).
        untested = check_every_query_and_rule(running, base, target, engine="replay", tiers=[])
        assert event_queries_only({e for e in untested if "$tier" not in e}), untested
        capacity = api(base, "/api/v1/query", query=(
            f'tiering_chunks_capacity{{instance=~"{target}", engine=~"replay"}}'
        ))["result"]  # fmt: skip
        assert [float(s["value"][1]) for s in capacity] == [100.0]
