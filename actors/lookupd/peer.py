"""A peer actor (``peer:<life>.<session>``): one broker's connection to the lookup daemon.

The listener's socket loop decodes the broker's commands
(:mod:`transport.nsq.lookup_codec`) and tells them to the connection's peer
actor, in order; the actor tells the registrar what changed, answers the
broker (``OK``, or IDENTIFY's JSON: this daemon's ports, broadcast address,
hostname and version), and remembers what its broker announced, so that it
can announce it again to a registrar restarted after a crash
(``Reannounce``).  Answers are sent after the registrar was told, and the
registrar handles its mailbox in order, so a lookup made after an ``OK`` sees
what the ``OK`` answered.

When the connection closes the peer tells the registrar the broker left and
stops: the node forgets it, so connections that come and go leave nothing
behind.  A peer restarted after a crash has lost what its broker announced:
it closes the connection, and the broker (nsqd, or ours) reconnects and
announces everything again.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from actors.lookupd.messages import (
    Identified,
    Left,
    PeerGone,
    PeerIdentify,
    PeerPing,
    PeerRegister,
    PeerUnregister,
    Pinged,
    Reannounce,
    Registered,
    Unregistered,
)
from actors.lookupd.registrar import REGISTRAR
from actors.runtime.actor import Actor

__all__ = ["PeerActor", "PeerConnection", "connection_of", "forget", "remember"]

log = logging.getLogger(__name__)


class PeerConnection(Protocol):
    """How a peer actor answers its broker (the listener's socket loop)."""

    @property
    def remote_address(self) -> str:
        """``ip:port`` of the broker's end: the peer's id, as in nsqlookupd."""
        ...

    def answer(self, data: bytes) -> None:
        """Send one V1 answer (``OK``, IDENTIFY's JSON)."""
        ...

    def identify_answer(self) -> bytes:
        """IDENTIFY's JSON answer: this daemon's ports, addresses and version."""
        ...

    def close(self) -> None:
        ...


_CONNECTIONS: dict[str, PeerConnection] = {}
"""Peer actor name -> its connection (per process: the gateway; dict operations are
atomic under the GIL)."""


def remember(name: str, connection: PeerConnection) -> None:
    _CONNECTIONS[name] = connection


def forget(name: str) -> PeerConnection | None:
    return _CONNECTIONS.pop(name, None)


def connection_of(name: str) -> PeerConnection | None:
    return _CONNECTIONS.get(name)


def live_peers() -> list[str]:
    """The names of the peers whose connection is open."""
    return list(_CONNECTIONS)


class PeerActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, **_options: Any) -> None:
        super().__init__(name)
        self.peer_id = ""
        self.info: dict[str, Any] | None = None
        self.announced: list[tuple[str, str]] = []  # (topic, channel), in order

    def on_start(self) -> None:
        conn = connection_of(self.name)
        if conn is not None:
            self.peer_id = conn.remote_address
            if self.restart_count:
                log.warning("peer %s restarted; closing its connection so its broker "
                            "announces everything again", self.name)
                conn.close()

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case PeerRegister(topic=topic, channel=channel):
                if (topic, channel) not in self.announced:
                    self.announced.append((topic, channel))
                self.tell(REGISTRAR, Registered(self.peer_id, topic, channel))
                self._answer(b"OK")
            case PeerUnregister(topic=topic, channel=channel):
                self.announced = [(t, c) for t, c in self.announced
                                  if t != topic or (channel and c != channel)]
                self.tell(REGISTRAR, Unregistered(self.peer_id, topic, channel))
                self._answer(b"OK")
            case PeerPing():
                if self.info is not None:
                    self.tell(REGISTRAR, Pinged(self.peer_id))
                self._answer(b"OK")
            case PeerIdentify():
                self.info = {"id": self.peer_id, "remote_address": self.peer_id,
                             "hostname": msg.hostname,
                             "broadcast_address": msg.broadcast_address,
                             "tcp_port": msg.tcp_port, "http_port": msg.http_port,
                             "version": msg.version, "extra": dict(msg.extra or {})}
                log.info("peer %s: IDENTIFY %s:%d (http %d) version %s", self.peer_id,
                         msg.broadcast_address, msg.tcp_port, msg.http_port, msg.version)
                self.tell(REGISTRAR, Identified(self.info))
                conn = connection_of(self.name)
                if conn is not None:
                    conn.answer(conn.identify_answer())
            case Reannounce():
                if self.info is not None:
                    self.tell(REGISTRAR, Identified(self.info))
                    for topic, channel in self.announced:
                        self.tell(REGISTRAR, Registered(self.peer_id, topic, channel))
            case PeerGone():
                if self.peer_id:
                    self.tell(REGISTRAR, Left(self.peer_id))
                self.stop()
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None

    def _answer(self, data: bytes) -> None:
        conn = connection_of(self.name)
        if conn is not None:
            conn.answer(data)
