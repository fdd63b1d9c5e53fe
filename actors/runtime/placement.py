"""Actor names and placement: which process hosts which actor (pure, no I/O).

Theory of operation
-------------------
An actor is addressed by a stable name ``kind:key``: ``topic:orders``,
``channel:orders/archive``, ``diskqueue:orders/archive``, ``client:42``.
Nodes are named ``gateway`` and ``worker-0`` .. ``worker-{N-1}``.

* ``client:*``, ``listener:*`` and ``lookup:*`` live on the gateway (it owns the
  client sockets, and the connections to lookup daemons), except a client whose
  key starts with ``w<i>.``: its connection was handed to worker ``i``
  (``client:w1.t3f.7`` lives on ``worker-1``).
* Names whose kind is *pinned* (``scanner`` and ``handoff`` by default) carry a
  worker index as key: ``scanner:1`` lives on ``worker-1`` (one per worker).
* Names whose kind is *topic-keyed* (``topic``, ``channel``, ``diskqueue`` by
  default) are placed by the topic, the part of the key before the first
  ``/``: ``worker-{crc32(topic) % N}``.  A topic, its channels and their disk
  queues are therefore co-located and talk through in-process inboxes.
* Any other name is placed by ``crc32(name) % N``.
* With no workers (``N = 0``: a small daemon such as the lookup daemon, all in
  one process), every name lives on the gateway.

CRC-32 (not Python's salted ``hash``) keeps the answer identical in every
process and across restarts.  The worker count is fixed for the lifetime of a
runtime; changing it moves actors (their state lives in storage keyed by
name, so this is a restart-time decision).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

__all__ = [
    "GATEWAY",
    "GATEWAY_KINDS",
    "PINNED_KINDS",
    "TOPIC_KINDS",
    "Placement",
    "handed_client_prefix",
    "split_name",
    "worker_name",
]

GATEWAY = "gateway"
"""Node name of the gateway process."""

TOPIC_KINDS = frozenset({"topic", "channel", "diskqueue"})
"""Name kinds whose key starts with a topic name."""

GATEWAY_KINDS = frozenset({"client", "listener", "lookup", "statsd"})
"""Name kinds that live on the gateway (client connections, protocol listeners,
connections to lookup daemons, the statsd push)."""

PINNED_KINDS = frozenset({"scanner", "handoff"})
"""Name kinds whose key is a worker index (one such actor per worker)."""


def worker_name(index: int) -> str:
    """Node name of worker ``index``."""
    return f"worker-{index}"


def split_name(name: str) -> tuple[str, str]:
    """Split ``kind:key`` into ``(kind, key)``; a name without ``:`` has kind ''."""
    kind, sep, key = name.partition(":")
    return (kind, key) if sep else ("", name)


_CACHE_MAX = 16_384
"""Names whose node is remembered (about 150 bytes each); the hot ones come back."""


def _handed_to(key: str) -> int | None:
    """The worker index in a client key ``w<i>.<rest>`` (None: any other key)."""
    if key[:1] == "w":
        index, dot, _ = key[1:].partition(".")
        if dot and index.isdigit():
            return int(index)
    return None


def handed_client_prefix(index: int) -> str:
    """The start of the names of client actors whose connections worker `index` serves."""
    return f"client:w{index}."


class Placement:
    """Maps actor names to node names for a fixed number of workers."""

    def __init__(self, workers: int, topic_kinds: Iterable[str] = TOPIC_KINDS) -> None:
        if workers < 0:
            msg = f"workers must be >= 0, got {workers}"
            raise ValueError(msg)
        self.workers = workers
        self.topic_kinds = frozenset(topic_kinds)
        self._nodes = tuple(worker_name(i) for i in range(workers))
        self._cache: dict[str, str] = {}

    @property
    def nodes(self) -> tuple[str, ...]:
        """All node names: the gateway first, then the workers."""
        return (GATEWAY, *self._nodes)

    def shard_key(self, name: str) -> str:
        """The string hashed to place ``name`` (the topic for topic-keyed kinds)."""
        kind, key = split_name(name)
        if kind in self.topic_kinds:
            return key.partition("/")[0]
        return name

    def node_for(self, name: str) -> str:
        """Return the node that hosts actor ``name``."""
        node = self._cache.get(name)
        if node is None:
            kind, key = split_name(name)
            if not self.workers:
                node = GATEWAY
            elif kind in GATEWAY_KINDS:
                index = _handed_to(key) if kind == "client" else None
                node = GATEWAY if index is None else self._nodes[index % self.workers]
            elif kind in PINNED_KINDS and key.isdigit():
                node = self._nodes[int(key) % self.workers]
            else:
                digest = zlib.crc32(self.shard_key(name).encode())
                node = self._nodes[digest % self.workers]
            cache = self._cache
            if len(cache) >= _CACHE_MAX:
                # Names churn (a client actor per connection, an ephemeral channel per
                # run): start afresh rather than keep every name ever seen.
                cache.clear()
            cache[name] = node
        return node
