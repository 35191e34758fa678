"""An optional part without its package: one `ConfigError` naming the extra, where it is
configured; from the command line, one line and exit code 2.

The package is made unimportable in this process (``sys.modules[name] = None``, its
loaded submodules too, all restored after the test), as on a machine where it was
never installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

from tiering._extras import EXTRAS, install_line, require
from tiering.cli import main
from tiering.errors import ConfigError
from tiering.secondary import RemoteNamespace

from .test_engine import config, kv_caches

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = RemoteNamespace(model="m", dtype="float16", row_bytes=4096, blocks_per_chunk=1)


def without(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """``package`` cannot be imported until the test ends (whatever was loaded before)."""
    for name in [n for n in sys.modules if n == package or n.startswith(f"{package}.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, package, None)


def test_each_extra_is_one_of_the_distributions_extras_and_all_takes_them_all() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(EXTRAS) <= set(extras)
    assert extras["all"] == [f"tiering[{','.join(EXTRAS)}]"]
    assert extras["zmq"] == ["tiering[events]"]  # the old name of the events extra
    assert "tiering[all]" in extras["dev"]


def test_require_names_the_extra_and_what_needs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert require("json", "plot", "a test") is sys.modules["json"]
    without(monkeypatch, "redis")
    with pytest.raises(ConfigError) as caught:
        require("redis.exceptions", "redis", "the Redis tier")
    assert str(caught.value) == (
        "the Redis tier needs redis-py, an optional part: pip install 'tiering[redis]'"
    )
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__  # no chained ImportError traceback
    with pytest.raises(ValueError, match="no extra 'redi'; the extras: redis, events"):
        install_line("redi")


@pytest.mark.parametrize(
    ("package", "file", "source", "missing"),
    [
        ("brokenpart", "brokenpart.py", "import a_module_that_is_not_there\n",
         "a_module_that_is_not_there"),
        # As a matplotlib whose compiled module was built for another Python: the package
        # is found, one of its own modules is not. "Install the extra" would not help.
        ("halfpart", "halfpart/__init__.py", "from halfpart._native import path\n",
         "halfpart._native"),
    ],
)  # fmt: skip
def test_a_package_there_that_cannot_be_imported_says_why_not_that_it_is_missing(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    package: str,
    file: str,
    source: str,
    missing: str,
) -> None:
    (tmp_path / file).parent.mkdir(exist_ok=True)
    (tmp_path / file).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as caught:
        require(package, "plot", "a plot")
    assert str(caught.value) == (
        "a plot needs matplotlib, an optional part, and it cannot be imported (No module "
        f"named '{missing}'): pip install 'tiering[plot]'"
    )


def test_the_redis_tier_without_redis_py_is_refused_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tiering.secondary.redis import RedisTier

    without(monkeypatch, "redis")
    with pytest.raises(ConfigError, match=r"^the Redis tier needs redis-py.*'tiering\[redis\]'$"):
        RedisTier("redis://127.0.0.1:1", NAMESPACE)


def test_an_engine_publishing_events_without_pyzmq_is_refused_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import msgspec

    from tiering.engine import TieringEngine
    from tiering.events import KVEventsConfig

    without(monkeypatch, "zmq")
    events_on = msgspec.structs.replace(config(), enable_kv_cache_events=True)
    with pytest.raises(
        ConfigError, match=r"^the ZMQ publisher of KV events needs pyzmq.*'tiering\[events\]'$"
    ):
        TieringEngine(events_on, kv_caches(), cpu_bytes=1 << 20, events=KVEventsConfig())
    # Events to in-process subscribers only need no pyzmq.
    TieringEngine(events_on, kv_caches(), cpu_bytes=1 << 20)


def test_plotting_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tiering.sim.plot import PlotUnavailableError, check_plotting, plot_hit_rates

    without(monkeypatch, "matplotlib")
    for call in (
        lambda: check_plotting(tmp_path / "x.png"),
        lambda: plot_hit_rates([], tmp_path / "x.png", title="t"),
    ):
        with pytest.raises(PlotUnavailableError, match=r"needs matplotlib.*'tiering\[plot\]'$"):
            call()
    assert issubclass(PlotUnavailableError, ConfigError)


@pytest.mark.parametrize(
    ("package", "argv", "line"),
    [
        (
            "redis",
            ["replay", "--workload", "chat", "--requests", "5", "--remote",
             "redis://127.0.0.1:1"],
            "the remote tier (--remote, --remote-url-env) needs redis-py, an optional part: "
            "pip install 'tiering[redis]'",
        ),
        (
            "redis",
            ["replay", "--workload", "chat", "--requests", "5", "--remote-url-env"],
            "the remote tier (--remote, --remote-url-env) needs redis-py, an optional part: "
            "pip install 'tiering[redis]'",
        ),
        (
            "zmq",
            ["replay", "--workload", "chat", "--requests", "5", "--events-endpoint",
             "tcp://127.0.0.1:1"],
            "--events-endpoint needs pyzmq, an optional part: pip install 'tiering[events]'",
        ),
        (
            "zmq",
            ["events", "tcp://127.0.0.1:1", "--timeout", "1"],
            "tiering events needs pyzmq, an optional part: pip install 'tiering[events]'",
        ),
        (
            "matplotlib",
            ["simulate", "--workload", "chat", "--requests", "5", "--capacity-tokens", "1000",
             "--plot", "{tmp}/hits.png"],
            "a plot (--plot) needs matplotlib, an optional part: pip install 'tiering[plot]'",
        ),
    ],
)  # fmt: skip
def test_the_command_line_says_which_extra_in_one_line_and_exits_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    package: str,
    argv: list[str],
    line: str,
) -> None:
    monkeypatch.setenv("TIERING_REMOTE_URL", "redis://127.0.0.1:1")
    without(monkeypatch, package)
    with pytest.raises(SystemExit) as exited:
        main([arg.format(tmp=tmp_path) for arg in argv])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.err == f"tiering: error: {line}\n"
    assert captured.out == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, no plot


def test_the_readme_installs_from_a_checkout_or_the_built_wheel_never_from_pypi() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = "\n".join(re.findall(r"```sh\n(.*?)```", readme, re.DOTALL))
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # No `tiering` distribution exists on PyPI: every install names a folder or the wheel
    # `make dist` builds (its name carries the version), with the extras it needs.
    assert re.findall(r"pip install (\S+)", commands) == [
        "'/path/to/tiering[redis]'",
        f"'dist/tiering-{version}-py3-none-any.whl[redis,events]'",
    ]
    assert "make dist" in commands
