"""`tiering._decode`: msgspec's errors as one line: the key path, the value, what is right."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import Meta

from tiering._decode import (
    NonEmptyStr,
    NonNegativeInt,
    Port,
    PositiveInt,
    Seconds,
    closest_key,
    decode,
    expected_text,
    shown,
)
from tiering.errors import ConfigError, WorkloadError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"
    GREEN = "green"


class Entry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: NonEmptyStr
    max_store_jobs: PositiveInt = 64
    timeout_s: Annotated[float, Meta(gt=0, description="a number of seconds")] = 2.0
    checksum: Literal["xxh3", "ml64"] = "xxh3"
    cluster: bool | None = None
    password: str | None = None
    backoff_s: tuple[Seconds, Seconds] = (0.5, 30.0)
    port: Port = 0
    colour: Colour = Colour.RED

    def __post_init__(self) -> None:
        if self.backoff_s[0] > self.backoff_s[1]:
            raise ConfigError(f"'backoff_s' must be [first, longest], got {list(self.backoff_s)}")


class Extra(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tiers: list[Entry] = []
    limits: dict[str, NonNegativeInt] = {}


WHERE = "kv_connector_extra_config"


def refusal(obj: object, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        decode(Extra, obj, where=WHERE, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_good_input_decodes() -> None:
    extra = decode(Extra, {"tiers": [{"url": "redis://h/0", "backoff_s": [1, 2]}]}, where=WHERE)
    assert extra.tiers[0] == Entry(url="redis://h/0", backoff_s=(1.0, 2.0))


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        ({"max_store_jobs": 0}, "['tiers'][0]['max_store_jobs'] must be a positive integer, got 0"),
        ({"max_store_jobs": True}, "must be a positive integer, got True of type bool"),
        ({"max_store_jobs": "4"}, "['max_store_jobs'] must be a positive integer, got '4' of"),
        ({"timeout_s": "2"}, "['timeout_s'] must be a number of seconds, got '2' of type str"),
        ({"checksum": "md5"}, "['checksum'] must be 'ml64' or 'xxh3', got 'md5'"),
        ({"colour": "pink"}, "['colour'] must be one of 'red', 'blue', 'green', got 'pink'"),
        ({"cluster": "auto"}, "['cluster'] must be true, false or None, got 'auto'"),
        ({"backoff_s": [1, 0]}, "['backoff_s'][1] must be a number > 0, got 0"),
        ({"backoff_s": 3}, "['backoff_s'] must be a list of 2 items: a number > 0, a number > 0"),
        ({"port": 70000}, "['port'] must be an integer from 0 to 65535, got 70000"),
        ({"url": ""}, "['url'] must be a non-empty string, got ''"),
    ],
)  # fmt: skip
def test_a_bad_value_names_the_path_the_value_and_what_is_right(tier: Any, message: str) -> None:
    text = refusal({"tiers": [{"url": "redis://h/0", **tier}]})
    assert text.startswith(f"{WHERE}['tiers'][0]")
    assert message in text


def test_a_missing_key_says_what_it_must_be() -> None:
    assert (
        refusal({"tiers": [{}]}) == f"{WHERE}['tiers'][0] needs the key 'url': a non-empty string"
    )


def test_an_unknown_key_is_named_with_the_key_it_misspells() -> None:
    text = refusal({"tiers": [{"url": "u", "timeout": 3, "flavour": 1}]})
    assert text.startswith(f"{WHERE}['tiers'][0] has unknown key(s) 'timeout', 'flavour'; ")
    assert "did you mean 'timeout_s'? the known keys are url, max_store_jobs," in text
    assert "did you mean" not in refusal({"zzz": 1})


def test_a_mapping_value_and_key_are_found() -> None:
    text = refusal({"limits": {"a": 1, "b": -1}})
    assert text == f"{WHERE}['limits']['b'] must be a non-negative integer, got -1"
    text = refusal({"limits": {3: 1}})
    assert text == f"{WHERE}['limits'] has the key 3; every key must be a string"


def test_the_whole_value_of_the_wrong_type() -> None:
    assert (
        refusal([1])
        == f"{WHERE} must be a mapping with the keys tiers, limits, got [1] of type list"
    )
    with pytest.raises(ConfigError, match=r"^the value must be a mapping"):
        decode(Extra, 3)


def test_without_where_the_path_starts_at_the_bare_key_after_the_context() -> None:
    context = "secondary tier 'r' (RedisSecondaryTier): "
    with pytest.raises(ConfigError) as info:
        decode(Entry, {"url": "u", "max_store_jobs": 0}, context=context)
    assert str(info.value) == f"{context}'max_store_jobs' must be a positive integer, got 0"


def test_a_check_across_fields_gets_the_context() -> None:
    with pytest.raises(ConfigError, match=r"^tier: 'backoff_s' must be \[first, longest\]"):
        decode(Entry, {"url": "u", "backoff_s": [2, 1]}, context="tier: ")


def test_a_secret_is_never_shown() -> None:
    text = refusal({"tiers": [{"url": "u", "password": 12345}]})
    assert text.endswith("['password'] must be a string or None, got ***")
    text = refusal({"tiers": [{"url": "redis://user:s3cret@host/0", "port": -1}]})
    assert "s3cret" not in text
    assert shown("redis://user:s3cret@host/0") == "'redis://user:***@host/0' of type str"
    assert shown("abc", "auth_token") == "***"
    assert shown("abc", "api_key") == "***"
    assert shown(7, "keys_total") == "7"  # a word of its own, not a part of one


def test_strict_by_default_lax_on_request() -> None:
    assert decode(PositiveInt, "4", strict=False) == 4
    with pytest.raises(ConfigError):
        decode(PositiveInt, "4")


def test_another_error_class() -> None:
    with pytest.raises(WorkloadError, match=r"^trace\['n'\] must be a positive integer"):
        decode(dict[str, PositiveInt], {"n": 0}, where="trace", error=WorkloadError)


@pytest.mark.parametrize(
    ("type_", "text"),
    [
        (PositiveInt, "a positive integer"),
        (NonNegativeInt, "a non-negative integer"),
        (Annotated[int, Meta(ge=16)], "an integer >= 16"),
        (Annotated[int, Meta(gt=0, lt=9)], "an integer from 1 to 8"),
        (Seconds, "a number > 0"),
        (float, "a number"),
        (str, "a string"),
        (Annotated[str, Meta(pattern="^a")], "a string matching '^a'"),
        (bool, "true or false"),
        (Literal["x"], "'x'"),
        (list[int], "a list, each item an integer"),
        (dict[str, bool], "a mapping, each value true or false"),
        (int | str | None, "an integer, a string or None"),
        (Any, "any value"),
    ],
)  # fmt: skip
def test_expected_text(type_: Any, text: str) -> None:
    assert expected_text(type_) == text


def test_closest_key() -> None:
    keys = ["max_queued_jobs", "slice_chunks"]
    assert closest_key("MAX_QUEUED_JOBS", keys) == "max_queued_jobs"
    assert closest_key("slice_chunk", keys) == "slice_chunks"
    assert closest_key("colour", keys) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=3)
    ),
    max_leaves=12,
)
ENTRY_KEYS = ("url", "max_store_jobs", "timeout_s", "backoff_s", "cluster", "colour", "x")
entries = st.fixed_dictionaries({}, optional=dict.fromkeys(ENTRY_KEYS, json_values))


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.fixed_dictionaries({"tiers": st.lists(entries, max_size=2)})))
def test_any_input_decodes_or_is_one_config_error_line(obj: object) -> None:
    message = ""
    try:
        decode(Extra, obj, where=WHERE)
    except ConfigError as exc:
        message = str(exc)
    assert "\n" not in message
    assert not message or message.startswith(WHERE)


def test_numpy_numbers_are_taken_as_pythons() -> None:
    # A number a program computed with numpy was always taken (msgspec alone takes none).
    np = pytest.importorskip("numpy")
    entry = decode(
        Entry, {"url": "u", "max_store_jobs": np.int64(3), "timeout_s": np.float64(1.5),
                "backoff_s": [np.float32(0.5), np.int32(2)]},
    )  # fmt: skip
    assert (entry.max_store_jobs, entry.timeout_s, entry.backoff_s) == (3, 1.5, (0.5, 2.0))
    assert type(entry.max_store_jobs) is int
    assert type(entry.timeout_s) is float
    assert "got 0" in refusal({"tiers": [{"url": "u", "max_store_jobs": np.int64(0)}]})
    with pytest.raises(
        ConfigError, match=r"must be a positive integer, got np\.True_ of type bool"
    ):
        decode(Entry, {"url": "u", "max_store_jobs": np.True_})  # numpy's bool is no number


@pytest.mark.parametrize(
    "url",
    ["redis://:pa/ss@h/0", "redis://user:p@ss@h/0", "rediss://u:a b@h:6380", "redis://s3:cr#et@h"],
)
def test_a_urls_password_is_never_shown_whatever_it_holds(url: str) -> None:
    password = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
    for text in (
        shown(url),
        shown({"tiers": {"url": url}}),
        refusal({"tiers": {"url": url}}),  # an entry where the list belongs
        refusal({"tiers": [{"url": url, "max_store_jobs": [url]}]}),
    ):
        assert password not in text, text


def test_a_secret_keys_value_is_hidden_inside_what_is_shown() -> None:
    text = refusal({"tiers": {"password": "hunter2", "token": ["t0k3n"]}})
    assert "hunter2" not in text
    assert "t0k3n" not in text
    assert "'password': ***" in text
    # and under a secret key anywhere up the path
    with pytest.raises(ConfigError) as info:
        decode(dict[str, dict[str, int]], {"credentials": {"user": "s3cret"}}, where="x")
    assert "s3cret" not in str(info.value)


def test_json_paths_hide_a_secret_too() -> None:
    class File(msgspec.Struct, forbid_unknown_fields=True):
        password: int = 0
        extra: dict[str, Any] = {}

    for obj in ({"password": "hunter2"}, {"extra": [{"url": "redis://:pa/ss@h/0"}]}):
        with pytest.raises(ConfigError) as info:
            decode(File, obj, json_paths=True)
        assert "hunter2" not in str(info.value)
        assert "pa/ss" not in str(info.value)
