"""The gateway's registry of live client connections, by client actor name.

A protocol server (ZeroMQ, NSQ TCP) registers a :class:`Connection` for
``client:<id>`` before it forwards the client's first command; the client
actor looks its connection up whenever it has something to send.  A client
actor without a connection (tests, embedders) keeps what it would have sent
in its outbox instead.  The registry is per process (the gateway) and its
operations are single dict operations, atomic under the GIL.
"""

from __future__ import annotations

from typing import Protocol

Wire = tuple[str, str, bool]


class Connection(Protocol):
    """How a client actor writes to its client, whatever the protocol."""

    def deliver(self, channel: str, messages: list[bytes]) -> None:
        """Send NSQ-encoded messages (a batch from one channel)."""

    def respond(self, corr: bytes | None, error: Wire | None,
                payload: bytes | None = None) -> None:
        """Answer a request: OK (with an optional payload) or its error."""

    def respond_oks(self, corrs: list[bytes | None]) -> None:
        """Answer several requests OK, in order, with one write where the protocol can."""

    def error(self, error: Wire) -> None:
        """Send an error that answers no particular request (E_FIN_FAILED, ...)."""

    def close(self) -> None:
        """Close the connection (after a fatal error)."""


_CONNECTIONS: dict[str, Connection] = {}
_SUBSCRIPTIONS: dict[str, str] = {}  # client actor -> "channel:T/C", outlives a crash


def register(name: str, connection: Connection) -> None:
    _CONNECTIONS[name] = connection


def unregister(name: str) -> Connection | None:
    _SUBSCRIPTIONS.pop(name, None)
    return _CONNECTIONS.pop(name, None)


def remember_subscription(name: str, channel: str | None) -> None:
    """Record (or, with None, forget) the channel a client actor subscribed to, so an
    instance restarted after a crash can release what the lost one held."""
    if channel is None:
        _SUBSCRIPTIONS.pop(name, None)
    else:
        _SUBSCRIPTIONS[name] = channel


def subscription(name: str) -> str | None:
    return _SUBSCRIPTIONS.get(name)


def lookup(name: str) -> Connection | None:
    return _CONNECTIONS.get(name)
