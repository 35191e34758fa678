from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tiering.errors import WorkloadError
from tiering.workload import (
    BLOCK_TOKENS,
    WORKLOADS,
    Request,
    chat_workload,
    load_workload,
)

# The default system prompts are 1024 to 3072 tokens: 2 to 6 full blocks.
MAX_SYSTEM_BLOCKS = 6


@pytest.fixture(scope="module")
def chat() -> list[Request]:
    return chat_workload(2000)


def full_blocks(request: Request) -> tuple[int, ...]:
    """The ids of the request's full blocks (a partial last block is its own)."""
    return request.hash_ids[: request.input_length // BLOCK_TOKENS]


def repeat_fraction(requests: Sequence[Request]) -> float:
    seen: set[int] = set()
    repeats = total = 0
    for request in requests:
        for block in request.hash_ids:
            repeats += block in seen
            seen.add(block)
            total += 1
    return repeats / total


def test_has_the_requested_size(chat: list[Request]) -> None:
    assert len(chat) == 2000
    assert chat_workload(0) == []
    assert len(chat_workload(1)) == 1


def test_same_seed_same_workload_other_seed_other_workload(chat: list[Request]) -> None:
    assert chat_workload(2000) == chat
    assert chat_workload(2000, seed=0) == chat
    assert chat_workload(2000, seed=1) != chat
    assert chat_workload(2000, seed=1) == chat_workload(2000, seed=1)


def test_a_shorter_workload_is_a_prefix_of_a_longer_one(chat: list[Request]) -> None:
    assert chat_workload(300) == chat[:300]
    assert chat_workload(1999) == chat[:1999]


def test_arrivals_are_sorted_from_zero(chat: list[Request]) -> None:
    timestamps = [request.timestamp for request in chat]
    assert timestamps[0] == 0
    assert timestamps == sorted(timestamps)
    # About request_rate (3/s) in the long run: between 1 and 10 per second.
    assert 1.0 < len(chat) / (timestamps[-1] / 1000) < 10.0


def test_input_length_matches_the_block_count(chat: list[Request]) -> None:
    for request in chat:
        blocks = len(request.hash_ids)
        assert (blocks - 1) * BLOCK_TOKENS < request.input_length <= blocks * BLOCK_TOKENS
        assert request.input_length <= 32768
        assert request.output_length >= 1


def test_lengths_are_realistic(chat: list[Request]) -> None:
    inputs = sorted(request.input_length for request in chat)
    assert inputs[0] >= 512
    assert 1000 < inputs[len(inputs) // 2] < 10000
    assert inputs[-1] > 15000
    outputs = [request.output_length for request in chat]
    assert 100 < sum(outputs) / len(outputs) < 1000


def test_ids_are_numbered_by_first_appearance(chat: list[Request]) -> None:
    next_id = 0
    for request in chat:
        for block in request.hash_ids:
            assert block <= next_id
            if block == next_id:
                next_id += 1


def test_equal_ids_are_equal_prefixes(chat: list[Request]) -> None:
    """A prefix hash names the whole prefix: equal ids sit at the same position
    behind equal ids; a block id never appears twice in one request."""
    where: dict[int, tuple[int, int | None]] = {}
    for request in chat:
        assert len(set(request.hash_ids)) == len(request.hash_ids)
        parent: int | None = None
        for position, block in enumerate(request.hash_ids):
            assert where.setdefault(block, (position, parent)) == (position, parent)
            parent = block


def test_system_prompts_are_shared_across_conversations(chat: list[Request]) -> None:
    first_blocks = [request.hash_ids[0] for request in chat]
    # Every prompt starts with one of the 8 system prompts (each >= 2 full blocks).
    assert len(set(first_blocks)) <= 8
    counts = sorted((first_blocks.count(block) for block in set(first_blocks)), reverse=True)
    assert counts[0] > 2000 // 8  # Zipf: the most popular is used more than its share
    assert counts[0] > counts[-1]
    # Single-turn conversations share only system prompts, never more blocks.
    single = chat_workload(1000, mean_turns=1.0)
    assert len({request.hash_ids[0] for request in single}) <= 8
    seen: set[int] = set()
    for request in single:
        for position, block in enumerate(request.hash_ids):
            if block in seen:
                assert position < MAX_SYSTEM_BLOCKS
            seen.add(block)


def test_later_turns_extend_earlier_turns(chat: list[Request]) -> None:
    """A later turn's prompt is an earlier prompt, its answer and a new message."""
    by_full_blocks: dict[tuple[int, ...], Request] = {}
    seen: set[int] = set()
    later_turns = 0
    for request in chat:
        repeated = [block in seen for block in request.hash_ids]
        if any(repeated[MAX_SYSTEM_BLOCKS:]):  # shares more than any system prompt
            later_turns += 1
            earlier = [
                by_full_blocks[request.hash_ids[:n]]
                for n in range(MAX_SYSTEM_BLOCKS, len(request.hash_ids))
                if request.hash_ids[:n] in by_full_blocks
            ]
            assert earlier, request
            previous = earlier[-1]
            assert previous.timestamp < request.timestamp
            assert request.input_length > previous.input_length + previous.output_length
        seen.update(request.hash_ids)
        by_full_blocks.setdefault(full_blocks(request), request)
    assert later_turns > len(chat) // 4
    assert repeat_fraction(chat) > repeat_fraction(chat_workload(2000, mean_turns=1.0))


def test_parameters_shape_the_workload() -> None:
    long = chat_workload(300, system_prompt_tokens=8192, max_input_tokens=65536)
    assert min(request.input_length for request in long) >= 4096
    capped = chat_workload(300, max_input_tokens=4096)
    assert max(request.input_length for request in capped) <= 4096
    one_prompt = chat_workload(300, num_system_prompts=1)
    assert len({request.hash_ids[0] for request in one_prompt}) == 1
    fast = chat_workload(300, request_rate=100.0)
    assert fast[-1].timestamp < chat_workload(300)[-1].timestamp


BAD_PARAMETERS: dict[str, tuple[dict[str, Any], str]] = {
    "negative requests": ({"num_requests": -1}, "num_requests"),
    "float requests": ({"num_requests": 2.0}, "num_requests"),
    "bool requests": ({"num_requests": True}, "num_requests"),
    "negative seed": ({"seed": -3}, "seed"),
    "no system prompts": ({"num_system_prompts": 0}, "num_system_prompts"),
    "empty system prompt": ({"system_prompt_tokens": 0}, "system_prompt_tokens"),
    "negative skew": ({"popularity_skew": -0.5}, "popularity_skew"),
    "nan skew": ({"popularity_skew": float("nan")}, "popularity_skew"),
    "too few turns": ({"mean_turns": 0.5}, "mean_turns"),
    "tiny messages": ({"user_tokens": 2}, "user_tokens"),
    "no output": ({"output_tokens": 0}, "output_tokens"),
    "zero rate": ({"request_rate": 0.0}, "request_rate"),
    "infinite rate": ({"request_rate": float("inf")}, "request_rate"),
    "string rate": ({"request_rate": "3"}, "request_rate"),
    "negative think time": ({"think_time_s": -1.0}, "think_time_s"),
    "context too short": ({"max_input_tokens": 3000}, "max_input_tokens"),
}


@pytest.mark.parametrize(("kwargs", "name"), BAD_PARAMETERS.values(), ids=BAD_PARAMETERS.keys())
def test_bad_parameters_are_refused(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(WorkloadError, match=name) as info:
        chat_workload(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_zero_think_time_is_allowed() -> None:
    requests = chat_workload(200, think_time_s=0.0)
    assert len(requests) == 200


def test_load_workload_by_name(chat: list[Request]) -> None:
    assert set(WORKLOADS) == {"chat", "documents"}
    assert load_workload("chat", 2000) == chat
    assert load_workload("chat", 100, seed=1) == chat_workload(100, seed=1)
    assert len(load_workload("chat", None)) == 5000


def test_an_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError, match=r"unknown workload 'agent'.*'chat'"):
        load_workload("agent", 10)


def test_load_workload_validates_num_requests() -> None:
    with pytest.raises(WorkloadError, match="num_requests"):
        load_workload("chat", -5)


def test_the_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        WORKLOADS["mine"] = chat_workload  # type: ignore[index]
