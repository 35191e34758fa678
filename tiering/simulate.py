"""The module path `tiering.simulate` had before the simulation became `tiering.sim`.

A pure re-export, kept without a deprecation warning: ``tiering/__init__.py``
imports it so that `tiering.simulate` stays the function (a first import of
this module later would replace the package's attribute with the module), so a
warning here would fire on every ``import tiering``. New code imports
`tiering.sim`; `ProgressBar` lives in `tiering.cli.progress`.
"""

from __future__ import annotations

from typing import Any

from tiering.sim import *  # noqa: F403  (every name of tiering.sim's __all__)
from tiering.sim import __all__ as _SIM_NAMES

__all__ = [*_SIM_NAMES, "ProgressBar"]  # noqa: F405  (ProgressBar: __getattr__)


def __getattr__(name: str) -> Any:
    if name == "ProgressBar":  # the command line's, loaded only when asked for
        from tiering.cli.progress import ProgressBar

        return ProgressBar
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
