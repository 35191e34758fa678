"""Capacity planning without moving bytes: a trace replayed through the chunk manager.

`simulate_keys` (`core`) runs one policy at one capacity: the CPU tier alone
(`one_tier`), with a disk tier below it (`chain`), or the offline optimum
(`optimal`), each through the loop of `result`; `plot` draws the results.
"""

from __future__ import annotations

from tiering.sim.core import ALL_POLICIES, expand_policies, simulate, simulate_keys
from tiering.sim.optimal import simulate_optimal
from tiering.sim.plot import (
    PlotUnavailableError,
    check_plotting,
    plot_hit_rates,
    plot_hit_rates_by_tier,
)
from tiering.sim.result import (
    OPTIMAL,
    Progress,
    SimulationResult,
    capacity_chunks,
    requests_to_keys,
)

__all__ = [
    "ALL_POLICIES",
    "OPTIMAL",
    "PlotUnavailableError",
    "Progress",
    "SimulationResult",
    "capacity_chunks",
    "check_plotting",
    "expand_policies",
    "plot_hit_rates",
    "plot_hit_rates_by_tier",
    "requests_to_keys",
    "simulate",
    "simulate_keys",
    "simulate_optimal",
]
