"""The documents workload: many short questions about long shared documents."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tiering.errors import WorkloadError
from tiering.workload import (
    BLOCK_TOKENS,
    Request,
    chat_workload,
    documents_workload,
    load_workload,
)


@pytest.fixture(scope="module")
def docs() -> list[Request]:
    return documents_workload(1500)


def test_deterministic_and_a_shorter_one_is_a_prefix(docs: list[Request]) -> None:
    assert len(docs) == 1500
    assert documents_workload(1500) == docs
    assert documents_workload(400) == docs[:400]
    assert documents_workload(1500, seed=1) != docs
    assert documents_workload(0) == []
    assert load_workload("documents", 400) == docs[:400]


def test_arrivals_sorted_and_lengths_match_blocks(docs: list[Request]) -> None:
    timestamps = [r.timestamp for r in docs]
    assert timestamps[0] == 0
    assert timestamps == sorted(timestamps)
    for r in docs:
        assert (
            (len(r.hash_ids) - 1) * BLOCK_TOKENS < r.input_length <= len(r.hash_ids) * BLOCK_TOKENS
        )
        assert r.input_length <= 65536
        assert r.output_length >= 1


def test_equal_ids_are_equal_prefixes(docs: list[Request]) -> None:
    where: dict[int, tuple[int, int | None]] = {}
    for r in docs:
        assert len(set(r.hash_ids)) == len(r.hash_ids)
        parent: int | None = None
        for position, block in enumerate(r.hash_ids):
            assert where.setdefault(block, (position, parent)) == (position, parent)
            parent = block


def test_long_documents_shared_by_many_short_questions(docs: list[Request]) -> None:
    # Every prompt starts with the two blocks of the one system prompt.
    assert {r.hash_ids[:2] for r in docs} == {(0, 1)}
    # Prompts are long (a document), and most of a prompt is shared with others.
    assert sorted(r.input_length for r in docs)[len(docs) // 2] > 6000
    counts = Counter(block for r in docs for block in r.hash_ids)
    shared = sum(c for c in counts.values() if c > 1)
    assert shared > 0.8 * sum(counts.values())
    # Reuse is far more concentrated than in chat: a few documents take many requests.
    per_document = Counter(r.hash_ids[2] for r in docs)
    assert per_document.most_common(1)[0][1] > 50
    assert len(per_document) > 40


def test_popularity_drifts_to_new_documents() -> None:
    requests = documents_workload(3000, document_rate=0.5)
    first = {r.hash_ids[2] for r in requests[:300]}
    last = {r.hash_ids[2] for r in requests[-300:]}
    assert len(last - first) > len(last) // 2


def test_parameters_shape_the_workload() -> None:
    single = documents_workload(300, mean_turns=1.0)
    multi = documents_workload(300, mean_turns=4.0)
    seen: set[tuple[int, ...]] = set()
    followups = 0
    for r in multi:
        full = r.hash_ids[: r.input_length // BLOCK_TOKENS]
        followups += any(full[:n] in seen for n in range(len(full) - 1, len(full) // 2, -1))
        seen.update(full[:n] for n in range(1, len(full) + 1))
    assert followups > 30
    short = documents_workload(200, document_tokens=1000, max_input_tokens=4096)
    assert max(r.input_length for r in short) <= 4096
    assert sum(r.input_length for r in single) != sum(r.input_length for r in multi)
    assert documents_workload(300, request_rate=50.0)[-1].timestamp < single[-1].timestamp


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "negative requests": ({"num_requests": -1}, "num_requests"),
    "no documents": ({"initial_documents": 0}, "initial_documents"),
    "negative document rate": ({"document_rate": -1.0}, "document_rate"),
    "nan skew": ({"popularity_skew": float("nan")}, "popularity_skew"),
    "tiny documents": ({"document_tokens": 10}, "document_tokens"),
    "tiny questions": ({"question_tokens": 1}, "question_tokens"),
    "too few turns": ({"mean_turns": 0.5}, "mean_turns"),
    "zero rate": ({"request_rate": 0.0}, "request_rate"),
    "negative think time": ({"think_time_s": -1.0}, "think_time_s"),
    "context too short": ({"max_input_tokens": 2000}, "max_input_tokens"),
}


@pytest.mark.parametrize(("kwargs", "name"), BAD.values(), ids=BAD.keys())
def test_bad_parameters_are_refused(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(WorkloadError, match=name) as info:
        documents_workload(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_unlike_chat() -> None:
    """The point of a second workload: its reuse has another shape."""
    docs = documents_workload(1000)
    chat = chat_workload(1000)
    assert sum(len(r.hash_ids) for r in docs) > 2 * sum(len(r.hash_ids) for r in chat)
