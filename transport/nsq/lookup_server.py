"""nsqlookupd's TCP protocol V1's socket loop: asyncio in one thread, a codec per broker.

Every connection holds a sans-IO
:class:`~transport.nsq.lookup_codec.LookupServerConnection`.  Bytes in are fed
to it; each command (``IDENTIFY``, ``REGISTER``, ``UNREGISTER``, ``PING``) goes to
the handler's ``on_command(session, command)``, which answers through
:meth:`LookupTcpServer.send` from any thread, in order.  A protocol error is
the loop's own to answer: it writes it and closes the connection, as
nsqlookupd does for every error.  Either way the handler hears
``on_close(session)`` once.  V1 has no heartbeats and no deadlines: brokers
PING (nsqd every 15 s) and the registry ages them out.
"""

from __future__ import annotations

import logging
from typing import Any

from transport.nsq.lookup_codec import CLOSED, NEED_DATA, LookupServerConnection, encode_error
from transport.nsq.server import BaseConn, LoopServer
from transport.protocol.validation import ProtocolError

__all__ = ["LookupTcpServer"]

log = logging.getLogger(__name__)


class _LookupConn(BaseConn):
    def __init__(self, server: LoopServer) -> None:
        super().__init__(server)
        self.codec = LookupServerConnection()

    def data_received(self, data: bytes) -> None:
        self.codec.receive_data(data)
        while not self.closed:
            event = self.codec.next_event()
            if event is NEED_DATA:
                return
            if event is CLOSED:
                self.close()
                return
            if isinstance(event, ProtocolError):
                log.info("lookup peer %s: %s", self.name, event)
                self.write(encode_error(event))
                self.close()
                return
            try:
                self.server.handler.on_command(self.name, event)
            except Exception:  # a broken handler must not take the listener down
                log.exception("lookup handler failed on %r from %s", event, self.name)


class LookupTcpServer(LoopServer):
    """The V1 listener: ``start()`` binds and returns the port; the handler has
    ``on_command(session, command)`` and ``on_close(session)``."""

    def __init__(self, host: str, port: int, handler: Any) -> None:
        super().__init__(host, port, handler, _LookupConn, thread_name="lookupd-tcp")
