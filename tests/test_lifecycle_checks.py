"""The one lifecycle (`_state`, `_closing`) and the shared constructor checks (`_checks`)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from tiering._checks import check_bool, check_int, check_real, integer_text, is_int
from tiering._closing import AsyncLifecycle
from tiering._state import Lifecycle, ResourceState
from tiering.errors import ConfigError, ResourceClosedError, WorkloadError


def test_a_lifecycle_moves_once_and_forward() -> None:
    life = Lifecycle("the thing")
    assert life.state is ResourceState.NEW
    assert not life.is_open
    assert not life.closed
    with pytest.raises(ResourceClosedError, match="the thing is new; no new jobs"):
        life.check_open("no new jobs")
    life.open()
    life.check_open()
    with pytest.raises(ResourceClosedError, match="opens once"):
        life.open()
    seen: list[str] = []
    life.when_closed(lambda: seen.append("closed"))
    assert life.begin_close() is True
    assert life.state is ResourceState.CLOSING
    assert life.closed
    assert life.begin_close() is False  # only the first caller closes
    assert seen == []
    life.end_close()
    life.end_close()  # idempotent: the callbacks run once
    assert life.state is ResourceState.CLOSED
    assert seen == ["closed"]
    life.when_closed(lambda: seen.append("late"))  # closed already: now
    assert seen == ["closed", "late"]
    with pytest.raises(ResourceClosedError, match="the thing is closed"):
        life.check_open()


def test_close_now_reports_the_first_close_only() -> None:
    life = Lifecycle("x", opened=True)
    assert life.close_now() is True
    assert life.close_now() is False
    assert life.state is ResourceState.CLOSED


@pytest.mark.anyio
async def test_a_second_aclose_waits_for_the_first() -> None:
    life = AsyncLifecycle("the tier", opened=True)
    order: list[str] = []

    async def second() -> None:
        first = await life.begin_aclose()
        order.append(f"second {first} {life.state.value}")

    assert await life.begin_aclose() is True
    async with anyio.create_task_group() as group:
        group.start_soon(second)
        await anyio.sleep(0.01)
        order.append("first ends")
        life.end_close()
    assert order == ["first ends", "second False closed"]
    assert await life.begin_aclose() is False  # closed: a checkpoint, nothing to do
    await life.wait_closed()


@pytest.mark.anyio
async def test_the_first_aclose_is_handed_over_even_when_cancelled() -> None:
    life = AsyncLifecycle("the tier", opened=True)
    with anyio.CancelScope() as scope:
        scope.cancel()
        assert await life.begin_aclose() is True  # a shielded checkpoint: the close goes on
    assert life.state is ResourceState.CLOSING


def test_integers_are_ints_or_numpy_integers_never_bools() -> None:
    assert is_int(3)
    assert is_int(np.int64(3))
    assert is_int(np.uint8(0))
    for value in (True, 3.0, "3", None, np.array([1, 2]), np.float64(1)):
        assert not is_int(value), value
    assert check_int("n", np.int32(4), minimum=1) == 4
    assert type(check_int("n", np.int32(4))) is int


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "cascade_queue must be a positive integer, got 0"),
        (True, "cascade_queue must be a positive integer, got True of type bool"),
        ("3", "cascade_queue must be a positive integer, got '3' of type str"),
        (2.0, "cascade_queue must be a positive integer, got 2.0"),
    ],
)
def test_check_int_says_what_which_value_and_what_is_right(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_int("cascade_queue", value, minimum=1)
    assert str(caught.value) == message


def test_integer_ranges_in_words() -> None:
    assert integer_text(0, None) == "a non-negative integer"
    assert integer_text(16, None) == "an integer >= 16"
    assert integer_text(1, 8) == "an integer from 1 to 8"
    assert integer_text(None, 8) == "an integer <= 8"
    assert integer_text(None, None) == "an integer"
    with pytest.raises(WorkloadError, match="from 1 to 8, got 9"):
        check_int("n", 9, minimum=1, maximum=8, error=WorkloadError)


def test_check_real_takes_finite_numbers_in_range() -> None:
    assert check_real("t", 2) == 2.0
    assert check_real("t", 0, minimum=0) == 0.0
    for value in (0, -1, float("nan"), float("inf"), 10**400, True, "1"):
        with pytest.raises(ConfigError, match="t must be a finite number > 0"):
            check_real("t", value, minimum=0, inclusive=False)


def test_check_bool_takes_only_bools() -> None:
    assert check_bool("b", False) is False
    for value in (0, 1, "false", None):
        with pytest.raises(ConfigError, match="b must be true or false"):
            check_bool("b", value)


def test_check_real_takes_inf_only_where_a_timeout_may_never_end() -> None:
    assert check_real("t", float("inf"), minimum=0, inclusive=False, infinite=True) == float("inf")
    with pytest.raises(ConfigError, match=r"> 0 \(or inf: no limit\), got nan"):
        check_real("t", float("nan"), minimum=0, inclusive=False, infinite=True)
    with pytest.raises(ConfigError, match="got -inf"):
        check_real("t", float("-inf"), minimum=0, infinite=True)
