"""`RequestHints`: a request's retention hint, read once off vLLM's per-request channels.

vLLM 0.33 hands every call of the offloading manager (and of its CPU policy)
the request's ``ReqContext``, which carries the request's ``kv_transfer_params``
and ``kv_hints`` and a scratch space keyed by type "so a tier can parse
kv_transfer_params and kv_hints once". `RequestHints.of` reads a request's
hint the first time it is asked (`tiering.hints.HintReader`: never raises; a
fault is counted and said once per kind through ``warn``) and keeps the result
in that scratch space, so later calls for the request cost a dict lookup. The
tiers below take it as read by the first component that did
(`RequestHints.given`), and read it themselves under vLLM's own manager and
policy, which read no hint (`tiering.integrations.vllm.polled`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiering.hints import Hint, HintCounts, HintReader

__all__ = ["RequestHints"]


@dataclass(frozen=True, slots=True)
class _Read:
    """What one `RequestHints` read off one request (None: no hint, or one refused)."""

    owner: object
    hint: Hint | None


class RequestHints:
    """The hints of the requests one scheduler component sees (``warn``: its logger's
    ``warning``, called once per kind of fault)."""

    def __init__(self, warn: Callable[..., object]) -> None:
        self._reader = HintReader(warn)

    def of(self, req_context: Any) -> Hint | None:
        """The request's hint, read from its channels the first time it is asked."""
        state: _Read | None = req_context.get_state(_Read)
        if state is None or state.owner is not self:
            hint = self._reader.read(req_context.kv_transfer_params, req_context.kv_hints)
            state = _Read(owner=self, hint=hint)
            req_context.set_state(state)
        return state.hint

    def given(self, req_context: Any) -> Hint | None:
        """The request's hint as whichever component read it first (`TieringSpec`'s
        manager, or a tiering policy under vLLM's own manager) read it; read here if
        none did (under vLLM's own spec and policy), so it is counted and said once."""
        state: _Read | None = req_context.get_state(_Read)
        return self.of(req_context) if state is None else state.hint

    @property
    def counts(self) -> HintCounts:
        """What the channels carried (a copy): hints taken, ignored, refused."""
        return HintCounts(**self.as_dict())

    def as_dict(self) -> dict[str, int]:
        """What the channels carried, by outcome (a fresh dict)."""
        return self._reader.counts.as_dict()

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {name}" for name, n in self.as_dict().items())
        return f"<RequestHints [{counts}]>"
