"""The examples run as they are, and the README quotes them as they are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMBED = ROOT / "examples" / "embed.py"


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
