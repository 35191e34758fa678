"""`bench/first_reuse.py`: the conversation parse, the next-turn tables, the TTL fit and
the class-TTL policy, on small hand-made requests."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from tiering._types import OffloadKey, make_offload_key
from tiering.policies import LRUPolicy
from tiering.sim import requests_to_keys, simulate_keys
from tiering.workload import chat_workload, write_trace

BENCH = Path(__file__).resolve().parents[1] / "bench" / "first_reuse.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_first_reuse", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec Structs and pickling look the module up
    spec.loader.exec_module(module)
    return module


bench = _load()
NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


class Fixed:
    """A classifier giving the classes set before each touch."""

    def __init__(self) -> None:
        self.classes: list[int] = []

    def __call__(self, touched: Sequence[OffloadKey]) -> list[int]:
        return self.classes


# -- conversation structure and tables ------------------------------------------------

# Block 0 is shared by every request, as in the trace.
FIVE = [
    [0, 1, 2],  # a first turn
    [0, 3, 4],  # a first turn too: only block 0 was seen
    [0, 1, 5, 6],  # request 0 without its last block, plus two: its next turn
    [0, 3, 7],  # request 1's next turn
    [0, 1, 5],  # seen up to block 5, last held by request 2: its next turn, nothing new
]


def test_the_parse_finds_parents_turns_and_next_turns() -> None:
    c = bench.parse_conversations(FIVE)
    assert c.parent == [-1, -1, 0, 1, 2]
    assert c.turn == [1, 1, 2, 2, 3]
    assert c.has_next == [True, True, True, False, False]
    assert c.first_turns == 2


def test_the_parse_finds_generations_gaps_and_new_last_blocks() -> None:
    c = bench.parse_conversations(FIVE)
    # Blocks 0 and 1 came from request 0 (generation 1), 3 from request 1 (2), 5 from 2 (2).
    assert c.generation == [1, 2, 2, 3, 3]
    assert c.gap == [0, 1, 2, 2, 2]
    assert c.last_new == [True, True, True, True, False]


def test_the_turn_table_and_the_best_error() -> None:
    c = bench.parse_conversations(FIVE)
    table = bench.turn_table(c, upto=4)  # request 4 left out, as the trace's tail
    assert [(b.label, b.requests, b.continued) for b in table] == [("1", 2, 2), ("2", 2, 1)]
    assert bench.best_error(table) == pytest.approx(1 / 4)
    mixed = [
        bench.Bucket(label="a", requests=10, continued=3),
        bench.Bucket(label="b", requests=10, continued=8),
    ]
    assert bench.best_error(mixed) == pytest.approx(5 / 20)
    assert bench.best_error([]) == 0.0


def test_the_feature_tables_count_the_first_turns_only() -> None:
    requests = chat_workload(200, seed=3)
    c = bench.parse_conversations([r.hash_ids for r in requests])
    tables = bench.feature_tables(requests, c, upto=150)
    first = sum(1 for t in c.turn[:150] if t == 1)
    continued = sum(1 for i in range(150) if c.turn[i] == 1 and c.has_next[i])
    assert len(tables) == 5
    for buckets in tables.values():
        assert sum(b.requests for b in buckets) == first
        assert sum(b.continued for b in buckets) == continued
        assert len({b.label for b in buckets}) == len(buckets)


def test_bucket_labels() -> None:
    label = bench._ranges((2, 3, 5), " tokens")
    assert [label(b) for b in range(4)] == ["<2 tokens", "2 tokens", "3-4 tokens", "5+ tokens"]


# -- classes and the fit --------------------------------------------------------------


def test_classes_of_a_request_and_deterministic_nested_flips() -> None:
    c = bench.parse_conversations(FIVE)
    plain = bench.Variant(name="plain")
    heads, lasts = bench.request_classes(c, plain, seed=0)
    assert heads == [0, 2, 2, 4, 4]  # generation 1, 2, 2, 3, 3; one subclass
    assert lasts == [1, 3, 3, 5, 4]  # request 4's last block is not new
    oracle = bench.Variant(name="oracle", oracle=True)
    heads, _ = bench.request_classes(c, oracle, seed=0)
    assert heads == [2, 6, 6, 8, 8]  # the next-turn bit between generation and last
    flips = [
        bench.request_classes(c, bench.Variant(name="f", oracle=True, flip=f), seed=7)[0]
        for f in (0.0, 0.5, 1.0)
    ]
    assert flips[0] == heads
    assert flips[2] == [2 * (h // 2 ^ 1) for h in heads]  # every bit flipped
    again = bench.request_classes(c, bench.Variant(name="f", oracle=True, flip=0.5), seed=7)
    assert again[0] == flips[1]


def test_gap_buckets() -> None:
    assert [bench.gap_bucket(g, 4) for g in (0, 31, 32, 63, 64, 127, 128, 10**6)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]


def test_reuse_ages_with_censoring_at_the_end() -> None:
    a, b, c = k(1), k(2), k(3)
    classes, ages, reused = bench.reuse_ages([[a, b], [a], [c, a]], [0, 2, 4], [1, 3, 5])
    got = sorted(zip(classes.tolist(), ages.tolist(), reused.tolist(), strict=True))
    assert got == [
        (0, 1, True),  # a, used again by request 1
        (1, 2, False),  # b, the last block of request 0: never again
        (3, 1, True),  # a in request 1, its last block: used by request 2
        (4, 0, False),  # request 2 is the last one
        (5, 0, False),
    ]


def test_the_fit_keeps_a_class_reused_later_longer_than_one_never_reused() -> None:
    classes = np.array([0] * 100 + [1] * 100, dtype=np.int64)
    ages = np.array([50] * 100 + [999] * 100, dtype=np.int64)
    reused = np.array([True] * 100 + [False] * 100)

    def fit(capacity: int) -> list[int]:
        ttls: list[int] = bench.fit_ttls(
            classes, ages, reused, num_classes=3, capacity=capacity, requests=1000
        )
        return ttls

    # Class 0 (0.1 keys a request, held 50 requests each) needs 5 chunks for its reuses.
    assert fit(10) == [50, 0, 0]
    assert fit(4) == [0, 0, 0]


# -- the policy -----------------------------------------------------------------------


def test_the_policy_evicts_the_smallest_last_use_plus_ttl_first() -> None:
    classify = Fixed()
    policy = bench.ClassTTLPolicy([0, 10], classify)
    for key, c in ((1, 1), (2, 0), (3, 1)):
        policy.insert(keys(key))
        classify.classes = [c]
        policy.touch(keys(key))  # at time 1, 2, 3: expiring at 11, 2, 13
    assert policy.evict(3, NONE) == keys(2, 1, 3)  # LRU would take key 1 first
    assert len(policy) == 0


def test_the_policy_evicts_exactly_n_or_nothing_and_never_a_protected_key() -> None:
    classify = Fixed()
    policy = bench.ClassTTLPolicy([0, 5], classify)
    policy.insert(keys(1, 2, 3, 4))
    classify.classes = [1, 1, 0, 0]
    policy.touch(keys(1, 2, 3, 4))
    assert policy.evict(4, frozenset(keys(2))) is None
    assert len(policy) == 4
    assert policy.evict(0, NONE) == []
    assert policy.evict(3, frozenset(keys(4))) == keys(3, 2, 1)  # class 0, then the tail first
    assert len(policy) == 1
    classify.classes = []
    policy.touch([])  # no key: only the clock moves
    classify.classes = [0]
    policy.touch(keys(9))  # untracked: ignored
    assert len(policy) == 1
    policy.remove(keys(4, 9))
    assert len(policy) == 0
    policy.insert(keys(5, 6))
    policy.clear()
    assert len(policy) == 0
    assert policy.evict(1, NONE) is None


def test_the_policy_refuses_bad_ttls_and_classes() -> None:
    with pytest.raises(ValueError, match="non-empty list of integers"):
        bench.ClassTTLPolicy([], Fixed())
    with pytest.raises(ValueError, match="non-empty list of integers"):
        bench.ClassTTLPolicy([3, -1], Fixed())
    classify = Fixed()
    policy = bench.ClassTTLPolicy([1], classify)
    with pytest.raises(ValueError, match="gave 0 classes for 2 keys"):
        policy.touch(keys(1, 2))
    with pytest.raises(ValueError, match=r"class 4 out of range; classes are 0\.\.3"):
        bench.ScheduledClasses([0, 4], [1, 1], num_classes=4)
    schedule = bench.ScheduledClasses([2], [3], num_classes=4)
    assert schedule(keys(1, 2, 3)) == [2, 2, 3]
    with pytest.raises(ValueError, match="more touches than scheduled requests"):
        schedule(keys(1))


class Model:
    """The policy's rule, plainly: evict by (last use + TTL, class, when placed)."""

    def __init__(self, ttls: list[int]) -> None:
        self.ttls = [*ttls, max(ttls)]
        self.state: dict[OffloadKey, tuple[int, int, int]] = {}
        self.now = self.placed = 0

    def place(self, key: OffloadKey, c: int) -> None:
        self.placed += 1
        self.state[key] = (self.now + self.ttls[c], c, self.placed)

    def evict(self, n: int, protected: frozenset[OffloadKey]) -> list[OffloadKey] | None:
        order = sorted((v, key) for key, v in self.state.items() if key not in protected)
        if len(order) < n:
            return None
        victims = [key for _, key in order[:n]]
        for key in victims:
            del self.state[key]
        return victims


ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "evict", "remove"]),
        st.lists(st.integers(0, 7), max_size=5),
        st.lists(st.integers(0, 2), min_size=5, max_size=5),
        st.integers(0, 4),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ttls=st.lists(st.integers(0, 6), min_size=3, max_size=3), steps=ops)
def test_the_policy_matches_a_plain_model(
    ttls: list[int], steps: list[tuple[str, list[int], list[int], int]]
) -> None:
    classify = Fixed()
    policy = bench.ClassTTLPolicy(ttls, classify)
    model = Model(ttls)
    for op, ids, classes, n in steps:
        chosen = keys(*ids)
        if op == "insert":
            policy.insert(chosen)
            for key in reversed(chosen):
                if key not in model.state:
                    model.place(key, len(ttls))
        elif op == "touch":
            classify.classes = classes[: len(chosen)]
            policy.touch(chosen)
            model.now += 1
            for key, c in zip(reversed(chosen), reversed(classify.classes), strict=True):
                if key in model.state:
                    model.place(key, c)
        elif op == "evict":
            protected = frozenset(chosen)
            victims = policy.evict(n, protected)
            assert victims == model.evict(n, protected)
            assert victims is None or (len(victims) == n and not protected & set(victims))
        else:
            policy.remove(chosen)
            for key in chosen:
                model.state.pop(key, None)
        assert len(policy) == len(model.state)


def test_one_class_replays_exactly_as_lru() -> None:
    request_keys = requests_to_keys(chat_workload(400, seed=1))
    expected = simulate_keys(request_keys, capacity_tokens=20 * 512, policy="lru")
    assert bench.replay(request_keys, LRUPolicy(), 20) == (expected.hit_blocks, expected.blocks)
    policy = bench.ClassTTLPolicy([0], lambda touched: [0] * len(touched))
    assert bench.replay(request_keys, policy, 20) == (expected.hit_blocks, expected.blocks)


# -- the run --------------------------------------------------------------------------


def test_largest_flip_for_the_target() -> None:
    points = [(0.0, 0.28), (0.1, 0.25), (0.2, 0.22), (0.3, 0.20)]
    assert bench.largest_flip_for(points, 0.21) == pytest.approx(0.25)
    assert bench.largest_flip_for(points, 0.29) is None
    assert bench.largest_flip_for(points, 0.19) == pytest.approx(0.3)


def test_the_script_prints_every_row_as_json_and_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, chat_workload(300, seed=2))
    argv = ["first_reuse.py", "--trace", str(trace), "--capacity-tokens", "51200"]
    argv += ["--tail", "50", "--jobs", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json"])
    assert bench.main() == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 300
    assert report["tables_upto"] == 250
    assert len(report["features"]) == 5
    rows = report["bound"]
    assert [r["name"] for r in rows][:2] == ["lru", "generation x last"]
    assert len(rows) == 1 + len(bench.VARIANTS)
    assert rows[0]["ratio_to_lru"] == 1.0
    assert [r["classes"] for r in rows[1:4]] == [16, 64, 32]
    assert all(len(r["ttls"]) == r["classes"] for r in rows[1:])
    monkeypatch.setattr(sys, "argv", argv)
    assert bench.main() == 0
    text = capsys.readouterr().out
    assert "P(next turn | turn number)" in text
    assert "issue #20's target: 1.5x lru" in text
