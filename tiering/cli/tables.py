"""What `tiering simulate` and `tiering replay` print: their tables and summary lines."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiering.cli.arguments import scope_of
from tiering.sim import SimulationResult
from tiering.workload import Request
from tiering.workload.hints import CONTINUATION_RETAIN_S

if TYPE_CHECKING:
    from tiering.replay import ReplayResult, TierReport
    from tiering.secondary.auth import AuthKey

__all__ = ["replay_table", "simulation_table"]

_TIERS = ("cpu", "disk")  # `tiering simulate --disk-tokens`'s tiers, in its table


def simulation_table(
    results: Sequence[SimulationResult], args: argparse.Namespace, requests: Sequence[Request]
) -> str:
    disk = args.disk_tokens is not None
    hinted = args.hints != "none"
    header = ["policy", "capacity tokens", "chunks", "hit rate", "hit blocks", "evictions",
              "store failures", "keys/s"]  # fmt: skip
    if disk:  # the hit rate by tier, after the disk's capacity
        header[3:4] = ["disk tokens", "hit rate", "cpu hits", "disk hits"]
    rows = []
    for r in results:
        row = [r.policy, f"{r.capacity_tokens:,}", f"{r.capacity_chunks:,}", f"{r.hit_rate:.2%}",
               f"{r.hit_blocks:,}", f"{r.evictions:,}", f"{r.store_failures:,}",
               f"{r.keys_per_s:,.0f}"]  # fmt: skip
        if disk:
            cpu, on_disk = (r.hit_blocks_by_tier.get(t, 0) / (r.blocks or 1) for t in _TIERS)
            row[3:4] = [f"{r.disk_tokens or 0:,}", row[3], f"{cpu:.2%}", f"{on_disk:.2%}"]
        if hinted:
            row.insert(1, _hints_cell(r))
        rows.append(row)
    if hinted:
        header.insert(1, "hints")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in (header, *rows)
    ]
    lines.insert(1, "-" * len(lines[0]))
    scope = (
        f"{scope_of(args, requests)}, {results[0].blocks:,} blocks of {args.block_tokens} tokens"
    )
    if hinted:
        lines.append(_hints_note(args))
    if not disk:
        same = "which hits the same"
        if hinted:  # the replay's clock is real time: each TTL scaled to its pace
            same = "with the same hints, which hits close to it: its TTLs follow its pace"
        lines.append(
            f"{scope}, one request at a time (as `tiering replay --concurrency 1`, {same})"
        )
        lines.append(
            "hit rate: blocks found in the CPU tier / all blocks; chunks: blocks it holds; "
            "store failures: requests that found no room; keys/s: blocks simulated per second"
        )
        return "\n".join(lines)
    lines.append(
        f"{scope}, one request at a time, each write-through landed before the next (as "
        "`tiering replay --disk --concurrency 1` while its writes keep up: it drops those it "
        "falls behind on)"
    )
    lines.append(
        "disk hits: blocks the CPU tier lacked, read from the disk tier into it (the leading "
        "run after the CPU hits); every chunk stored in the CPU tier is written through to it"
    )
    lines.append(
        "hit rate: blocks found in either tier / all blocks (cpu hits + disk hits); chunks, "
        "evictions, store failures: the CPU tier's; keys/s: blocks simulated per second"
    )
    return "\n".join(lines)


def _hints_cell(r: SimulationResult) -> str:
    """A row's hints: ``continuation``, ``continuation, 20% wrong``, or ``none``."""
    if r.hints == "none":
        return "none (ignored)" if r.policy == "optimal" else "none"
    return r.hints if not r.hint_error else f"{r.hints}, {r.hint_error:.0%} wrong"


def _hints_note(args: argparse.Namespace) -> str:
    """What the hints column means, in one line."""
    seed = args.hint_seed or 0
    return (
        f"hints: each request retains its chunks {CONTINUATION_RETAIN_S:g} s when a later "
        "request begins with its complete blocks, else releases "
        f"them; wrong: that share of the requests given the other hint (seed {seed}); the "
        "offline optimum ignores hints, the clock is the workload's"
    )


def replay_table(
    r: ReplayResult, args: argparse.Namespace, requests: Sequence[Request], key: AuthKey | None
) -> str:
    """`tiering replay`'s summary: a line per row, then how it compares with `tiering
    simulate` and what its units are."""
    from tiering.replay import format_bytes

    rows = [
        ("requests", f"{scope_of(args, requests)}, {r.concurrency} at once, {r.backend} backend"),
        ("CPU tier", f"{r.capacity_chunks:,} chunks, {format_bytes(r.cpu_bytes)}, {r.policy}"),
        ("hit rate", f"{r.hit_rate:.2%} ({r.hit_blocks:,} of {r.blocks:,} blocks loaded back)"),
        ("stored", f"{r.stored_chunks:,} chunks, {format_bytes(r.store_bytes)} at "
                   f"{r.store_gbps:.2f} GB/s"),
        ("loaded", f"{r.loaded_chunks:,} chunks, {format_bytes(r.load_bytes)} at "
                   f"{r.load_gbps:.2f} GB/s"),
        ("evictions", f"{r.evictions:,}"),
        ("hints", _replay_hints(r)),
        ("job latency", f"p50 {r.job_latency_p50_ms:.2f} ms, p99 {r.job_latency_p99_ms:.2f} ms"),
        ("failed jobs", f"{r.failed_jobs:,} (and {r.no_room_stores:,} stores found no room)"),
        ("corrupt chunks", f"{r.corrupt_chunks:,}" if args.verify else "not checked (--verify)"),
        ("hit by tier", _by_tier(r)),
        *_tier_rows(r, args),
        *([("values", _keyed(key))] if r.tiers else []),
        ("events", f"{r.events_published:,} published, {r.events_dropped:,} dropped"
                   if args.events_endpoint else "off (--events-endpoint)"),
        ("seconds", f"{r.seconds:.2f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    block = format_bytes(args.bytes_per_token * args.block_tokens)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(_against_simulate(r, args))
    lines.append(
        f"block: {args.block_tokens} tokens of KV, {block}, one a chunk; hit rate: blocks "
        "loaded back from the tiers / all blocks; GB/s: over the copies' own time; "
        "1 GB = 10^9 bytes"
    )
    return "\n".join(lines)


def _replay_hints(r: ReplayResult) -> str:
    """The replay's hints: none, or where they came from and what they did."""
    if r.hints == "none":
        return "none (--hints)"
    wrong = f", {r.hint_error:.0%} wrong" if r.hint_error else ""
    return (
        f"{r.hints}{wrong}: {r.hinted_keys:,} chunk hints taken, {r.released_evicted:,} "
        f"released chunks evicted first; {_followed(r)}; TTLs scaled to the replay's pace"
    )


def _followed(r: ReplayResult) -> str:
    """Which kinds of hint the CPU tier followed at the end (it follows a kind only while
    it measures it helping): ``releases followed, retentions ignored (measured no better
    than chance)``."""
    kinds = (("releases", r.following_releases), ("retentions", r.following_retentions))
    followed = [kind for kind, following in kinds if following]
    ignored = [kind for kind, following in kinds if not following]
    said = [" and ".join(followed) + " followed"] if followed else []
    if ignored:
        said.append(" and ".join(ignored) + " ignored (measured no better than chance)")
    return ", ".join(said)


def _by_tier(r: ReplayResult) -> str:
    """Where the hit blocks came from: ``cpu 12,345 (80.0 %), disk 3,086 (20.0 %)``."""
    total = r.hit_blocks or 1
    return ", ".join(
        f"{label} {n:,} ({n / total:.1%})" for label, n in r.hit_blocks_by_tier.items()
    )


def _tier_rows(r: ReplayResult, args: argparse.Namespace) -> list[tuple[str, str]]:
    """One summary line per tier below the CPU tier (and the ones not asked for)."""
    rows = [(f"{t.label} tier", _tier_summary(t)) for t in r.tiers]
    labels = {t.label for t in r.tiers}
    if "disk" not in labels:
        rows.append(("disk tier", "none (--disk)"))
    if "remote" not in labels:
        rows.append(("remote tier", "none (--remote)"))
    return rows


def _tier_summary(t: TierReport) -> str:
    """A tier's line: what it held and gave, and every chunk it did not take, by reason."""
    from tiering.replay import format_bytes
    from tiering.secondary.refusals import Unwritten  # not at import: `tiering.cli` stays light

    text = ""
    if t.found_at_open is not None:
        text += f"found {t.found_at_open:,} chunks at open"
        if t.dropped_at_open:
            reasons = ", ".join(f"{n:,} {why}" for why, n in t.dropped_at_open.items())
            text += f" (dropped {reasons})"
        text += "; "
    if t.chunks is not None and t.capacity_bytes:
        of = format_bytes(t.capacity_bytes)
        effective = t.effective_capacity_bytes
        if effective is not None and effective != t.capacity_bytes:  # a small file system
            of += f" configured, {format_bytes(effective)} effective (what its file system holds)"
        text += f"holds {t.chunks:,} chunks, {format_bytes(t.used_bytes or 0)} of {of}; "
    text += (
        f"{t.hit_blocks:,} hit blocks, {format_bytes(t.read_bytes)} read, "
        f"{format_bytes(t.write_bytes)} written; "
    )
    if t.writes_dropped:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.writes_dropped_by_reason.items())
        text += f"{t.writes_dropped:,} chunk writes dropped ({reasons})"
    else:
        text += "no chunk write dropped"
    if t.rejected:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.rejected_by_reason.items())
        text += f"; {t.rejected:,} values rejected ({reasons})"
    if t.lost:
        text += f"; {t.lost:,} values lost (gone behind its back)"
    if t.refused_by_reason:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.refused_by_reason.items())
        text += f"; commands refused by the store: {reasons}"
    text += f"; {t.errors:,} failed calls"
    if t.busy:
        text += f"; {t.busy:,} calls found every worker busy (overload: answered as misses)"
    if t.writes_dropped_by_reason.get(Unwritten.BEHIND.value):
        text += "; the tier fell behind the stores (its write queue was full)"
    return text


def _keyed(key: AuthKey | None) -> str:
    """The summary's word on the lower tiers' values: keyed (by which key), or not."""
    if key is None:
        return "unkeyed: anyone who can write to the tiers can write a value (--auth-key-file)"
    return f"keyed: only holders of auth key {key.key_id} (from {key.source}) can write one"


def _against_simulate(r: ReplayResult, args: argparse.Namespace) -> str:
    """Why the hit rate may differ from `tiering simulate`'s, in one line."""
    same = f" --requests {r.requests}" if args.requests is not None else ""
    if r.hints != "none":  # the same hints, on the same requests
        same += f" --hints {r.hints}"
        same += f" --hint-error {r.hint_error}" if r.hint_error else ""
        same += f" --hint-seed {args.hint_seed}" if r.hint_error and args.hint_seed else ""
    if r.concurrency == 1:
        if r.hints != "none":
            return (
                f"one request at a time: the hit rate is close to `tiering simulate{same}`'s at "
                "the same capacity and policy (TTLs follow the replay's pace, not the workload's)"
            )
        return (
            f"one request at a time: the hit rate is `tiering simulate{same}`'s at the same "
            "capacity and policy"
        )
    return (
        f"{r.concurrency} requests at once: one can miss chunks others are still storing, so "
        f"the hit rate can be below `tiering simulate{same}`'s (one at a time, as "
        "--concurrency 1)"
    )
