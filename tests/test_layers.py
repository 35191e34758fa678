"""The layer table of DESIGN.md, enforced: a module imports only its own layer or lower ones."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import tiering

PACKAGE = Path(tiering.__file__).resolve().parent

# Module (dotted, below ``tiering``) or package prefix -> layer. Layer 2 and 2'
# are siblings: the control plane (policies, manager) and the data plane
# (transfer) may not import each other.
LAYERS: dict[str, float] = {
    "errors": 0,
    "_types": 0,
    "_state": 0,
    "_checks": 0,
    "_exports": 0,  # a module's __getattr__: lazy names, deprecated names
    "_extras": 0,  # the optional parts: a missing package is one ConfigError naming its extra
    "_closing": 3,  # the async wait of the one lifecycle
    "config": 1,
    "extra_config": 1,  # extra_config's keys: tiering's, vLLM's, a misspelling refused
    "_decode": 1,  # external input decoded by msgspec, one ConfigError line
    "hints": 1,  # the retention hint vocabulary and its channels' readers
    "specs": 1,
    "cpu.common": 1,
    "integrations": 1,
    "integrations.vllm": 6.5,  # the vLLM adapters (6′): vLLM's classes over layers 0-4′
    "integrations.vllm.config": 1,  # the seed's config translation: duck-typed, no vLLM
    "integrations.vllm.duck": 1,  # reading vLLM's objects by attribute; vLLM's config converted
    "policies": 2,
    "cpu.manager": 2,
    "cpu.flows": 2,  # the write-through and promotion core: pure, as the manager
    "transfer": 2.5,
    "events": 3,
    "scheduler": 4,  # the anyio shell (_scheduler) and what callers hold (_jobs)
    "scheduler._plan": 2,  # the planning core: pure, no anyio, no torch, no I/O
    "secondary": 4,  # the SecondaryTier contract, health, the in-memory tier
    "secondary.codec": 1,  # pure: the value format
    "secondary.checksum": 1,
    "secondary.auth": 1,  # pure: the shared key of keyed values
    "secondary.refusals": 1,  # pure: why a chunk was not written, what a fault means
    "secondary.redis": 6,  # redis-py, imported lazily
    "metrics": 5,
    "hint_metrics": 5,  # the retention hints' metric families, a part of metrics
    "engine": 6,
    "assembly": 6,  # what the engine builds and reports, apart from its facade
    "workload": 7,
    "simulate": 7,  # the old path of sim: a re-export
    "sim": 7,  # the simulation: one tier, a disk below it, the optimum, plots
    "replay": 7,
    "replay_result": 7,  # what a replay reports, and the counts it is made of
    "cli": 7,
    "__main__": 7,
    "": 8,  # tiering/__init__.py re-exports the public surface
    "cpu": 8,  # package __init__ files re-export their own layer
}
SIBLINGS = {(2, 2.5), (2.5, 2)}

# Third-party imports allowed per layer (anything not listed is stdlib-only or tiering).
THIRD_PARTY: dict[str, set[float]] = {
    "numpy": {1, 2, 2.5, 3, 4, 5, 6, 6.5, 7, 8},
    "msgspec": {1, 2, 2.5, 3, 4, 5, 6, 6.5, 7, 8},
    "torch": {2.5, 6, 6.5, 7, 8},
    "anyio": {3, 4, 5, 6, 6.5, 7, 8},
    "vllm": {6.5},
    "prometheus_client": {5, 6.5, 7},
    "zmq": {3, 7},
    "redis": {6, 7},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def layer_of(name: str) -> float:
    best = None
    for prefix, layer in LAYERS.items():
        matches = name == prefix or (prefix and name.startswith(prefix + "."))
        if matches and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    if best is None:
        raise AssertionError(
            f"tiering.{name} is in no layer of tests/test_layers.py: add it to LAYERS"
        )
    return best[1]


def imports_of(name: str, is_package: bool, source: str) -> list[tuple[str, int]]:
    """Absolute names imported by module ``tiering.<name>``, with their line numbers."""
    tree = ast.parse(source)
    package = name.split(".") if name else []
    if not is_package:
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(["tiering", *base, *(node.module or "").split(".")]).rstrip(".")
            else:
                target = node.module or ""
            if target == "tiering":  # submodules, or names of the public surface (layer 8)
                found += [
                    (f"tiering.{a.name}" if is_submodule(a.name) else "tiering", node.lineno)
                    for a in node.names
                ]
            elif target in (f"tiering.{p}" for p in PACKAGES):
                found += [(f"{target}.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((target, node.lineno))
    return found


def is_submodule(name: str) -> bool:
    return (PACKAGE / f"{name}.py").exists() or (PACKAGE / name / "__init__.py").exists()


PACKAGES = (
    "cpu",
    "transfer",
    "policies",
    "integrations",
    "integrations.vllm",
    "workload",
    "events",
)


def violations(name: str, is_package: bool, source: str) -> list[str]:
    """What module ``tiering.<name>`` imports against the layer table."""
    own = layer_of(name)
    found = []
    for target, line in imports_of(name, is_package, source):
        top = target.split(".")[0]
        where = f"tiering.{name}:{line}"
        if top == "tiering":
            inner = target.removeprefix("tiering").lstrip(".")
            if inner in PACKAGES:
                continue  # a package's __init__ is checked on its own
            theirs = layer_of(inner)
            if (own, theirs) in SIBLINGS:
                found.append(f"{where}: {target} is in a sibling layer")
            elif theirs > own and own != 8:
                found.append(f"{where}: layer {own} imports {target} (layer {theirs})")
        elif top in THIRD_PARTY and own not in THIRD_PARTY[top]:
            found.append(f"{where}: layer {own} may not import {top}")
        if layer_of(name) == 6.5 and target.startswith("tiering.engine"):
            found.append(f"{where}: the vLLM adapters use the pieces, never the engine")
        if target.startswith("torch.cuda") and name != "transfer.cuda":
            found.append(f"{where}: only tiering/transfer/cuda.py touches torch.cuda")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p) or "tiering")
def test_module_imports_only_its_layer_or_lower(path: Path) -> None:
    assert violations(module_name(path), path.name == "__init__.py", path.read_text()) == []


def test_the_checker_finds_upward_and_forbidden_imports() -> None:
    source = (
        "import torch\n"
        "from tiering.engine import TieringEngine\n"
        "from ..transfer import cpu\n"
        "from tiering import errors\n"
        "from tiering import CPUOffloadingManager\n"
    )
    found = violations("policies.bad", False, source)
    assert len(found) == 4, found
    assert "may not import torch" in found[0]
    assert "imports tiering.engine (layer 6)" in found[1]
    assert "sibling" in found[2]
    assert "imports tiering (layer 8)" in found[3]
    assert violations("transfer.cpu", False, "import torch.cuda\n") == [
        "tiering.transfer.cpu:1: only tiering/transfer/cuda.py touches torch.cuda"
    ]
    with pytest.raises(AssertionError, match="no layer"):
        layer_of("brand_new_module")


def test_torch_cuda_is_touched_only_in_the_cuda_backend() -> None:
    offenders = [
        str(p.relative_to(PACKAGE.parent))
        for p in MODULES
        if "torch.cuda" in p.read_text() and module_name(p) != "transfer.cuda"
    ]
    assert offenders == []


def test_importing_tiering_is_light() -> None:
    # No optional extra, no metrics client and no CUDA initialisation on import;
    # the simulate command line does not even need torch or anyio.
    code = (
        "import sys, tiering, tiering.cli\n"
        "heavy = [m for m in ('zmq', 'torch', 'anyio', 'prometheus_client', 'redis') "
        "if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_surface_matches_all() -> None:
    exported = set(tiering.__all__)
    assert len(exported) == len(tiering.__all__), "duplicates in tiering.__all__"
    for name in exported:
        assert getattr(tiering, name) is not None, name
    public = {n for n in vars(tiering) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(tiering, n)).__name__ == "module"}
    assert public - modules - {"annotations"} <= exported
    assert (PACKAGE / "py.typed").exists()
