"""The README's figures (docs/*.png) are made by `make plots`; its own commands write elsewhere."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
#: The images the README shows.
FIGURES = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)


def _commands() -> str:
    """The README's shell blocks, continuation lines joined."""
    blocks = re.findall(r"```sh\n(.*?)```", README, re.DOTALL)
    return "\n".join(blocks).replace("\\\n", " ")


def test_the_readme_shows_the_two_figures_of_docs() -> None:
    assert sorted(FIGURES) == ["docs/disk-tiers.png", "docs/policies.png"]
    assert all((ROOT / figure).is_file() for figure in FIGURES)


def test_the_readmes_plot_commands_write_no_figure_of_its_own() -> None:
    targets = re.findall(r"--plot\s+(\S+)", _commands())
    assert targets  # the README does show how to plot
    for target in targets:
        assert target not in FIGURES, target
        assert not target.startswith("docs/"), target


def test_make_plots_regenerates_every_figure() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(
        ["make", "-n", "plots", "TRACE=/absent/trace.jsonl"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    commands = dry.stdout.replace("\\\n", " ")
    written = re.findall(r"tiering simulate --trace /absent/trace\.jsonl .*?--plot (\S+)", commands)
    assert sorted(written) == sorted(FIGURES)
