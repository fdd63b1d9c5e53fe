"""The listener actor (``listener:lookup``): the lookup daemon's two socket loops.

It starts, in ``on_start``, the TCP V1 loop for brokers
(:class:`transport.nsq.lookup_server.LookupTcpServer`) with a bridge that
turns each connection's commands into messages to its own peer actor, and
the HTTP API (:class:`transport.http.lookup_api.LookupHttpServer`) over a
facade that asks the registrar.  It knows both bound ports, so it writes
IDENTIFY's answer (nsqd reads the HTTP port from it to ask ``/channels``).
A listen that fails is reported by ``ListenerInfo``, never a crash loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any

from actors import __version__
from actors.lookupd import peer
from actors.lookupd.messages import (
    ListenerInfo,
    PeerGone,
    PeerIdentify,
    PeerPing,
    PeerRegister,
    PeerUnregister,
    Query,
    Reannounce,
)
from actors.lookupd.options import LookupdOptions
from actors.lookupd.registrar import REGISTRAR
from actors.runtime.actor import Actor, current_endpoint
from transport.nsq.lookup_codec import Identify, Ping, Register, Unregister, encode_answer

__all__ = ["LISTENER", "ListenerActor"]

log = logging.getLogger(__name__)

LISTENER = "listener:lookup"
ASK_TIMEOUT = 10.0


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class _Connection:
    """A broker's connection as its peer actor sees it (any thread may answer)."""

    def __init__(self, bridge: _Bridge, session: str) -> None:
        self.server = bridge.server
        self.bridge = bridge
        self.session = session
        self.remote_address = str(self.server.peer(session))

    def answer(self, data: bytes) -> None:
        self.server.send(self.session, encode_answer(data))

    def identify_answer(self) -> bytes:
        return self.bridge.identify_answer

    def close(self) -> None:
        self.server.drop(self.session)


class _Bridge:
    """The TCP loop's handler: a connection's commands to ``peer:<life>.<session>``."""

    def __init__(self, life: str) -> None:
        self.life = life
        self.server: Any = None
        self.identify_answer = b"{}"

    def name(self, session: str) -> str:
        return f"peer:{self.life}.{session}"

    def on_command(self, session: str, command: Any) -> None:
        name = self.name(session)
        if peer.connection_of(name) is None:
            peer.remember(name, _Connection(self, session))
        match command:
            case Register(topic=topic, channel=channel):
                msg: Any = PeerRegister(topic, channel)
            case Unregister(topic=topic, channel=channel):
                msg = PeerUnregister(topic, channel)
            case Ping():
                msg = PeerPing()
            case Identify():
                msg = PeerIdentify(command.broadcast_address, command.tcp_port,
                                   command.http_port, command.version, command.hostname,
                                   dict(command.extra))
            case _:
                return
        current_endpoint().tell(name, msg)

    def on_close(self, session: str) -> None:
        name = self.name(session)
        if peer.forget(name) is not None:
            current_endpoint().tell(name, PeerGone())


class RegistrarFacade:
    """The HTTP API's view of the registrar: each call an ask, awaited on the HTTP
    loop (the registrar is in this process: its answer is handed to the loop, with
    no thread parked waiting for it)."""

    async def _ask(self, what: str, topic: str = "", channel: str = "",
                   node: str = "") -> Any:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()

        def on_done(value: Any, exc: BaseException | None) -> None:
            def settle() -> None:
                if answer.done():
                    return
                if exc is None:
                    answer.set_result(value)
                else:
                    answer.set_exception(exc)
            loop.call_soon_threadsafe(settle)

        current_endpoint().ask_local(REGISTRAR, Query(what, topic, channel, node), on_done)
        return await asyncio.wait_for(answer, ASK_TIMEOUT)

    async def lookup(self, topic: str) -> bytes | None:
        return await self._ask("lookup", topic)

    async def topics(self) -> list[str]:
        return await self._ask("topics")

    async def channels(self, topic: str) -> list[str]:
        return await self._ask("channels", topic)

    async def nodes(self) -> list[dict[str, Any]]:
        return await self._ask("nodes")

    async def debug(self) -> dict[str, list[dict[str, Any]]]:
        return await self._ask("debug")

    async def topic_create(self, topic: str) -> None:
        await self._ask("topic_create", topic)

    async def topic_delete(self, topic: str) -> None:
        await self._ask("topic_delete", topic)

    async def channel_create(self, topic: str, channel: str) -> None:
        await self._ask("channel_create", topic, channel)

    async def channel_delete(self, topic: str, channel: str) -> bool:
        return bool(await self._ask("channel_delete", topic, channel))

    async def tombstone(self, topic: str, node: str) -> None:
        await self._ask("tombstone", topic, node=node)

    async def info(self) -> dict[str, Any]:
        return {"version": __version__}


class ListenerActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: LookupdOptions) -> None:
        super().__init__(name)
        self.options = options
        self.tcp: Any = None
        self.http: Any = None
        self.tcp_port = 0
        self.http_port = 0
        self.error: str | None = None

    def on_start(self) -> None:
        # Peer names carry this listener's life: sessions count afresh after a restart.
        bridge = _Bridge(os.urandom(3).hex())
        o = self.options
        try:
            from transport.http.lookup_api import LookupHttpServer  # noqa: PLC0415
            from transport.nsq.lookup_server import LookupTcpServer  # noqa: PLC0415

            # TCP first: once /ping answers, so does the TCP port (a restart included)
            host, port = split_address(o.tcp_address)
            self.tcp = LookupTcpServer(host, port, bridge)
            bridge.server = self.tcp
            self.tcp_port = self.tcp.start()
            http_host, port = split_address(o.http_address)
            self.http = LookupHttpServer(RegistrarFacade(), http_host, port).start()
            self.http_port = self.http.port
            # (peers answer IDENTIFY on this dispatcher thread, so not before this is set)
            bridge.identify_answer = json.dumps(
                {"broadcast_address": o.broadcast_address, "hostname": socket.gethostname(),
                 "http_port": self.http_port, "tcp_port": self.tcp_port, "version": __version__},
                sort_keys=True, separators=(",", ":")).encode()
        except Exception as e:  # reported by ListenerInfo: never a crash loop
            self.error = f"listen failed: {e}"
            log.error("%s", self.error)
            self.on_stop()
            return
        log.info("TCP: listening on %s:%d; HTTP: listening on %s:%d", host, self.tcp_port,
                 split_address(o.http_address)[0], self.http_port)

    def on_stop(self) -> None:
        for server in (self.tcp, self.http):
            if server is not None:
                server.stop()
        self.tcp = self.http = None

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case ListenerInfo():
                return {"tcp_port": self.tcp_port, "http_port": self.http_port,
                        "error": self.error}
            case Reannounce():
                for name in peer.live_peers():
                    self.tell(name, Reannounce())
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None
