"""The Python client library, over the broker's ZeroMQ protocol (docs/PROTOCOL.md).

``Producer`` publishes with acknowledgements; ``Consumer`` subscribes a
handler.  Both talk to one or more brokers (``tcp://host:port`` endpoints)
through DEALER sockets and use the sans-IO codec in
:mod:`transport.zmq.codec`.

Theory of operation
-------------------
**Producer.**  Every request carries a correlation frame (``#<n>``), so a
producer can keep many requests in flight on one socket and match each OK or
ERROR to its request: ``publish`` waits for its own answer, and
``publish_batch`` sends its batches as several MPUBs back to back and then
collects all the answers (internal batching: one round trip for a whole
batch of batches).  Brokers are used round-robin, from a random one.  A
broker that does not answer in ``timeout`` seconds is marked down for a
capped exponential
backoff and the request is retried on the next broker; only the requests
that were not answered are sent again.  When every broker has failed
``max_attempts`` times (and ``retry_for`` seconds have passed, if set) the
call raises ``PublishError`` -- a publish is never dropped silently.  A
broker's refusal (``ERROR E_BAD_TOPIC ...``) is raised at once as
``BrokerRefused`` with nsqd's code.  Each new session starts with IDENTIFY
``packed_messages``; once a broker's answer says it can, MPUBs go as PMPUB
(the bodies in one frame, up to its ``max_body_size``), and a PMPUB refused
as an unknown command (an older broker now behind the endpoint) is sent
again as MPUB on a new session.
A broker drops a session silent for two heartbeat intervals, and a producer
never answers HEARTBEATs: a socket idle for 1.5 intervals (the IDENTIFY
answer's) is replaced, so the next request starts a session that AUTHs again.

**Consumer.**  A session per broker (``connections_per_broker`` of them):
IDENTIFY (heartbeat interval, message timeout, ``packed_messages``), SUB, RDY.
One I/O thread polls every session's socket and calls the handler (a thread
per session cost twice the CPU a message with the 40 sessions of a Spark drain);
FINs, REQs and TOUCHes queued from other threads wake it.  ``close()`` sends
CLS on every session and closes the sockets once each has answered; messages
held unfinished are best given back with ``close(requeue=...)``, whose REQs go
only then (before, another session of the consumer could take them again).
A broker that packs sends each batch of deliveries as one MESSAGES reply (its
messages as columns) and takes the FIN ids of a round in one frame.
``max_in_flight`` is spread across the brokers as RDY.  Each delivered message goes to the
handler; a handler that returns normally FINs the message (FINs are batched
per poll round), one that raises REQs it with a backoff that grows with its
attempts (as go-nsq does), and a long handler can call ``message.touch()``.
With ``auto_finish=False`` the handler only receives; the application calls
``finish()``/``requeue()`` later, from any thread (how the Spark reader FINs a
micro-batch only after it is written).  With ``batches=True`` the handler is
called once for each delivery frame with a ``Delivery``: its messages as columns
(ids, bodies, timestamps, attempts), with no object a message, answered
together (returning FINs them all, raising REQs them all; the Spark reader's
way).
HEARTBEATs are answered with NOP; a broker silent for two heartbeat intervals
is treated as gone and the session is rebuilt with capped backoff.

**Discovery.**  Given ``lookupd_http_addresses``, a consumer asks every lookup
daemon's ``/lookup?topic=`` at start and then every
``lookupd_poll_interval`` seconds (60 s, go-nsq's default; the first repeat
is jittered), opens a session to every broker listed (its ZeroMQ endpoint is
``tcp://<broadcast_address>:<zmq_port>``: our brokers announce ``zmq_port``;
an nsqd without one is skipped, saying so) and closes the sessions of brokers
that no daemon lists any more.  A daemon that does not answer changes
nothing.  ``max_in_flight`` is shared out as RDY over the sessions that are
up (subscribed), at most ``max_rdy_per_connection`` each (``connections_per_broker``
opens more sessions per broker for more in flight), so a broker that dies
leaves its share to the others at once; with more brokers than
``max_in_flight``, RDY 1 goes to a window of them that moves every
``rdy_redistribute_interval`` seconds, as go-nsq redistributes.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from transport.protocol import commands as pc
from transport.protocol.validation import ProtocolError, parse_from
from transport.zmq import curve
from transport.zmq.codec import (
    Columns,
    ErrorReply,
    Messages,
    Ok,
    PackedMessages,
    SizedBodies,
    columns_of,
    encode_request,
    mpub_body_size,
    parse_reply,
    unpack_columns,
)
from transport.zmq.frames import recv_frames, send_frames

log = logging.getLogger(__name__)

MAX_BATCH_BYTES = 4 * 1024 * 1024  # an MPUB's body stays under nsqd's 5 MiB --max-body-size


def split_batches(bodies: Sequence[bytes], batch_size: int,
                  max_bytes: int = MAX_BATCH_BYTES) -> list[Sequence[bytes]]:
    """`bodies` cut into MPUBs of at most `batch_size` whose NSQ-encoded body (4 bytes,
    then 4 + size per message) stays within `max_bytes` (a body larger alone goes
    alone, for the broker to refuse)."""
    batches: list[Sequence[bytes]] = []
    start, size = 0, 4
    for i, body in enumerate(bodies):
        grown = size + 4 + len(body)
        if i > start and (i - start >= batch_size or grown > max_bytes):
            batches.append(bodies[start:i])
            start, grown = i, 8 + len(body)
        size = grown
    if start < len(bodies):
        batches.append(bodies[start:])
    return batches


class ClientError(Exception):
    """Root of the client library's errors."""


class PublishError(ClientError):
    """No broker accepted the publish within the retries (nothing was dropped silently)."""


class BrokerRefused(ClientError):
    """A broker answered ERROR: ``code`` is nsqd's (``E_BAD_TOPIC``, ...)."""

    def __init__(self, code: str, text: str) -> None:
        super().__init__(f"{code} {text}")
        self.code = code
        self.text = text


Curve = tuple[bytes | str, "curve.KeyPair"]  # (the server's public key, our key pair)


def _curve(server_key: bytes | str | None, keypair: Any) -> Curve | None:
    """CURVE settings for a client's sockets (one key pair for all of them)."""
    if server_key is None:
        return None
    return server_key, keypair or zmq.curve_keypair()


def _socket(ctx: zmq.Context[Any], endpoint: str, curve_with: Curve | None = None
            ) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_with is not None:
        curve.client_options(sock, *curve_with)
    sock.connect(endpoint)
    return sock


def _message_count(command: Any) -> int:
    return len(command.bodies) if isinstance(command, pc.Mpub) else 1


@dataclass
class _Broker:
    endpoint: str
    sock: zmq.Socket[Any] | None = None
    down_until: float = 0.0
    failures: int = 0
    packed: bool = False  # its IDENTIFY reply said packed_messages: MPUBs go as PMPUB
    max_body_size: int = 0  # (from the same reply) a larger PMPUB frame would be dropped
    # The broker drops a session silent for two heartbeat intervals (a producer never
    # answers its HEARTBEATs): one idle for 1.5 (from the same reply) is not used again
    idle_after: float = 0.0
    last_sent: float = 0.0


class Producer:
    """Publishes to one or more brokers with acknowledgements; see the module docstring."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 5.0,
                 max_attempts: int = 3, max_backoff: float = 5.0,
                 retry_for: float = 0.0, curve_server_key: bytes | str | None = None,
                 curve_keypair: tuple[bytes, bytes] | None = None,
                 auth_secret: bytes | str | None = None) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps:
            raise ValueError("need at least one broker endpoint")
        self._curve = _curve(curve_server_key, curve_keypair)
        self._auth_secret = auth_secret.encode() if isinstance(auth_secret, str) \
            else auth_secret
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._brokers = [_Broker(e) for e in eps]
        # round-robin from a random broker: many short-lived producers (Spark tasks)
        # spread their first publishes instead of all starting on the first broker
        start = random.randrange(len(eps))
        self._next = itertools.cycle([*range(start, len(eps)), *range(start)])
        self._corr = itertools.count(1)
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.max_backoff = max_backoff
        self.retry_for = retry_for
        self.retried = 0  # messages sent again after a broker failed to answer

    def publish(self, topic: str, body: bytes, tag: str = "") -> None:
        """PUB (TPUB with a `tag`: channels filtering by tag take it or not, #21)."""
        self._call([pc.Pub(topic, body, tag)])

    def multi_publish(self, topic: str, bodies: Sequence[bytes], tag: str = "") -> None:
        self._call([pc.Mpub(topic, tuple(bodies), tag)])

    def deferred_publish(self, topic: str, delay_ms: int, body: bytes, tag: str = "") -> None:
        self._call([pc.Dpub(topic, delay_ms, body, tag)])

    def publish_batch(self, topic: str, bodies: Sequence[bytes], batch_size: int = 200,
                      max_bytes: int = MAX_BATCH_BYTES, tag: str = "") -> None:
        """Publish many bodies as MPUBs of `batch_size`, pipelined: one wait for all.

        An MPUB also stops before its NSQ-encoded body (4 bytes, then 4 + size per
        message) would pass `max_bytes`, so it stays under the broker's
        ``--max-body-size`` (5 MiB by default, as nsqd).
        """
        self.publish_mpubs(topic, split_batches(bodies, batch_size, max_bytes), tag)

    def publish_mpubs(self, topic: str, batches: Sequence[Sequence[bytes]],
                      tag: str = "") -> None:
        """Publish each of `batches` as one MPUB, pipelined: one wait for all.  A batch
        may be a `SizedBodies` (bodies already in MPUB's form, sent as they are)."""
        commands = [pc.Mpub(topic, b if isinstance(b, SizedBodies) else tuple(b), tag)
                    for b in batches if len(b)]
        if commands:
            self._call(commands)

    def _call(self, commands: list[Any]) -> None:
        pending = list(commands)  # _roundtrip removes each request as it is answered
        last_error: Exception | None = None
        give_up = time.monotonic() + self.retry_for
        attempts = 0
        while attempts < self.max_attempts * len(self._brokers) or time.monotonic() < give_up:
            attempts += 1
            broker = self._pick()
            try:
                self._roundtrip(broker, pending)
                broker.failures = 0
                return
            except TimeoutError as e:
                last_error = e
                self.retried += sum(_message_count(c) for c in pending)
                broker.failures += 1
                broker.down_until = time.monotonic() + min(
                    self.max_backoff, 0.05 * 2 ** broker.failures)
                self._reset(broker)
        raise PublishError(f"no broker acknowledged the publish: {last_error}")

    def _pick(self) -> _Broker:
        now = time.monotonic()
        for _ in range(len(self._brokers)):
            b = self._brokers[next(self._next)]
            if b.down_until <= now:
                return b
        b = min(self._brokers, key=lambda x: x.down_until)
        time.sleep(max(0.0, b.down_until - now))
        return b

    def _reset(self, broker: _Broker) -> None:
        if broker.sock is not None:
            broker.sock.close(linger=0)
            broker.sock = None

    def _roundtrip(self, broker: _Broker, commands: list[Any]) -> None:
        """Send `commands` pipelined and collect their answers.

        Each answered command is removed from `commands`, so after a timeout
        the caller retries only what no broker acknowledged.
        """
        waiting: dict[bytes, Any] = {}
        if broker.sock is not None and broker.idle_after \
                and time.monotonic() - broker.last_sent > broker.idle_after:
            # its session is gone, or about to be: with AUTH, a request on the next one
            # would be refused (E_AUTH_FIRST); a new socket IDENTIFYs and AUTHs again
            self._reset(broker)
        if broker.sock is None:
            broker.sock = _socket(self._ctx, broker.endpoint, self._curve)
            # A new session: IDENTIFY (is PMPUB spoken? the requests sent before its
            # answer go as MPUB), then AUTH, each answered before what follows
            broker.packed = False
            waiting[b"#identify"] = None
            send_frames(broker.sock, encode_request(pc.Identify({"packed_messages": True}),
                                                    b"#identify"))
            if self._auth_secret is not None:
                waiting[b"#auth"] = None
                send_frames(broker.sock, encode_request(pc.Auth(self._auth_secret), b"#auth"))
        sock, packed = broker.sock, broker.packed
        for command in commands:
            corr = b"#%d" % next(self._corr)
            waiting[corr] = command
            # (a PMPUB over the broker's --max-body-size goes as MPUB, which it refuses
            # with E_BAD_BODY: ZeroMQ would drop the larger frame without a word)
            send_frames(sock, encode_request(command, corr, packed=packed and isinstance(
                command, pc.Mpub) and mpub_body_size(command.bodies) <= broker.max_body_size))
        broker.last_sent = time.monotonic()
        deadline = time.monotonic() + self.timeout
        refused: BrokerRefused | None = None
        fatal = False
        unpacked: list[Any] = []  # PMPUBs a broker did not know after all
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                raise TimeoutError(f"{broker.endpoint} did not answer in {self.timeout}s")
            reply = parse_reply(recv_frames(sock))
            corr = getattr(reply, "corr", None)
            if corr not in waiting:
                continue  # a heartbeat, or the answer to a request that timed out earlier
            command = waiting.pop(corr)
            if command is not None:
                commands.remove(command)
            elif corr == b"#identify" and isinstance(reply, Ok):
                answer = _identified(reply)
                broker.packed = answer.get("packed_messages") is True
                broker.max_body_size = int(answer.get("max_body_size") or 0)
                broker.idle_after = 1.5 * int(answer.get("heartbeat_interval") or 0) / 1000
            if isinstance(reply, ErrorReply):
                if packed and isinstance(command, pc.Mpub) and reply.error.code == "E_INVALID" \
                        and reply.error.text.startswith("invalid command"):
                    unpacked.append(command)  # (the endpoint now reaches an older broker)
                    continue
                refused = refused or BrokerRefused(reply.error.code, reply.error.text)
                fatal = fatal or reply.error.fatal
                if reply.error.fatal and self._auth_secret is not None:
                    # the broker ended the session: the next one must AUTH again
                    self._reset(broker)
                    raise refused
        if fatal or unpacked:
            self._reset(broker)  # the broker ended the session: the next one starts afresh
        if unpacked:  # sent again as MPUB, on a session that IDENTIFYs again
            commands += unpacked
            self._roundtrip(broker, commands)
        if refused is not None:
            raise refused

    def rewind(self, topic: str, channel: str, start: int | str, *,
               timeout: float = 60.0) -> int:
        """REWIND (#21) on every broker of this producer: each queues again on `channel`
        what its `topic`'s history kept from `start` on -- unix milliseconds, an RFC 3339
        time, or a message id (16 hex characters) -- and this returns how many messages
        they queued in all.  Raises `BrokerRefused` (``E_NOT_RETAINED``: a broker's
        history does not hold all of it) or `PublishError` (no answer in `timeout`).
        The brokers are asked one after the other: a refusal by one comes after those
        before it have queued theirs."""
        since_ns, message_id = parse_from(str(start))
        command = pc.Rewind(topic, channel, since_ns, message_id)
        total = 0
        for broker in self._brokers:
            self._reset(broker)  # (a session of its own: nothing else waits on it)
            sock = broker.sock = _socket(self._ctx, broker.endpoint, self._curve)
            if self._auth_secret is not None:
                send_frames(sock, encode_request(pc.Auth(self._auth_secret), b"#auth"))
            send_frames(sock, encode_request(command, b"#rewind"))
            deadline = time.monotonic() + timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                    self._reset(broker)
                    raise PublishError(f"{broker.endpoint} did not answer REWIND in {timeout}s")
                reply = parse_reply(recv_frames(sock))
                if isinstance(reply, ErrorReply) and reply.corr in (b"#rewind", b"#auth"):
                    self._reset(broker)
                    raise BrokerRefused(reply.error.code, reply.error.text)
                if isinstance(reply, Ok) and reply.corr == b"#rewind":
                    total += int(msgpack.unpackb(reply.payload or b"\x80")["messages"])
                    break
            self._reset(broker)  # (the next publish opens a session that IDENTIFYs)
        return total

    def close(self) -> None:
        for b in self._brokers:
            self._reset(b)
        self._ctx.term()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identified(reply: Ok) -> dict[str, Any]:
    """A broker's IDENTIFY answer ({} if it has none).  ``packed_messages`` says it speaks
    the packed forms (deliveries as columns in a MESSAGES reply, FIN ids in one frame,
    PMPUB): an older broker leaves it out."""
    if not reply.payload:
        return {}
    try:
        answer = msgpack.unpackb(reply.payload)
    except (ValueError, TypeError, msgpack.UnpackException):
        return {}
    return answer if isinstance(answer, dict) else {}


@dataclass(slots=True)
class Message:
    """A delivered message; FIN/REQ/TOUCH go back to the broker that sent it.

    The three calls may come from any thread: they are queued and the
    consumer's I/O thread sends them (within one poll round, 100 ms at most; a
    TOUCH from the handler itself goes at once).
    """

    id: bytes
    body: bytes
    timestamp: int
    attempts: int
    _session: _Session = field(repr=False)
    responded: bool = False

    @property
    def source(self) -> str | None:
        """The endpoint of the broker that delivered it.  Message ids are unique per
        broker only (two brokers with the same node id, e.g. on one host, issue the
        same ids in the same millisecond), so (source, id) names a message."""
        return getattr(self._session, "endpoint", None)

    def finish(self) -> None:
        if not self.responded:
            self.responded = True
            self._session.fins.append(self.id)
            _fins_queued(self._session)

    def requeue(self, delay_ms: int = 0) -> None:
        if not self.responded:
            self.responded = True
            self._session.outbox.append(pc.Req(self.id, delay_ms))
            self._session.consumer.wake()

    def touch(self) -> None:
        self._session.outbox.append(pc.Touch(self.id))
        _touches_queued(self._session)


class Delivery(Columns):
    """The messages of one delivery frame, kept as columns (`Columns`: ids, headers,
    and the bodies split only when asked for): what a ``batches=True`` consumer's
    handler gets.  No object is made a message (a Message each cost a drain's driver
    ~0.5 us a row to make, and more again in garbage collections while two batches of
    them were alive), and they are answered together: ``finish()`` FINs them all in one
    frame's worth of ids, ``requeue()`` and ``touch()`` each of them.  The calls may come
    from any thread, as a Message's.  `split` and `select` make deliveries of some of
    its messages (the reader's batch boundaries, duplicates), to be answered instead of
    it."""

    __slots__ = ("_session", "responded")

    def __init__(self, ids: list[bytes], headers: bytes, sizes: bytes, lines: bytes,
                 bodies: list[bytes] | None = None, *, session: _Session) -> None:
        super().__init__(ids, headers, sizes, lines, bodies)
        self._session = session
        self.responded = False

    @classmethod
    def of(cls, columns: Columns, session: _Session) -> Delivery:
        return cls(columns.ids, columns.headers, columns.sizes, columns.lines,
                   columns._bodies, session=session)

    def _like(self, ids: list[bytes], headers: bytes, sizes: bytes, lines: bytes,
              bodies: list[bytes] | None) -> Delivery:
        return Delivery(ids, headers, sizes, lines, bodies, session=self._session)

    def __repr__(self) -> str:
        return f"<Delivery of {len(self.ids)} from {self.source}>"

    @property
    def source(self) -> str | None:
        """The endpoint of the broker that delivered it (see ``Message.source``)."""
        return getattr(self._session, "endpoint", None)

    def finish(self) -> None:
        if not self.responded:
            self.responded = True
            if self.ids:
                self._session.fins.append(b"".join(self.ids))
                _fins_queued(self._session)

    def requeue(self, delay_ms: int = 0) -> None:
        if not self.responded:
            self.responded = True
            if self.ids:
                self._session.outbox.extend([pc.Req(i, delay_ms) for i in self.ids])
                self._session.consumer.wake()

    def touch(self) -> None:
        if self.ids:
            self._session.outbox.extend([pc.Touch(i) for i in self.ids])
            _touches_queued(self._session)


def _fins_queued(session: _Session) -> None:
    c = session.consumer
    if not c.woken and threading.get_ident() != c.io_ident:
        c.wake()  # (the I/O thread itself sends its FINs after the handler)


def _touches_queued(session: _Session) -> None:
    if threading.current_thread() is session.consumer.io_thread:
        session._flush()  # a long handler touches while it still holds the thread
    else:
        session.consumer.wake()


_SESSION_ENDED = (TimeoutError, zmq.ZMQError, BrokerRefused)
"""What ends a consumer's session (closed, and opened again after its backoff)."""


class _Session:
    """One consumer connection to one broker, run by the consumer's I/O thread."""

    def __init__(self, consumer: Consumer, endpoint: str, rdy: int) -> None:
        self.consumer = consumer
        self.endpoint = endpoint
        self.rdy = rdy
        # the ids to FIN, one or more (a Delivery's) an item: thread-safe appends,
        # drained by the I/O thread
        self.fins: deque[bytes] = deque()
        self.outbox: deque[Any] = deque()
        self.sock: zmq.Socket[Any] | None = None
        self.monitor: zmq.Socket[Any] | None = None
        self.up = False  # subscribed (SUB answered): it gets a share of max_in_flight
        # the broker packs deliveries in one frame, and takes many FIN ids in one (its
        # IDENTIFY reply said packed_messages: an older broker sends MESSAGE frames)
        self.packed = False
        self.fins_per_frame = 500  # (packed: as many as the broker's max_body_size holds)
        self.stop = False  # this session only (its broker left the lookups), or all
        self.backoff = 0.05
        self.retry_at = 0.0  # (no socket: when to open one again)
        self.last_heard = 0.0
        self.cls_sent = False
        self.cls_sent_at = 0.0
        self.cls_done = False  # the broker answered CLS: it delivers nothing more
        self.linger_ms = 0  # (closing the consumer: what was queued last still goes out)

    def send(self, command: Any, corr: bytes | None = None) -> None:
        assert self.sock is not None
        send_frames(self.sock, encode_request(command, corr))

    def open(self, now: float) -> None:
        """A new socket, and the session's first commands: IDENTIFY, AUTH, SUB, RDY."""
        c = self.consumer
        self.packed = False  # (until this broker's IDENTIFY reply says so)
        self.cls_sent = self.cls_done = False
        self.sock = _socket(c.ctx, self.endpoint, c.curve)
        # A DEALER reconnects by itself, but the broker behind it may be a new one that
        # knows nothing of this session: on a disconnect, start the session afresh
        # (IDENTIFY, SUB, RDY) at once rather than after two silent heartbeats.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        c.poller.register(self.sock, zmq.POLLIN)
        c.poller.register(self.monitor, zmq.POLLIN)
        c.owner[self.sock] = c.owner[self.monitor] = self
        self.last_heard = now
        self.send(pc.Identify({"client_id": c.client_id,
                               "heartbeat_interval": c.heartbeat_interval_ms,
                               "msg_timeout": c.msg_timeout_ms, "packed_messages": True,
                               "user_agent": "zmqnsq-python/0.1"}), b"#identify")
        if c.auth_secret is not None:
            self.send(pc.Auth(c.auth_secret), b"#auth")  # (the broker answers it before SUB)
        self.send(pc.Sub(c.topic, c.channel), b"#sub")
        self.send(pc.Rdy(self.rdy))

    def close_socket(self) -> None:
        # Never raises: disable_monitor on a context being terminated raises ETERM, and
        # a socket left open makes the consumer's close() wait forever in Context.term().
        sock, monitor, self.sock, self.monitor = self.sock, self.monitor, None, None
        if sock is None:
            return
        c = self.consumer
        for part in (sock, monitor):
            if part is not None:
                c.owner.pop(part, None)
                with contextlib.suppress(KeyError):
                    c.poller.unregister(part)
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        sock.close(linger=self.linger_ms)

    def failed(self, error: Exception, now: float) -> None:
        """The session ended badly: closed, its RDY share to the others, and opened
        again after a backoff that doubles (from 50 ms, to ``max_backoff``)."""
        c = self.consumer
        log.warning("consumer session with %s ended: %s", self.endpoint, error)
        self.close_socket()
        if self.up:  # its share goes to the sessions still up until it is back
            self.up = False
            self.rdy = 0
            if not c.stopping.is_set():
                c._share_rdy()
        self.retry_at = now + self.backoff
        self.backoff = min(c.max_backoff, self.backoff * 2)

    def tick(self, now: float) -> None:
        """Each round of the I/O loop: send what is queued; CLS once the session is to
        stop; a broker silent for two heartbeat intervals is gone."""
        self._flush()
        if self.stop and not self.cls_sent:
            self.send(pc.Cls(), b"#cls")
            self.cls_sent = True
            self.cls_sent_at = now
        if not self.cls_sent and \
                now - self.last_heard > 2 * self.consumer.heartbeat_interval_ms / 1000:
            assert self.sock is not None
            if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return  # (not silent: a long handler kept the thread from reading it)
            raise TimeoutError(f"{self.endpoint} silent for two heartbeat intervals")

    def readable(self, now: float) -> None:
        """Handle what the broker sent (up to 16 frames, so that one busy broker does
        not starve the others)."""
        assert self.sock is not None
        c = self.consumer
        self.last_heard = now
        for _ in range(16):
            try:
                frames = recv_frames(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            if c.batches and frames[0] == b"MESSAGES":
                if not self.cls_done:
                    try:
                        columns = unpack_columns(frames[1:])
                    except ValueError as e:
                        raise TimeoutError(
                            f"{self.endpoint} sent a malformed reply: {e}") from None
                    self._handle_batch(Delivery.of(columns, self))
                    self._flush()
                continue
            reply = parse_reply(frames)
            if isinstance(reply, PackedMessages | Messages):
                if self.cls_done:
                    continue  # (cannot happen after CLS's OK; a broker that did: ignored)
                if c.batches:  # (MESSAGE frames: a broker that does not pack)
                    self._handle_batch(Delivery.of(columns_of(reply.messages), self))
                else:
                    messages = (reply.columns.messages() if isinstance(reply, PackedMessages)
                                else reply.messages)
                    for m in messages:
                        self._handle(*m)
                self._flush()
            elif isinstance(reply, ErrorReply):
                if reply.error.fatal:
                    raise BrokerRefused(reply.error.code, reply.error.text)
                log.info("broker %s: %s", self.endpoint, reply.error)
            elif isinstance(reply, Ok):
                if reply.corr == b"#cls" and self.cls_sent:
                    self.cls_done = True
                elif reply.corr == b"#identify":
                    answer = _identified(reply)
                    self.packed = answer.get("packed_messages") is True
                    self.fins_per_frame = max(1, min(
                        5000, int(answer.get("max_body_size") or 0) // pc.MSG_ID_LENGTH))
                elif reply.corr == b"#sub" and not self.up:
                    self.up = True
                    self.backoff = 0.05
                    c._share_rdy()
                    self._flush()
            elif isinstance(reply, ProtocolError):
                raise TimeoutError(f"{self.endpoint} sent a malformed reply: {reply}")
            else:  # HEARTBEAT
                self.send(pc.Nop())

    def set_rdy(self, count: int) -> None:
        """A new share of ``max_in_flight`` (sent by the I/O thread)."""
        if count != self.rdy:
            self.rdy = count
            self.outbox.append(pc.Rdy(count))
            self.consumer.wake()

    def _handle(self, msg_id: bytes, timestamp: int, attempts: int, body: bytes) -> None:
        c = self.consumer
        msg = Message(msg_id, body, timestamp, attempts, self)
        try:
            c.handler(msg)
        except Exception:  # the handler failed: REQ with a backoff, as go-nsq does
            log.exception("handler failed on message %s (attempt %d)", msg_id, attempts)
            msg.requeue(c.requeue_delay_ms(attempts))
            return
        if c.auto_finish:
            msg.finish()
        c.handled += 1

    def _handle_batch(self, delivery: Delivery) -> None:
        """`batches=True`: one handler call for a delivery frame's messages, as columns."""
        c = self.consumer
        try:
            c.handler(delivery)
        except Exception:  # the handler failed: REQ each, with the backoff of the most tried
            log.exception("handler failed on %d messages", len(delivery))
            delivery.requeue(c.requeue_delay_ms(max(delivery.attempts)))
            return
        if c.auto_finish:
            delivery.finish()
        c.handled += len(delivery)

    def _flush(self) -> None:
        """Send the queued FINs (500 ids a request; up to 5,000 in one frame to a broker
        that packs) and the other queued commands."""
        fins, outbox = self.fins, self.outbox
        room = (self.fins_per_frame if self.packed else 500) * pc.MSG_ID_LENGTH
        while fins:
            parts, size = [], 0
            while fins and size < room:
                ids = fins.popleft()
                if size + len(ids) > room:  # (the rest goes in the next request)
                    fins.appendleft(ids[room - size:])
                    ids = ids[:room - size]
                parts.append(ids)
                size += len(ids)
            ids = b"".join(parts)
            if self.packed:
                assert self.sock is not None
                send_frames(self.sock, [b"FIN", ids])
            else:
                self.send(pc.Fin(tuple(ids[i:i + pc.MSG_ID_LENGTH]
                                       for i in range(0, size, pc.MSG_ID_LENGTH))))
        while outbox:
            item = outbox.popleft()
            if isinstance(item, threading.Event):
                item.set()  # a marker: everything queued before it has been sent
            else:
                self.send(item)


class Consumer:
    """Subscribes `handler(message)` to `topic`/`channel` on every broker; see the docstring.

    Brokers are given as ZeroMQ `endpoints`, or found through lookup daemons
    (``lookupd_http_addresses``: ``host:port`` of their HTTP API, as go-nsq takes
    them), or both.  See "Discovery" in the module docstring.
    """

    def __init__(self, topic: str, channel: str, handler: Callable[[Any], None],
                 endpoints: str | Sequence[str] = (), *, max_in_flight: int = 200,
                 heartbeat_interval_ms: int = 5000, msg_timeout_ms: int = 60_000,
                 max_requeue_delay_ms: int = 60_000, max_backoff: float = 5.0,
                 client_id: str | None = None, auto_finish: bool = True,
                 batches: bool = False,
                 lookupd_http_addresses: Sequence[str] = (),
                 lookupd_poll_interval: float = 60.0, lookupd_poll_jitter: float = 0.3,
                 rdy_redistribute_interval: float = 5.0,
                 connections_per_broker: int = 1,
                 max_rdy_per_connection: int = 2500,
                 curve_server_key: bytes | str | None = None,
                 curve_keypair: tuple[bytes, bytes] | None = None,
                 auth_secret: bytes | str | None = None) -> None:
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not eps and not lookupd_http_addresses:
            raise ValueError("need at least one broker endpoint or lookupd address")
        self.curve = _curve(curve_server_key, curve_keypair)
        self.auth_secret = auth_secret.encode() if isinstance(auth_secret, str) \
            else auth_secret
        self.topic, self.channel, self.handler = topic, channel, handler
        self.max_in_flight = max_in_flight
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.msg_timeout_ms = msg_timeout_ms
        self.max_requeue_delay_ms = max_requeue_delay_ms
        self.max_backoff = max_backoff
        self.auto_finish = auto_finish
        self.batches = batches
        self.client_id = client_id or f"py-{random.getrandbits(32):08x}"
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.stopping = threading.Event()
        self.handled = 0
        self.static = list(eps)
        self.lookupds = list(lookupd_http_addresses)
        self.poll_interval = lookupd_poll_interval
        self.poll_jitter = lookupd_poll_jitter
        self.redistribute_interval = rdy_redistribute_interval
        self.connections_per_broker = max(1, connections_per_broker)
        self.max_rdy_per_connection = max_rdy_per_connection  # (nsqd's --max-rdy-count)
        self._lock = threading.Lock()  # sessions
        self.sessions: dict[str, _Session] = {}
        self._leaving: list[_Session] = []  # removed (their broker left the lookups)
        self._rotation = 0
        self._paused = False
        self._discovery: threading.Thread | None = None
        # every session's socket, on one thread (a thread each was ~2x the CPU a message
        # with the 40 sessions of a drain)
        self.io_thread = threading.Thread(target=self._io, daemon=True,
                                          name=f"consumer-{topic}/{channel}")
        self.poller = zmq.Poller()
        self.owner: dict[Any, _Session] = {}  # a session's socket or monitor -> it
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.woken = False
        self.io_ident: int | None = None
        self._requeue_at_close: Callable[[], Iterable[Message | Delivery]] | None = None
        for e in eps:
            self._add(e)

    def requeue_delay_ms(self, attempts: int) -> int:
        """The delay of a REQ after a handler failed: it doubles with the attempts
        (from 100 ms), up to ``max_requeue_delay_ms`` (as go-nsq's backoff)."""
        return min(self.max_requeue_delay_ms, 100 * 2 ** min(attempts, 16))

    # -- sessions -------------------------------------------------------------------

    def _add(self, endpoint: str) -> None:
        """``connections_per_broker`` sessions to `endpoint` (opened by the I/O thread),
        unless it has them."""
        added = []
        with self._lock:
            if self.stopping.is_set():
                return
            for i in range(self.connections_per_broker):
                key = f"{endpoint}#{i}"
                if key not in self.sessions:
                    self.sessions[key] = _Session(self, endpoint, 0)
                    added.append(self.sessions[key])
        if added:
            self._share_rdy()
            self.wake()

    def _remove(self, endpoint: str) -> None:
        """Stop the sessions with a broker that left every lookup (CLS, then close)."""
        with self._lock:
            gone = [self.sessions.pop(k) for k in list(self.sessions)
                    if self.sessions[k].endpoint == endpoint]
            for session in gone:
                session.stop = True
            self._leaving.extend(gone)
        if gone:
            log.info("consumer: %s left the lookups; closing its session", endpoint)
            self._share_rdy()
            self.wake()

    def _share_rdy(self) -> None:
        """Spread ``max_in_flight`` over the sessions that are up (subscribed) as RDY, so a
        broker that dies leaves its share to the others at once; with more sessions
        than ``max_in_flight``, RDY 1 to a window of them that rotates (go-nsq's way)."""
        with self._lock:
            sessions = [self.sessions[e] for e in sorted(self.sessions)
                        if self.sessions[e].up]
            rotation = self._rotation
        n = len(sessions)
        if not n:
            return
        if self._paused:
            for session in sessions:
                session.set_rdy(0)
            return
        if n <= self.max_in_flight:
            share, extra = divmod(self.max_in_flight, n)
            for i, session in enumerate(sessions):
                session.set_rdy(min(share + (1 if i < extra else 0),
                                    self.max_rdy_per_connection))
            return
        window = {(rotation + i) % n for i in range(self.max_in_flight)}
        for i, session in enumerate(sessions):
            session.set_rdy(1 if i in window else 0)

    def wake(self) -> None:
        """Have the I/O thread send what another thread queued (a FIN, RDY, a new session,
        close) now rather than at its next round (100 ms)."""
        if not self.woken and self._wake_w >= 0:
            self.woken = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"w")

    def _io(self) -> None:
        """The I/O thread: every session's socket in one poll loop.

        Every 100 ms (or when woken) a round over the sessions: one without a
        socket opens one when its backoff is over; the others send what is queued
        (see ``_Session.tick``).  A session whose broker fails (disconnect,
        silence, refusal, garbage) closes its socket and waits its backoff.  A
        removed session sends CLS and closes on the answer.  When the consumer
        closes, every session sends CLS and the sockets close together once each
        has answered (2 s at most): a socket closing makes its broker requeue its
        in-flight messages, which would go straight to a sibling session still
        open and count an attempt each time."""
        poller, owner = self.poller, self.owner
        self.io_ident = threading.get_ident()
        poller.register(self._wake_r, zmq.POLLIN)
        close_by: float | None = None
        next_round = 0.0
        try:
            while True:
                now = time.monotonic()
                if self.woken or now >= next_round:
                    self.woken = True  # (wakes are not needed while the round runs)
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    stopping, next_round = self._round(now)
                    if stopping and close_by is None:
                        close_by = now + 2.0
                    if close_by is not None and self._closed(now >= close_by):
                        self._last_words()
                        return
                    # (what was queued while the round ran, and did not wake it: at once)
                    self.woken = self._queued()
                wait = 0.0 if self.woken else max(0.0, next_round - time.monotonic())
                for sock, _ in poller.poll(wait * 1000):
                    session = owner.get(sock)
                    if session is None:
                        continue  # (the waker: the next round runs at once)
                    now = time.monotonic()
                    try:
                        if sock is session.monitor:
                            sock.recv_multipart()  # (the event itself says nothing more)
                            if not session.cls_sent:
                                raise TimeoutError(f"{session.endpoint} disconnected")
                        elif session.sock is not None:
                            session.readable(now)
                    except _SESSION_ENDED as e:
                        session.failed(e, now)
        finally:  # (also if something unforeseen ended the loop: a socket left open
            # would make close() wait for ever in Context.term())
            poller.unregister(self._wake_r)
            sessions = self._every_session()
            for session in sessions:
                session.close_socket()

    def _round(self, now: float) -> tuple[bool, float]:
        """Open, tick and retire the sessions.  Whether the consumer is stopping, and
        when the next round is due (in 100 ms, or when a backoff ends)."""
        stopping = self.stopping.is_set()
        due = now + 0.1
        sessions = self._every_session()
        for session in sessions:
            if stopping:
                session.stop = True
            try:
                if session.sock is None and not session.stop:
                    if now < session.retry_at:
                        due = min(due, session.retry_at)
                        continue
                    session.open(now)
                if session.sock is not None:
                    session.tick(now)
            except _SESSION_ENDED as e:
                session.failed(e, now)
                due = min(due, session.retry_at)
        if not stopping:
            with self._lock:
                for session in self._leaving:  # (no answer to CLS in 2 s: closed all the same)
                    if session.cls_done or now > session.cls_sent_at + 2.0:
                        session.close_socket()
                self._leaving = [x for x in self._leaving if x.sock is not None]
        return stopping, due

    def _last_words(self) -> None:
        """Closing, past the CLS barrier: REQ what the caller of close() gives back, send
        every session's queued FINs and REQs, and let those go out as the sockets close
        (a DEALER closed at once drops what it has not sent)."""
        if self._requeue_at_close is not None:
            try:
                for m in self._requeue_at_close():
                    m.requeue(0)
            except Exception:  # (what it could not give back times out at the broker)
                log.exception("consumer: the messages to requeue at close")
        sessions = self._every_session()
        for session in sessions:
            if session.sock is not None:
                try:
                    session._flush()
                except zmq.ZMQError as e:
                    log.warning("consumer: %s at close: %s", session.endpoint, e)
                session.linger_ms = 1000

    def _every_session(self) -> list[_Session]:
        """The sessions, and those removed that have not closed yet."""
        with self._lock:
            return list(self.sessions.values()) + self._leaving

    def _queued(self) -> bool:
        """Whether a session has a FIN or a command waiting to be sent."""
        sessions = self._every_session()
        return any((x.fins or x.outbox) and x.sock is not None for x in sessions)

    def _closed(self, late: bool) -> bool:
        """While closing: whether every session has answered CLS (or has no socket), or
        it is `late`; the loop then ends, and its end closes every socket."""
        sessions = self._every_session()
        return late or all(x.sock is None or x.cls_done for x in sessions)

    # -- discovery ------------------------------------------------------------------

    def _discover(self) -> None:
        """Poll every lookup daemon's /lookup (after a jittered first wait); add the
        brokers that have the topic, remove the ones no daemon lists any more; rotate
        RDY when brokers outnumber ``max_in_flight``."""
        wait = random.random() * self.poll_jitter * self.poll_interval
        next_poll = time.monotonic() + wait
        next_rotation = time.monotonic() + self.redistribute_interval
        while not self.stopping.wait(max(0.0, min(next_poll, next_rotation)
                                         - time.monotonic())):
            now = time.monotonic()
            if now >= next_rotation:
                next_rotation = now + self.redistribute_interval
                if len(self.sessions) > self.max_in_flight:
                    with self._lock:
                        self._rotation += self.max_in_flight
                    self._share_rdy()
            if now >= next_poll:
                next_poll = now + self.poll_interval
                self.poll_lookupds()

    def poll_lookupds(self) -> None:
        """Ask every lookup daemon where the topic lives, now, and follow the answer.
        A daemon that does not answer changes nothing (the others still count)."""
        found: set[str] = set()
        answered = 0
        for address in self.lookupds:
            try:
                producers = lookup(address, self.topic)
            except (OSError, ValueError) as e:
                log.warning("consumer: lookupd %s: %s", address, e)
                continue
            answered += 1
            for p in producers:
                endpoint = zmq_endpoint(p)
                if endpoint is None:
                    log.warning("consumer: broker %s:%s has no ZeroMQ port (nsqd?); "
                                "skipped", p.get("broadcast_address"), p.get("tcp_port"))
                else:
                    found.add(endpoint)
        for endpoint in sorted(found):
            self._add(endpoint)
        if answered:
            with self._lock:
                gone = {s.endpoint for s in self.sessions.values()
                        if s.endpoint not in found and s.endpoint not in self.static}
            for endpoint in gone:
                self._remove(endpoint)

    # -- life -----------------------------------------------------------------------

    def pause(self, timeout: float = 2.0) -> None:
        """RDY 0 on every session; returns once each has sent it (or after `timeout`)."""
        sent = []
        with self._lock:
            self._paused = True
            sessions = list(self.sessions.values())
        for s in sessions:
            s.rdy = 0
            marker = threading.Event()
            s.outbox.extend((pc.Rdy(0), marker))
            sent.append(marker)
        self.wake()
        deadline = time.monotonic() + timeout
        for marker in sent:
            marker.wait(max(0.0, deadline - time.monotonic()))

    def resume(self) -> None:
        """After :meth:`pause`: share ``max_in_flight`` out as RDY again."""
        with self._lock:
            self._paused = False
        self._share_rdy()

    def start(self) -> Consumer:
        if self.lookupds:
            self.poll_lookupds()  # (the first poll at once: the jitter is for the next)
        self.io_thread.start()
        if self.lookupds:
            self._discovery = threading.Thread(target=self._discover, daemon=True,
                                               name=f"consumer-lookupd-{self.topic}")
            self._discovery.start()
        return self

    def close(self, timeout: float = 5.0, *,
              requeue: Callable[[], Iterable[Message | Delivery]] | None = None) -> None:
        """CLS every session; once each has answered, REQ what ``requeue`` returns, send
        what is queued and close the sockets; stop the threads.

        ``requeue`` is called on the I/O thread once no broker delivers to this
        consumer any more, so it sees every message delivered (the Spark reader
        passes those it holds unwritten).  A REQ sent before that could go straight
        to another session of this consumer still subscribed, which takes the
        message at an attempt more, only to give it back as it closes."""
        self._requeue_at_close = requeue
        self.stopping.set()
        self.wake()
        if self.io_thread.is_alive():
            self.io_thread.join(timeout)
        if self._discovery is not None:
            self._discovery.join(timeout)
        self.ctx.term()
        if self._wake_w >= 0 and not self.io_thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def __enter__(self) -> Consumer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookup(address: str, topic: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The producers a lookup daemon (``host:port`` of its HTTP API) lists for `topic`
    (``[]`` for a topic it does not know); OSError or ValueError if it cannot say."""
    return _producers(f"http://{address}/lookup?topic={urllib.parse.quote(topic, safe='')}",
                      timeout)


def nodes(address: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Every live broker a lookup daemon knows (``/nodes``), whatever its topics."""
    return _producers(f"http://{address}/nodes", timeout)


def discover(lookupd_http_addresses: Sequence[str], topic: str | None = None,
             timeout: float = 5.0) -> list[str]:
    """The ZeroMQ endpoints of our brokers the lookup daemons list (that have `topic`,
    or all of them); OSError if no daemon answers."""
    found: set[str] = set()
    errors = []
    for address in lookupd_http_addresses:
        try:
            producers = lookup(address, topic, timeout) if topic else nodes(address, timeout)
        except (OSError, ValueError) as e:
            errors.append(f"{address}: {e}")
            continue
        found.update(e for e in map(zmq_endpoint, producers) if e)
    if errors and len(errors) == len(lookupd_http_addresses):
        raise OSError("no lookup daemon answered: " + "; ".join(errors))
    return sorted(found)


def _producers(url: str, timeout: float) -> list[dict[str, Any]]:
    request = urllib.request.Request(  # noqa: S310 - always http://, built above
        url, headers={"Accept": "application/vnd.nsq; version=1.0"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            body = json.loads(response.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:  # TOPIC_NOT_FOUND
            return []
        raise
    if isinstance(body, dict) and "data" in body:  # (nsqlookupd 0.x's envelope)
        body = body["data"]
    return [p for p in body.get("producers", ()) if isinstance(p, dict)]


def zmq_endpoint(producer: dict[str, Any]) -> str | None:
    """Our ZeroMQ endpoint for a producer of a lookup answer (None: not one of ours)."""
    port = producer.get("zmq_port")
    if not port:
        return None
    host = str(producer.get("broadcast_address") or "127.0.0.1")
    return f"tcp://{host}:{int(port)}"


__all__ = ["BrokerRefused", "ClientError", "Consumer", "Message", "Producer", "PublishError",
           "discover", "lookup", "nodes", "zmq_endpoint"]
