"""Backends by name, the default choice, and the benchmark's output format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiering.errors import ConfigError
from tiering.transfer import (
    BACKEND_NAMES,
    KVCacheTensor,
    KVLayout,
    TransferBackend,
    default_backend_name,
    get_backend_class,
)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "transfer.py"


@pytest.mark.parametrize("name", ["cpu", "mock"])
def test_backends_are_found_by_name(name: str) -> None:
    cls = get_backend_class(name)
    assert issubclass(cls, TransferBackend)
    assert cls.name == name
    assert name in BACKEND_NAMES


def test_an_unknown_backend_name_says_which_exist() -> None:
    with pytest.raises(ConfigError, match="cpu, cuda, mock"):
        get_backend_class("tpu")


def test_the_default_backend_follows_the_kv_device() -> None:
    layout = KVLayout([KVCacheTensor(torch.zeros(2, 64, dtype=torch.uint8), 2, 64)], 1)
    assert default_backend_name(layout) == "cpu"


def test_the_benchmark_prints_one_json_object_per_measurement() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--json",
            "--total-mib=4",
            "--repeat=1",
            "--page-kib",
            "16",
            "--chunk-order=sequential",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["page_bytes"], r["direction"]) for r in rows] == [
        (16384, "store"),
        (16384, "load"),
    ]
    for row in rows:
        assert row["backend"] == "cpu"
        assert row["gbps"] > 0
        assert row["limit_gbps"] > 0
        # the ratio is rounded to 3 decimals: tiny ratios (a 4 MiB job) need the abs slack
        assert row["ratio"] == pytest.approx(row["gbps"] / row["limit_gbps"], rel=0.01, abs=1e-3)
