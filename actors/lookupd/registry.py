"""nsqlookupd's registration database as a pure class: who has which topic and channel.

Theory of operation
-------------------
A *registration* is ``(category, key, subkey)``: ``("client", "", "")`` for
every identified broker, ``("topic", T, "")`` and ``("channel", T, C)``.
Each registration maps to the *producers* that announced it, keyed by peer
id (the connection's remote address).  A registration may exist with no
producer at all: ``/topic/create`` makes one, and so does a broker's
``REGISTER`` of a non-ephemeral name after the broker went away (the name
stays listed in ``/topics`` until deleted, as in nsqlookupd).

A producer carries its peer's :class:`PeerInfo` (what its ``IDENTIFY`` said)
and ``last_update``, moved by every ``PING``; :meth:`Registry.active` drops the
producers silent for longer than the inactive timeout and the ones
tombstoned for this registration less than the tombstone lifetime ago.  A
tombstone is per registration: ``/topic/tombstone?topic=T&node=N`` hides
node N from the lookups of T only, and only for ``tombstone_lifetime``; N's
later ``REGISTER`` of T does not lift it (nsqlookupd keeps the same producer
object, so a broker that deletes a topic and re-creates it within the lifetime
is still hidden).

No I/O, no clock, no logging: times are passed in (seconds, any monotonic
origin), so the tests move them by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from transport.mailbox.envelope import frozen

__all__ = ["CHANNEL", "CLIENT", "TOPIC", "PeerInfo", "Producer", "Registration", "Registry"]

CLIENT = "client"
TOPIC = "topic"
CHANNEL = "channel"


@frozen
class Registration:
    """What is announced: ``(category, key, subkey)``; ``*`` in a query matches any."""

    category: str
    key: str = ""
    subkey: str = ""

    def matches(self, category: str, key: str, subkey: str) -> bool:
        return (self.category == category and key in ("*", self.key)
                and subkey in ("*", self.subkey))


@dataclass
class PeerInfo:
    """A broker as its IDENTIFY described it; ``id`` is the connection's remote address."""

    id: str
    remote_address: str
    hostname: str = ""
    broadcast_address: str = ""
    tcp_port: int = 0
    http_port: int = 0
    version: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    """IDENTIFY fields nsqlookupd does not know (ours: ``zmq_port``), passed on in lookups."""
    last_update: float = 0.0

    @property
    def node(self) -> str:
        """``broadcast_address:http_port``: how ``/topic/tombstone`` names a node."""
        return f"{self.broadcast_address}:{self.http_port}"

    def to_json(self) -> dict[str, object]:
        """The fields nsqlookupd's JSON answers carry for a producer (plus ours)."""
        return {"remote_address": self.remote_address, "hostname": self.hostname,
                "broadcast_address": self.broadcast_address, "tcp_port": self.tcp_port,
                "http_port": self.http_port, "version": self.version, **self.extra}


@dataclass
class Producer:
    """A peer under one registration, with that registration's tombstone."""

    peer: PeerInfo
    tombstoned_at: float | None = None

    def tombstoned(self, now: float, lifetime: float) -> bool:
        return self.tombstoned_at is not None and now - self.tombstoned_at < lifetime


class Registry:
    """Registrations and their producers (nsqlookupd's ``RegistrationDB``)."""

    def __init__(self) -> None:
        self._regs: dict[Registration, dict[str, Producer]] = {}
        # (category, key) -> its registrations, in creation order: a topic's channels
        # without a scan of every registration (a /lookup with 10,000 topics)
        self._by_key: dict[tuple[str, str], dict[Registration, None]] = {}
        # peer id -> the registrations it is a producer of (its /nodes entry, its leaving)
        self._by_peer: dict[str, dict[Registration, None]] = {}

    # -- changes ---------------------------------------------------------------------

    def _producers_of(self, reg: Registration) -> dict[str, Producer]:
        producers = self._regs.get(reg)
        if producers is None:
            producers = self._regs[reg] = {}
            self._by_key.setdefault((reg.category, reg.key), {})[reg] = None
        return producers

    def add_registration(self, reg: Registration) -> None:
        self._producers_of(reg)

    def add_producer(self, reg: Registration, peer: PeerInfo) -> bool:
        """Announce `peer` under `reg` (created if new); False if it was there already."""
        producers = self._producers_of(reg)
        if peer.id in producers:
            return False
        producers[peer.id] = Producer(peer)
        self._by_peer.setdefault(peer.id, {})[reg] = None
        return True

    def remove_producer(self, reg: Registration, peer_id: str) -> tuple[bool, int]:
        """Withdraw `peer_id` from `reg`: (whether it was there, producers left)."""
        producers = self._regs.get(reg)
        if producers is None:
            return False, 0
        removed = producers.pop(peer_id, None) is not None
        if removed:
            self._forget(peer_id, reg)
        return removed, len(producers)

    def _forget(self, peer_id: str, reg: Registration) -> None:
        regs = self._by_peer.get(peer_id)
        if regs is not None:
            regs.pop(reg, None)
            if not regs:
                del self._by_peer[peer_id]

    def remove_registration(self, reg: Registration) -> None:
        producers = self._regs.pop(reg, None)
        if producers is not None:
            for peer_id in producers:
                self._forget(peer_id, reg)
            same_key = self._by_key[(reg.category, reg.key)]
            del same_key[reg]
            if not same_key:
                del self._by_key[(reg.category, reg.key)]

    def remove_peer(self, peer_id: str) -> list[Registration]:
        """Withdraw `peer_id` from everything (its connection closed); what it left."""
        left = list(self._by_peer.pop(peer_id, ()))
        for reg in left:
            del self._regs[reg][peer_id]
        return left

    def tombstone(self, reg: Registration, node: str, now: float) -> bool:
        """Hide the producers of `reg` whose node is `node`; whether any was found."""
        found = False
        for producer in self._regs.get(reg, {}).values():
            if producer.peer.node == node:
                producer.tombstoned_at = now
                found = True
        return found

    # -- queries ---------------------------------------------------------------------

    def find(self, category: str, key: str = "", subkey: str = "") -> list[Registration]:
        """Registrations matching (``*`` matches any key or subkey), in creation order."""
        if "*" not in (key, subkey):
            reg = Registration(category, key, subkey)
            return [reg] if reg in self._regs else []
        if key != "*":
            return [reg for reg in self._by_key.get((category, key), ())
                    if reg.matches(category, key, subkey)]
        return [reg for reg in self._regs if reg.matches(category, key, subkey)]

    def producers(self, category: str, key: str = "", subkey: str = "") -> list[Producer]:
        """The producers of every matching registration, each peer once."""
        seen: dict[str, Producer] = {}
        for reg in self.find(category, key, subkey):
            for peer_id, producer in self._regs[reg].items():
                seen.setdefault(peer_id, producer)
        return list(seen.values())

    def of_peer(self, peer_id: str) -> list[Registration]:
        """Every registration `peer_id` announced."""
        return list(self._by_peer.get(peer_id, ()))

    def producer(self, reg: Registration, peer_id: str) -> Producer | None:
        return self._regs.get(reg, {}).get(peer_id)

    def entries(self) -> Iterable[tuple[Registration, list[Producer]]]:
        """Every registration with its producers (``/debug``)."""
        return [(reg, list(producers.values())) for reg, producers in self._regs.items()]

    @staticmethod
    def active(producers: Iterable[Producer], now: float, inactive_timeout: float,
               tombstone_lifetime: float) -> list[Producer]:
        """Those heard from within `inactive_timeout` and not tombstoned within
        `tombstone_lifetime` (nsqlookupd's ``FilterByActive``)."""
        return [p for p in producers
                if now - p.peer.last_update <= inactive_timeout
                and not p.tombstoned(now, tombstone_lifetime)]
