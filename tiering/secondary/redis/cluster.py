"""A Redis Cluster as the tier sees it: which node holds a key, and each node's health.

Everything here runs in the tier's worker threads (`RedisWire` calls it), and
is thread-safe where calls overlap: the node gates take a lock, the slot map is
redis-py's.

Nodes, one at a time: a node that cannot be reached takes only its own slots
down (`NodeGates`): its keys miss and its writes are dropped (``node down``)
without I/O, while every other node is sent its commands as before. When a down
node's retry time comes, the call that takes the probe asks the node (``CLUSTER
INFO``); it is up again when it answers that it serves its slots
(``cluster_state:ok``). If it does not, the slot map is refreshed (``CLUSTER
SLOTS``: a replica promoted in its place now holds its slots, and is sent them
in this very call). So a node that is away costs the calls of the other nodes
at most one wait per probe.

Which node holds a key is redis-py's slot map (``RedisCluster``: discovery,
refreshes); keys carry a hash tag, so a chunk's keys share a slot. A ``MOVED``
or ``ASK`` reply (the cluster is resharding) marks the map `stale`: it is
refreshed before the next call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tiering.secondary.base import describe
from tiering.secondary.health import Admission, NodeGates
from tiering.secondary.redis.answer import Answer, Node, Row
from tiering.secondary.redis.failures import errors

__all__ = ["ClusterNodes"]

logger = logging.getLogger(__name__)


class ClusterNodes:
    """The nodes of one tier's Redis Cluster: its slot map, the nodes that hold slots
    (``masters``) and each node's health (``gates``). ``url``: the tier's, shown in logs."""

    def __init__(self, url: str, timeout_s: float, backoff_s: tuple[float, float]) -> None:
        self.url = url
        self.timeout_s = timeout_s
        #: The health of each node (only those that failed are tracked).
        self.gates: NodeGates[Node] = NodeGates(backoff_s)
        #: redis-py's ``RedisCluster`` (its slot map), once the tier knows it is a cluster.
        self.slot_map: Any = None
        #: The nodes that hold slots.
        self.masters: frozenset[Node] = frozenset()
        #: The slot map may be stale (a slot moved, a call failed): refresh it first.
        self.stale = False

    def attach(self, slot_map: Any) -> None:
        """Route by ``slot_map`` (redis-py's ``RedisCluster``) from now on."""
        self.slot_map = slot_map
        self.masters = _masters(slot_map)

    def route(
        self, rows: list[Row], batch: list[int], answer: Answer[Any]
    ) -> list[tuple[Node, list[int]]]:
        """(node, positions) per node that holds ``rows[batch]``.

        A row whose slot no node holds (``cluster-require-full-coverage no``)
        goes in ``answer.node_down``.
        """
        groups: dict[Node, list[int]] = {}
        uncovered = errors().rx.SlotNotCoveredError
        for position in batch:
            try:
                node = self.slot_map.get_node_from_key(rows[position][1])
            except uncovered:
                answer.node_down.append(position)
                continue
            groups.setdefault((str(node.host), int(node.port)), []).append(position)
        return list(groups.items())

    def check(self, answer: Answer[Any], ping: Callable[[Node], None]) -> None:
        """Before a call: refresh a stale slot map, probe the nodes due a probe.

        A probe is ``ping(node)`` (``CLUSTER INFO``: see `RedisWire`). A node that
        does not answer it, or says it does not serve its slots, may have been
        failed over: the slot map is refreshed then (``CLUSTER SLOTS``, once per
        call), and a node that holds no slots any more is forgotten, its slots
        going to the replica promoted in its place. The refresh follows the
        probe, so a node that does not answer at all keeps a caller waiting
        once (the probe, within the call's timeout), never twice.
        """
        if self.stale:
            self.stale = False
            self.refresh()
        probes = self.gates.take_due()
        refreshed = False
        e = errors()
        for i, (node, admission) in enumerate(probes):
            answer.stuck = node
            try:
                try:
                    ping(node)
                except e.unavailable as exc:
                    if not refreshed:
                        refreshed = True
                        self.refresh()  # a replica may hold its slots now
                    if node in self.masters:
                        self.failed(answer, node, admission, [], exc)
                else:
                    self.answered(answer, node, admission)
            except BaseException:
                for later, theirs in probes[i:]:
                    self.gates.release(later, theirs)
                raise
            finally:
                answer.stuck = None

    def refresh(self) -> None:
        """Read the slot map again (redis-py: ``CLUSTER SLOTS``); forget nodes without slots."""
        self.slot_map.nodes_manager.initialize()
        self.masters = _masters(self.slot_map)
        for node in self.gates.retain(self.masters):
            logger.warning(
                "Redis tier at %s: node %s:%d holds no slots any more (failed over?)",
                self.url,
                *node,
            )

    def answered(self, answer: Answer[Any], node: Node, admission: Admission) -> None:
        """``node`` answered: up again if it was down (counted in ``answer.nodes_back``)."""
        if self.gates.succeeded(node, admission):
            answer.nodes_back += 1
            logger.warning("Redis tier at %s: node %s:%d answers again", self.url, *node)

    def failed(
        self,
        answer: Answer[Any],
        node: Node,
        admission: Admission,
        positions: list[int],
        exc: BaseException,
    ) -> None:
        """``node`` could not answer: its rows are unanswered, it goes down (backs off)."""
        text = describe(exc)
        answer.node_down.extend(positions)
        answer.node_failures.append(
            (f"{text} (node {node[0]}:{node[1]})", isinstance(exc, errors().timeout))
        )
        self._down(node, admission, text)  # its first probe refreshes the slot map

    def timed_out(self, node: Node) -> bool:
        """A call gave up waiting on ``node``: it goes down. True when that took it down.

        Called from the event loop while the abandoned thread may still wait
        on the node: the node's later failure there changes nothing more.
        """
        return self._down(node, Admission.NORMAL, f"no answer within {self.timeout_s} s")

    def all_down(self, *, waiting: bool = False) -> bool:
        """Whether every node that holds slots is down (``waiting``: and none is due a probe)."""
        return self.gates.all_down(self.masters, waiting=waiting)

    def _down(self, node: Node, admission: Admission, why: str) -> bool:
        if not self.gates.failed(node, admission):
            return False
        logger.warning(
            "Redis tier at %s: node %s:%d is down (%s); its slots miss until it answers",
            self.url,
            node[0],
            node[1],
            why,
        )
        return True


def _masters(slot_map: Any) -> frozenset[Node]:
    """The nodes that hold slots in redis-py's slot map."""
    cache = slot_map.nodes_manager.slots_cache
    return frozenset((str(n[0].host), int(n[0].port)) for n in list(cache.values()) if n)
