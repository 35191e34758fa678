"""Capacity planning without moving bytes: replay a trace through the chunk manager.

`simulate_keys` runs one policy at one capacity: the CPU tier alone
(`tiering.sim.one_tier`), with a disk tier below it (`tiering.sim.chain`), or
the offline optimum (`tiering.sim.optimal`). `simulate` does it from requests.

With retention hints (one per request, `tiering.hints.Hint`), each request
touches the tiers with its own, and the managers' clock is the workload's:
the arrival of the request being served (``times_s``), so a hint's
``retain_s`` counts trace seconds. Without hints (``hints=None``) a run is
exactly the run without them, hit for hit. The offline optimum ignores hints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiering._checks import is_int
from tiering._types import OffloadKey
from tiering.config import DEFAULT_POLICY
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import CapacityError, ConfigError
from tiering.hints import Hint
from tiering.policies import POLICY_NAMES, create_policy
from tiering.sim.chain import Chain
from tiering.sim.one_tier import OneTier
from tiering.sim.optimal import simulate_optimal
from tiering.sim.result import (
    OPTIMAL,
    HasHashIds,
    Progress,
    SimulationResult,
    TraceClock,
    capacity_chunks,
    requests_to_keys,
    run_simulation,
)

__all__ = ["ALL_POLICIES", "expand_policies", "simulate", "simulate_keys"]

#: What ``--policy all`` stands for: every online policy, then the offline optimum.
ALL_POLICIES: tuple[str, ...] = (*POLICY_NAMES, OPTIMAL)


def _disk_manager(
    disk_tokens: int | None,
    disk_policy: str | None,
    policy: str,
    block_tokens: int,
    clock: TraceClock,
) -> CPUOffloadingManager | None:
    """The disk tier's index (None without one), after checking its arguments."""
    if policy == OPTIMAL and (disk_tokens is not None or disk_policy is not None):
        raise ConfigError(
            "the offline optimum models one tier; drop disk_tokens or the optimal policy "
            f"(an online one: {', '.join(POLICY_NAMES)})"
        )
    if disk_tokens is None:
        if disk_policy is not None:
            raise ConfigError(
                f"disk_policy {disk_policy!r} needs a disk tier; give disk_tokens too"
            )
        return None
    if not is_int(disk_tokens):
        raise CapacityError(f"disk_tokens must be a number of tokens or None, got {disk_tokens!r}")
    num_chunks = capacity_chunks(int(disk_tokens), block_tokens, tier="disk")  # numpy's too
    name = policy if disk_policy is None else disk_policy
    if name not in POLICY_NAMES:
        raise ConfigError(
            f"unknown disk tier policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    return CPUOffloadingManager(num_chunks, create_policy(name, num_chunks), clock=clock)


def simulate_keys(
    request_keys: Sequence[Sequence[OffloadKey]],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
    progress: Progress | None = None,
    disk_tokens: int | None = None,
    disk_policy: str | None = None,
    hints: Sequence[Hint | None] | None = None,
    times_s: Sequence[float] | None = None,
    labels: tuple[str, float] = ("none", 0.0),
) -> SimulationResult:
    """Replay requests given as chunk keys (see `requests_to_keys`) through a fresh manager.

    ``policy`` is a policy name, or `OPTIMAL` for `simulate_optimal`. ``progress``
    is called every thousand requests or so, and once at the end. ``disk_tokens``
    puts a disk tier of that many tokens below the CPU tier (see
    `tiering.sim.chain`), with the policy ``disk_policy`` (default: ``policy``);
    the offline optimum models one tier only (`ConfigError`). Without it the run
    is exactly the one-tier run. ``hints`` gives each request its retention hint
    and ``times_s`` its arrival in seconds, the managers' clock (both one per
    request; the module's docstring); ``labels`` names them in the result
    (``hints``, ``hint_error``). The optimum ignores them (its result says
    ``none``).
    """
    clock = TraceClock()
    if policy == OPTIMAL:
        _disk_manager(disk_tokens, disk_policy, policy, block_tokens, clock)  # refuses a disk
        return simulate_optimal(
            request_keys,
            capacity_tokens=capacity_tokens,
            block_tokens=block_tokens,
            progress=progress,
        )
    num_chunks = capacity_chunks(capacity_tokens, block_tokens)
    manager = CPUOffloadingManager(num_chunks, create_policy(policy, num_chunks), clock=clock)
    disk = _disk_manager(disk_tokens, disk_policy, policy, block_tokens, clock)
    tiers = OneTier(manager, policy=policy, capacity_tokens=capacity_tokens)
    if disk is not None and disk_tokens is not None:
        tiers = Chain(
            manager,
            disk,
            policy=policy,
            capacity_tokens=capacity_tokens,
            disk_tokens=int(disk_tokens),
        )
    return run_simulation(
        request_keys, tiers, progress, hints=hints, times_s=times_s, clock=clock, labels=labels
    )


def simulate(
    requests: Iterable[HasHashIds],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
    disk_tokens: int | None = None,
    disk_policy: str | None = None,
) -> SimulationResult:
    """Replay ``requests`` (anything with ``hash_ids``) through a fresh manager (and a
    disk tier of ``disk_tokens`` below it: see `simulate_keys`)."""
    return simulate_keys(
        requests_to_keys(requests),
        capacity_tokens=capacity_tokens,
        policy=policy,
        block_tokens=block_tokens,
        disk_tokens=disk_tokens,
        disk_policy=disk_policy,
    )


def expand_policies(names: Iterable[str]) -> list[str]:
    """``names`` with ``all`` replaced by every policy and the optimum, duplicates dropped."""
    out: list[str] = []
    for name in names:
        out.extend(ALL_POLICIES if name == "all" else (name,))
    return list(dict.fromkeys(out))
