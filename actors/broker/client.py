"""The client-connection actor: `client:<id>`, one per connected client, on the gateway.

It holds what nsqd's protocol loop keeps per connection -- the subscription,
the RDY count, the negotiated message timeout -- validates the client's
commands against the broker's limits, and forwards them to the channel.
Channels send it ``Deliver`` batches and ``ClientError``s.

Publishes are pipelined: ``ClientPub`` becomes a ``Publish`` told to the
topic with this actor as ``reply_to``; the topic answers ``PublishDone`` and
the answers are sent back in request order (NSQ V2 has no correlation ids,
and a client's publishes may go to topics on different workers).  The
publishes of one run of the inbox are told to each topic as one envelope,
and its FINs to the channel as one ``Fin``, when the run ends
(``on_batch_end``) or before any other command, which keeps every command's
order towards each actor.

What reaches the client goes to its :class:`~actors.broker.connections.Connection`
when a protocol server registered one, otherwise to an *outbox* of
``("message", channel, encoded)``, ``("ok", corr)`` and
``("error", (code, text, fatal))`` entries that tests and embedders drain
with ``ClientTake``.  A fatal error ends the subscription and closes the
connection, as nsqd does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from actors.broker import connections, health
from actors.broker.channel_state import client_entry
from actors.broker.errors import (
    BrokerError,
    PubFailed,
    bad_body,
    bad_channel,
    bad_topic,
    from_wire,
    invalid,
)
from actors.broker.messages import (
    GATHER_MAX,
    ChannelRewind,
    ClientError,
    Deliver,
    Fin,
    Publish,
    PublishDone,
    Rdy,
    Req,
    Sub,
    TopicCommand,
    Touch,
    Unsub,
)
from actors.broker.nsq_message import is_valid_channel_name, is_valid_topic_name
from actors.broker.options import BrokerOptions
from actors.runtime.actor import Actor, no_spawn
from transport.mailbox.envelope import message

log = logging.getLogger(__name__)

PUBLISH_TIMEOUT = 10.0  # seconds a publish may wait for its topic before it fails
SUB_TIMEOUT = 10.0  # seconds a SUB may wait for its topic to create the channel
REWIND_TIMEOUT = 60.0  # seconds a REWIND may wait for its messages to be queued


@message
class ClientIdentify:
    """IDENTIFY: the message timeout (ms; 0 keeps the broker's default) and what the
    client says of itself (shown in /stats as nsqd shows it)."""

    msg_timeout_ms: int = 0
    client_id: str = ""
    hostname: str = ""
    user_agent: str = ""
    sample_rate: int = 0


@message
class ClientSub:
    topic: str
    channel: str
    corr: bytes | None = None


@message
class ClientRewind:
    """REWIND (ZeroMQ, #21): answered ``OK`` with msgpack ``{"messages": N}``."""

    topic: str
    channel: str
    since_ns: int = 0
    message_id: str = ""
    corr: bytes | None = None


@message
class ClientRdy:
    count: int


@message
class ClientFin:
    ids: list[bytes]


@message
class ClientReq:
    id: bytes
    delay_ms: int


@message
class ClientTouch:
    id: bytes


@message
class ClientPub:
    """PUB / MPUB / DPUB from the client; answered OK or with an error, in order
    (`answers` times: PUBs of one read, gathered, are stored as one)."""

    topic: str
    bodies: list[bytes]
    defer_ms: int = 0
    corr: bytes | None = None
    tag: str = ""
    answers: int = 1


@message
class ClientClose:
    """CLS: no more deliveries; messages in flight can still be FINed or REQed."""


@message
class ClientGone:
    """The connection dropped: its in-flight messages go back to the channel at once."""


@no_spawn
@message
class ClientTick:
    """The connection's heartbeat: refresh the subscription's lease with the channel."""


@message
class ClientHandoff:
    """The connection subscribed or first published (its loop paused reading after
    that command): hand it to worker `worker`, which holds the topic, once every
    publish is answered."""

    worker: int


@message
class ClientAdopted:
    """This client's connection was handed over by the gateway: the state of the
    client actor there (``msg_timeout_ms``, ``identity``, ``connect_ts``,
    ``pub_counts``) and, if it was handed over at its SUB, the SUB's ``topic`` and
    ``channel``."""

    state: dict[str, Any]


@message
class ClientTake:
    """Ask: up to `limit` outbox entries, oldest first (removed from the outbox)."""

    limit: int = 1_000_000


@message
class ClientInfo:
    """Ask: the client's state (subscription, RDY, outbox size)."""


@no_spawn
@message
class ClientProducer:
    """Ask: this client as an nsqd /stats producer (with `pub_counts` per topic), or
    None if it never published."""


class ClientActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name)
        self.options = options
        self.clock = clock
        self.msg_timeout_ms = int(options.msg_timeout * 1000)
        self.identity: dict[str, Any] = {}
        self.connect_ts = int(time.time())
        self.channel: str | None = None  # "channel:topic/channel"
        self.rdy = 0
        self.outbox: deque[tuple[Any, ...]] = deque()
        self.closed = False
        self.pub_seq = 0
        # waiting answers, in order: (seq, corr, when sent, how many)
        self.pubs: deque[tuple[int, bytes | None, float, int]] = deque()
        self.pub_done: dict[int, Any] = {}
        self.pub_topics: dict[int, tuple[str, int]] = {}  # seq -> (topic, messages)
        self.pub_counts: dict[str, int] = {}  # topic -> messages published (answered OK)
        # publishes of this run, per topic: told as one envelope each at its end
        self.publishing: dict[str, list[Publish]] = {}
        self.publishing_bodies = 0  # (sent without waiting for the run's end at GATHER_MAX)
        self.finishing: list[bytes] = []  # FINs of this run, told to the channel as one
        self.handoff: ClientHandoff | None = None  # waiting for the publishes' answers

    def on_start(self) -> None:
        if not self.restart_count:
            return
        # Restarted after a crash: the lost instance's subscription, RDY and pending
        # publishes are gone.  Release its in-flight messages and drop the connection,
        # so the client reconnects and starts again from a state both sides know.
        lost = connections.subscription(self.name)
        if lost is not None:
            self.tell(lost, Unsub(self.name))
            connections.remember_subscription(self.name, None)
        if connections.lookup(self.name) is not None:
            log.warning("client actor %s restarted; closing its connection", self.name)
            self._error(invalid("the broker lost this connection's state (its client "
                                "actor restarted); reconnect"))  # fatal: closes

    def on_stop(self) -> None:
        self._send_publishes()
        self._send_fins()
        self._leave()

    def on_batch_end(self) -> None:
        self._send_publishes()
        self._send_fins()

    def _send_fins(self) -> None:
        """Tell the channel this run's FINs as one."""
        if self.finishing:
            ids, self.finishing = self.finishing, []
            if self.channel is not None:
                self.tell(self.channel, Fin(self.name, ids))

    def _send_publishes(self) -> None:
        """Tell each topic this run's publishes to it in one envelope (the topic gathers
        them with other clients' into one fan-out)."""
        if self.publishing:
            publishing, self.publishing = self.publishing, {}
            self.publishing_bodies = 0
            for topic, publishes in publishing.items():
                self.tell_many(topic, publishes)

    def on_receive(self, msg: Any) -> Any:
        if type(msg) not in (ClientPub, ClientFin):
            # anything else reaches its actor after the publishes and FINs before it
            self._send_publishes()
            self._send_fins()
        match msg:
            case Deliver(messages=messages) if self.closed and self.channel is not None:
                # Sent by the channel before it had this client's RDY 0 of its CLS: nsqd
                # sends nothing after CLS, and a ZeroMQ client may have closed its socket
                # once CLS was answered (a DEALER's close cannot be seen), where these
                # would wait, in flight, for the session to be dropped for silence.
                for m in messages:
                    self.tell(self.channel, Req(self.name, m[10:26], 0))
            case Deliver(channel=channel, messages=messages):
                conn = connections.lookup(self.name)
                if conn is not None:
                    conn.deliver(channel, list(messages))
                else:
                    self.outbox.extend(("message", channel, m) for m in messages)
            case PublishDone(corr=seq, error=error):
                health.record_publish(error)
                if self.pubs and seq >= self.pubs[0][0]:  # else: given up on (expired)
                    self.pub_done[seq] = error
                    self._answer_publishes()
            case ClientError(error=error):
                self._error(BrokerError(error[1], fatal=error[2], code=error[0]))
            case ClientTick():
                self._expire_publishes()
                if self.channel is not None:
                    self.tell(self.channel, Rdy(self.name, self.rdy, self.msg_timeout_ms))
            case ClientTake(limit=limit):
                n = min(limit, len(self.outbox))
                return [self.outbox.popleft() for _ in range(n)]
            case ClientProducer():
                if not self.pub_counts:
                    return None
                return {**client_entry(self._stats_info(), state=3 if self.channel else 0),
                        "pub_counts": [{"topic": t, "count": n}
                                       for t, n in sorted(self.pub_counts.items())]}
            case ClientInfo():
                return {"channel": self.channel, "rdy": self.rdy, "outbox": len(self.outbox),
                        "msg_timeout_ms": self.msg_timeout_ms, "closed": self.closed}
            case _:
                try:
                    self._command(msg)
                except BrokerError as e:
                    self._error(e, getattr(msg, "corr", None))
        return None

    def _command(self, msg: Any) -> None:
        o = self.options
        match msg:
            case ClientIdentify(msg_timeout_ms=timeout_ms):
                max_ms = int(o.max_msg_timeout * 1000)
                if timeout_ms and not 1000 <= timeout_ms <= max_ms:
                    raise bad_body(f"IDENTIFY msg timeout ({timeout_ms}) is invalid")
                if timeout_ms:
                    self.msg_timeout_ms = timeout_ms
                self.identity = {"client_id": msg.client_id, "hostname": msg.hostname,
                                 "user_agent": msg.user_agent, "sample_rate": msg.sample_rate}
            case ClientSub(topic=topic, channel=channel, corr=corr):
                if self.channel is not None or self.closed:
                    raise invalid("cannot SUB in current state")
                if not is_valid_topic_name(topic):
                    raise bad_topic(topic, "SUB")
                if not is_valid_channel_name(channel):
                    raise bad_channel(channel, "SUB")
                # The topic creates the channel (and itself) before the OK, so whatever
                # is published or paused after the OK finds it (nsqd's read-your-writes).
                try:
                    reply = self.ask(f"topic:{topic}", TopicCommand("subscribe", channel),
                                     timeout=SUB_TIMEOUT)
                except Exception as e:  # the topic's worker is down or restarting
                    raise invalid(f"SUB failed: {e}") from e
                if reply is not None:
                    raise from_wire(reply)
                self.channel = f"channel:{topic}/{channel}"
                connections.remember_subscription(self.name, self.channel)
                self.tell(self.channel, Sub(self.name, self.msg_timeout_ms, self._stats_info()))
                self._ok(corr)
            case ClientRewind(topic=topic, channel=channel, corr=corr):
                if not is_valid_topic_name(topic):
                    raise bad_topic(topic, "REWIND")
                if not is_valid_channel_name(channel):
                    raise bad_channel(channel, "REWIND")
                # (this actor waits meanwhile, as for SUB; the rewind may take seconds).
                # The channel is created if need be (a drain rebuilding a table from
                # history starts on a new one); the topic must exist: it has the history.
                try:
                    reply = self.ask(f"topic:{topic}",
                                     ChannelRewind(channel, msg.since_ns, msg.message_id,
                                                   create=True),
                                     timeout=REWIND_TIMEOUT)
                except TimeoutError as e:  # (it goes on: kept in the topic's metadata)
                    raise BrokerError(f"REWIND still under way after {REWIND_TIMEOUT:g}s",
                                      code="E_REWIND_IN_PROGRESS", fatal=False) from e
                except Exception as e:  # the topic's worker is down or restarting
                    raise invalid(f"REWIND failed: {e}") from e
                if isinstance(reply, tuple):
                    raise from_wire(reply)
                self._ok(corr, msgpack.packb(dict(reply)))
            case ClientRdy() if self.closed:
                pass  # nsqd ignores RDY after CLS
            case ClientRdy(count=count):
                if self.channel is None:
                    raise invalid("cannot RDY in current state")
                if not 0 <= count <= o.max_rdy_count:
                    raise invalid(f"RDY count {count} out of range 0-{o.max_rdy_count}")
                self.rdy = count
                self.tell(self.channel, Rdy(self.name, count, self.msg_timeout_ms))
            case ClientFin(ids=ids):
                self._require_sub("FIN")
                self.finishing.extend(ids)  # told at the run's end (_send_fins)
            case ClientReq(id=msg_id, delay_ms=delay_ms):
                self._require_sub("REQ")
                max_ms = int(o.max_req_timeout * 1000)
                if not 0 <= delay_ms <= max_ms:
                    raise invalid(f"REQ timeout {delay_ms} out of range 0-{max_ms}")
                self.tell(self.channel, Req(self.name, msg_id, delay_ms))
            case ClientTouch(id=msg_id):
                self._require_sub("TOUCH")
                self.tell(self.channel, Touch(self.name, msg_id))
            case ClientPub(topic=topic, bodies=bodies, defer_ms=defer_ms, corr=corr, tag=tag,
                           answers=answers):
                if not is_valid_topic_name(topic):
                    raise bad_topic(topic, "DPUB" if defer_ms else "PUB")
                self.pub_seq += 1
                self.pubs.append((self.pub_seq, corr, self.clock(), answers))
                self.pub_topics[self.pub_seq] = (topic, len(bodies))
                self._expire_publishes()
                self.publishing.setdefault(f"topic:{topic}", []).append(
                    Publish(list(bodies), defer_ms, self.name, self.pub_seq, tag))
                self.publishing_bodies += len(bodies)
                if self.publishing_bodies >= GATHER_MAX:
                    self._send_publishes()
            case ClientHandoff():
                self.handoff = msg
                self._hand_off()
            case ClientAdopted(state=state):
                self.msg_timeout_ms = int(state["msg_timeout_ms"])
                self.identity = dict(state["identity"])
                self.connect_ts = int(state["connect_ts"])
                self.pub_counts = dict(state["pub_counts"])
                if "channel" in state:
                    self._command(ClientSub(state["topic"], state["channel"]))
            case ClientGone():
                self._leave()
                self.closed = True
                self.stop()  # the connection is gone: so is its actor
            case ClientClose():
                # nsqd's CLS: no more deliveries, but the messages in flight stay this
                # client's to FIN or REQ until it disconnects (which requeues them).
                if self.channel is not None and self.rdy:
                    self.rdy = 0
                    self.tell(self.channel, Rdy(self.name, 0, self.msg_timeout_ms))
                self.closed = True
            case _:
                raise invalid(f"invalid command {type(msg).__name__}")

    def _hand_off(self) -> None:
        """Hand the connection over (ClientHandoff) once no publish waits for its answer,
        so every OK this actor owes is written before the new owner writes SUB's."""
        if self.handoff is None or self.pubs:
            return
        worker, self.handoff = self.handoff.worker, None
        conn = connections.lookup(self.name)
        if conn is None or self.closed:
            return
        # If the hand-off fails, the loop serves the connection here after all; if it
        # works, the connection's close (ClientGone) stops this actor.
        conn.hand_off(worker, {"msg_timeout_ms": self.msg_timeout_ms,
                               "identity": self.identity, "connect_ts": self.connect_ts,
                               "pub_counts": self.pub_counts})

    def _require_sub(self, verb: str) -> None:
        if self.channel is None:
            raise invalid(f"cannot {verb} in current state")

    def _expire_publishes(self) -> None:
        """A publish unanswered for PUBLISH_TIMEOUT (its topic's worker died with it):
        fail it with nsqd's fatal E_PUB_FAILED, which closes the connection, rather than
        hold this and every later answer back forever.  The client publishes again;
        the message may or may not have been stored (at least once)."""
        if self.pubs and self.clock() - self.pubs[0][2] > PUBLISH_TIMEOUT and not self.closed:
            corr = self.pubs[0][1]
            self.pub_done.clear()
            self.pubs.clear()
            self.pub_topics.clear()
            self._error(PubFailed(f"PUB failed: no answer from the topic in "
                                  f"{PUBLISH_TIMEOUT:g}s", fatal=True), corr)

    def _answer_publishes(self) -> None:
        oks: list[bytes | None] = []  # answered with one write
        while self.pubs and self.pubs[0][0] in self.pub_done:
            seq, corr, _, answers = self.pubs.popleft()
            error = self.pub_done.pop(seq)
            topic, count = self.pub_topics.pop(seq, ("", 0))
            if error is None and topic:
                self.pub_counts[topic] = self.pub_counts.get(topic, 0) + count
            if error is None:
                oks.extend([corr] * answers)
                continue
            self._respond_oks(oks)
            oks = []
            for _ in range(1 if error[2] else answers):  # (a fatal one closes)
                self._error(BrokerError(error[1], fatal=error[2], code=error[0]), corr)
        self._respond_oks(oks)
        self._hand_off()

    def _respond_oks(self, corrs: list[bytes | None]) -> None:
        if not corrs:
            return
        conn = connections.lookup(self.name)
        if conn is not None:
            conn.respond_oks(corrs)
        else:
            self.outbox.extend(("ok", corr) for corr in corrs)

    def _stats_info(self) -> dict[str, Any]:
        """What the channel shows of this client in /stats, with nsqd's fields and types
        (nsqd: without IDENTIFY, client_id and hostname are the remote host)."""
        conn = connections.lookup(self.name)
        remote = str(getattr(conn, "remote_address", "")) if conn is not None else ""
        host = remote.rpartition(":")[0].strip("[]") if ":" in remote else remote
        ident = self.identity
        return {"client_id": ident.get("client_id") or host,
                "hostname": ident.get("hostname") or host,
                "version": "V2", "remote_address": remote,
                "connect_ts": self.connect_ts, "sample_rate": ident.get("sample_rate", 0),
                "user_agent": ident.get("user_agent", ""),
                **(getattr(conn, "details", None) or {})}

    def _ok(self, corr: bytes | None, payload: bytes | None = None) -> None:
        conn = connections.lookup(self.name)
        if conn is not None:
            conn.respond(corr, None, payload)
        elif corr is not None:
            self.outbox.append(("ok", corr))

    def _error(self, error: BrokerError, corr: bytes | None = None) -> None:
        conn = connections.lookup(self.name)
        if conn is not None and corr is not None:
            conn.respond(corr, error.to_wire())
        elif conn is not None:
            conn.error(error.to_wire())
        else:
            self.outbox.append(("error", error.to_wire()))
        if error.fatal:
            self._leave()
            self.closed = True
            if conn is not None:
                conn.close()

    def _leave(self) -> None:
        if self.channel is not None:
            self.tell(self.channel, Unsub(self.name))
            self.channel = None
            connections.remember_subscription(self.name, None)
            self.rdy = 0
