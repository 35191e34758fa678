"""External input decoded into msgspec Structs, each error one line a person can act on (layer 1).

Every input that comes from outside Python (a config file, vLLM's
``kv_connector_extra_config`` and its ``secondary_tiers`` entries, options a
CLI builds from its arguments) is modelled as a msgspec Struct, with
``forbid_unknown_fields=True`` where the keys are ours and ``Meta``
constraints on the values, and loaded by `decode`::

    class TierEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
        url: str
        max_store_jobs: PositiveInt = 64
        timeout_s: Seconds = 2.0

    entry = decode(TierEntry, raw, where="kv_connector_extra_config['secondary_tiers'][0]")

`decode` is ``msgspec.convert`` (strict: ``"4"`` is not taken for ``4``, nor
``True`` for ``1``); a `msgspec.ValidationError` becomes one `ConfigError`
line that names the key path in the project's notation (``where`` followed by
``['key'][0]``), the value found there, and what would be right, in words
drawn from the Struct's type and its ``Meta`` constraints ("an integer >= 1",
"one of 'xxh3', 'ml64'"), or from ``Meta(description=...)`` where a field
says it in its own words. An unknown key is named with the close known key it
may misspell (``difflib``) and the keys that are known. A value under a key
named like a secret (password, secret, token, key), at any depth of what is
shown, is ``***``, and the password of a URL never appears. numpy's numbers
are taken for Python's (msgspec alone takes neither).

Checks that span fields (one value below another) stay in the Struct's
``__post_init__``, which runs on decoding too; their `ConfigError` passes
through `decode` with ``context`` in front.
"""

from __future__ import annotations

import difflib
import numbers
import operator
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

from tiering._checks import integer_text, is_int
from tiering.errors import ConfigError

__all__ = [
    "NonEmptyStr",
    "NonNegativeInt",
    "NonNegativeSeconds",
    "Port",
    "PositiveInt",
    "Seconds",
    "closest_key",
    "decode",
    "expected_text",
    "shown",
]

T = TypeVar("T")

#: An integer of at least 1 (a count, a size).
PositiveInt = Annotated[int, Meta(ge=1)]
#: An integer of at least 0 (an index, an optional size where 0 means "unknown").
NonNegativeInt = Annotated[int, Meta(ge=0)]
#: A TCP port, 0 for "any free port".
Port = Annotated[int, Meta(ge=0, le=65535)]
#: A duration in seconds, above 0.
Seconds = Annotated[float, Meta(gt=0)]
#: A duration in seconds, 0 allowed.
NonNegativeSeconds = Annotated[float, Meta(ge=0)]
#: A string with at least one character.
NonEmptyStr = Annotated[str, Meta(min_length=1)]

#: Words that make a key's value a secret: never shown in an error.
_SECRET_WORDS = frozenset({"password", "passwd", "pw", "secret", "token", "key", "credentials"})
#: A URL's userinfo: from ``://`` to the last ``@`` before a space, as
#: `tiering.secondary.redis.redact_url` reads it (a password may hold an unencoded
#: ``/``, ``@`` or ``:``).
_URL_USERINFO = re.compile(r"://(\S*)@")
#: In a string of its own, the userinfo runs to the last ``@`` (spaces too).
_URL_USERINFO_WHOLE = re.compile(r"://(.*)@", re.DOTALL)
_PLAIN_USER = re.compile(r"[A-Za-z0-9._~-]*")
_AT = re.compile(r"^(?P<text>.*?)(?: - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`)?$", re.DOTALL)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[(\.\.\.)\]")


def decode(
    type_: type[T],
    obj: object,
    *,
    where: str = "",
    context: str = "",
    root: str = "the value",
    strict: bool = True,
    json_paths: bool = False,
    error: type[Exception] = ConfigError,
) -> T:
    """``obj`` converted to ``type_`` (``msgspec.convert``), or one ``error`` line.

    ``where`` names ``obj`` as the project writes it (``kv_connector_extra_config``);
    the key path of a bad value is appended to it (``['tiers'][0]['url']``). With no
    ``where`` the path starts at the bare key (``'timeout_s'``), and ``root`` names
    the whole value (``the entry has unknown key(s) ...``). ``context`` goes in front
    of the message (``"secondary tier 'redis' (RedisSecondaryTier): "``), also in
    front of a `ConfigError` that a Struct's ``__post_init__`` raises.

    ``json_paths`` keeps msgspec's own words and JSON path, with the value found there
    (``Expected `int`, got `str` - at `$.cache.blocks_per_chunk` (value: '4')``): for a
    file, whose reader thinks in its JSON or TOML tables.
    """
    obj = _plain(obj)
    try:
        return msgspec.convert(obj, type_, strict=strict)
    except msgspec.ValidationError as exc:
        if json_paths:
            raise error(f"{context}{exc}{_value_text(obj, str(exc))}") from exc
        if isinstance(exc.__cause__, ConfigError):  # a check across fields, in __post_init__
            raise error(f"{context}{exc.__cause__}") from None
        text = problem_text(type_, obj, str(exc), where=where, root=root)
        raise error(context + text) from None


def problem_text(
    type_: Any, obj: object, message: str, *, where: str = "", root: str = "the value"
) -> str:
    """msgspec's validation ``message`` about ``obj`` (of ``type_``) in the project's words."""
    match = _AT.match(message)
    if match is None:  # never: the pattern matches any text
        return message
    text, on_key = match["text"], bool(match["key"])
    info: Any = mi.type_info(type_)
    value: object = obj
    location = where
    name = secret = ""  # the key the value is under; the first secret key of the path
    for field, index, any_key in _STEP.findall(match["path"] or ""):
        secret = secret or (name if _is_secret(name) else "")
        info = _unwrap(info, want_index=bool(index))
        if any_key:  # a mapping's value: msgspec does not say which; find it
            key, value = _failing_item(value, info.value_type)
            info, name = info.value_type, str(key)
            location += _key_text(key, location)
        elif index:
            value = value[int(index)] if isinstance(value, Sequence) else None
            info = _item_type(info, int(index))
            location += f"[{index}]"
        else:
            value = value.get(field) if isinstance(value, Mapping) else None
            info, name = _field_type(info, field), field
            location += _key_text(field, location)
    location = location or root
    unknown = re.match(r"Object contains unknown field `(.*)`$", text)
    if unknown:
        return _unknown_text(location, value, _unwrap(info), unknown[1])
    missing = re.match(r"Object missing required field `(.*)`$", text)
    if missing:
        field = missing[1]
        right = expected_text(_field_type(_unwrap(info), field))
        return f"{location} needs the key {field!r}: {right}"
    if on_key:
        info = _unwrap(info)
        key_type = info.key_type if isinstance(info, mi.DictType) else mi.type_info(str)
        key, _ = _failing_item(value, key_type, keys=True)
        return f"{location} has the key {key!r}; every key must be {expected_text(key_type)}"
    typed = "got `" in text  # the value is of a wrong type: say which
    shown_value = shown(value, secret or name, typed=typed)
    return f"{location} must be {expected_text(info)}, got {shown_value}"


def _value_text(obj: object, message: str) -> str:
    """`` (value: ...)`` for the value msgspec's ``message`` points at, if it is there."""
    path = _AT.match(message)
    value = obj
    if path is None or path["key"] or not path["path"]:
        return ""
    for field, index, _any in _STEP.findall(path["path"]):
        if field and _is_secret(field):
            return " (value: ***)"
        if field and isinstance(value, Mapping) and field in value:
            value = value[field]
        elif index and isinstance(value, Sequence) and int(index) < len(value):
            value = value[int(index)]
        else:
            return ""
    return f" (value: {_repr(value)})"


def expected_text(info: Any) -> str:
    """What a value of type ``info`` (a type, or ``msgspec.inspect``'s view of one) is, in
    words: "an integer >= 1", "true or false", "one of 'a', 'b'"."""
    if not isinstance(info, mi.Type):
        info = mi.type_info(info)
    if isinstance(info, mi.Metadata):
        described = (info.extra_json_schema or {}).get("description")
        return str(described) if described else expected_text(info.type)
    if isinstance(info, mi.IntType):
        low = info.ge if info.gt is None else info.gt + 1
        high = info.le if info.lt is None else info.lt - 1
        return integer_text(low, high)
    if isinstance(info, mi.FloatType):
        limits = ((">", info.gt), (">=", info.ge), ("<", info.lt), ("<=", info.le))
        bounds = [f"{op} {bound:g}" for op, bound in limits if bound is not None]
        return "a number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(info, mi.StrType):
        if info.pattern is not None:
            return f"a string matching {info.pattern!r}"
        return "a non-empty string" if info.min_length else "a string"
    if isinstance(info, mi.BoolType):
        return "true or false"
    if isinstance(info, mi.NoneType):
        return "None"
    if isinstance(info, (mi.LiteralType, mi.EnumType)):
        values = (
            info.values
            if isinstance(info, mi.LiteralType)
            else tuple(member.value for member in info.cls)
        )
        return " or ".join(map(repr, values)) if len(values) <= 2 else _one_of(values)
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return f"a list, each item {expected_text(info.item_type)}"
    if isinstance(info, mi.TupleType):
        items = ", ".join(expected_text(item) for item in info.item_types)
        return f"a list of {len(info.item_types)} items: {items}"
    if isinstance(info, mi.DictType):
        if isinstance(info.value_type, mi.AnyType):
            return "a mapping"
        return f"a mapping, each value {expected_text(info.value_type)}"
    if isinstance(info, (mi.StructType, mi.TypedDictType, mi.DataclassType)):
        return f"a mapping with the keys {', '.join(_field_names(info))}"
    if isinstance(info, mi.UnionType):
        parts: list[str] = []
        for member in info.types:
            parts += (
                ["true", "false"] if isinstance(member, mi.BoolType) else [expected_text(member)]
            )
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if isinstance(info, mi.AnyType):
        return "any value"
    return f"a {getattr(info, 'cls', type(info)).__name__}"


def shown(value: object, name: str = "", *, typed: bool = False) -> str:
    """``value`` as an error shows it: its repr (cut at 80 characters), ``***`` under a key
    ``name`` that is a secret's, and inside it (at any depth) a URL's userinfo and the
    value of a key named like a secret replaced by ``***``; the type where the repr hides
    it (``'4' of type str``) or ``typed`` asks (``64.0 of type float``)."""
    if _is_secret(name):
        return "***"
    text = _repr(value)
    plain = (isinstance(value, (int, float)) and not isinstance(value, bool)) or value is None
    if plain and not typed:
        return text
    return f"{text} of type {type(value).__name__}"


def _is_secret(name: str) -> bool:
    """Whether a value under the key ``name`` is a secret (a word of it is one of
    `_SECRET_WORDS`: ``password_file``, ``auth_token``, not ``keys_total``)."""
    return bool(set(re.split(r"[^a-z]+", name.lower())) & _SECRET_WORDS)


class _Hidden:
    def __repr__(self) -> str:
        return "***"


_HIDDEN = _Hidden()


def _repr(value: object) -> str:
    """``value``'s repr with no secret in it (`_redacted`), cut at 80 characters."""
    text = _URL_USERINFO.sub(_hide_userinfo, repr(_redacted(value)))
    return text if len(text) <= 80 else text[:77] + "..."


def _redacted(value: object, depth: int = 0) -> object:
    """``value`` with its secrets replaced: a URL's userinfo, and in a mapping the value
    of each key named like a secret, at any depth (a tier entry given where a list of
    them belongs holds its URL)."""
    if isinstance(value, str):
        return _URL_USERINFO_WHOLE.sub(_hide_userinfo, value) if "://" in value else value
    if depth > 16:
        return _HIDDEN
    if isinstance(value, Mapping):
        return {
            key: _HIDDEN if isinstance(key, str) and _is_secret(key) else _redacted(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        items = [_redacted(item, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _hide_userinfo(match: re.Match[str]) -> str:
    """``://user:***@`` for a plain user name before a ``:``, else ``://***@``."""
    user, colon, _ = match[1].partition(":")
    return f"://{user}:***@" if colon and _PLAIN_USER.fullmatch(user) else "://***@"


def _plain(obj: object) -> object:
    """``obj`` with numpy's numbers as Python's ``int`` and ``float``, in lists, tuples and
    mappings at any depth: msgspec takes only Python's, and a number a program computed
    with numpy was always taken (`tiering._checks.is_int`)."""
    if isinstance(obj, (str, bytes, bool)) or obj is None:
        return obj
    if isinstance(obj, Mapping):
        return {key: _plain(item) for key, item in obj.items()}
    if isinstance(obj, list) or type(obj) is tuple:
        items = [_plain(item) for item in obj]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, int) or type(obj) is float:  # msgspec takes an int's subclasses
        return obj
    if is_int(obj):
        return operator.index(obj)  # type: ignore[arg-type]
    if isinstance(obj, float) or (hasattr(obj, "dtype") and isinstance(obj, numbers.Real)):
        return float(obj)
    return obj


def closest_key(key: str, known: Sequence[str], *, cutoff: float = 0.75) -> str | None:
    """The known key that ``key`` most likely misspells, case aside; None if none is close."""
    by_lower = {name.lower(): name for name in known}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[close[0]] if close else None


def _one_of(values: Sequence[object]) -> str:
    return f"one of {', '.join(map(repr, values))}"


def _unknown_text(location: str, value: object, info: Any, first: str) -> str:
    known = _field_names(info)
    unknown = [k for k in value if k not in known] if isinstance(value, Mapping) else [first]
    unknown = unknown or [first]
    meant = next(filter(None, (closest_key(str(key), known) for key in unknown)), None)
    hint = f"did you mean {meant!r}? " if meant else ""
    names = ", ".join(map(repr, unknown))
    return f"{location} has unknown key(s) {names}; {hint}the known keys are {', '.join(known)}"


def _key_text(key: object, location: str) -> str:
    return f"[{key!r}]" if location else repr(key)


def _unwrap(info: Any, *, want_index: bool = False) -> Any:
    """``info`` without its ``Meta``; of a union, the member a path can step into."""
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.UnionType):
        for member in info.types:
            member = _unwrap(member)
            steps_by_index = isinstance(
                member, (mi.ListType, mi.VarTupleType, mi.TupleType, mi.SetType, mi.FrozenSetType)
            )
            if steps_by_index == want_index and not isinstance(member, mi.NoneType):
                return member
    return info


def _field_type(info: Any, name: str) -> Any:
    if isinstance(info, (mi.StructType, mi.TypedDictType, mi.DataclassType)):
        for field in info.fields:
            if field.encode_name == name:
                return field.type
    if isinstance(info, mi.DictType):
        return info.value_type
    return mi.AnyType()


def _item_type(info: Any, index: int) -> Any:
    if isinstance(info, mi.TupleType):
        return info.item_types[index] if index < len(info.item_types) else mi.AnyType()
    return getattr(info, "item_type", mi.AnyType())


def _field_names(info: Any) -> list[str]:
    return [field.encode_name for field in getattr(info, "fields", ())]


def _failing_item(value: object, info: Any, *, keys: bool = False) -> tuple[object, object]:
    """The first (key, value) of mapping ``value`` whose key (or value) is not of ``info``."""
    if isinstance(value, Mapping):
        target = _python_type(info)
        for key, item in value.items():
            try:
                msgspec.convert(key if keys else item, target)
            except msgspec.ValidationError:
                return key, item
    return "...", None


def _python_type(info: Any) -> Any:
    """A type ``msgspec.convert`` takes for ``info`` (enough to find the failing item)."""
    simple = {mi.IntType: int, mi.FloatType: float, mi.StrType: str, mi.BoolType: bool}
    for kind, python in simple.items():
        if isinstance(info, kind):
            bounds = {k: getattr(info, k) for k in ("gt", "ge", "lt", "le", "min_length")
                      if getattr(info, k, None) is not None}  # fmt: skip
            return Annotated[python, Meta(**bounds)] if bounds else python
    if isinstance(info, mi.Metadata):
        return _python_type(info.type)
    return getattr(info, "cls", Any)
