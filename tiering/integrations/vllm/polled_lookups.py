"""`Lookups`: the existence checks a polled secondary tier has queued, sent and had answered.

vLLM's manager asks `tiering.integrations.vllm.polled.PolledSecondaryTier`
whether a key is there and must be answered at once. A key's first lookup
answers ``RETRY`` and queues it (`Lookups.lookup`); at the step's end the
queued keys go to the tier as one batch (`Lookups.take_batch`, `Lookups.sent`);
the tier's answer comes back from the loop thread through a thread-safe queue
(`Lookups.answered`), and is taken on the scheduler side (`Lookups.take_answers`)
before a later lookup reads it. A key is remembered while a request that asked
for it runs (`Lookups.finished` forgets it), or until its answer comes. At most
``max_in_flight`` keys are queued or asked at once; past that a lookup is
deferred (``None``: the caller answers ``RETRY`` and counts it).

Threads: everything but `answered` runs under vLLM's manager lock, on
whichever thread holds it; `answered` is the loop thread's only call.
"""

from __future__ import annotations

import queue

from vllm.v1.kv_offload.base import LookupResult, OffloadKey

__all__ = ["Lookups"]


class _Lookup:
    """One key's existence check; ``found`` is ``None`` until the tier answered."""

    __slots__ = ("found", "requests", "sent")

    def __init__(self) -> None:
        self.found: bool | None = None
        self.sent = False
        self.requests: set[str] = set()


#: A batch of keys sent to the tier as one call, each with its check.
Batch = list[tuple[OffloadKey, _Lookup]]


class Lookups:
    """The lookups of one polled tier, at most ``max_in_flight`` queued or asked."""

    def __init__(self, max_in_flight: int) -> None:
        self._max = max_in_flight
        self._states: dict[OffloadKey, _Lookup] = {}
        self._queued: Batch = []
        self._asked = 0  # keys sent to the tier and not answered yet
        self._request_keys: dict[str, set[OffloadKey]] = {}
        # Loop thread -> scheduler side.
        self._answers: queue.SimpleQueue[tuple[Batch, list[bool]]] = queue.SimpleQueue()

    @property
    def in_flight(self) -> int:
        """Keys queued or asked, not answered yet."""
        return len(self._queued) + self._asked

    @property
    def asked(self) -> bool:
        """Whether keys were sent to the tier and not answered yet."""
        return self._asked > 0

    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult | None:
        """The answer for ``key`` asked by request ``req_id``: ``RETRY`` until the tier
        answered; None when too many are in flight (deferred, not queued)."""
        self.take_answers()
        state = self._states.get(key)
        if state is None:
            if self.in_flight >= self._max:
                return None
            state = self._states[key] = _Lookup()
            self._queued.append((key, state))
        state.requests.add(req_id)
        self._request_keys.setdefault(req_id, set()).add(key)
        if state.found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if state.found else LookupResult.MISS

    def take_batch(self) -> Batch:
        """The keys queued since the last batch and still wanted (the queue emptied)."""
        self.take_answers()
        batch = [(key, state) for key, state in self._queued if self._states.get(key) is state]
        self._queued = []
        return batch

    def sent(self, batch: Batch) -> None:
        """``batch`` was handed to the tier: its answer comes through `answered`."""
        for _, state in batch:
            state.sent = True
        self._asked += len(batch)

    def answered(self, batch: Batch, found: list[bool]) -> None:
        """The tier's answer for ``batch`` (from the loop thread)."""
        self._answers.put((batch, found))

    def take_answers(self) -> None:
        """Record the answers the loop thread gave since the last call."""
        while True:
            try:
                batch, found = self._answers.get_nowait()
            except queue.Empty:
                return
            self._asked -= len(batch)
            for (key, state), hit in zip(batch, found, strict=True):
                if self._states.get(key) is not state:
                    continue  # forgotten meanwhile
                if not state.requests:
                    del self._states[key]
                else:
                    state.found = hit

    def finished(self, req_id: str) -> None:
        """Request ``req_id`` ended: the keys only it asked for are forgotten (an asked
        one once its answer comes)."""
        for key in self._request_keys.pop(req_id, ()):
            state = self._states.get(key)
            if state is None:
                continue
            state.requests.discard(req_id)
            if not state.requests and (state.found is not None or not state.sent):
                del self._states[key]

    def missing(self, key: OffloadKey) -> None:
        """``key`` did not load: a miss from now on, so it is recomputed, not promoted."""
        state = self._states.get(key)
        if state is not None and state.found is not None:
            state.found = False
