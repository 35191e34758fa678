"""What importing a module really loads, checked in a fresh interpreter.

tests/test_layers.py reads the import statements; this runs them. A module of
a low layer that reaches torch, pyzmq or redis-py through some chain of
imports (a re-export, an alias defined next to a torch type) is caught here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiering.errors import ConfigError

HEAVY = ("torch", "zmq", "redis", "prometheus_client", "vllm")

# Module -> the heavy packages it may load on import.
ALLOWED: dict[str, frozenset[str]] = {
    "tiering": frozenset(),
    "tiering.cli": frozenset(),
    "tiering.config": frozenset(),
    "tiering.specs": frozenset(),
    "tiering.cpu": frozenset(),
    "tiering.policies": frozenset(),
    "tiering.events": frozenset(),
    "tiering.scheduler": frozenset(),
    "tiering.secondary": frozenset(),
    "tiering.metrics": frozenset({"prometheus_client"}),
    "tiering.workload": frozenset(),
    "tiering.simulate": frozenset(),
    "tiering.sim": frozenset(),
    # The vLLM adapters' package: vLLM is imported only when vLLM asks it for a class.
    "tiering.integrations.vllm": frozenset(),
    "tiering.integrations.vllm.config": frozenset(),
}


def loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m for m in out.stdout.strip().split(",") if m}


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_importing_loads_no_heavy_package_it_does_not_need(module: str) -> None:
    assert loaded_by(module) <= ALLOWED[module]


def test_the_check_sees_a_heavy_import() -> None:
    assert "torch" in loaded_by("tiering.transfer")


def test_the_architecture_docs_layer_table_is_the_enforced_one() -> None:
    """docs/architecture.md's table places exactly what tests/test_layers.py enforces."""
    from pathlib import Path

    from .test_layers import LAYERS, MODULES, layer_of, module_name

    doc = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
    table: dict[str, float] = {}
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0] or cells[0][0] not in "0123456789":
            continue
        layer = float(cells[0].replace("′", ".5"))
        for name in cells[1].split(","):
            name = name.strip().strip("`")
            table["" if name == "(root)" else name] = layer
    assert table == LAYERS
    for path in MODULES:  # every module is placed (layer_of raises otherwise)
        layer_of(module_name(path))


def test_the_vllm_package_lists_each_lazy_name_once_and_loads_none_before_use() -> None:
    import tiering.integrations.vllm as adapters

    assert sorted(adapters.__all__) == sorted(adapters._EXPORTS)
    assert set(adapters.__all__) <= set(dir(adapters))
    with pytest.raises(AttributeError, match=r"cache policies \(eviction_policy\) are ARC") as got:
        adapters.TieringSpek  # noqa: B018 - the attribute access is the test
    assert isinstance(got.value, ConfigError)  # one clear line from vLLM's factories
    assert "secondary tiers (a secondary_tiers entry's type) are DiskSecondaryTier" in str(
        got.value
    )
    assert not hasattr(adapters, "NoSuchTier")
