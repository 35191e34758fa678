"""The lower tiers under vLLM 0.33's scheduler, for ``bench/vllm.py``: promotion steps and
hit tokens, for Redis and the disk, under `TieringSpec` and vLLM's ``TieringOffloadingSpec``.

**Promotion steps.** A first scheduler stores ``prefixes`` prompts of 32 chunks
and more (32, 36, 40...); it is shut down, and a second one over the same store
(one Redis namespace, one folder; its CPU tier empty) gets them one at a
time: every chunk of each is in the lower tier only. After each step comes the
model's time, here the wait for the tiers to finish what they were handed (a
model's step outlasts a round trip to Redis or a read of a few MiB from disk),
so the figures are the protocol's, not this machine's latency. Counted per
request, from vLLM's side: the step of its first lookup in the tier, the step
in which the tier answered a hit for every chunk (it is asked in one step:
vLLM looks up past a ``RETRY``), and the step in which vLLM scheduled its load
from the CPU tier. Target (issue #28): the load within 2 steps of the answer.
And one case beside it (``part held``): one scheduler, LRU, its CPU tier full
and holding the first 24 chunks of a 40-chunk prefix, the tier alone the last
16; a promotion that evicts the request's own hits costs a second round.

**Hit tokens.** The first ``requests`` of the trace replayed through each spec
with a CPU tier of ``capacity_tokens`` trace tokens alone, then over Redis,
then over the disk (each large enough for the whole replay): what the lower
tier adds to the CPU tier's hits.

**Lost.** Each row's chunks the lower tiers did not take or give (their log lines
are silenced): under `TieringSpec` the link's ``cascade_dropped``,
``cascade_failed`` and ``promote_failed``; under vLLM's spec, whose cascade counts
only in its metrics, its tiers' adapters' ``chunks_dropped`` and
``keys_not_loaded``.

Under `TieringSpec` vLLM's worker connectors move real bytes (the link reads the
workers' rows); vLLM's spec has no worker on a machine without a GPU, so there
the rows hold whatever they held.

Its own redis-server, on a free loopback port, is started for each run
(no persistence, its folder temporary) and stopped by its pid; the disk tier's
folders are temporary too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The most steps from the tier's answer to the request's load (issue #28).
PROMOTION_TARGET = 2
TIERS = {"redis": "RedisSecondaryTier", "disk": "DiskSecondaryTier"}
SPECS = ("TieringSpec", "TieringOffloadingSpec")
#: The smallest prefix of the promotion runs, in chunks (one 16-token block a chunk).
PREFIX_CHUNKS = 32
#: `SecondaryLink.statistics`' counts of chunks not written through or not promoted.
LINK_LOSSES = ("cascade_dropped", "cascade_failed", "promote_failed")
#: A `PolledSecondaryTier`'s counts of chunks it failed itself or did not load.
ADAPTER_LOSSES = ("chunks_dropped", "keys_not_loaded")


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A redis-server of this run on a free loopback port; its URL. Stopped by its pid."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: the lower-tier runs need it")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(folder)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server on port {port} did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(30)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def entry(harness: Any, tier: str, where: str, capacity_bytes: int) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of ``tier``: a Redis URL (a namespace of its own) or a
    folder of ``capacity_bytes``."""
    if tier == "redis":
        return harness.redis_entry(where, namespace=f"bench-{uuid.uuid4().hex}")
    return harness.disk_entry(where, capacity_bytes)


def losses(engine: Any) -> dict[str, int]:
    """What the engine's lower tiers did not take or give, in chunks (the lines that say it
    are silenced): `TieringSpec`'s link's counts; under vLLM's ``TieringOffloadingSpec``
    (whose own cascade counts only in its metrics), its tiers' adapters'."""
    link = getattr(engine.manager, "link", None)
    if link is not None:
        stats = link.statistics()
        return {name: stats[name] for name in LINK_LOSSES}
    counts = dict.fromkeys(ADAPTER_LOSSES, 0)
    for tier in engine.manager.secondary_tiers:
        stats = tier.statistics()
        for name in ADAPTER_LOSSES:
            counts[name] += getattr(stats, name)
    return counts


def _added(*counts: dict[str, int]) -> dict[str, int]:
    total: dict[str, int] = {}
    for each in counts:
        for name, n in each.items():
            total[name] = total.get(name, 0) + n
    return total


def make_engine(
    harness: Any,
    model: Path,
    spec: str,
    cpu_bytes: int,
    tier: dict[str, Any] | None,
    policy: str | None = None,
    **config: Any,
) -> Any:
    """A scheduler of ``spec`` with the lower tier ``tier`` (None: the CPU tier alone) and
    the eviction ``policy`` (None: the spec's default)."""
    lower = [dict(tier)] if tier is not None else []
    if spec == "TieringSpec":
        keys: dict[str, Any] = {"secondary_tiers": lower} if lower else {}
        if policy is not None:
            keys["eviction_policy"] = policy
        extra = harness.tiering_extra(cpu_bytes, **keys)
        engine = harness.build_engine(model, extra, **config)
        if lower:
            engine.attach_model()  # the link reads the workers' rows: real bytes move
        return engine
    extra = {"spec_name": spec, "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": lower}
    if policy is not None:
        extra["eviction_policy"] = policy
    return harness.build_engine(model, extra, **config)


def shut(engine: Any) -> None:
    engine.scheduler.shutdown()
    for model in getattr(engine, "models", None) or ([engine.model] if engine.model else []):
        model.connector.shutdown()


class Watch:
    """The lower tiers' lookups, whatever engine made the tier: their classes' ``lookup``
    wrapped while the watch is open (and put back after)."""

    def __init__(self) -> None:
        import tiering.integrations.vllm as integration

        self.classes = [getattr(integration, name) for name in TIERS.values()]
        self.answers: list[tuple[bytes, Any]] = []
        self.tiers: dict[int, Any] = {}
        self._own: dict[type, Any] = {}

    def __enter__(self) -> Watch:
        for cls in self.classes:
            self._own[cls] = cls.__dict__.get("lookup")
            lookup = cls.lookup

            def spied(tier: Any, key: bytes, context: Any, _lookup: Any = lookup) -> Any:
                self.tiers[id(tier)] = tier
                result = _lookup(tier, key, context)
                self.answers.append((key, result))
                return result

            cls.lookup = spied
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, own in self._own.items():
            if own is None:
                del cls.lookup
            else:
                cls.lookup = own

    def idle(self) -> None:
        """The model's time: every tier finishes what it was handed (at most 10 s)."""
        for tier in self.tiers.values():
            tier.wait_idle(10)


def prompts_of(count: int) -> list[list[int]]:
    """``count`` prompts of 32, 36, 40... full 16-token blocks and a tail of 8 tokens, no
    two sharing a block."""
    prompts = []
    for i in range(count):
        blocks = PREFIX_CHUNKS + 4 * i
        start = 1 + i * 4096
        prompts.append([1 + (start + j) % 31998 for j in range(blocks * 16 + 8)])
    return prompts


def measure(engine: Any, watch: Watch, prompt: list[int], what: str) -> tuple[int, int]:
    """Send a request of ``prompt``; step, the model's time after each, until vLLM schedules
    its load. Returns the steps from its first lookup in the tier to its load, and from
    the tier's answer (the first step whose every lookup in the tier was a hit)."""
    from vllm.v1.kv_offload.base import LookupResult

    watch.answers.clear()
    request = engine.add(prompt)
    asked = answered = loading = None
    for step in range(50):
        output = engine.step()
        here = [result for _, result in watch.answers]
        watch.answers.clear()
        if asked is None and here:
            asked = step
        if answered is None and here and all(r is LookupResult.HIT for r in here):
            answered = step
        metadata = output.kv_connector_metadata
        jobs = metadata.load_jobs.values() if metadata is not None else ()
        if any(job.req_id == request.request_id for job in jobs):
            loading = step
            break
        watch.idle()
    engine.run()
    if asked is None or answered is None or loading is None:
        raise SystemExit(
            f"{what}: not loaded from the tier in 50 steps (first lookup at step {asked}, "
            f"answer at {answered}, load at {loading})"
        )
    return loading - asked, loading - answered


def promotion_steps(
    harness: Any, model: Path, spec: str, tier: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    """The steps of each prompt's promotion from ``tier`` into a second scheduler's CPU tier."""
    chunk_bytes = harness.attention_spec().page_size_bytes * len(harness.LAYERS)
    biggest = max(len(p) for p in prompts) // 16
    cpu_bytes = 4 * biggest * chunk_bytes  # write-throughs may pin half: a prompt lands whole
    what = f"{spec} over {tier['type']}"
    with Watch() as watch:
        first = make_engine(harness, model, spec, cpu_bytes, tier)
        try:
            for prompt in prompts:
                first.add(prompt)
                first.run()
                watch.idle()
                first.run()
            stored = losses(first)
        finally:
            shut(first)
        watch.tiers.clear()
        second = make_engine(harness, model, spec, cpu_bytes, tier)
        try:
            rows = [measure(second, watch, prompt, what) for prompt in prompts]
            promoted = losses(second)
        finally:
            shut(second)
    to_load = [r[0] for r in rows]
    after = [r[1] for r in rows]
    return {
        "requests": len(rows),
        "prefix_chunks": [len(p) // 16 for p in prompts],
        "lookup_to_load_median": statistics.median(to_load),
        "lookup_to_load_worst": max(to_load),
        "answer_to_load_median": statistics.median(after),
        "answer_to_load_worst": max(after),
        "met": max(after) <= PROMOTION_TARGET,
        "lost": _added(stored, promoted),
    }


def part_held_steps(harness: Any, model: Path, spec: str, tier: dict[str, Any]) -> dict[str, Any]:
    """One scheduler, LRU, a full CPU tier of 128 chunks holding the first 24 chunks of a
    40-chunk prefix, the tier alone its last 16: the steps to the prefix's load (a
    promotion that evicts the request's own hits costs a second round)."""
    chunk_bytes = harness.attention_spec().page_size_bytes * len(harness.LAYERS)
    prefix = [1 + j for j in range(40 * 16)]
    shared = prefix[: 10 * 16] + [20_000 + i for i in range(20 * 16)]
    other = [10_000 + i for i in range(84 * 16)]
    what = f"{spec} over {tier['type']}, part of the prefix held"
    with Watch() as watch:
        engine = make_engine(harness, model, spec, 128 * chunk_bytes, tier, policy="lru")
        try:
            for prompt in (prefix, shared, other):  # the prefix's tail only in the tier
                assert engine.scheduler.reset_prefix_cache()
                engine.add([*prompt, 3, 3, 3, 3, 3, 3, 3, 3])
                engine.run()
                watch.idle()
                engine.run()
            assert engine.scheduler.reset_prefix_cache()
            for worker in getattr(engine, "models", ()):
                worker.wipe()
            to_load, after = measure(engine, watch, [*prefix, 9, 9, 9, 9, 9, 9, 9, 9], what)
            lost = losses(engine)
        finally:
            shut(engine)
    return {"lookup_to_load": to_load, "answer_to_load": after, "lost": lost}


def trace_hits(
    harness: Any,
    model: Path,
    spec: str,
    tier: dict[str, Any] | None,
    prompts: list[list[int]],
    cpu_bytes: int,
) -> dict[str, Any]:
    """Hit tokens of the trace's ``prompts`` replayed through ``spec`` over ``tier``."""
    engine = make_engine(
        harness,
        model,
        spec,
        cpu_bytes,
        tier,
        num_gpu_blocks=2048,
        max_model_len=8192,
        max_num_batched_tokens=8192,
    )
    started = time.perf_counter()
    try:
        harness.replay(engine, prompts)
        lost = losses(engine) if tier is not None else {}
    finally:
        shut(engine)
    return {
        "hit_tokens": engine.hit_tokens,
        "queried_tokens": engine.queried_tokens,
        "hit_rate": engine.hit_tokens / max(1, engine.queried_tokens),
        "wall_seconds": time.perf_counter() - started,
        "lost": lost,
    }


def run(
    harness: Any,
    model: Path,
    *,
    prefixes: int,
    requests: int,
    capacity_tokens: int,
) -> dict[str, Any]:
    """Every lower tier under every spec: promotion steps and the trace's hit tokens."""
    chunk_bytes = harness.attention_spec().page_size_bytes * len(harness.LAYERS)
    cpu_bytes = capacity_tokens // harness.TRACE_BLOCK_TOKENS * chunk_bytes
    trace = harness.trace_prompts(harness.TRACE, requests)
    room = (sum(len(p) for p in trace) // 16 + 1024) * chunk_bytes * 2  # everything, twice
    prompts = prompts_of(prefixes)
    result: dict[str, Any] = {
        "prefixes": prefixes,
        "requests": len(trace),
        "capacity_tokens": capacity_tokens,
        "promotion": {},
        "hits": {},
    }
    for spec in SPECS:
        result["hits"].setdefault("cpu only", {})[spec] = trace_hits(
            harness, model, spec, None, trace, cpu_bytes
        )
    for name in TIERS:
        for spec in SPECS:
            with _where(name) as where:
                tier = entry(harness, name, where, room)
                steps = promotion_steps(harness, model, spec, tier, prompts)
                tier = entry(harness, name, where, room)
                steps["part_held"] = part_held_steps(harness, model, spec, tier)
            with _where(name) as where:
                tier = entry(harness, name, where, room)
                hits = trace_hits(harness, model, spec, tier, trace, cpu_bytes)
            base = result["hits"]["cpu only"][spec]["hit_tokens"]
            hits["vs_cpu_only"] = hits["hit_tokens"] / max(1, base)
            result["promotion"].setdefault(name, {})[spec] = steps
            result["hits"].setdefault(name, {})[spec] = hits
    result["met"] = all(s["met"] for by in result["promotion"].values() for s in by.values())
    return result


@contextlib.contextmanager
def _where(tier: str) -> Iterator[str]:
    """A fresh store for one run: a redis-server's URL, or an empty folder."""
    with tempfile.TemporaryDirectory(prefix=f"tiering-bench-{tier}-") as folder:
        if tier == "redis":
            with redis_server(Path(folder)) as url:
                yield url
        else:
            yield str(Path(folder) / "tier")


def report(result: dict[str, Any]) -> None:
    """The figures as a table (stdout)."""
    chunks = result["promotion"] and next(iter(next(iter(result["promotion"].values())).values()))
    sizes = chunks["prefix_chunks"] if chunks else []
    print(
        f"\nLower tiers: {result['prefixes']} prefixes of {min(sizes, default=0)} to "
        f"{max(sizes, default=0)} chunks only in the tier, a second scheduler, the model's "
        "time after each step"
    )
    print(
        "tier   spec                    first lookup->load  answer->load (median/worst)"
        "  part held: lookup->load, answer->load  lost (chunks)"
    )
    for name, by_spec in result["promotion"].items():
        for spec, row in by_spec.items():
            part = row["part_held"]
            print(
                f"{name:<6} {spec:<23} {row['lookup_to_load_median']:>8g}/"
                f"{row['lookup_to_load_worst']:<9g} {row['answer_to_load_median']:>6g}/"
                f"{row['answer_to_load_worst']:<3g} {'met' if row['met'] else 'NOT met':<7}  "
                f"{part['lookup_to_load']:>33}, {part['answer_to_load']:<12}  "
                f"{_said(_added(row['lost'], part['lost']))}"
            )
    print(
        f"\nHit tokens, first {result['requests']} requests of the trace, CPU tier "
        f"{result['capacity_tokens']:,} trace tokens"
    )
    print("lower tier  spec                    hit tokens  hit rate  x cpu only  lost (chunks)")
    for name, by_spec in result["hits"].items():
        for spec, row in by_spec.items():
            ratio = row.get("vs_cpu_only", 1.0)
            print(
                f"{name:<11} {spec:<23} {row['hit_tokens']:>10}  {row['hit_rate']:7.2%}  "
                f"{ratio:9.3f}  {_said(row['lost'])}"
            )
    print(
        f"promotion within {PROMOTION_TARGET} steps of the tier's answer: "
        f"{'met' if result['met'] else 'NOT met'}"
    )


def _said(lost: dict[str, int]) -> str:
    """``lost`` in a table's cell: ``-`` where nothing is below, else every count."""
    return ", ".join(f"{name} {n:,}" for name, n in lost.items()) or "-"
