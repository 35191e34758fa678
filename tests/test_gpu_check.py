"""scripts/gpu_check.sh, dry-run on the CPU, so that it works at the first try on a GPU.

The dry run (``GPU_CHECK_BACKEND=cpu``) goes through every step the GPU run
takes: finding a python, unpacking missing distributions from wheels, the
transfer tests, both benchmark runs and the one-line summary. It runs under a
python like the device image's where there is one, else under this one. To
make one (Python 3.12, torch 2.11, no msgspec, as on the device), then the
wheels it needs::

    python3.12 -m venv .venv-device
    .venv-device/bin/pip install torch==2.11.0 anyio numpy prometheus-client \\
        xxhash pytest pytest-timeout hypothesis
    make gpu-wheels

``TIERING_GPU_CHECK_PYTHON`` names another.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

#: What the device image has (its page in the device tool), by distribution name.
DEVICE_IMAGE = {
    "torch",
    "anyio",
    "numpy",
    "prometheus-client",
    "xxhash",
    "pytest",
    "pytest-timeout",
    "hypothesis",
}


def _device_like_python() -> str | None:
    named = os.environ.get("TIERING_GPU_CHECK_PYTHON")
    if named:
        return named
    python = ROOT / ".venv-device" / "bin" / "python"
    if python.exists() and any((ROOT / "wheels").glob("msgspec-*.whl")):
        return str(python)
    return None


def _run(tmp_path: Path, python: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GPU_CHECK_"))}
    clean.pop("OUT", None)
    clean.update({"GPU_CHECK_BACKEND": "cpu", "PYTHON": python, "TMPDIR": str(tmp_path)})
    clean.update(env)
    return subprocess.run(
        ["bash", str(SCRIPT)], env=clean, capture_output=True, text=True, timeout=400
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_dry_run_goes_through_every_step_and_prints_one_summary_line(
    tmp_path: Path,
) -> None:
    python = _device_like_python() or sys.executable
    out = tmp_path / "out"
    run = _run(tmp_path, python, OUT=str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 1, run.stdout  # everything else went to stderr
    summary = json.loads(lines[0])
    assert summary["gpu_check"] == "ok"
    assert summary["backend"] == "cpu"
    assert summary["failures"] == []
    assert summary["tests"]["failed"] == 0
    assert summary["tests"]["passed"] > 50
    assert summary["contract"]["passed"] >= 20  # the contract suite over the cpu backend
    pages = {"16KiB", "256KiB", "2MiB"}
    for table in (summary["gbps"], summary["limit_gbps"]):
        assert set(table) == {"pinned", "pageable"}
        for mode in table.values():
            assert set(mode) == {"store", "load"}
            for figures in mode.values():
                assert set(figures) == pages
                assert all(gbps > 0 for gbps in figures.values())
    assert set(summary["shuffled_gbps"]["pinned"]["store"]) == pages
    if python != sys.executable:  # the device-like python: msgspec came from a wheel
        assert "unpacked msgspec-" in run.stderr
        assert summary["python"].startswith("3.12")
    assert sorted(p.name for p in out.iterdir()) == [
        "bench_pageable.jsonl",
        "bench_pinned.jsonl",
        "junit.xml",
        "pytest.log",
        "summary.json",
    ]


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A minimal wheel of distribution ``name`` (one module), needing ``requires``."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", "PROBE = True\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{name}-1.0.dist-info/RECORD", "")
    return path


def test_what_the_python_lacks_comes_from_the_wheels_or_is_named(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(
        wheels, "gpu_check_probe", ["gpu-check-absent>=1", "numpy", "gpu-check-extra; extra == 'x'"]
    )
    run = _run(
        tmp_path,
        sys.executable,
        GPU_CHECK_WHEELS=str(wheels),
        GPU_CHECK_NEED="numpy gpu-check-probe",
    )
    assert run.returncode == 2, run.stderr
    assert "unpacked gpu_check_probe-1.0-py3-none-any.whl" in run.stderr
    (line,) = run.stdout.splitlines()  # the check could not run: still one summary line
    summary = json.loads(line)
    assert summary["gpu_check"] == "failed"
    # Its requirement has no wheel (numpy is there; a requirement of an extra is not needed).
    assert summary["reason"].startswith("missing: gpu-check-absent, with no wheel for Python")
    assert "make gpu-wheels" in summary["reason"]


def test_without_a_python_that_has_torch_it_says_so(tmp_path: Path) -> None:
    run = _run(tmp_path, "/nonexistent/python", GPU_CHECK_BACKEND="cuda", PATH="/usr/bin:/bin")
    assert run.returncode == 2
    summary = json.loads(run.stdout)
    assert summary["gpu_check"] == "failed"
    assert "no python whose torch sees a GPU" in summary["reason"]


def test_make_gpu_wheels_fetches_every_runtime_dependency_the_device_image_lacks() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=!~;\[ ]", d)[0].lower() for d in project["dependencies"]}
    makefile = (ROOT / "Makefile").read_text()
    (wheels,) = re.findall(r"^GPU_WHEELS \?= (.*)$", makefile, re.MULTILINE)
    fetched = {re.split(r"[<>=!~;\[ ]", w)[0].lower() for w in wheels.split()}
    assert runtime - DEVICE_IMAGE <= fetched, "add them to GPU_WHEELS in the Makefile"
    # And the script checks for them.
    (need,) = re.findall(r'^NEED=\$\{GPU_CHECK_NEED:-"(.*)"\}$', SCRIPT.read_text(), re.MULTILINE)
    assert fetched <= set(need.split())
