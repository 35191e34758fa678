"""Retention hints: what a client or a router knows about a request's prefix.

A policy sees only which chunks were used when; whether a conversation has
another turn is all but random to it (``bench/first_reuse.py``). The client
knows (its session is open or closed) and so does a router. A *hint* says so,
for one request's prefix, in a small versioned vocabulary (version 1):

- ``retain_s``: this prefix will be used again within that many seconds; keep
  it until then (within a bounded share of the tier: `tiering.policies.hints`);
- ``release``: this conversation is over; its chunks are the first to go;
- ``priority``: an integer from -100 to 100 (0 by default) that orders ties:
  among released chunks the lower priority goes first, among retained ones the
  lower priority loses its protection first when retention overflows its share.

A hint holds at most one of ``retain_s`` and ``release``; one with neither
(only a priority, or nothing) changes nothing. It reaches the tier through
three channels, each carrying the same payload, a JSON object of these keys:

- a request's ``kv_transfer_params`` (any OpenAI-compatible client):
  ``{"tiering": {"version": 1, "retain_s": 600}}`` (`KV_TRANSFER_PARAMS_KEY`);
- an orchestrator's ``KvHintsEnvelope`` (vLLM's ``kv_hints``): an action of
  ``action_type`` ``"tiering.retention"`` (`ACTION_TYPE`), ``action_version``
  ``"1"``, ``payload`` ``{"retain_s": 600}``;
- the engine's API, for servers that embed tiering: a `Hint` per store or touch.

Unknown versions and other components' actions are ignored and counted
(`HintCounts`); a malformed payload (a wrong type, an unknown key, both
``retain_s`` and ``release``) is counted and refused with one message that
says what is wrong and what would be right (`HintError`), never raised into a
scheduler step by `HintReader`, which logs each kind of fault once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from tiering.errors import ConfigError

__all__ = [
    "ACTION_TYPE",
    "HINTS_VERSION",
    "KV_TRANSFER_PARAMS_KEY",
    "MAX_PRIORITY",
    "MAX_RETAIN_S",
    "Hint",
    "HintCounts",
    "HintError",
    "HintReader",
    "action_hint",
    "check_hint",
    "payload_hint",
    "transfer_params_hint",
]

#: The version of the vocabulary this module speaks.
HINTS_VERSION = 1
#: The entry of a request's ``kv_transfer_params`` that carries a hint.
KV_TRANSFER_PARAMS_KEY = "tiering"
#: The ``action_type`` of a ``KvHintsEnvelope`` action that carries a hint.
ACTION_TYPE = "tiering.retention"
#: The longest retention a hint may ask for: a week.
MAX_RETAIN_S = 7 * 24 * 3600.0
#: Priorities run from ``-MAX_PRIORITY`` to ``MAX_PRIORITY``.
MAX_PRIORITY = 100


class HintError(ConfigError, ValueError):
    """A hint payload that is not one of the vocabulary's (the message says why)."""


class Hint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One request's retention hint (see the module's docstring); `check_hint` checks one
    built in Python, the channels decode theirs with the same rules."""

    retain_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_RETAIN_S)] | None = None
    release: bool = False
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0

    @property
    def retains(self) -> bool:
        return self.retain_s is not None

    @property
    def empty(self) -> bool:
        """Neither a retention nor a release: the hint changes nothing."""
        return self.retain_s is None and not self.release


_RIGHT = (
    f"a hint is a JSON object of retain_s (seconds, > 0 and <= {MAX_RETAIN_S:g}) or "
    f"release (true), and priority (an integer from -{MAX_PRIORITY} to {MAX_PRIORITY})"
)


def _decode(value: object, into: type[Any], where: str) -> Any:
    try:
        out = msgspec.convert(value, into, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = text.rpartition(" - at `$.")[2].rstrip("`")
        if field != text and isinstance(value, Mapping) and field in value:
            text = f"{text} (got {value[field]!r})"
        raise HintError(f"{where}: {text}; {_RIGHT}") from None
    if out.retain_s is not None and out.release:
        raise HintError(
            f"{where}: a hint holds retain_s or release, not both "
            f"(got retain_s={out.retain_s:g} and release=true)"
        )
    return out


def check_hint(hint: object) -> Hint | None:
    """``hint`` if it is a valid `Hint` (or None); `HintError` otherwise."""
    if hint is None:
        return None
    if not isinstance(hint, Hint):
        raise HintError(f"a hint must be a tiering.hints.Hint or None, got {hint!r}")
    return _decode(msgspec.structs.asdict(hint), Hint, "hint")  # type: ignore[no-any-return]


def payload_hint(payload: object, where: str = "hint") -> Hint:
    """The hint of a version-1 payload without its version (a ``KvHintsEnvelope``
    action's ``payload``); `HintError` if it is not one."""
    return _decode(payload, Hint, where)  # type: ignore[no-any-return]


class UnknownVersion(Exception):
    """A payload of a version this module does not speak (ignored, counted)."""


def transfer_params_hint(params: object) -> Hint | None:
    """The hint in a request's ``kv_transfer_params``: None without a ``"tiering"`` entry;
    `UnknownVersion` for another version; `HintError` for a malformed entry."""
    if not isinstance(params, Mapping):
        if params is None:
            return None
        raise HintError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    entry = params.get(KV_TRANSFER_PARAMS_KEY)
    if entry is None:
        return None
    where = f"kv_transfer_params[{KV_TRANSFER_PARAMS_KEY!r}]"
    if not isinstance(entry, Mapping):
        raise HintError(
            f"{where} must be a JSON object such as "
            f'{{"version": {HINTS_VERSION}, "retain_s": 600}}, got {entry!r}'
        )
    version = entry.get("version")
    if version is None or isinstance(version, bool) or not isinstance(version, int):
        raise HintError(f"{where} needs a version, the integer {HINTS_VERSION}; got {version!r}")
    if version != HINTS_VERSION:
        raise UnknownVersion(version)
    return payload_hint({k: v for k, v in entry.items() if k != "version"}, where)


def action_hint(action_type: object, action_version: object, payload: object) -> Hint | None:
    """The hint of one ``KvHintsEnvelope`` action: None for another component's action
    type; `UnknownVersion` for another version of tiering's; `HintError` if malformed."""
    if action_type != ACTION_TYPE:
        return None
    if not isinstance(action_version, str):  # vLLM's KvHintAction: a string, unchecked
        raise HintError(
            f"kv_hints action {ACTION_TYPE!r} needs an action_version, the string "
            f"{str(HINTS_VERSION)!r}; got {action_version!r}"
        )
    if action_version != str(HINTS_VERSION):
        raise UnknownVersion(action_version)
    return payload_hint(payload, f"kv_hints action {ACTION_TYPE!r}")


class HintCounts(msgspec.Struct, kw_only=True):
    """What the channels carried: hints taken, and those ignored or refused, by why."""

    taken: int = 0
    unknown_version: int = 0
    other_actions: int = 0
    malformed: int = 0

    def as_dict(self) -> dict[str, int]:
        return msgspec.structs.asdict(self)


class HintReader:
    """Reads hints off a request's channels for a scheduler: never raises.

    `read` gives the request's hint (an envelope's last tiering action wins over
    ``kv_transfer_params``, as the orchestrator sees the cluster); everything
    ignored or refused is counted in `counts`, and ``warn`` (a logger's
    ``warning``) is called once per kind of fault, the first time it is seen,
    with a message that says what was wrong, never once per request.
    """

    def __init__(self, warn: Any = None) -> None:
        self.counts = HintCounts()
        self._warn = warn
        self._warned: set[str] = set()

    def _fault(self, kind: str, message: str) -> None:
        if kind == "malformed":
            self.counts.malformed += 1
        elif kind == "unknown_version":
            self.counts.unknown_version += 1
        if self._warn is not None and kind not in self._warned:
            self._warned.add(kind)
            self._warn(
                "tiering: %s (counted; the request goes on without the hint; this is said once)",
                message,
            )

    def read(self, kv_transfer_params: object, kv_hints: object) -> Hint | None:
        """The hint of one request, from its ``kv_transfer_params`` and ``kv_hints``
        (an object with ``actions``, each with ``action_type``, ``action_version`` and
        ``payload``, as vLLM's ``KvHintsEnvelope``), or None."""
        hint: Hint | None = None
        try:
            hint = transfer_params_hint(kv_transfer_params)
        except UnknownVersion as exc:
            self._fault(
                "unknown_version",
                f"a kv_transfer_params hint of version {exc.args[0]!r} was ignored; "
                f"this tiering speaks version {HINTS_VERSION}",
            )
        except HintError as exc:
            self._fault("malformed", f"a malformed hint was refused: {exc}")
        if kv_hints is not None:
            actions = getattr(kv_hints, "actions", None)
            if not isinstance(actions, list | tuple):
                self._fault(
                    "malformed",
                    f"a malformed hint was refused: kv_hints has no list of actions "
                    f"({type(kv_hints).__name__})",
                )
                actions = []
            for action in actions:
                try:
                    got = action_hint(
                        getattr(action, "action_type", None),
                        getattr(action, "action_version", None),
                        getattr(action, "payload", None),
                    )
                except UnknownVersion as exc:
                    self._fault(
                        "unknown_version",
                        f"a {ACTION_TYPE!r} action of version {exc.args[0]!r} was ignored; "
                        f"this tiering speaks version {HINTS_VERSION!s}",
                    )
                    continue
                except HintError as exc:
                    self._fault("malformed", f"a malformed hint was refused: {exc}")
                    continue
                if got is None:
                    self.counts.other_actions += 1
                else:
                    hint = got
        if hint is not None:
            self.counts.taken += 1
        return hint
