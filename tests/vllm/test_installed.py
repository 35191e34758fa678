"""The built wheel, installed (not editable) into a fresh virtual environment, under vLLM.

What an operator does (README, "Use it from vLLM"): build the wheel, install it
into vLLM's environment, keep vLLM's torch. Here: the wheel is built from a copy
of the checkout's sources (the checkout is left as it is), installed with
``--no-deps`` into a new venv, which sees the packages it depends on (torch, vLLM's
imports) through a ``.pth`` line naming this venv's site-packages, where the
editable install's own ``.pth`` hook is not run, so the checkout's ``tiering``
cannot be imported there; vLLM's sources are on ``PYTHONPATH`` as in every vLLM
test. Then ``installed_forms.py`` drives each form through vLLM's scheduler with
the fresh venv's python, and the test checks the hits and where each class came from.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm

from tiering._extras import EXTRAS

from ..secondary import conftest as secondary
from .harness import write_model

redis_server = secondary.redis_server

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: What each extra installs (the distribution's name in its requirement).
PACKAGES = {"redis": "redis", "events": "pyzmq", "plot": "matplotlib", "auth": "cryptography"}

pytestmark = pytest.mark.slow


def run(*command: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=300, **kwargs
    )
    if done.returncode != 0:
        raise AssertionError(f"{command} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as ``make dist`` builds it, from a copy of the sources."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "tiering", source / "tiering", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", out, source)
    (built,) = out.glob("tiering-*-py3-none-any.whl")
    return built


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> tuple[Path, dict[str, str]]:
    """A new venv holding the wheel, and the environment to run its python in."""
    home = tmp_path_factory.mktemp("fresh")
    venv = home / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # This venv's packages (torch, numpy, msgspec, redis-py...), after the fresh venv's own.
    (Path(site.stdout.strip()) / "tiering-deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {
        "PYTHONPATH": str(Path(vllm.__file__).resolve().parents[1]),
        "PYTHONNOUSERSITE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
    }
    # Before the install: the checkout's editable tiering is not seen from there.
    probe = subprocess.run(
        [python, "-c", "import tiering"], capture_output=True, text=True, cwd=home, env=env
    )
    assert probe.returncode == 1, probe.stderr
    assert "No module named 'tiering'" in probe.stderr
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
        "--no-index", wheel)  # fmt: skip
    return venv, env


def test_the_wheel_holds_the_package_its_marker_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = email.parser.Parser().parsestr(
            archive.read(f"{wheel.name.split('-py3')[0]}.dist-info/METADATA").decode()
        )
    sources = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tiering").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert sources <= names  # every module of the package
    assert "tiering/py.typed" in names  # typed, for mypy in the user's project
    info = f"{wheel.name.split('-py3')[0]}.dist-info/"
    assert {n for n in names if not n.startswith(("tiering/", info))} == set()
    assert not any(n.endswith((".pyc", ".so")) for n in names)
    assert {n for n in names if n.startswith("tiering/") and not n.endswith(".py")} == {
        "tiering/py.typed"
    }
    # The extras: one per optional part, its old name, and one that takes them all.
    extras = set(metadata.get_all("Provides-Extra"))
    assert set(EXTRAS) | {"zmq", "all", "dev"} == extras
    requires = metadata.get_all("Requires-Dist")
    for extra, package in PACKAGES.items():
        assert any(r.startswith(package) and f'extra == "{extra}"' in r for r in requires)
    assert f'tiering[{",".join(sorted(EXTRAS))}]; extra == "all"' in requires
    assert 'tiering[events]; extra == "zmq"' in requires
    torch = [r for r in requires if r.startswith("torch")]
    assert torch == ["torch>=2.4"]  # met by vLLM's torch: the install keeps it


def test_each_form_runs_under_vllms_scheduler_from_the_installed_wheel(
    fresh: tuple[Path, dict[str, str]],
    wheel: Path,
    redis_server: secondary.RedisServer,
    tmp_path: Path,
) -> None:
    venv, env = fresh
    model = write_model(tmp_path / "model")
    done = run(
        venv / "bin" / "python", HERE / "installed_forms.py", model, redis_server.url,
        f"installed-{uuid.uuid4().hex}", cwd=tmp_path, env=env,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    installed = str(venv.resolve())
    assert result["tiering"].startswith(installed), result["tiering"]
    assert result["version"] == "0.1.0"
    assert result["distribution"].startswith(installed), result["distribution"]
    assert result["direct_url"]["url"].endswith(wheel.name)  # installed from the wheel file
    assert "dir_info" not in result["direct_url"]  # where an editable install says so
    for form in ("tiering_spec", "cache_policy", "redis_tier"):
        for file in result[form]["files"]:
            assert file.startswith(installed), (form, file)
            assert "/tiering/" in file
    # Every block of the repeated prompt came from the CPU tier (vLLM recomputes nothing
    # of a full prefix hit but its last token, which the 256 counts include).
    assert result["tiering_spec"]["hits"] == 256
    assert result["tiering_spec"]["verified_blocks"] > 0  # real bytes, loaded and checked
    assert result["cache_policy"]["hits"] == 256
    assert result["redis_tier"]["hits"] == 256  # promoted from Redis into the CPU tier
    assert result["redis_tier"]["redis_reads"] == 16


def test_installing_the_wheel_with_its_extras_keeps_the_environments_torch(
    fresh: tuple[Path, dict[str, str]], wheel: Path
) -> None:
    # The README's line, resolved (not installed) into an environment that has a torch, as
    # vLLM's has: pip takes what is there (the wheel itself is installed already), and
    # downloads neither torch nor anything else.
    venv, env = fresh
    done = run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install",
        "--dry-run", "--no-index", "--quiet", "--report", "-", f"{wheel}[redis,events]",
        env=env,
    )  # fmt: skip
    # --no-index: a requirement the environment did not meet would fail the resolve.
    report = json.loads(done.stdout)
    assert {item["metadata"]["name"] for item in report["install"]} <= {"tiering"}


def test_the_installed_command_line_runs(
    fresh: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    venv, env = fresh
    done = run(venv / "bin" / "tiering", "--version", cwd=tmp_path, env=env)
    assert done.stdout.strip() == "tiering 0.1.0"
