"""The hint vocabulary: its channels' payloads, what is refused and why, what is counted."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tiering.hints import (
    ACTION_TYPE,
    Hint,
    HintError,
    HintReader,
    action_hint,
    check_hint,
    transfer_params_hint,
)


class Action(msgspec.Struct, frozen=True):
    """Shaped as vLLM's ``KvHintAction`` (the reader reads attributes, not the type)."""

    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Any]


class Envelope(msgspec.Struct, frozen=True):
    protocol_version: str
    message_id: str
    actions: list[Action]


def envelope(*actions: Action) -> Envelope:
    return Envelope(protocol_version="1", message_id="m", actions=list(actions))


def action(payload: dict[str, Any], *, kind: str = ACTION_TYPE, version: str = "1") -> Action:
    return Action(action_id="a", action_type=kind, action_version=version, payload=payload)


def test_kv_transfer_params_carry_a_hint() -> None:
    assert transfer_params_hint(None) is None
    assert transfer_params_hint({"do_remote_prefill": True}) is None  # another connector's
    params = {"tiering": {"version": 1, "retain_s": 600, "priority": 2}}
    assert transfer_params_hint(params) == Hint(retain_s=600.0, priority=2)
    assert transfer_params_hint({"tiering": {"version": 1, "release": True}}) == Hint(release=True)
    assert transfer_params_hint({"tiering": {"version": 1}}) == Hint()  # changes nothing
    assert Hint().empty
    assert not Hint(release=True).empty


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"retain_s": 600}, "needs a version, the integer 1; got None"),
        ({"version": "1", "retain_s": 600}, "needs a version, the integer 1; got '1'"),
        ({"version": 1, "retain_s": -5}, "Expected `float` > 0"),
        ({"version": 1, "retain_s": 0}, "Expected `float` > 0"),
        ({"version": 1, "retain_s": 10**9}, "Expected `float` <= 604800"),
        (
            {"version": 1, "retain_s": "600"},
            "Expected `float | null`, got `str` - at `$.retain_s` (got '600')",
        ),
        ({"version": 1, "release": "yes"}, "Expected `bool`, got `str`"),
        ({"version": 1, "priority": 101}, "Expected `int` <= 100"),
        ({"version": 1, "retian_s": 600}, "unknown field `retian_s`"),
        ({"version": 1, "retain_s": 60, "release": True}, "retain_s or release, not both"),
        ("retain", "must be a JSON object such as"),
    ],
)
def test_a_malformed_entry_is_refused_with_one_line(entry: object, message: str) -> None:
    with pytest.raises(HintError) as info:
        transfer_params_hint({"tiering": entry})
    text = str(info.value)
    assert "\n" not in text
    assert message in text
    assert "kv_transfer_params['tiering']" in text


def test_envelope_actions() -> None:
    assert action_hint("router.prefetch", "1", {}) is None  # another component's action
    assert action_hint(ACTION_TYPE, "1", {"retain_s": 30}) == Hint(retain_s=30.0)
    with pytest.raises(HintError, match="not both"):
        action_hint(ACTION_TYPE, "1", {"retain_s": 30, "release": True})


def test_check_hint() -> None:
    assert check_hint(None) is None
    assert check_hint(Hint(release=True)) == Hint(release=True)
    with pytest.raises(HintError, match=r"a hint must be a tiering\.hints\.Hint or None, got 600"):
        check_hint(600)
    with pytest.raises(HintError, match="not both"):
        check_hint(Hint(retain_s=5, release=True))
    with pytest.raises(HintError, match="<= 604800"):
        check_hint(Hint(retain_s=1e9))


def test_the_reader_never_raises_counts_everything_and_warns_once_per_kind() -> None:
    said: list[str] = []
    reader = HintReader(lambda fmt, *args: said.append(fmt % args))
    assert reader.read({"tiering": {"version": 1, "retain_s": 5}}, None) == Hint(retain_s=5.0)
    # The envelope's last tiering action wins over kv_transfer_params.
    both = reader.read(
        {"tiering": {"version": 1, "retain_s": 5}},
        envelope(action({"release": True}), action({}, kind="other.thing")),
    )
    assert both == Hint(release=True)
    for _ in range(3):
        assert reader.read({"tiering": {"version": 1, "retain_s": "x"}}, None) is None
        assert reader.read({"tiering": {"version": 2, "retain_s": 5}}, None) is None
        assert reader.read(None, envelope(action({"retain_s": 5}, version="9"))) is None
        assert reader.read(None, envelope(action({"bogus": 1}))) is None
        assert reader.read(None, object()) is None  # no actions at all
    assert reader.read(None, None) is None
    assert reader.counts.as_dict() == {
        "taken": 2,
        "unknown_version": 6,
        "other_actions": 1,
        "malformed": 9,
    }
    assert len(said) == 2  # once per kind of fault
    assert "version 2 was ignored; this tiering speaks version 1" in said[1]
    assert "malformed hint was refused" in said[0]
    assert "the request goes on without the hint" in said[0]


def test_an_action_version_that_is_no_string_is_malformed_and_says_the_string() -> None:
    # vLLM's KvHintAction types action_version as a string and does not check it: an
    # orchestrator that builds one with the integer 1 gets told the string '1', once,
    # not "version 1 was ignored; this tiering speaks version 1".
    with pytest.raises(HintError) as info:
        action_hint(ACTION_TYPE, 1, {"retain_s": 5})
    assert str(info.value) == (
        "kv_hints action 'tiering.retention' needs an action_version, the string '1'; got 1"
    )
    said: list[str] = []
    reader = HintReader(lambda fmt, *args: said.append(fmt % args))
    version: Any = 1  # as an orchestrator's Python may build it
    unchecked = Action(action_id="a", action_type=ACTION_TYPE, action_version=version, payload={})
    assert reader.read(None, envelope(unchecked)) is None
    assert (reader.counts.malformed, reader.counts.unknown_version) == (1, 0)
    assert "needs an action_version, the string '1'; got 1" in said[0]
