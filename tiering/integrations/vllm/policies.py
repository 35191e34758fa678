"""tiering's cache policies as CPU-tier policies of vLLM 0.33's native offloading manager.

An operator keeps vLLM's own ``CPUOffloadingSpec`` and manager and changes one
setting::

    "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
        "eviction_policy": "DSLRUCachePolicy",
        "cache_policy_module_path": "tiering.integrations.vllm"}

vLLM's ``CachePolicyFactory`` imports the class from this package and builds it
as ``cls(cache_capacity=num_chunks)``. Each policy of `tiering.policies.POLICY_NAMES`
has its class, named `vllm_policy_name` of it (``"dslru"`` -> ``DSLRUCachePolicy``;
all of them in `CACHE_POLICIES`): a `TieringCachePolicy` over the policy
`create_policy` makes (`LRUPolicy`, `ARCPolicy`, `ASLRUPolicy`, `DSLRUPolicy`
with their defaults); every ordering decision is the tiering policy's. The
classes are made from `POLICY_NAMES`, so a policy added there has its vLLM
class with no code here (a line in ``_SUMMARIES`` gives it its docstring).

Design note. vLLM's policy contract and tiering's differ in three ways, and
`TieringCachePolicy` bridges each:

- *Who holds the chunks.* vLLM's policy is also its chunk map (``get``) and
  sees ref counts only through ``mark_evictable`` / ``mark_non_evictable``;
  tiering's policy orders keys and is told what it may not evict. The adapter
  keeps the map and the set of evictable keys (ref count 0), and hands the
  tiering policy, as ``protected``, every key that is not evictable or that
  vLLM protects. It checks before the tiering policy runs that ``n`` victims
  exist, so a refusal changes nothing.
- *One key at a time.* vLLM inserts a store's chunks one by one, after it
  evicted for them; tiering inserts a store's keys as one batch, head first,
  *before* the eviction that makes room for them, so that a ghost hit (a key
  stored again while remembered after its eviction: ARC's B1/B2, ASLRU's
  ghost lists) adapts the policy before it chooses victims, and the keys of
  that insert count as the newcomers they are (ARC does not count them in
  |T1|). vLLM announces a store's new keys in ``on_store_miss`` just before it
  evicts, so the adapter remembers them there and, when ``evict`` comes,
  inserts those of them that this store offers (vLLM protects the whole offer)
  and that are not held yet, then evicts. Keys vLLM inserts without such an
  announcement (a store with room to spare, or a retry whose misses vLLM
  already reported) are batched per request and inserted at the adapter's next
  decision, in prefix order (``get_offload_key_position``). An announced key
  that vLLM does not insert in the end (vLLM's ``store_threshold`` filtered
  it) is removed again at the next decision.
- *When a request's recency lands.* tiering's engine commits a request's
  recency once, when it is done: ``touch`` of all its keys, head first, the
  keys it stored included. Its policies tell insertion from reuse themselves:
  the first touch of a just-inserted key is its storing request's and does
  not count as a reuse. vLLM's ``on_request_finished`` gives the request's
  keys by KV-cache group; the adapter orders them by prefix position across
  the groups and touches them once. vLLM's own split into insertion-only and
  reused keys is then what the tiering policy finds by itself, so it is not
  needed. ``on_request_access`` is left as vLLM's no-op: tiering commits no
  provisional recency while a request runs (its loaded chunks are pinned
  while they load).

Hints. vLLM's native manager hands the policy each request's ``ReqContext``
(on ``insert``, ``touch``, ``on_request_finished``), and with it the request's
``kv_transfer_params`` and ``kv_hints``. The adapter reads a request's
retention hint once (`RequestHints`, its result kept in the context) and
holds a `tiering.policies.hints.HintBook`, asked for victims as
tiering's own manager asks it: released chunks first, retained ones spared
until their deadline within their share of the tier, the tiering policy's own
choice where no hint is held. A request's hint applies to the chunks it
stores (``insert``) and to its keys when it ends (``on_request_finished``). A
malformed hint is counted (`hint_counts`) and said once per kind in vLLM's
log. vLLM's native manager reports no policy figures to vLLM's metrics
(its ``get_stats`` does not ask the policy), so the counts are read here
(`hint_counts`, `hints`), not in Prometheus: `TieringSpec` reports them there.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Sequence
from typing import ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from tiering.errors import ConfigError
from tiering.hints import HintCounts
from tiering.integrations.vllm.logs import adopt_vllm_logging
from tiering.integrations.vllm.request_hints import RequestHints
from tiering.policies import POLICY_NAMES, PolicyStatistics, create_policy
from tiering.policies import CachePolicy as OrderPolicy
from tiering.policies.hints import HintBook

#: With one ``<NAME>CachePolicy`` per tiering policy, added below (`CACHE_POLICIES`).
__all__ = ["CACHE_POLICIES", "TieringCachePolicy", "vllm_policy_name"]

logger = logging.getLogger(__name__)


def prefix_order(keys: Iterable[OffloadKey], context: ReqContext | None) -> list[OffloadKey]:
    """``keys`` head first by their end-token position in the request, when all have one.

    Keys of equal position (one block in several KV-cache groups) keep their
    order; without positions for every key, the order given stands.
    """
    ordered = list(keys)
    if context is None or not ordered:
        return ordered
    position = context.get_offload_key_position
    positions = [position(key) for key in ordered]
    if None in positions:
        return ordered
    ranked = sorted(range(len(ordered)), key=positions.__getitem__)
    return [ordered[i] for i in ranked]


class _Blocked:
    """The keys a tiering policy may not evict: protected by vLLM, or not evictable."""

    __slots__ = ("_evictable", "_protected")

    def __init__(self, protected: Container[OffloadKey], evictable: set[OffloadKey]) -> None:
        self._protected = protected
        self._evictable = evictable

    def __contains__(self, key: object) -> bool:
        return key in self._protected or key not in self._evictable


class TieringCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` whose eviction order is a tiering policy's.

    Guarantees vLLM's contract: ``get`` finds every inserted chunk until it is
    evicted, removed or cleared; ``evict`` returns exactly ``n`` chunks of ref
    count 0 outside ``protected``, or ``None`` and changes nothing; ``clear``
    forgets the chunks and the tiering policy's history (ghost lists, learned
    targets). Subclasses name the tiering policy (`policy_name`).
    """

    #: The tiering policy (a name `tiering.policies.create_policy` accepts).
    policy_name: ClassVar[str] = ""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        adopt_vllm_logging()
        # A tier of no chunks never stores; the ghost lists still need a size.
        self._order: OrderPolicy = create_policy(self.policy_name, max(1, cache_capacity))
        self._hints = HintBook(max(1, cache_capacity))
        self._requests = RequestHints(logger.warning)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._evictable: set[OffloadKey] = set()
        # The latest on_store_miss: a store's new keys, head first.
        self._offered: list[OffloadKey] = []
        # Inserted into the tiering policy by evict, before vLLM inserts them.
        self._announced: set[OffloadKey] = set()
        # Inserted by vLLM, not yet by the tiering policy: one request's, in order.
        self._staged: list[OffloadKey] = []
        self._staged_context: ReqContext | None = None

    @property
    def order(self) -> OrderPolicy:
        """The tiering policy that orders the chunks (read it; do not drive it)."""
        self._settle()
        return self._order

    @property
    def hints(self) -> HintBook:
        """The retention hints the tier holds (read its `statistics`; do not drive it)."""
        return self._hints

    @property
    def hint_counts(self) -> HintCounts:
        """What the requests' channels carried (a copy): hints taken, ignored, refused."""
        return self._requests.counts

    # -- vLLM's chunk map --------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self._chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
        hint = self._requests.of(req_context)
        if hint is not None:  # the request's stores carry its hint from the start
            self._hints.apply((key,), hint, self._chunks)
        if key in self._announced:  # the tiering policy has it since the eviction
            self._announced.discard(key)
            return
        if self._staged and self._staged_context is not req_context:
            self._flush_staged()
        self._staged.append(key)
        self._staged_context = req_context

    def remove(self, key: OffloadKey) -> None:
        self._settle()
        if self._chunks.pop(key, None) is not None:
            self._evictable.discard(key)
            self._order.remove((key,))
            if self._hints.engaged:
                self._hints.forget((key,))

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self._chunks:
            self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    # -- recency ---------------------------------------------------------------

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Not a use (vLLM's default would touch): the store's announcement.
        self._settle()
        self._offered = prefix_order(keys, req_context)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._settle()
        used = list(keys)
        self._order.touch(used)
        self._note(used, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        del insertion_only_keys, reused_keys  # the tiering policy tells them apart itself
        self._settle()
        keys = prefix_order((key for group in key_groups for key in group), req_context)
        if keys:
            self._order.touch(keys)
            self._note(keys, req_context)

    # -- eviction ----------------------------------------------------------------

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        self._settle()
        evictable, chunks = self._evictable, self._chunks
        if len(evictable) - len(evictable.intersection(protected)) < n:
            return None
        newcomers = [key for key in self._offered if key in protected and key not in chunks]
        self._offered = []
        # The store's new keys join before its victims are chosen. An empty insert
        # too: it tells ARC that none of T1 is this store's (its keys came earlier).
        self._order.insert(newcomers)
        self._announced.update(newcomers)
        blocked = _Blocked(protected, evictable)
        hints = self._hints
        victims = (  # without a hint ever seen: the tiering policy's own choice, as before
            hints.evict(self._order, n, blocked) if hints.engaged else self._order.evict(n, blocked)
        )
        if victims is None or len(victims) != n:
            raise RuntimeError(  # the evictable set and the policy disagree: a bug
                f"{self._order!r} gave {victims!r} for {n} victims of {len(evictable)} evictable"
            )
        evicted: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in victims:
            evictable.remove(key)
            evicted.append((key, chunks.pop(key)))
        return evicted

    def clear(self) -> None:
        self._order.clear()
        self._hints.clear()
        self._chunks.clear()
        self._evictable.clear()
        self._offered = []
        self._announced.clear()
        self._staged = []
        self._staged_context = None

    # -- bookkeeping -------------------------------------------------------------

    def _note(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """A request used ``keys``: its hint (if any) goes to the book, which sees every
        request from the first hint on."""
        hint = self._requests.of(req_context)
        if hint is not None or self._hints.engaged:
            self._hints.note(keys, hint, self._chunks)

    def _flush_staged(self) -> None:
        staged = self._staged
        if staged:
            self._order.insert(prefix_order(staged, self._staged_context))
            self._staged = []
        self._staged_context = None

    def _settle(self) -> None:
        """Bring the tiering policy up to date with the chunk map before it decides."""
        self._flush_staged()
        announced = self._announced
        if announced:  # announced and evicted for, but vLLM did not insert them
            self._order.remove(list(announced))
            announced.clear()

    def statistics(self) -> PolicyStatistics:
        """The tiering policy's snapshot (tracked keys, history and its bound, figures)."""
        return self.order.statistics()

    def __len__(self) -> int:
        return len(self._chunks)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} [{len(self._chunks)} chunks, "
            f"{len(self._evictable)} evictable] {self._order!r}>"
        )


#: One line per tiering policy: the docstring of its vLLM class. A policy of
#: `POLICY_NAMES` missing here still gets its class, with a generic docstring.
_SUMMARIES: dict[str, str] = {
    "lru": "tiering's `LRUPolicy`: least recently used first, a request's tail before its head.",
    "arc": "tiering's `ARCPolicy`: adaptive replacement, ghost hits adapt before the eviction.",
    "aslru": "tiering's `ASLRUPolicy`: probation and protected, ghost admission.",
    "dslru": "tiering's `DSLRUPolicy`: segmented LRU run by the expert its shadows favour.",
}


def vllm_policy_name(policy: str) -> str:
    """The name of the vLLM class of tiering policy ``policy`` (``eviction_policy``'s value).

    ``"dslru"`` -> ``"DSLRUCachePolicy"``; every name of `POLICY_NAMES` has its
    class here and in ``tiering.integrations.vllm``. Any other name is a `ConfigError`.
    """
    if policy not in POLICY_NAMES:
        raise ConfigError(
            f"unknown cache policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    return f"{policy.upper()}CachePolicy"


def _policy_class(policy: str) -> type[TieringCachePolicy]:
    class Policy(TieringCachePolicy):
        policy_name = policy

    Policy.__name__ = Policy.__qualname__ = vllm_policy_name(policy)
    Policy.__doc__ = _SUMMARIES.get(policy, f"tiering's {policy!r} policy (`create_policy`).")
    return Policy


#: The vLLM class of each tiering policy, by class name, in `POLICY_NAMES`' order.
CACHE_POLICIES: dict[str, type[TieringCachePolicy]] = {
    vllm_policy_name(policy): _policy_class(policy) for policy in POLICY_NAMES
}

__all__ += CACHE_POLICIES


def __getattr__(name: str) -> type[TieringCachePolicy]:
    # The classes are made from POLICY_NAMES, not defined by name: `from ... import`
    # and vLLM's factory find them here, and a type checker by this return type.
    cls = CACHE_POLICIES.get(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *CACHE_POLICIES})
