"""A blocking NSQ TCP V2 connection for command-line tools (``zmqnsq tail``, ``pub``,
``to-file``): one socket and the sans-IO client codec, heartbeats answered by itself.

It speaks to our brokers and to nsqd alike.  :meth:`Connection.request` sends a
command and waits for its response frame (PUB, MPUB, SUB); :meth:`events`
reads what one ``recv`` brings (messages, responses, errors) for a loop that
multiplexes several connections with ``selectors``.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from transport.nsq.client_codec import ClientConnection, ErrorFrame, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc
from transport.protocol.validation import ProtocolError


class ConnectionClosed(ConnectionError):
    """The broker closed the connection (after an error frame, if it sent one)."""


def split_address(address: str) -> tuple[str, int]:
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"expected <host>:<port>, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class Connection:
    """One connection, IDENTIFYed (``feature_negotiation``, no TLS or compression)."""

    def __init__(self, address: str, *, timeout: float = 5.0, user_agent: str = "zmqnsq",
                 heartbeat_interval_ms: int = 30_000) -> None:
        self.address = address
        self.sock = socket.create_connection(split_address(address), timeout=timeout)
        self.codec = ClientConnection()
        self._kept: list[Any] = []  # what arrived while a request waited for its answer
        try:
            reply = self.request(pc.Identify({"feature_negotiation": True,
                                              "heartbeat_interval": heartbeat_interval_ms,
                                              "user_agent": user_agent}))
            self.server: dict[str, Any] = json.loads(reply.data) if reply.data[:1] == b"{" \
                else {}
        except BaseException:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, command: pc.Command) -> None:
        self.sock.sendall(self.codec.send(command))

    def request(self, command: pc.Command) -> Response:
        """Send `command` and wait for its response; an error frame raises ProtocolError.
        (Messages that arrive meanwhile are kept for :meth:`events`.)"""
        self.send(command)
        while True:
            for event in self._read():
                if isinstance(event, Response):
                    return event
                if isinstance(event, ErrorFrame):
                    raise event.error
                self._kept.append(event)

    def events(self) -> list[Any]:
        """What one read brings (blocks until something arrives): messages, responses,
        non-fatal error frames; heartbeats are answered here.  Raises ConnectionClosed."""
        kept, self._kept = self._kept, []
        return kept or self._read()

    def _read(self) -> list[Any]:
        out: list[Any] = []
        while True:
            event = self.codec.next_event()
            if event is NEED_DATA:
                if out:
                    return out
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionClosed(f"{self.address} closed the connection")
                self.codec.receive_data(data)
                continue
            if event is CLOSED:
                raise ConnectionClosed(f"{self.address} closed the connection")
            if isinstance(event, pc.Heartbeat):
                self.send(pc.Nop())
                continue
            if isinstance(event, ErrorFrame) and event.error.fatal:
                raise event.error
            if isinstance(event, ProtocolError):  # not V2: the codec gave up on the stream
                raise event
            out.append(event)

    def close(self) -> None:
        self.sock.close()
