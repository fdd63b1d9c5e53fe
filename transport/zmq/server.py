"""The ZeroMQ protocol's socket loop: one ROUTER, sessions, heartbeats (see docs/PROTOCOL.md).

Theory of operation
-------------------
One thread owns the ROUTER socket bound at ``--zmq-address`` and polls it
together with an ``inproc`` PULL socket.  Any other thread sends replies
with :meth:`ZmqServer.send`, which queues ``(routing id, frames)`` on a
deque and pushes a one-byte wake-up token (under a lock); the loop drains
the tokens and then the deque, and sends each reply's frames to the ROUTER.
A MESSAGE batch of hundreds of frames thus crosses threads as one object,
not as hundreds of inproc frames sent and received again.  ZeroMQ sockets
are not thread-safe, so nothing but the loop touches the ROUTER.

A *session* is a routing id the loop has heard from.  For each one it keeps
the protocol state (:class:`~transport.protocol.validation.ConnectionState`), the
negotiated heartbeat interval, when it last heard from it and when it last
sent it a heartbeat.  Requests are parsed with
:func:`~transport.zmq.codec.parse_request`; the loop answers IDENTIFY,
CLS (CLOSE_WAIT) and protocol errors itself and hands every command to the
*handler* (the broker's bridge), which answers the rest -- SUB's OK once the
channel exists at its topic -- through :meth:`send`.  A fatal error ends
the session after its ERROR is sent; so does silence for two heartbeat
intervals.  Either way the handler
hears ``on_close(session)`` and the routing id starts afresh in INIT.

Sessions are named ``<routing id hex>.<n>`` (``n`` counts the sessions of
that routing id), so the broker's per-session state never outlives a reset.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from transport.auth import ASK_AGAIN, AuthError, AuthServers, AuthState, answer, judge
from transport.auth import ask as auth_ask
from transport.protocol.commands import Auth, Cls, Dpub, Handler, Identify, Mpub, Nop, Pub, Sub
from transport.protocol.identify import IdentifySettings, ServerInfo
from transport.protocol.validation import ConnectionState, Limits, ProtocolError
from transport.zmq import curve as curve_keys
from transport.zmq.codec import (
    encode_error,
    encode_heartbeat,
    encode_identify_reply,
    encode_messages,
    encode_ok,
    encode_packed_messages,
    parse_request,
)
from transport.zmq.frames import recv_frames, send_frames

log = logging.getLogger(__name__)

_ids = itertools.count()


@dataclass
class _Session:
    name: str
    state: ConnectionState
    heartbeat_ms: int
    last_heard: float
    last_beat: float
    settings: IdentifySettings | None = None
    extra: dict[str, object] = field(default_factory=dict)
    auth_state: AuthState | None = None
    secret: str = ""
    waiting: list[Any] | None = None  # (corr, command)s held while the auth server is asked


class ZmqServer:
    """See the module docstring."""

    def __init__(self, address: str, handler: Handler, *, limits: Limits,
                 server: ServerInfo | None = None, max_frame: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 curve: curve_keys.KeyPair | None = None,
                 curve_allowed: frozenset[bytes] | None = None,
                 auth: AuthServers | None = None) -> None:
        self.address = address
        self.handler = handler
        self.limits = limits
        self.server = server or ServerInfo()
        self.max_frame = max_frame or (limits.max_body_size + 1024)
        self.clock = clock
        self.endpoint = ""
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._router.setsockopt(zmq.SNDHWM, 100_000)
        # NSQ AUTH (transport/auth.py): the auth servers are asked on a small pool; the
        # answers come back to the loop through _answers (and a wake-up)
        self.auth = auth
        self._encrypted = curve is not None
        self._asking: ThreadPoolExecutor | None = None
        self._answers: deque[tuple[bytes, str, bytes | None, bool, Any]] = deque()
        # CURVE (transport/zmq/curve.py): the ZAP handler checks keys in the handshake
        self._zap = None
        if curve is not None:
            self._zap = curve_keys.start_authenticator(self._ctx, curve_allowed)
            curve_keys.server_options(self._router, curve)
        self._out_addr = f"inproc://zmq-server-out-{next(_ids)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._out_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self._out_addr)
        self._push_lock = threading.Lock()
        # (routing id, frames) to send, or (None, session name) to drop; in order
        self._outq: deque[tuple[bytes | None, Any]] = deque()
        self._sessions: dict[bytes, _Session] = {}
        self._generation: dict[bytes, int] = {}
        self._by_name: dict[str, bytes] = {}
        self._drop_requests: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- lifecycle

    def start(self) -> str:
        """Bind and start the loop; returns the bound endpoint (a real port for port 0)."""
        host, _, port = self.address.rpartition(":")
        self._router.bind(f"{host}:*" if port == "0" else self.address)
        self.endpoint = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._loop, name="zmq-server", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake()  # (the loop may be in a poll with a timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        with self._push_lock:
            self._push.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        if self._asking is not None:
            self._asking.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)

    # ----------------------------------------------------------------- sending

    def peer(self, session: str) -> str:
        """A ROUTER does not tell a peer's address: the session's routing id, as
        ``zmq:<hex>``, names the remote end."""
        return f"zmq:{session.partition('.')[0]}" if session in self._by_name else ""

    def send(self, session: str, frames: list[bytes]) -> None:
        """Send a reply to a session, from any thread (dropped if the session is gone)."""
        rid = self._by_name.get(session)
        if rid is None:
            return
        self._outq.append((rid, frames))
        self._wake()

    def deliver(self, session: str, messages: list[bytes]) -> None:
        """Send NSQ-encoded messages to a session, from any thread: ``MESSAGE`` frames, or
        one ``MESSAGES`` frame if it asked for ``packed_messages`` (docs/PROTOCOL.md 1.5)."""
        rid = self._by_name.get(session)
        s = None if rid is None else self._sessions.get(rid)
        packed = s is not None and s.settings is not None and s.settings.packed_messages
        self.send(session, encode_packed_messages(messages) if packed
                  else encode_messages(messages))

    def drop(self, session: str) -> None:
        """End a session from any thread (after a fatal error the broker found)."""
        self._outq.append((None, session))
        self._wake()

    def _wake(self) -> None:
        with self._push_lock:
            if not self._push.closed:
                # a full token queue means the loop has wake-ups pending anyway
                with contextlib.suppress(zmq.Again):
                    self._push.send(b"", zmq.NOBLOCK)

    # -------------------------------------------------------------------- loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        router, pull = self._router, self._pull
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(0 if self._outq else self._poll_timeout_ms()))
                if pull in events:
                    with contextlib.suppress(zmq.Again):
                        for _ in range(10_000):
                            pull.recv(zmq.NOBLOCK)  # wake-up tokens
                self._outgoing()
                if self._answers:
                    self._auth_answers()
                if router in events:
                    for _ in range(1000):
                        try:
                            frames = recv_frames(router, zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._incoming(frames[0], frames[1:])
                self._heartbeats(self.clock())
        except zmq.ContextTerminated:
            pass
        finally:
            for rid in list(self._sessions):
                self._close(rid, notify=True)
            router.close(linger=0)
            pull.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        """Until the next heartbeat is due (at most 100 ms, so stop() is prompt)."""
        due = [s.last_beat + s.heartbeat_ms / 1000 for s in self._sessions.values()
               if s.heartbeat_ms > 0]
        if not due:
            return 100
        return max(1, min(100, int((min(due) - self.clock()) * 1000)))

    def _outgoing(self) -> None:
        """Send what other threads queued (at most 5,000 replies, then read requests)."""
        outq, router, sessions = self._outq, self._router, self._sessions
        for _ in range(min(len(outq), 5000)):
            rid, frames = outq.popleft()
            if rid is None:  # drop(session)
                rid = self._by_name.get(frames)
                if rid is not None:
                    self._close(rid, notify=True)
            elif rid in sessions:
                send_frames(router, [rid, *frames])

    def _session(self, rid: bytes) -> _Session:
        s = self._sessions.get(rid)
        if s is None:
            gen = self._generation.get(rid, 0) + 1
            self._generation[rid] = gen
            now = self.clock()
            s = _Session(f"{rid.hex()}.{gen}", ConnectionState(),
                         self.limits.client_timeout // 2, now, now)
            self._sessions[rid] = s
            self._by_name[s.name] = rid
        return s

    def _incoming(self, rid: bytes, frames: list[bytes]) -> None:
        s = self._session(rid)
        s.last_heard = self.clock()
        corr, command = parse_request(frames, self.limits, s.state, self.server)
        if s.waiting is not None:  # the auth server is being asked: in order, after it
            s.waiting.append((corr, command))
            return
        self._dispatch(rid, s, corr, command)

    def _dispatch(self, rid: bytes, s: _Session, corr: bytes | None, command: Any) -> None:
        if isinstance(command, ProtocolError):
            self._router.send_multipart([rid, *encode_error(corr, command)])
            if command.fatal:
                self._close(rid, notify=True)
            return
        match command:
            case Nop():
                return
            case Identify(settings=settings):
                s.settings = settings
                s.heartbeat_ms = settings.heartbeat_interval
                self._router.send_multipart([rid, *encode_identify_reply(corr, command)])
            case Cls():
                self._router.send_multipart([rid, *encode_ok(corr, b"CLOSE_WAIT")])
            case Auth(secret=secret):
                self._auth(rid, s, corr, secret)
                return
            case Pub(topic=topic) | Mpub(topic=topic) | Dpub(topic=topic) | Sub(topic=topic):
                if self.auth is not None and not self._authorized(rid, s, corr, command,
                                                                  topic):
                    return
        try:
            self.handler.on_command(s.name, corr, command)
        except Exception:  # a broken handler must not take the listener down
            log.exception("zmq handler failed on %s from %s", type(command).__name__, s.name)

    # ------------------------------------------------------------------- AUTH

    def _fail(self, rid: bytes, corr: bytes | None, code: str, text: str) -> None:
        self._router.send_multipart([rid, *encode_error(corr, ProtocolError(code, text,
                                                                            fatal=True))])
        self._close(rid, notify=True)

    def _auth(self, rid: bytes, s: _Session, corr: bytes | None, secret: bytes) -> None:
        if self.auth is None:
            self._fail(rid, corr, "E_AUTH_DISABLED", "AUTH disabled")
        elif s.auth_state is not None and s.auth_state.authorizations:
            self._fail(rid, corr, "E_INVALID", "AUTH already set")
        else:
            s.secret = secret.decode("utf-8", "replace")
            self._ask(rid, s, corr, None)

    def _authorized(self, rid: bytes, s: _Session, corr: bytes | None, command: Any,
                    topic: str) -> bool:
        """As NSQ TCP's (transport/nsq/server.py): refused, asked again, or allowed."""
        verdict = judge(s.auth_state, type(command).__name__.upper(), topic,
                        command.channel if isinstance(command, Sub) else "", self.clock())
        if verdict == ASK_AGAIN:
            self._ask(rid, s, corr, command)
        elif verdict is not None:
            self._fail(rid, corr, *verdict)
        return verdict is None

    def _ask(self, rid: bytes, s: _Session, corr: bytes | None, then: Any) -> None:
        """Ask the auth servers on the pool, holding the session's requests meanwhile;
        `then` (a command whose TTL had passed) runs first after the answer, or (None)
        the answer goes to AUTH."""
        assert self.auth is not None
        s.waiting = [] if then is None else [(corr, then)]
        if self._asking is None:
            self._asking = ThreadPoolExecutor(4, thread_name_prefix="zmq-auth")
        name, servers, secret = s.name, self.auth, s.secret

        def ask() -> None:
            try:
                result: Any = auth_ask(servers, remote_ip="", tls=self._encrypted,
                                       secret=secret, common_name="", clock=self.clock)
            except AuthError as e:
                result = e
            except Exception as e:  # (never lose the answer: the session waits for it)
                log.exception("asking the auth servers failed")
                result = AuthError(str(e))
            self._answers.append((rid, name, corr, then is None, result))
            self._wake()

        self._asking.submit(ask)

    def _auth_answers(self) -> None:
        while self._answers:
            rid, name, corr, answer_auth, result = self._answers.popleft()
            s = self._sessions.get(rid)
            if s is None or s.name != name:
                continue  # the session went meanwhile
            if isinstance(result, AuthError):
                log.warning("zmq session %s: AUTH failed %s", name, result)
                s.waiting = None
                self._fail(rid, corr, "E_AUTH_FAILED", "AUTH failed")
                continue
            s.auth_state = result
            reply = answer(result)
            if isinstance(reply, tuple):
                s.waiting = None
                self._fail(rid, corr, *reply)
                continue
            s.extra.update(auth_identity=result.identity,
                           auth_identity_url=result.identity_url)
            if answer_auth:
                self._router.send_multipart([rid, *encode_ok(corr, msgpack.packb(reply))])
            waiting, s.waiting = s.waiting or [], None
            for i, (c, command) in enumerate(waiting):
                if self._sessions.get(rid) is not s:
                    break
                if s.waiting is not None:  # asked again (a TTL passed): the rest waits
                    s.waiting.extend(waiting[i:])
                    break
                self._dispatch(rid, s, c, command)

    def _heartbeats(self, now: float) -> None:
        for rid, s in list(self._sessions.items()):
            if s.heartbeat_ms <= 0:
                continue
            interval = s.heartbeat_ms / 1000
            if now - s.last_heard > 2 * interval:
                log.info("zmq session %s silent for two heartbeat intervals: dropped", s.name)
                self._close(rid, notify=True)
            elif now - s.last_beat >= interval:
                s.last_beat = now
                self._router.send_multipart([rid, *encode_heartbeat()])
                try:
                    self.handler.on_heartbeat(s.name)
                except Exception:
                    log.exception("zmq handler failed on a heartbeat of %s", s.name)

    def _close(self, rid: bytes, *, notify: bool) -> None:
        s = self._sessions.pop(rid, None)
        if s is None:
            return
        self._by_name.pop(s.name, None)
        if notify:
            try:
                self.handler.on_close(s.name)
            except Exception:
                log.exception("zmq handler failed closing %s", s.name)

    def sessions(self) -> int:
        return len(self._sessions)
