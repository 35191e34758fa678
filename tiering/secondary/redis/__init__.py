"""A shared secondary tier on Redis (or Valkey), standalone or Redis Cluster.

Needs the ``redis`` extra (redis-py): without it, building a `RedisTier` is one
`ConfigError` naming it (`tiering._extras`). redis-py is imported then, never on
``import tiering``.

The modules, each one job: `tier` (`RedisTier`: the contract, counting, the
async shell and its health gates), `options` (`RedisOptions`: the keyword
options, decoded), `address` (the URL, checked when the tier is built),
`resp` (RESP, sans-IO: the reply reader that puts a value's payload where it
is told), `connection` (the tier's sockets, TCP or TLS, and their pools),
`wire` (a call as one round trip per node, in a worker thread), `answer`
(what that thread did, for the tier to count), `cluster` (a Redis Cluster's
slot map and each node's health) and `failures` (redis-py's exception
classes, sorted by what they mean).

Why the tier reads replies itself: a value is received straight into the
caller's row, where redis-py's parsers and hiredis copy it once to three
times first (``bench/remote.py`` measures the tier beside both, and its
docstring keeps the figures). redis-py keeps what it does well and the tier need not redo:
the cluster's slot map and its refreshes, and the exception classes errors
are reported in.
"""

from __future__ import annotations

from tiering.secondary.redis.address import redact_url
from tiering.secondary.redis.options import RedisOptions
from tiering.secondary.redis.tier import RedisTier

__all__ = ["RedisOptions", "RedisTier", "redact_url"]
