"""Hit rate against capacity, drawn: matplotlib (the ``plot`` extra), imported only here.

`plot_hit_rates` draws hit rate against capacity, a line per policy;
`plot_hit_rates_by_tier` hit rate by tier against disk capacity. `check_plotting`
says before a long run whether the file can be written.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiering._extras import require
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError, TieringError
from tiering.sim.result import OPTIMAL, SimulationResult

__all__ = ["PlotUnavailableError", "check_plotting", "plot_hit_rates", "plot_hit_rates_by_tier"]


class PlotUnavailableError(ConfigError):
    """``--plot`` was asked for but matplotlib (the ``plot`` extra) is not installed."""


def check_plotting(path: Path | str) -> str:
    """Before a long run: the file format ``path``'s suffix names (``png``, ``svg``...).

    Raises `PlotUnavailableError` unless matplotlib can be imported, and
    `TieringError` unless matplotlib writes that format and ``path``'s folder
    exists and is writable.
    """
    backends = require("matplotlib.backend_bases", "plot", _PLOTTING, error=PlotUnavailableError)
    suffix = Path(path).suffix
    if suffix.lower()[1:] not in backends.FigureCanvasBase.get_supported_filetypes():
        what = f"matplotlib writes no format {suffix!r}" if suffix else "the name has no suffix"
        raise TieringError(
            f"cannot write plot {path}: {what}; end the name with .png, .svg or .pdf"
        )
    folder = Path(path).parent
    if not folder.is_dir():
        raise TieringError(f"cannot write plot {path}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise TieringError(f"cannot write plot {path}: folder {folder} is not writable")
    return suffix.lower()[1:]


_PLOTTING = "a plot (--plot)"


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing off screen."""
    require("matplotlib", "plot", _PLOTTING, error=PlotUnavailableError).use("Agg")
    return require("matplotlib.pyplot", "plot", _PLOTTING, error=PlotUnavailableError)


def _save(fig: Any, path: Path | str, file_format: str) -> None:
    try:
        fig.savefig(path, format=file_format)
    except OSError as exc:
        raise TieringError(f"cannot write plot {path}: {exc.strerror or exc}") from exc


def _short_tokens(tokens: int) -> str:
    """``3000000`` -> ``3M``, ``51200`` -> ``51.2k``."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}"
    return str(tokens)


def plot_hit_rates(results: Sequence[SimulationResult], path: Path | str, *, title: str) -> None:
    """Draw hit rate against capacity, a line per policy, the optimum dashed, and save
    it in the format the suffix of ``path`` names (`check_plotting`).

    Imports matplotlib here only (the ``plot`` extra); raises `PlotUnavailableError`
    when it is missing and `TieringError` when the file cannot be written.
    """
    file_format = check_plotting(path)
    plt = _pyplot()
    by_policy: dict[str, list[SimulationResult]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        for policy, rows in by_policy.items():
            rows = sorted(rows, key=lambda r: r.capacity_tokens)
            xs = [r.capacity_tokens for r in rows]
            ys = [100.0 * r.hit_rate for r in rows]
            if policy == OPTIMAL:
                ax.plot(xs, ys, "k--", label="offline optimum (Belady)")
            else:
                label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log")
        capacities = sorted({r.capacity_tokens for r in results})
        ax.set_xticks(capacities, [_short_tokens(c) for c in capacities])
        ax.minorticks_off()
        ax.set_xlabel("CPU tier capacity (tokens)")
        ax.set_ylabel("hit rate (% of blocks)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        _save(fig, path, file_format)
    finally:
        plt.close(fig)


def plot_hit_rates_by_tier(
    results: Sequence[SimulationResult], path: Path | str, *, title: str
) -> None:
    """Draw hit rate by tier against disk capacity (of the results with a disk tier),
    one panel per CPU capacity: at each disk capacity a bar per policy, its CPU
    tier's hits at the bottom and the disk tier's on top, the total above it;
    saved as `plot_hit_rates` saves.
    """
    file_format = check_plotting(path)
    plt = _pyplot()
    chained = [r for r in results if r.disk_tokens is not None]
    cpu_capacities = sorted({r.capacity_tokens for r in chained})
    disks = sorted({r.disk_tokens or 0 for r in chained})
    policies = list(dict.fromkeys(r.policy for r in chained))
    # Bars side by side around each disk capacity, in log space (the x axis is log).
    gaps = [math.log10(b / a) for a, b in itertools.pairwise(disks)]
    width = min(min(gaps, default=1.0) * 0.8 / max(1, len(policies)), 0.1)
    panels = max(1, len(cpu_capacities))
    fig, axes = plt.subplots(
        1, panels, figsize=(max(6.4, 4.2 * panels), 4.4), dpi=100, sharey=True, squeeze=False
    )
    try:
        for ax, capacity in zip(axes[0], cpu_capacities, strict=False):
            for i, policy in enumerate(policies):
                rows = [r for r in chained if r.policy == policy and r.capacity_tokens == capacity]
                offset = (i - (len(policies) - 1) / 2) * width
                lefts = [(r.disk_tokens or 1) * 10 ** (offset - width / 2) for r in rows]
                widths = [left * (10**width - 1) for left in lefts]
                cpu = [100.0 * r.hit_blocks_by_tier.get("cpu", 0) / (r.blocks or 1) for r in rows]
                total = [100.0 * r.hit_rate for r in rows]
                label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
                color = f"C{i}"
                ax.bar(lefts, cpu, widths, align="edge", color=color, label=f"{label}: CPU tier")
                ax.bar(lefts, [t - c for t, c in zip(total, cpu, strict=True)], widths,
                       bottom=cpu, align="edge", color=color, alpha=0.4, hatch="//",
                       edgecolor=color, label=f"{label}: disk tier")  # fmt: skip
                for left, w, t in zip(lefts, widths, total, strict=True):
                    ax.annotate(f"{t:.1f}", (left + w / 2, t), ha="center", va="bottom",
                                fontsize=6, xytext=(0, 1), textcoords="offset points")  # fmt: skip
            ax.set_xscale("log")
            ax.set_xticks(disks, [_short_tokens(d) for d in disks])
            ax.minorticks_off()
            ax.set_xlabel("disk tier capacity (tokens)")
            ax.set_title(f"CPU tier {_short_tokens(capacity)} tokens", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][0].set_ylabel("hit rate (% of blocks)")
        axes[0][0].set_ylim(0, max((100.0 * r.hit_rate for r in chained), default=1.0) * 1.1)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=max(1, len(policies)), fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        _save(fig, path, file_format)
    finally:
        plt.close(fig)
