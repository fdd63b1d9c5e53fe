"""The NSQ TCP protocol V2's socket loop: asyncio in one thread, one codec per connection.

Theory of operation
-------------------
One thread runs an asyncio event loop with a TCP server on
``--tcp-address``; every connection is an :class:`_Conn` (an
``asyncio.Protocol``) holding a sans-IO
:class:`~transport.nsq.codec.ServerConnection`.  Thousands of idle connections
cost one small object each, not a thread.

Bytes in are fed to the codec; each event is handled on the loop (the FINs
of one read are merged into one, so a consumer acking a batch costs the
broker one message, not one per id): the loop
answers what needs no broker (IDENTIFY's negotiation, CLS's ``CLOSE_WAIT``,
NOP, protocol errors, AUTH) and hands every other command to the *handler*
(the broker's bridge).  SUB's
``OK`` is the handler's: it comes once the channel exists at its topic, so
a message published after the OK reaches it (as with nsqd).  Other threads
(client actors) write through :meth:`TcpServer.send`, which hops onto the
loop with ``call_soon_threadsafe``.

TLS follows nsqd too: with a server context, an IDENTIFY that asks for
``tls_v1`` (with ``feature_negotiation``) is answered in clear, then the
connection is upgraded in place (``loop.start_tls``) and ``OK`` is sent inside
TLS.  Bytes that came after the IDENTIFY in clear are dropped, as nsqd drops
them; writes from other threads wait for the handshake; a handshake that fails
or stalls for :data:`HANDSHAKE_TIMEOUT` closes the connection.  With
``tls_required`` every command but IDENTIFY is refused until then
(``E_INVALID cannot PUB in current state (TLS required)``, fatal).  Snappy or
deflate, when IDENTIFY negotiated one, wraps the stream after that (inside TLS),
answering ``OK`` in the compressed stream.

AUTH (with :class:`~transport.auth.AuthServers`) asks the auth servers on this
loop (aiohttp), holding the connection's later commands until the answer;
PUB, MPUB, DPUB and SUB are then checked against the authorizations, and a
command after the answer's TTL asks again first (transport/auth.py).  Without
auth servers, AUTH is nsqd's ``E_AUTH_DISABLED``.

Heartbeats follow nsqd: every negotiated ``heartbeat_interval`` the server
sends ``_heartbeat_``, and a connection that sends nothing for two intervals
(the read deadline) is closed.  A fatal error is written, then the connection
is closed; either way the handler hears ``on_close(session)``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import ssl
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from typing import Any

from transport.auth import ASK_AGAIN, AuthError, AuthServers, AuthState, answer, judge, query_any
from transport.nsq.codec import (
    CLOSE_WAIT_FRAME,
    HEARTBEAT_FRAME,
    OK_FRAME,
    PUBLISHES,
    ServerConnection,
    encode_error,
    encode_identify_response,
    encode_response,
)
from transport.nsq.handoff import BUSY, SENT, Receiver, Sender
from transport.protocol.commands import (
    Auth,
    Cls,
    Dpub,
    Fin,
    Handler,
    Identify,
    Mpub,
    Nop,
    Pub,
    Pubs,
    Sub,
)
from transport.protocol.identify import IdentifySettings, ServerInfo
from transport.protocol.validation import Limits, ProtocolError
from transport.tls import peer_details

log = logging.getLogger(__name__)

_sessions = itertools.count(1)

HANDSHAKE_TIMEOUT = 5.0
"""Seconds a TLS handshake may take (nsqd's deadline for it)."""

HANDOFF_DEADLINE = 30.0
"""Seconds a connection offered for a hand-off may wait, unread, for it: the client
actor's publishes unanswered that long mean their topic's worker is gone (with
heartbeats, the actor fails them after 10 s itself), or the client reads nothing of
what it is owed; then the connection is closed."""

HANDOFF_BUSY_FOR = 1.0
"""Seconds a hand-off is tried again while its receiver's queue is full, before the
connection is served where it is."""


class BaseConn(asyncio.Protocol):
    """A connection of a :class:`LoopServer`: its session name, output and closing.

    Subclasses decode in ``data_received`` and may keep a timer (cancelled at close)."""

    def __init__(self, server: LoopServer) -> None:
        self.server = server
        self.name = f"t{next(_sessions)}"
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.conns[self.name] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_quietly()

    def eof_received(self) -> bool | None:
        self.close()
        return False

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # flushes what was written first
        self._close_quietly()

    def _close_quietly(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        self.server.conns.pop(self.name, None)
        try:
            self.server.handler.on_close(self.name)
        except Exception:
            log.exception("tcp handler failed closing %s", self.name)


class _Conn(BaseConn):
    def __init__(self, server: TcpServer, resume: dict[str, Any] | None = None) -> None:
        super().__init__(server)
        self.server: TcpServer = server
        self.resume = resume  # the state of a connection handed over by another process
        if resume is None:
            self.codec = ServerConnection(server.limits, server.info)
        else:
            self.codec = ServerConnection.resumed(
                server.limits, server.info, IdentifySettings(**resume["settings"]),
                resume["buffered"], subscribed="channel" in resume)
        # the first publish offers the connection to its topic's process
        self.codec.pause_at_publish = server.handoff is not None
        self.heartbeat_s = self.codec.settings.heartbeat_interval / 1000
        # the SUB or publish whose connection is being handed over
        self.handing: Sub | Pub | Mpub | Dpub | None = None
        self.overdue: asyncio.TimerHandle | None = None  # closes it if never handed over
        self.heard = 0.0
        self.codec.tls_required = server.tls_required
        self.held: list[bytes] | None = None  # writes waiting for the TLS handshake
        # TLS version, cipher suite, common name (transport.tls.peer_details), compression
        self.details: dict[str, Any] = {}
        self.switched = False  # IDENTIFY changed the stream: the rest of the read is dropped
        self.inflate: Callable[[bytes], Iterator[bytes]] | None = None
        self.compress: Callable[[bytes], bytes] | None = None
        self.auth_state: AuthState | None = None
        self.secret = ""
        self.waiting: list[Any] | None = None  # events held while the auth server is asked

    # -- asyncio.Protocol ---------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.heard = self.server.loop.time()
        self._schedule()
        if self.resume is not None:
            resume, self.resume = self.resume, None
            try:
                self.server.handler.on_adopt(self.name, resume)
            except Exception:
                log.exception("tcp handler failed adopting %s", self.name)
                self.close()
                return
            self._feed_buffered()

    def data_received(self, data: bytes) -> None:
        self.heard = self.server.loop.time()
        if self.inflate is None:
            self._feed(data)
            return
        try:
            for piece in self.inflate(data):
                if self.closed:
                    return
                if piece:  # (b"" is the codec's end of stream; part of a chunk inflates to it)
                    self._feed(piece)
        except Exception as e:  # zlib.error, snappy's errors: the stream is garbage
            log.info("tcp client %s sent a corrupt compressed stream: %s", self.name, e)
            self.close()

    def _feed(self, data: bytes) -> None:
        self.codec.receive_data(data)
        self.switched = False
        self._feed_buffered()

    def _feed_buffered(self) -> None:
        # (next_events stops after a SUB or the first publish, which may hand this
        # connection over)
        while not (self.closed or self.switched or self.handing):
            events = self.codec.next_events()
            if not events:
                return
            self._run(events)

    def _run(self, events: list[Any]) -> None:
        """Handle `events` in order; while the auth server is asked, they wait.

        Consecutive FINs of one read go to the broker as one `Fin`, and consecutive
        PUBs to one topic as one `Pubs` (without AUTH: its checks are each command's;
        nor while the first publish may hand the connection over)."""
        fins: list[bytes] = []
        pubs: list[bytes] = []
        topic = ""
        gather = self.server.auth is None
        for i, event in enumerate(events):
            if self.closed or self.switched:
                return
            if self.waiting is not None:
                self.waiting.extend([Fin(tuple(fins))] if fins else [])
                self.waiting.extend(events[i:])
                return
            kind = type(event)
            if kind is Fin:
                if pubs:
                    self._pubs(topic, pubs)
                    pubs = []
                fins.extend(event.ids)
                continue
            if fins:
                self._event(Fin(tuple(fins)))
                fins = []
            if kind is Pub and gather and not event.tag and not self.codec.pause_at_publish:
                if pubs and event.topic != topic:
                    self._pubs(topic, pubs)
                    pubs = []
                topic = event.topic
                pubs.append(event.body)
                continue
            if pubs:
                self._pubs(topic, pubs)
                pubs = []
            self._event(event)
        if pubs and not self.closed:
            self._pubs(topic, pubs)
        if fins and not self.closed:
            if self.waiting is not None:
                self.waiting.append(Fin(tuple(fins)))
            else:
                self._event(Fin(tuple(fins)))

    def _pubs(self, topic: str, bodies: list[bytes]) -> None:
        if len(bodies) == 1:
            self._event(Pub(topic, bodies[0]))
        else:
            self._command(Pubs(topic, tuple(bodies)))

    # -- events -----------------------------------------------------------------

    def _event(self, event: Any) -> None:
        if isinstance(event, ProtocolError):
            self.write(encode_error(event))
            if event.fatal:
                self.close()
            return
        match event:
            case Nop():
                return
            case Identify(settings=settings, reply=reply):
                self.write(encode_identify_response(event))
                if settings is not None:
                    self.heartbeat_s = settings.heartbeat_interval / 1000
                    self._schedule()
                if reply is not None and (reply["tls_v1"] or reply["snappy"]
                                          or reply["deflate"]):
                    self._switch(reply)
            case Cls():
                self.write(CLOSE_WAIT_FRAME)
            case Auth(secret=secret):
                self._auth(secret)
                return
            case Pub(topic=topic) | Mpub(topic=topic) | Dpub(topic=topic) | Sub(topic=topic):
                if self.server.auth is not None and not self._authorized(event, topic):
                    return
                if type(event) is Sub:
                    self.codec.pause_at_publish = False  # the SUB says where it goes
                    if self._offer(event):
                        return
        self._command(event)
        if self.codec.pause_at_publish and type(event) in PUBLISHES:
            # after the publish: its client actor answers it before the hand-off
            self.codec.pause_at_publish = False
            self._offer(event)

    def _command(self, event: Any) -> None:
        try:
            self.server.handler.on_command(self.name, None, event)
        except Exception:  # a broken handler must not take the listener down
            log.exception("tcp handler failed on %s from %s", type(event).__name__, self.name)

    # -- hand-off of a connection (transport.nsq.handoff) -----------------------------

    def _offer(self, event: Sub | Pub | Mpub | Dpub) -> bool:
        """Offer the connection to the process that holds `event`'s topic (a SUB's
        channel, or the topic of the connection's first publish): only a plain one
        (TLS, compression and AUTH stay with this loop, which keeps their state).
        True: the handler took the offer; reading pauses until :meth:`hand_off`."""
        server = self.server
        if (server.handoff is None or server.auth is not None or self.codec.tls
                or self.compress is not None or self.held is not None
                or self.transport is None or self.handing is not None):
            return False
        offer = getattr(server.handler, "on_handoff", None)
        if offer is None or not offer(self.name, event):
            return False
        self.handing = event
        self.transport.pause_reading()
        self.overdue = self.server.loop.call_later(HANDOFF_DEADLINE, self._overdue)
        return True

    def _overdue(self) -> None:
        if self.handing is not None and not self.closed:
            log.warning("tcp client %s: its hand-off waited %gs: closed", self.name,
                        HANDOFF_DEADLINE)
            self.close()

    def hand_off(self, index: int, state: dict[str, Any], busy_until: float = 0.0) -> None:
        """On the loop: send this connection to receiver `index` once everything written
        to it has left (its OKs come before the new owner's), with `state` (the client
        actor's part) and the decoder's; if that fails, serve it here after all (a
        SUB offered is handled now; a publish offered was handled already)."""
        event, transport, loop = self.handing, self.transport, self.server.loop
        if self.closed or event is None or transport is None:
            return
        if transport.get_write_buffer_size():
            loop.call_later(0.002, self.hand_off, index, state, busy_until)
            return
        full = {**state, "settings": asdict(self.codec.settings),
                "buffered": self.codec.take_buffered()}
        if type(event) is Sub:
            full.update(topic=event.topic, channel=event.channel)
        sock = transport.get_extra_info("socket")
        assert self.server.handoff is not None
        sent = self.server.handoff.send(index, sock.fileno(), full) if sock else None
        if sent == SENT:
            self._stop_overdue()
            transport.abort()  # this process's descriptor: the connection lives on there
            return
        if full["buffered"]:
            self.codec.receive_data(full["buffered"])
        if sent == BUSY:  # the receiver's queue is full: again soon, for a while
            busy_until = busy_until or loop.time() + HANDOFF_BUSY_FOR
            if loop.time() < busy_until:
                loop.call_later(0.005, self.hand_off, index, state, busy_until)
                return
        self.handing = None
        self._stop_overdue()
        self.heard = loop.time()  # (nothing was read while it waited)
        if type(event) is Sub:
            self._command(event)
        transport.resume_reading()
        self._feed_buffered()

    def _stop_overdue(self) -> None:
        if self.overdue is not None:
            self.overdue.cancel()
            self.overdue = None

    # -- AUTH ----------------------------------------------------------------------------

    def _fail(self, code: str, text: str) -> None:
        self.write(encode_error(ProtocolError(code, text, fatal=True)))
        self.close()

    def _auth(self, secret: bytes) -> None:
        if self.server.auth is None:
            self._fail("E_AUTH_DISABLED", "AUTH disabled")
        elif self.auth_state is not None and self.auth_state.authorizations:
            self._fail("E_INVALID", "AUTH already set")
        else:
            self.secret = secret.decode("utf-8", "replace")
            self._ask_auth_server(None)

    def _authorized(self, event: Any, topic: str) -> bool:
        """Whether `event` may run now (else it was refused, or waits for the auth server
        to be asked again: its TTL has passed)."""
        verdict = judge(self.auth_state, type(event).__name__.upper(), topic,
                        event.channel if isinstance(event, Sub) else "",
                        self.server.loop.time())
        if verdict == ASK_AGAIN:
            self._ask_auth_server(event)
        elif verdict is not None:
            self._fail(*verdict)
        return verdict is None

    def _ask_auth_server(self, then: Any) -> None:
        """Ask the auth server (AUTH's secret), holding every event until it answers;
        then `then` (a command whose TTL had passed) runs first, or AUTH is answered."""
        self.waiting = [] if then is None else [then]
        self.server.loop.create_task(self._query(answer_auth=then is None))

    async def _query(self, *, answer_auth: bool) -> None:
        server = self.server
        assert server.auth is not None
        peer = self.transport.get_extra_info("peername") if self.transport else None
        try:
            state = await query_any(
                server.http_session(), server.auth.addresses, server.auth.method,
                remote_ip=peer[0] if peer else "", tls=self.codec.tls, secret=self.secret,
                common_name=self.details.get("tls_common_name", ""), clock=server.loop.time)
        except AuthError as e:  # (the reason is logged, never told: nsqd's rule)
            log.warning("tcp client %s: AUTH failed %s", self.name, e)
            self.waiting = None
            self._fail("E_AUTH_FAILED", "AUTH failed")
            return
        if self.closed:
            return
        self.auth_state = state
        reply = answer(state)
        if isinstance(reply, tuple):
            self.waiting = None
            self._fail(*reply)
            return
        self.details.update(auth_identity=state.identity,
                            auth_identity_url=state.identity_url)
        if answer_auth:
            self.write(encode_response(json.dumps(reply, separators=(",", ":")).encode()))
        waiting, self.waiting = self.waiting or [], None
        self._run(waiting)

    # -- TLS and compression, after IDENTIFY -------------------------------------------

    def write(self, data: bytes) -> None:
        if self.held is not None:
            self.held.append(data)
            return
        if self.compress is not None:
            data = self.compress(data)
        super().write(data)

    def _switch(self, reply: Mapping[str, Any]) -> None:
        """TLS, then snappy or deflate, each answered ``OK`` in its new stream (nsqd)."""
        self.codec.discard_buffered()
        self.switched = True
        if reply["tls_v1"]:
            self.held = []
            self.server.loop.create_task(self._upgrade(reply))
        else:
            self._compression(reply)

    def _compression(self, reply: Mapping[str, Any]) -> None:
        if reply["snappy"]:
            self.inflate, self.compress = _snappy()
        elif reply["deflate"]:
            self.inflate, self.compress = _deflate(reply["deflate_level"],
                                                   self.server.limits.max_body_size)
        else:
            return
        self.details.update(snappy=bool(reply["snappy"]), deflate=bool(reply["deflate"]))
        self.write(OK_FRAME)

    async def _upgrade(self, reply: Mapping[str, Any]) -> None:
        server = self.server
        assert self.transport is not None
        assert server.ssl_context is not None
        try:
            transport = await server.loop.start_tls(
                self.transport, self, server.ssl_context, server_side=True,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT)
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError, RuntimeError) as e:
            log.info("tcp client %s: TLS handshake failed: %s", self.name, e)
            transport = None
        if transport is None or self.closed:  # (None: the connection went meanwhile)
            self.held = None
            self._close_quietly()
            return
        self.transport = transport
        self.codec.tls = True
        self.heard = server.loop.time()
        self.details.update(peer_details(transport.get_extra_info("ssl_object")))
        held, self.held = self.held or [], None
        self.write(OK_FRAME)
        self._compression(reply)
        if held:
            self.write(b"".join(held))

    # -- heartbeats and output -----------------------------------------------------

    def _schedule(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.heartbeat_s > 0 and not self.closed:
            self.timer = self.server.loop.call_later(self.heartbeat_s, self._beat)

    def _beat(self) -> None:
        if self.closed:
            return
        # (a connection waiting for its hand-off reads nothing: not silence)
        if self.handing is None and self.server.loop.time() - self.heard > 2 * self.heartbeat_s:
            log.info("tcp client %s sent nothing for two heartbeat intervals: closed", self.name)
            self.close()
            return
        self.write(HEARTBEAT_FRAME)
        try:
            self.server.handler.on_heartbeat(self.name)
        except Exception:
            log.exception("tcp handler failed on a heartbeat of %s", self.name)
        self._schedule()


def _deflate(level: int, chunk: int) -> tuple[Callable[[bytes], Iterator[bytes]],
                                             Callable[[bytes], bytes]]:
    """Raw DEFLATE both ways (Go's ``compress/flate``), each write sync-flushed.  A read
    inflates in pieces of at most `chunk` bytes, each parsed before the next is made: a
    small stream that inflates to gigabytes is refused by the codec's limits first."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    deflater = zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)

    def inflate(data: bytes) -> Iterator[bytes]:
        piece = inflater.decompress(data, chunk)
        while True:
            yield piece
            if not inflater.unconsumed_tail:
                return
            piece = inflater.decompress(inflater.unconsumed_tail, chunk)

    def compress(data: bytes) -> bytes:
        return deflater.compress(data) + deflater.flush(zlib.Z_SYNC_FLUSH)

    return inflate, compress


def _snappy() -> tuple[Callable[[bytes], Iterator[bytes]], Callable[[bytes], bytes]]:
    """Snappy's framing format both ways (Go's ``golang/snappy`` reader and writer),
    through python-snappy, the binding pynsq uses.  (A frame holds at most 64 KiB, so a
    read inflates at most ~21 times.)"""
    import snappy  # noqa: PLC0415 - only for clients that ask for it

    decompressor, compressor = snappy.StreamDecompressor(), snappy.StreamCompressor()
    check = _SnappyChunks().check

    def inflate(data: bytes) -> Iterator[bytes]:
        check(data)
        yield decompressor.decompress(data)

    return inflate, compressor.add_chunk


class _SnappyChunks:
    """Follows the chunk headers of a snappy stream and refuses a corrupt one as it comes
    (python-snappy waits for a whole chunk first, and a garbage header can claim 16 MiB);
    the checks are Go's reader's, which nsqd runs."""

    MAX_DATA = 4 + 76490  # CRC + the longest encoding of a 64 KiB block

    def __init__(self) -> None:
        self.remaining = 0
        self.header = b""

    def check(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.remaining:
                step = min(self.remaining, n - i)
                self.remaining -= step
                i += step
                continue
            take = 4 - len(self.header)
            self.header += data[i:i + take]
            i += take
            if len(self.header) < 4:
                return
            kind, length = self.header[0], int.from_bytes(self.header[1:], "little")
            self.header = b""
            if (kind == 0xFF and length != 6) or (kind in {0, 1} and length > self.MAX_DATA) \
                    or 0x02 <= kind <= 0x7F:
                raise ValueError(f"corrupt snappy chunk (type {kind:#x}, {length} bytes)")
            self.remaining = length


def _write_parts(conn: Any, parts: list[bytes]) -> None:
    try:
        conn.write(b"".join(parts) if len(parts) > 1 else parts[0])
    except Exception:  # one connection's failure must not cost the others their writes
        log.exception("tcp write to %s failed", getattr(conn, "name", "?"))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class LoopServer:
    """A TCP listener on an asyncio loop in its own thread, one `BaseConn` per
    connection (made by ``make_conn``); the handler hears ``on_close(session)``, and
    any thread may :meth:`send` to a session or :meth:`drop` it.  With no listening
    address (it serves connections handed to it) and made on a thread whose loop
    runs, it serves on that loop instead (see ``__init__``)."""

    def __init__(self, host: str | None, port: int, handler: Any,
                 make_conn: Any, *, thread_name: str = "tcp-server") -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self.make_conn = make_conn
        self.thread_name = thread_name
        self.conns: dict[str, BaseConn] = {}
        # With no listening address, a server made on a thread whose loop runs (an actor
        # on its dispatcher thread: actors.runtime.dispatcher) serves on that loop: the
        # connections handed to a worker are read, handled and written on one thread.
        running = _running_loop() if host is None else None
        self.loop = running or asyncio.new_event_loop()
        self._shared = running is not None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        # Writes and drops from other threads, in order; one loop wake-up per burst
        self._out: list[tuple[BaseConn, Any]] = []  # bytes, None (close), tuple (hand-off)
        self._out_lock = threading.Lock()
        self._out_scheduled = False
        self._out_plain = True  # nothing but bytes is queued
        self._loop_thread = threading.get_ident()  # (the shared loop's: this one)
        self._stopped = False

    def _on_loop_thread(self) -> bool:
        """Whether the caller runs on the shared loop's thread (where no self-pipe
        wake-up is needed, and the loop can be called directly)."""
        return self._shared and threading.get_ident() == self._loop_thread

    def start(self) -> int:
        """Bind and serve; returns the bound port.  (With no host, nothing is bound: the
        loop serves only connections handed to it, :meth:`adopt`.)"""
        if self._shared:
            return self.port
        self._thread = threading.Thread(target=self.loop.run_forever, name=self.thread_name,
                                        daemon=True)
        self._thread.start()
        if self.host is not None:
            # (on the server's own thread: the caller's may be running a loop of its own)
            try:
                self._server = asyncio.run_coroutine_threadsafe(
                    self.loop.create_server(lambda: self.make_conn(self), self.host,
                                            self.port, reuse_address=True, backlog=1024),
                    self.loop).result()
            except BaseException:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
                self._thread = None
                self.loop.close()
                raise
            self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def stop(self, timeout: float = 5.0) -> None:
        self._stopped = True
        if self._shared:  # (on the loop's own thread: its dispatcher closes the loop)
            self._flush_out()  # (what was written before the stop goes first)
            for conn in list(self.conns.values()):
                conn.close()
            self._release()
            self.loop.create_task(self._close_resources())
            return
        if self._thread is None:
            self.loop.close()
            return

        async def _shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self.conns.values()):
                conn.close()
            if self._server is not None:
                await self._server.wait_closed()
            await self._close_resources()

        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result(timeout)
        except Exception:
            log.exception("tcp server shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self.loop.close()

    def _release(self) -> None:
        """What a subclass releases at once as it stops on a shared loop (it takes no
        new connection from then on)."""

    async def _close_resources(self) -> None:
        """What a subclass must release on the loop as it stops."""

    def send(self, session: str, data: bytes) -> None:
        """Write to a connection, from any thread (dropped if it is gone)."""
        conn = self.conns.get(session)
        if conn is not None:
            self._post(conn, data)

    def answer(self, session: str, data: bytes) -> None:
        """:meth:`send` an answer its client waits for before it sends more (a publish's
        OK): on the loop's own thread, at once, with the writes queued before it, not
        at the end of the loop's turn, so that what the client sends next comes in
        while the turn goes on (NSQ's bench_writer has one MPUB in flight a
        connection: its PUB+SUB ran 13-15 % faster)."""
        conn = self.conns.get(session)
        if conn is not None:
            self._post(conn, data, at_once=True)

    def _post(self, conn: BaseConn, data: Any, at_once: bool = False) -> None:
        """Queue a write (``None``: a close; a tuple: a hand-off) for the loop; wake it
        only if no wake-up is already pending (the self-pipe write of
        ``call_soon_threadsafe`` was a tenth of the gateway's dispatcher under load, one
        per delivery batch and answer).  `at_once`: flush now if on the loop's thread
        and only writes are queued."""
        with self._out_lock:
            self._out.append((conn, data))
            self._out_plain = self._out_plain and type(data) is bytes
            at_once = at_once and self._out_plain and self._on_loop_thread()
            if not at_once:
                if self._out_scheduled:
                    return
                self._out_scheduled = True
        if at_once:
            self._flush_out()
            return
        try:
            if self._on_loop_thread():
                self.loop.call_soon(self._flush_out)
            else:
                self.loop.call_soon_threadsafe(self._flush_out)
        except RuntimeError:  # the loop is closed: the server has stopped
            with self._out_lock:
                self._out.clear()
                self._out_scheduled = False

    def _flush_out(self) -> None:
        with self._out_lock:
            out, self._out = self._out, []
            self._out_scheduled = False
            self._out_plain = True
        # Consecutive writes to one connection go out as one (one send syscall)
        parts: list[bytes] = []
        last: BaseConn | None = None
        for conn, data in out:
            if parts and (conn is not last or type(data) is not bytes):
                _write_parts(last, parts)
                parts = []
            last = conn
            if data is None:
                try:
                    conn.close()
                except Exception:
                    log.exception("tcp close of %s failed", getattr(conn, "name", "?"))
            elif type(data) is tuple:  # a hand-off, after the writes before it
                try:
                    conn.hand_off(*data)  # type: ignore[attr-defined]
                except Exception:
                    log.exception("hand-off of %s failed", getattr(conn, "name", "?"))
                    conn.close()
            else:
                parts.append(data)
        if parts:
            _write_parts(last, parts)

    def peer(self, session: str) -> str:
        """``host:port`` of the connection's remote end ("" if it is gone)."""
        conn = self.conns.get(session)
        transport = conn.transport if conn is not None else None
        address = transport.get_extra_info("peername") if transport is not None else None
        if not address:
            return ""
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def details(self, session: str) -> dict[str, Any]:
        """What IDENTIFY switched on: the connection's TLS version, cipher suite and
        client certificate's common name, and ``snappy``/``deflate`` (empty if none did
        or the connection has gone)."""
        conn = self.conns.get(session)
        return dict(getattr(conn, "details", None) or {})

    def hand_off(self, session: str, index: int, state: dict[str, Any]) -> None:
        """From any thread, after the writes queued before it: hand the connection that
        offered itself (its SUB or first publish, ``handler.on_handoff``) to receiver
        `index`."""
        conn = self.conns.get(session)
        if conn is not None:
            self._post(conn, (index, state))

    def drop(self, session: str) -> None:
        conn = self.conns.get(session)
        if conn is not None:
            self._post(conn, None)

    def sessions(self) -> int:
        return len(self.conns)


class TcpServer(LoopServer):
    """NSQ TCP V2's listener: see the module docstring."""

    def __init__(self, host: str | None, port: int, handler: Handler, *, limits: Limits,
                 info: ServerInfo | None = None, ssl_context: ssl.SSLContext | None = None,
                 tls_required: bool = False, auth: AuthServers | None = None,
                 handoff: Sender | None = None) -> None:
        super().__init__(host, port, handler, _Conn)
        self.limits = limits
        self.info = info or ServerInfo()
        self.ssl_context = ssl_context
        self.tls_required = tls_required
        self.auth = auth
        self.handoff = handoff
        self._receiver: Receiver | None = None
        self._http: Any = None

    def adopt_from(self, receiver: Receiver) -> None:
        """Serve the connections other processes hand over through `receiver` (after
        :meth:`start`); it is closed with the server."""
        self._receiver = receiver
        if self._on_loop_thread():
            self.loop.add_reader(receiver.fileno(), self._adopt)  # (a stop may come next)
        else:
            self.loop.call_soon_threadsafe(self.loop.add_reader, receiver.fileno(),
                                           self._adopt)

    def _adopt(self) -> None:
        if self._receiver is None:  # (released: the server stopped)
            return
        for sock, state in self._receiver.receive():
            self.loop.create_task(self._adopt_one(sock, state))

    async def _adopt_one(self, sock: Any, state: dict[str, Any]) -> None:
        try:
            transport, _ = await self.loop.connect_accepted_socket(
                lambda: _Conn(self, state), sock)
        except Exception as e:  # the client went meanwhile, or the state is not ours
            log.info("tcp: a handed-over connection could not be adopted: %s", e)
            sock.close()
            return
        except BaseException:  # cancelled as the loop closes
            sock.close()
            raise
        if self._stopped:  # (it stopped while this one was being adopted)
            transport.close()

    def _release(self) -> None:
        if self._receiver is not None:
            self.loop.remove_reader(self._receiver.fileno())
            self._receiver.close()
            self._receiver = None

    def http_session(self) -> Any:
        """The loop's HTTP client (for the auth servers), made on first use."""
        if self._http is None:
            import aiohttp  # noqa: PLC0415 - only with --auth-http-address

            self._http = aiohttp.ClientSession()
        return self._http

    async def _close_resources(self) -> None:
        self._release()
        if self._http is not None:
            await self._http.close()
            self._http = None
