"""The registrar actor (``registry:lookup``): nsqlookupd's registration database.

It owns a :class:`~actors.lookupd.registry.Registry` and applies, in the
order they arrive, what the peer actors tell it (a broker identified,
registered, unregistered, pinged, left) and what the HTTP API asks
(``Query``: lookups, and the admin changes).  Its rules are nsqlookupd 1.3's
(``nsqlookupd/lookup_protocol_v1.go``, ``http.go``):

* ``REGISTER T C`` announces the channel and the topic; ``UNREGISTER T C``
  withdraws the channel only, ``UNREGISTER T`` the topic and every channel of
  it.  Names stay registered when their last producer goes (``/topics`` still
  lists them), except an ``#ephemeral`` one withdrawn by ``UNREGISTER``.
* Only ``IDENTIFY`` and ``PING`` count as signs of life; a broker silent for
  ``--inactive-producer-timeout`` is left out of ``/lookup`` and ``/nodes``
  until it pings again.
* ``/topic/tombstone`` hides a broker from one topic's lookups for
  ``--tombstone-lifetime``.

A ``/lookup`` answer is kept as its JSON bytes until something it shows
changes: every registration, withdrawal, tombstone, or peer coming, going or
pinging after a silence drops them all, and each answer is kept only until the
first of its brokers would fall silent past ``--inactive-producer-timeout`` or
its first tombstone ends, so a kept answer is always the one a fresh lookup
would give.  Clients poll ``/lookup`` all the time (go-nsq every minute per
reader and topic), and encoding a topic's hundred producers was most of an
answer's cost.

Unlike nsqlookupd, ``*`` is not a wildcard in what clients send: a name is a
name (``/topic/delete?topic=*`` deletes nothing).

Its state is rebuilt, not stored: after a crash the restarted registrar asks
the listener to have every peer tell it again what its broker announced
(``Reannounce``); a broker's own connection, dropped with its gateway, makes
the broker announce everything again when it reconnects.  What was created
over HTTP alone is lost with it, as it is when nsqlookupd restarts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from actors.lookupd.messages import (
    Identified,
    Left,
    Pinged,
    Query,
    Reannounce,
    Registered,
    Unregistered,
)
from actors.lookupd.options import LookupdOptions
from actors.lookupd.registry import CHANNEL, CLIENT, TOPIC, PeerInfo, Registration, Registry
from actors.runtime.actor import Actor

__all__ = ["REGISTRAR", "RegistrarActor"]

log = logging.getLogger(__name__)

REGISTRAR = "registry:lookup"
LISTENER = "listener:lookup"

_EPHEMERAL = "#ephemeral"
_CHANGES = frozenset({"topic_create", "topic_delete", "channel_create", "channel_delete",
                      "tombstone"})
_NEVER_NS = -6795364578871345152
"""What nsqlookupd's /debug shows as ``tombstoned_at`` of a producer never tombstoned
(Go's zero time in Unix nanoseconds)."""


class RegistrarActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: LookupdOptions,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name)
        self.options = options
        self.clock = clock
        self.db = Registry()
        self.peers: dict[str, PeerInfo] = {}
        self._lookups: dict[str, tuple[float, bytes | None]] = {}  # topic -> (until, JSON)

    def on_start(self) -> None:
        if self.restart_count:
            log.warning("%s restarted: asking every peer to announce again", self.name)
            self.tell(LISTENER, Reannounce())

    def on_receive(self, msg: Any) -> Any:
        if type(msg) is not Pinged and not (type(msg) is Query and msg.what not in _CHANGES):
            self._lookups.clear()  # a change: the next lookups are computed afresh
        match msg:
            case Registered(peer=peer_id, topic=topic, channel=channel):
                peer = self.peers.get(peer_id)
                if peer is not None:
                    if channel:
                        self.db.add_producer(Registration(CHANNEL, topic, channel), peer)
                    self.db.add_producer(Registration(TOPIC, topic), peer)
            case Unregistered(peer=peer_id, topic=topic, channel=channel):
                self._unregister(peer_id, topic, channel)
            case Pinged(peer=peer_id):
                if (peer := self.peers.get(peer_id)) is not None:
                    now = self.clock()
                    if now - peer.last_update > self.options.inactive_producer_timeout:
                        self._lookups.clear()  # back from silence: in lookups at once
                    peer.last_update = now
            case Identified(info=info):
                self._identified(info)
            case Left(peer=peer_id):
                self.db.remove_peer(peer_id)
                self.peers.pop(peer_id, None)
            case Query():
                return self._query(msg)
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None

    # -- what brokers announce ------------------------------------------------------

    def _identified(self, info: dict[str, Any]) -> None:
        known = {"id", "remote_address", "hostname", "broadcast_address", "tcp_port",
                 "http_port", "version"}
        peer = PeerInfo(**{k: v for k, v in info.items() if k in known},
                        extra=dict(info.get("extra") or {}), last_update=self.clock())
        self.peers[peer.id] = peer
        self.db.add_producer(Registration(CLIENT), peer)

    def _unregister(self, peer_id: str, topic: str, channel: str) -> None:
        if channel:
            reg = Registration(CHANNEL, topic, channel)
            _, left = self.db.remove_producer(reg, peer_id)
            if not left and channel.endswith(_EPHEMERAL):
                self.db.remove_registration(reg)
            return
        for reg in self._channels_of(topic):
            self.db.remove_producer(reg, peer_id)
        reg = Registration(TOPIC, topic)
        _, left = self.db.remove_producer(reg, peer_id)
        if not left and topic.endswith(_EPHEMERAL):
            self.db.remove_registration(reg)

    def _channels_of(self, topic: str) -> list[Registration]:
        if "*" in topic:  # (a name, never the registry's wildcard)
            return []
        return self.db.find(CHANNEL, topic, "*")

    # -- what the HTTP API asks -------------------------------------------------------

    def _query(self, q: Query) -> Any:
        o, now, db = self.options, self.clock(), self.db
        topic = Registration(TOPIC, q.topic)
        match q.what:
            case "lookup":
                cached = self._lookups.get(q.topic)
                if cached is not None and now < cached[0]:
                    return cached[1]
                answer, until = None, float("inf")
                if "*" not in q.topic and db.find(TOPIC, q.topic):
                    every = db.producers(TOPIC, q.topic)
                    producers = db.active(every, now, o.inactive_producer_timeout,
                                          o.tombstone_lifetime)
                    answer = json.dumps(
                        {"channels": [r.subkey for r in self._channels_of(q.topic)],
                         "producers": [p.peer.to_json() for p in producers]},
                        separators=(",", ":")).encode()
                    # until a broker in it falls silent or a tombstone ends
                    until = min([p.peer.last_update + o.inactive_producer_timeout
                                 for p in producers]
                                + [p.tombstoned_at + o.tombstone_lifetime for p in every
                                   if p.tombstoned(now, o.tombstone_lifetime)],
                                default=until)
                if len(self._lookups) >= 10_000:
                    self._lookups.clear()
                self._lookups[q.topic] = (until, answer)
                return answer
            case "topics":
                return [r.key for r in db.find(TOPIC, "*")]
            case "channels":
                return [r.subkey for r in self._channels_of(q.topic)]
            case "nodes":
                return self._nodes(now)
            case "debug":
                return self._debug()
            case "topic_create":
                db.add_registration(topic)
            case "topic_delete":
                for reg in self._channels_of(q.topic):
                    db.remove_registration(reg)
                db.remove_registration(topic)
            case "channel_create":
                db.add_registration(Registration(CHANNEL, q.topic, q.channel))
                db.add_registration(topic)
            case "channel_delete":
                found = db.find(CHANNEL, q.topic, q.channel)
                for reg in found:
                    db.remove_registration(reg)
                return bool(found)
            case "tombstone":
                db.tombstone(topic, q.node, now)
            case _:
                raise ValueError(f"unknown registry query {q.what!r}")
        return None

    def _nodes(self, now: float) -> list[dict[str, Any]]:
        o, db = self.options, self.db
        out = []
        for producer in db.active(db.producers(CLIENT), now, o.inactive_producer_timeout, 0):
            peer = producer.peer
            topics = [r.key for r in db.of_peer(peer.id) if r.category == TOPIC]
            tombstones = []
            for t in topics:
                p = db.producer(Registration(TOPIC, t), peer.id)
                tombstones.append(p is not None and p.tombstoned(now, o.tombstone_lifetime))
            out.append({**peer.to_json(), "tombstones": tombstones, "topics": topics})
        return out

    def _debug(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for reg, producers in self.db.entries():
            if producers:
                out[f"{reg.category}:{reg.key}:{reg.subkey}"] = [
                    {**p.peer.to_json(), "id": p.peer.id,
                     "last_update": int(p.peer.last_update * 1e9),
                     "tombstoned": p.tombstoned_at is not None,
                     "tombstoned_at": _NEVER_NS if p.tombstoned_at is None
                     else int(p.tombstoned_at * 1e9)}
                    for p in producers]
        return out
