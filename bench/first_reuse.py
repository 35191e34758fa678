"""Why no online policy reaches 1.5x LRU on the conversation trace: the next turn is unforeseeable.

Issue #20 asks for a policy at 1.5x LRU's hit rate at 3,000,000 tokens on the
Mooncake conversation trace (LRU hits 13.61% there, so 20.4%); the best online
policies reach about 18%, the offline optimum 35%. This script shows the gap
is one of information, not of cleverness, in two parts.

1. Conversation structure. A request whose leading run of already seen blocks
   goes beyond block 0 (a system prompt every request shares) is the next turn
   of its *parent*: the request that last held the deepest of those blocks
   (almost always the parent without its last block, plus new blocks). Turn
   numbers follow. Whether a request has a next turn depends strongly on its
   turn number (a third of first turns continue, most later turns do), but for
   first turns, most of the requests, nothing a policy sees at the time tells
   them apart: prompt length, the fill of the last block, the answer's length,
   how many requests arrive at the same millisecond, the position in the trace.
   Per feature, the script prints P(next turn) by bucket, with counts, and the
   error of the best predictor built on the feature (each bucket's majority),
   beside the base rate's ("never continues"). No bucket rises above one half,
   so no such predictor beats the base rate. The last ``--tail`` requests
   (2,500) are left out of these tables: they have no room for a next turn.

2. A bound on policies that know which requests continue. `ClassTTLPolicy`
   sorts keys into classes and evicts the key whose last use plus its class's
   TTL comes first (per-class LRU lists, a merge of their heads). The classes
   are built from what a request shows when it is touched: its *generation*
   (1 + the largest generation of the requests that first held its already seen
   blocks, capped at 8) and whether a key is the request's new last block (a
   turn's last block is not in its next turn's prompt), optionally a bucket of
   the gap to the request's parent. The TTLs are fitted to the whole trace's
   per-class reuse ages (`fit_ttls`: Kaplan-Meier survival per class, then the
   Lagrangian of "most reuses within TTL" under the capacity's mean occupancy):
   an oracle of distributions, not of the future, so these rows bound what a
   TTL policy on such classes can reach online. Adding one oracle bit per
   request, "this request has a next turn", lifts it far past the target; the
   same bit flipped for 10, 20 and 30% of the requests (seeded) shows how good
   a continuation predictor would have to be: the script interpolates the
   largest error that still meets 1.5x, and part 1 shows the features give no
   better than the base rate's error.

Run it (under 20 s on two cores; ``--jobs`` processes, one per CPU by default,
share the replays, which are deterministic: the figures do not depend on it)::

    python bench/first_reuse.py [--trace FILE] [--capacity-tokens N] [--tail R]
                                [--seed S] [--jobs N] [--json]

It prints the turn table, the first-turn feature tables and the best error they
allow, then one line per replay at the capacity (LRU, the classes without the
oracle, with it, with it flipped): hit rate and ratio to LRU, beside the
issue's 1.5x target, and the wall time. ``--json`` prints the same as one JSON
object (rates as fractions). At the time of writing: first turns continue with
P 0.335 and no feature bucket above 0.43, so every feature's best error is the
base rate's 33.5% (predicted from the turn number, the bit is wrong for 35.9% of
the requests); LRU 13.61%, the classes 17.5 and 17.7%, with the oracle bit
28.1%, flipped 24.9 / 22.4 / 20.2%: the bit may be wrong for at most about 29%
of the requests.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import heapq
import json
import os
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from itertools import filterfalse, pairwise
from pathlib import Path

import msgspec
import numpy as np
from numpy.typing import NDArray

from tiering._types import OffloadKey
from tiering.cpu.manager import CPUOffloadingManager
from tiering.policies import CachePolicy
from tiering.sim import capacity_chunks, requests_to_keys, simulate_keys
from tiering.workload import BLOCK_TOKENS, Request, read_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)
CAPACITY_TOKENS = 3_000_000
#: Requests at the end of the trace left out of the next-turn tables.
TAIL = 2_500
#: Issue #20's target at 3,000,000 tokens: this times LRU's hit rate.
TARGET_RATIO = 1.5
#: Turn numbers and generations from this one up share a row, a class.
MAX_TURN = 8
MAX_GENERATION = 8
#: Gap buckets: below 32 requests to the parent, below 64, below 128, the rest.
GAP_BUCKETS = 4
FLIP_RATES = (0.1, 0.2, 0.3)


# -- conversation structure ---------------------------------------------------------


class Conversations(msgspec.Struct, frozen=True, kw_only=True):
    """What `parse_conversations` finds, one entry per request (in trace order).

    ``parent`` is the request this one continues (-1 for a first turn);
    ``turn`` counts from 1; ``has_next`` says whether a later request continues
    this one; ``generation`` is 1 + the largest generation among the requests
    that first held this request's already seen blocks; ``gap`` is the distance
    in requests to the last holder of its deepest leading seen block (0 when
    none); ``last_new`` says whether its last block was never seen before.
    """

    parent: list[int]
    turn: list[int]
    has_next: list[bool]
    generation: list[int]
    gap: list[int]
    last_new: list[bool]

    @property
    def first_turns(self) -> int:
        return self.turn.count(1)


def parse_conversations(requests: Sequence[Sequence[int]]) -> Conversations:
    """The conversation structure of ``requests``, given as lists of hash ids."""
    owner: dict[int, int] = {}  # hash id -> the last request holding it
    lineage: dict[int, int] = {}  # hash id -> generation of the first request holding it
    n = len(requests)
    parent, turn, has_next = [-1] * n, [1] * n, [False] * n
    generation, gap, last_new = [1] * n, [0] * n, [False] * n
    for i, ids in enumerate(requests):
        seen = 0
        for hash_id in ids:
            if hash_id not in owner:
                break
            seen += 1
        if seen:
            holder = owner[ids[seen - 1]]
            gap[i] = i - holder
            if seen > 1:  # more than the shared block 0: a next turn
                parent[i] = holder
                turn[i] = turn[holder] + 1
                has_next[holder] = True
        generation[i] = 1 + max((lineage[h] for h in ids if h in lineage), default=0)
        last_new[i] = bool(ids) and ids[-1] not in owner
        for hash_id in ids:
            owner[hash_id] = i
            lineage.setdefault(hash_id, generation[i])
    return Conversations(
        parent=parent,
        turn=turn,
        has_next=has_next,
        generation=generation,
        gap=gap,
        last_new=last_new,
    )


# -- next-turn tables ---------------------------------------------------------------


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    """Requests of one bucket of a feature, and how many of them have a next turn."""

    label: str
    requests: int
    continued: int

    @property
    def rate(self) -> float:
        return self.continued / self.requests if self.requests else 0.0


def buckets_of(
    values: Sequence[int], has_next: Sequence[bool], labels: Callable[[int], str]
) -> list[Bucket]:
    """One `Bucket` per distinct value (in increasing order), named by ``labels``."""
    count: Counter[int] = Counter()
    continued: Counter[int] = Counter()
    for value, more in zip(values, has_next, strict=True):
        count[value] += 1
        continued[value] += more
    return [
        Bucket(label=labels(v), requests=count[v], continued=continued[v]) for v in sorted(count)
    ]


def best_error(buckets: Sequence[Bucket]) -> float:
    """The error of the best predictor of a next turn from the bucket alone (the
    bucket's majority): the least share of requests any such predictor gets wrong."""
    total = sum(b.requests for b in buckets)
    wrong = sum(min(b.continued, b.requests - b.continued) for b in buckets)
    return wrong / total if total else 0.0


def _ranges(edges: Sequence[int], unit: str = "") -> Callable[[int], str]:
    """Labels of the buckets ``bisect_right(edges, x)``: ``<e0``, ``e0-e1``..., ``eN+``."""

    def label(b: int) -> str:
        if b == 0:
            return f"<{edges[0]}{unit}"
        if b == len(edges):
            return f"{edges[-1]}+{unit}"
        low, high = edges[b - 1], edges[b] - 1
        return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"

    return label


def turn_table(conversations: Conversations, upto: int) -> list[Bucket]:
    """P(next turn) by turn number (`MAX_TURN` and up in one row), over requests ``< upto``."""
    turns = [min(t, MAX_TURN) for t in conversations.turn[:upto]]
    last = f"{MAX_TURN}+"
    return buckets_of(
        turns, conversations.has_next[:upto], lambda t: last if t == MAX_TURN else str(t)
    )


def feature_tables(
    requests: Sequence[Request], conversations: Conversations, upto: int
) -> dict[str, list[Bucket]]:
    """P(next turn) of the first turns among requests ``< upto``, by each feature a
    policy could see when the request arrives."""
    first = [i for i in range(upto) if conversations.turn[i] == 1]
    has_next = [conversations.has_next[i] for i in first]
    same_time = Counter(r.timestamp for r in requests)
    features: dict[str, tuple[list[int], Callable[[int], str]]] = {}

    def by_edges(name: str, values: list[int], edges: Sequence[int], unit: str = "") -> None:
        features[name] = ([bisect.bisect_right(edges, v) for v in values], _ranges(edges, unit))

    by_edges("prompt length (blocks)", [len(requests[i].hash_ids) for i in first], (5, 10, 20, 40))
    fills = [(requests[i].input_length - 1) % BLOCK_TOKENS + 1 for i in first]
    by_edges("last block fill (tokens)", fills, range(65, BLOCK_TOKENS, 64))
    outputs = [requests[i].output_length for i in first]
    by_edges("answer length (tokens)", outputs, range(100, 1001, 100))
    by_edges(
        "requests at its timestamp", [same_time[requests[i].timestamp] for i in first], range(2, 13)
    )
    features["position in the trace (tenths)"] = (
        [10 * i // upto for i in first],
        lambda d: f"{d / 10:.1f}-{(d + 1) / 10:.1f}",
    )
    return {
        name: buckets_of(values, has_next, labels) for name, (values, labels) in features.items()
    }


# -- classes and their TTLs ------------------------------------------------------------


class Variant(msgspec.Struct, frozen=True, kw_only=True):
    """How requests are sorted into classes: generation, then either ``gap_buckets``
    buckets of the gap to the parent or (``oracle``) the next-turn bit, flipped for a
    ``flip`` share of the requests; then whether a key is the request's new last block."""

    name: str
    gap_buckets: int = 1
    oracle: bool = False
    flip: float = 0.0

    @property
    def subclasses(self) -> int:
        return 2 if self.oracle else self.gap_buckets

    @property
    def classes(self) -> int:
        return MAX_GENERATION * self.subclasses * 2


VARIANTS = (
    Variant(name="generation x last"),
    Variant(name="generation x gap x last", gap_buckets=GAP_BUCKETS),
    Variant(name="generation x next-turn oracle x last", oracle=True),
    *(
        Variant(name=f"  oracle wrong for {rate:.0%} of requests", oracle=True, flip=rate)
        for rate in FLIP_RATES
    ),
)


def gap_bucket(gap: int, buckets: int) -> int:
    """0 below 32 requests, then one bucket per doubling, the last one open."""
    return min(buckets - 1, max(0, gap.bit_length() - 5))


def request_classes(
    conversations: Conversations, variant: Variant, seed: int
) -> tuple[list[int], list[int]]:
    """Per request: the class of its keys but the last, and of its last key.

    The flipped bits are drawn from ``seed``; for one seed, the requests flipped at
    a rate are among those flipped at any higher rate.
    """
    n = len(conversations.turn)
    if variant.oracle:
        flipped = np.random.default_rng(seed).random(n) < variant.flip
        subs = [
            int(more != flip) for more, flip in zip(conversations.has_next, flipped, strict=True)
        ]
    else:
        subs = [gap_bucket(gap, variant.gap_buckets) for gap in conversations.gap]
    heads, lasts = [], []
    for g, sub, new in zip(conversations.generation, subs, conversations.last_new, strict=True):
        head = ((min(g, MAX_GENERATION) - 1) * variant.subclasses + sub) * 2
        heads.append(head)
        lasts.append(head + 1 if new else head)
    return heads, lasts


def reuse_ages(
    request_keys: Sequence[Sequence[OffloadKey]], heads: Sequence[int], lasts: Sequence[int]
) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_]]:
    """One observation per key of each request: its class, its age (requests until the
    key's next use, or until the end of the trace) and whether it was used again."""
    n = len(request_keys)
    classes: list[int] = []
    ages: list[int] = []
    reused: list[bool] = []
    later: dict[OffloadKey, int] = {}  # key -> the next request using it
    for i in range(n - 1, -1, -1):
        keys = request_keys[i]
        for j, key in enumerate(keys):
            use = later.get(key)
            classes.append(lasts[i] if j == len(keys) - 1 else heads[i])
            ages.append(n - 1 - i if use is None else use - i)
            reused.append(use is not None)
        for key in keys:
            later[key] = i
    return np.array(classes, dtype=np.int64), np.array(ages, dtype=np.int64), np.array(reused)


def fit_ttls(
    classes: NDArray[np.int64],
    ages: NDArray[np.int64],
    reused: NDArray[np.bool_],
    *,
    num_classes: int,
    capacity: int,
    requests: int,
) -> list[int]:
    """TTLs (in requests) per class that catch the most reuses within their TTL while
    the keys they keep fill ``capacity`` chunks on average.

    From the observations (`reuse_ages`), per class: the survival S(a) = P(age > a)
    (Kaplan-Meier; the keys not used again are censored at the trace's end), the
    share of reuses a TTL T catches, F(T) = 1 - S(T), and the requests a key
    stays, M(T) = sum of S(a) for a < T. With r the class's observations per
    request, the mean occupancy is the sum of r M(T) (Little's law); each class
    takes the T maximizing r (F(T) - l M(T)), the multiplier l bisected so the
    occupancy fits ``capacity``. A class without observations gets TTL 0.
    """
    width = requests + 1
    reuses = np.zeros((num_classes, width))
    seen = np.zeros((num_classes, width))
    np.add.at(reuses, (classes[reused], ages[reused]), 1.0)
    np.add.at(seen, (classes, ages), 1.0)
    at_risk = np.cumsum(seen[:, ::-1], axis=1)[:, ::-1]  # observations of age >= a
    hazard = np.divide(reuses, at_risk, out=np.zeros_like(reuses), where=at_risk > 0)
    survival = np.cumprod(1.0 - hazard, axis=1)  # S(a) = P(age > a)
    caught = 1.0 - survival  # F(T) for T = 0..requests
    held = np.concatenate([np.zeros((num_classes, 1)), np.cumsum(survival, axis=1)[:, :-1]], 1)
    rate = seen.sum(axis=1, keepdims=True) / max(requests, 1)
    gain, cost = rate * caught, rate * held
    rows = np.arange(num_classes)

    def choose(log_multiplier: float) -> tuple[NDArray[np.intp], float]:
        ttls = np.argmax(gain - 10.0**log_multiplier * cost, axis=1)
        return ttls, float(cost[rows, ttls].sum())

    low, high = -12.0, 2.0
    best, _ = choose(high)
    for _ in range(50):
        middle = (low + high) / 2
        ttls, occupancy = choose(middle)
        if occupancy > capacity:
            low = middle
        else:
            high, best = middle, ttls
    return [int(t) for t in best]


# -- the policy ---------------------------------------------------------------------

#: ``classify(keys)``: the class of each key of a touch, in the same order.
Classifier = Callable[[Sequence[OffloadKey]], Sequence[int]]


class ScheduledClasses:
    """A `Classifier` replaying precomputed classes: the n-th touch gets the n-th
    request's (every key its head class, the last key its last class)."""

    def __init__(self, heads: Sequence[int], lasts: Sequence[int], num_classes: int) -> None:
        if len(heads) != len(lasts):
            raise ValueError(f"{len(heads)} head classes but {len(lasts)} last classes")
        bad = [c for c in (*heads, *lasts) if not 0 <= c < num_classes]
        if bad:
            raise ValueError(f"class {bad[0]} out of range; classes are 0..{num_classes - 1}")
        self._schedule: Iterator[tuple[int, int]] = zip(heads, lasts, strict=True)

    def __call__(self, keys: Sequence[OffloadKey]) -> list[int]:
        try:
            head, last = next(self._schedule)
        except StopIteration:
            raise ValueError("more touches than scheduled requests") from None
        return [head] * (len(keys) - 1) + [last] if keys else []


class ClassTTLPolicy(CachePolicy):
    """Evicts the key whose last use plus its class's TTL is smallest.

    Time counts touches (one per request in a replay): every touch, even of no
    key, advances the clock and calls ``classify`` once. It commits the tracked
    keys to the classes ``classify`` gives them, tail first, so within a class a
    request's tail goes before its head; keys inserted and not touched yet wait
    in a list of their own, with the largest TTL. Each class is an LRU list, so
    its head expires first: an eviction merges the lists' heads (a heap over
    the classes), O(classes) to start and O(log classes) per victim, plus the
    protected keys it skips. Ties go to the lower class.
    """

    name = "class-ttl"

    def __init__(self, ttls: Sequence[int], classify: Classifier) -> None:
        if not ttls or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ttls):
            raise ValueError(f"ttls must be a non-empty list of integers >= 0, got {ttls!r}")
        self._ttls = (*ttls, max(ttls))  # the last list: inserted, not touched yet
        self._pending = len(ttls)
        self._classify = classify
        self._lists: list[OrderedDict[OffloadKey, int]] = [OrderedDict() for _ in self._ttls]
        self._class: dict[OffloadKey, int] = {}
        self._now = 0

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        pending, now = self._lists[self._pending], self._now
        for key in reversed(keys):
            if key not in self._class:
                pending[key] = now
                self._class[key] = self._pending

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._now += 1
        classes = self._classify(keys)
        if len(classes) != len(keys):
            raise ValueError(f"the classifier gave {len(classes)} classes for {len(keys)} keys")
        lists, where, now = self._lists, self._class, self._now
        for key, c in zip(reversed(keys), reversed(classes), strict=True):
            old = where.get(key)
            if old is not None:
                del lists[old][key]
                lists[c][key] = now
                where[key] = c

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        skip = protected.__contains__
        heads: list[tuple[int, int, OffloadKey, Iterator[OffloadKey]]] = []
        for c, order in enumerate(self._lists):
            rest: Iterator[OffloadKey] = filterfalse(skip, order)
            key = next(rest, None)
            if key is not None:
                heads.append((order[key] + self._ttls[c], c, key, rest))
        heapq.heapify(heads)
        victims: list[OffloadKey] = []
        while heads and len(victims) < n:
            _, c, key, rest = heads[0]
            victims.append(key)
            following = next(rest, None)
            if following is None:
                heapq.heappop(heads)
            else:
                expiry = self._lists[c][following] + self._ttls[c]
                heapq.heapreplace(heads, (expiry, c, following, rest))
        if len(victims) < n:
            return None
        for key in victims:
            del self._lists[self._class.pop(key)][key]
        return victims

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            c = self._class.pop(key, None)
            if c is not None:
                del self._lists[c][key]

    def clear(self) -> None:
        for order in self._lists:
            order.clear()
        self._class.clear()

    def __len__(self) -> int:
        return len(self._class)

    def __repr__(self) -> str:
        return f"<ClassTTLPolicy [{len(self._class)} keys, {self._pending} classes]>"


def replay(
    request_keys: Sequence[Sequence[OffloadKey]], policy: CachePolicy, num_chunks: int
) -> tuple[int, int]:
    """Hit blocks and blocks of the requests through a manager of ``num_chunks`` chunks
    under ``policy``, each request as `tiering.sim.simulate_keys` handles it."""
    manager = CPUOffloadingManager(num_chunks, policy)
    hit_blocks = blocks = 0
    for keys in request_keys:
        blocks += len(keys)
        hits = manager.lookup_prefix(keys)
        hit_blocks += hits
        if hits:
            manager.prepare_load(keys[:hits])
        if hits < len(keys):
            output = manager.prepare_store(keys[hits:])
            if output is not None and output.keys_to_store:
                manager.complete_store(output.keys_to_store)
        if hits:
            manager.complete_load(keys[:hits])
        manager.touch(keys)
    return hit_blocks, blocks


# -- the run ------------------------------------------------------------------------


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One replay at the capacity: a policy's hit rate, its classes' TTLs (in requests)
    and the seconds its job took (fit and replay)."""

    name: str
    classes: int
    hit_rate: float
    ttls: list[int] = msgspec.field(default_factory=list)
    seconds: float = 0.0


class Job(msgspec.Struct, frozen=True, kw_only=True):
    trace: str
    capacity_tokens: int
    seed: int
    variant: Variant | None = None  # None: LRU


@functools.cache
def _load(trace: str) -> tuple[list[Request], list[list[OffloadKey]], Conversations]:
    """The trace's requests, keys and conversations, built once per process."""
    requests = read_trace(trace)
    conversations = parse_conversations([r.hash_ids for r in requests])
    return requests, requests_to_keys(requests), conversations


def run_job(job: Job) -> Row:
    """One replay (in whichever process: it loads the trace there)."""
    start = time.perf_counter()
    _, request_keys, conversations = _load(job.trace)
    if job.variant is None:
        result = simulate_keys(request_keys, capacity_tokens=job.capacity_tokens, policy="lru")
        seconds = time.perf_counter() - start
        return Row(name="lru", classes=1, hit_rate=result.hit_rate, seconds=seconds)
    variant = job.variant
    num_chunks = capacity_chunks(job.capacity_tokens, BLOCK_TOKENS)
    heads, lasts = request_classes(conversations, variant, job.seed)
    classes, ages, reused = reuse_ages(request_keys, heads, lasts)
    ttls = fit_ttls(
        classes,
        ages,
        reused,
        num_classes=variant.classes,
        capacity=num_chunks,
        requests=len(request_keys),
    )
    policy = ClassTTLPolicy(ttls, ScheduledClasses(heads, lasts, variant.classes))
    hits, blocks = replay(request_keys, policy, num_chunks)
    return Row(
        name=variant.name,
        classes=variant.classes,
        hit_rate=hits / blocks if blocks else 0.0,
        ttls=ttls,
        seconds=time.perf_counter() - start,
    )


def run_bound(trace: str, capacity_tokens: int, seed: int, jobs: int) -> list[Row]:
    """LRU, then every `VARIANTS` row, in ``jobs`` processes (1: here)."""
    todo = [Job(trace=trace, capacity_tokens=capacity_tokens, seed=seed)]
    todo += [
        Job(trace=trace, capacity_tokens=capacity_tokens, seed=seed, variant=v) for v in VARIANTS
    ]
    if jobs == 1:
        return [run_job(job) for job in todo]
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo))) as pool:
        return list(pool.map(run_job, todo))


def largest_flip_for(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The share of flipped oracle bits at which the hit rate falls to ``target``,
    interpolated between the ``(flip rate, hit rate)`` points run (None where even
    the least flipped misses it; the largest flip rate where all meet it)."""
    points = sorted(points)
    if not points or points[0][1] < target:
        return None
    for (f0, h0), (f1, h1) in pairwise(points):
        if h1 < target <= h0:
            return f0 + (f1 - f0) * (h0 - target) / (h0 - h1)
    return points[-1][0]  # met at every flip rate run: at least this


def _bucket_lines(title: str, buckets: Sequence[Bucket]) -> list[str]:
    lines = [f"  {title}", f"    {'bucket':<14}{'requests':>9}{'next turn':>11}"]
    lines += [f"    {b.label:<14}{b.requests:>9,}{b.rate:>10.1%}" for b in buckets]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity-tokens", type=int, default=CAPACITY_TOKENS)
    parser.add_argument("--tail", type=int, default=TAIL, help="requests left out of the tables")
    parser.add_argument("--seed", type=int, default=1, help="of the flipped oracle bits")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.capacity_tokens < BLOCK_TOKENS:
        parser.error(
            f"--capacity-tokens must be at least {BLOCK_TOKENS}, got {args.capacity_tokens}"
        )
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}; give one with --trace")
    start = time.perf_counter()
    trace = str(args.trace)
    requests, request_keys, conversations = _load(trace)
    n = len(requests)
    if not 0 <= args.tail < n:
        parser.error(f"--tail must be in 0..{n - 1} for {n:,} requests, got {args.tail}")
    upto = n - args.tail
    turns = turn_table(conversations, upto)
    features = feature_tables(requests, conversations, upto)
    first = turns[0]
    base = best_error([first])
    rows = run_bound(trace, args.capacity_tokens, args.seed, args.jobs)
    lru = rows[0].hit_rate
    target = TARGET_RATIO * lru
    oracle = [(v.flip, r.hit_rate) for v, r in zip(VARIANTS, rows[1:], strict=True) if v.oracle]
    flip = largest_flip_for(oracle, target)
    turn_error = best_error(turns)
    seconds = time.perf_counter() - start

    if args.json:
        print(json.dumps({
            "trace": trace, "requests": n, "blocks": sum(map(len, request_keys)),
            "first_turns": conversations.first_turns, "tables_upto": upto,
            "turns": [msgspec.to_builtins(b) | {"rate": round(b.rate, 4)} for b in turns],
            "first_turn_base_error": round(base, 4), "turn_error": round(turn_error, 4),
            "features": {
                name: {
                    "buckets": [msgspec.to_builtins(b) | {"rate": round(b.rate, 4)} for b in bs],
                    "best_error": round(best_error(bs), 4),
                    "highest_rate": round(max(b.rate for b in bs), 4),
                }
                for name, bs in features.items()
            },
            "capacity_tokens": args.capacity_tokens,
            "target_ratio": TARGET_RATIO, "target_hit_rate": round(target, 5),
            "bound": [
                {"name": r.name.strip(), "classes": r.classes, "hit_rate": round(r.hit_rate, 5),
                 "ratio_to_lru": round(r.hit_rate / lru, 4) if lru else None, "ttls": r.ttls,
                 "seconds": round(r.seconds, 1)}
                for r in rows
            ],
            "largest_flip_for_target": None if flip is None else round(flip, 4),
            "seconds": round(seconds, 1), "jobs": args.jobs,
        }))  # fmt: skip
        return 0

    out = [
        f"conversation trace: {n:,} requests, {sum(map(len, request_keys)):,} blocks, "
        f"{conversations.first_turns:,} first turns",
        f"next-turn tables over the first {upto:,} requests (the last {args.tail:,} have no "
        "room for a next turn)",
        "",
        *_bucket_lines("P(next turn | turn number)", turns),
        f"    best error {turn_error:.1%} (each turn's majority)",
        "",
        f"first turns ({first.requests:,}): P(next turn) by what a policy sees; "
        f"'never continues' errs on {base:.1%}",
    ]
    for name, buckets in features.items():
        out += _bucket_lines(name, buckets)
        top = max(b.rate for b in buckets)
        out.append(
            f"    best error {best_error(buckets):.1%} (base {base:.1%}), top bucket {top:.1%}"
        )
    best = min(best_error(bs) for bs in features.values())
    out.append(f"  best error any feature allows: {best:.1%}, against the base rate's {base:.1%}")
    chunks = capacity_chunks(args.capacity_tokens, BLOCK_TOKENS)
    out += [
        "",
        f"class-TTL bound at {args.capacity_tokens:,} tokens ({chunks:,} chunks), TTLs fitted "
        "to the whole trace's per-class reuse ages",
        f"  {'policy':<40}{'classes':>8}{'hit rate':>10}{'x lru':>8}",
    ]
    for row in rows:
        ratio = row.hit_rate / lru if lru else 0.0
        mark = "  meets 1.5x" if row.hit_rate >= target else ""
        out.append(f"  {row.name:<40}{row.classes:>8}{row.hit_rate:>9.2%}{ratio:>7.2f}x{mark}")
    out.append(f"  issue #20's target: {TARGET_RATIO}x lru = {target:.2%}")
    if flip is None:
        out.append("  even the exact oracle bit misses the target")
    else:
        out.append(
            f"  the oracle bit meets it while wrong for up to ~{flip:.0%} of requests; predicted "
            f"from the turn number it is wrong for {turn_error:.1%} of them (of the first turns "
            f"{base:.1%}, which no feature above lowers)"
        )
    out.append(f"wall time {seconds:.1f} s ({args.jobs} jobs)")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
