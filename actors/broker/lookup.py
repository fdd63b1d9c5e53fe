"""The broker's connections to lookup daemons: a ``lookup:<host:port>`` actor per
``--lookupd-tcp-address`` (nsqd's ``lookupPeer``), on the gateway.

Theory of operation
-------------------
Topics and channels tell every lookup actor what appears and goes
(:func:`announce`: a topic that comes to exist, restored at start included, a
channel created or subscribed, a channel or topic deleted -- ephemeral ones
too, as nsqd does).  Each lookup actor keeps the broker's whole set of
topics and channels, and keeps its lookup daemon told:

* **connect** (at start, and after any failure, with backoff from 0.1 s up
  to the 15 s ping period): the V1 magic and ``IDENTIFY`` with nsqd's fields
  (broadcast address, the bound or ``--broadcast-*-port`` ports, version,
  hostname) plus ``zmq_port`` (the ZeroMQ listener's port, which NSQ clients
  ignore and ours use), then every topic and channel again, as nsqd does:
  ``REGISTER t c`` for each channel, ``REGISTER t`` for a topic with none.
  The daemon's answer to IDENTIFY gives its HTTP address (its broadcast
  address and HTTP port).
* **changes** are sent as they come; the ones queued behind each other go out
  in one write, and their answers are read together.
* **PING** every 15 s; a failed write or read, or an ``E_*`` answer, closes
  the connection and starts the reconnection.  Unlike nsqd, which finds a
  lookup daemon gone only at its next PING, the actor also looks every second
  (a non-blocking ``select``) whether the daemon closed the connection, so a
  restarted daemon is told everything again within about a second.

Each exchange is a blocking socket call with nsqd's 1 s deadline, run on the
node's I/O pool (``Actor.blocking``): the actor parks, the gateway's
dispatcher thread goes on.

**Channels elsewhere.**  When a topic is created (not restored), it asks every
lookup actor which channels the cluster knows for it (``ChannelsOf``: the
daemon's ``GET /channels?topic=``) and creates them before it takes the first
message -- nsqd's way of not dropping messages meant for consumers that are
already subscribed elsewhere.  Ephemeral channels are not created.

A gateway restarted after a crash has lost the set: the lookup actor asks
every topic for its channels when it starts (as ``/stats`` does).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
import urllib.parse
from typing import Any

from actors import __version__
from actors.broker.gateway import ListenerInfo
from actors.broker.messages import TopicStats
from actors.broker.options import BrokerOptions
from actors.runtime.actor import Actor, current_endpoint
from actors.runtime.placement import GATEWAY, Placement
from actors.runtime.system import ListActors
from transport.mailbox.envelope import message
from transport.nsq.lookup_codec import (
    CLOSED,
    Answer,
    Identify,
    LookupClientConnection,
    Ping,
    Register,
    Unregister,
)

__all__ = ["Announce", "ChannelsOf", "LookupActor", "announce", "lookup_names"]

log = logging.getLogger(__name__)

PING_INTERVAL = 15.0
"""nsqd's: a PING to every lookup daemon every 15 s."""
IO_TIMEOUT = 1.0
"""nsqd's deadline for each exchange with a lookup daemon."""
WATCH_INTERVAL = 1.0
"""How often a connection is looked at for the daemon having closed it."""
HTTP_TIMEOUT = 2.0
"""For ``/channels`` when a topic is created."""
_FIRST_RETRY = 0.1


@message
class Announce:
    """A topic (``channel`` empty) or a channel appeared, or (``gone``) went."""

    topic: str
    channel: str = ""
    gone: bool = False


@message
class ChannelsOf:
    """Ask: the channels the lookup daemon knows for `topic` (``[]`` if it cannot say)."""

    topic: str


@message
class _Tick:
    """Ping now (connected), or connect now (not connected)."""

    retry: bool = False


@message
class _Watch:
    """Look whether the daemon closed the connection (every second, without blocking)."""


def lookup_names(options: BrokerOptions) -> list[str]:
    """The lookup actors of a broker with these options."""
    return [f"lookup:{address}" for address in options.lookupd_tcp_address]


def announce(actor: Actor, options: BrokerOptions, topic: str, channel: str = "",
             gone: bool = False) -> None:
    """Tell every lookup actor that `topic` (or its `channel`) appeared or went."""
    for name in lookup_names(options):
        actor.tell(name, Announce(topic, channel, gone))


class LookupActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions) -> None:
        super().__init__(name)
        self.options = options
        self.address = name.partition(":")[2]
        self.topics: dict[str, set[str]] = {}
        self.sock: socket.socket | None = None
        self.codec = LookupClientConnection()
        self.http_address = ""  # the daemon's, from its IDENTIFY answer
        self.pending: list[Register | Unregister] = []
        self.retry_in = _FIRST_RETRY
        self.retry_scheduled = False

    # -- lifecycle ----------------------------------------------------------------

    def on_start(self) -> None:
        self._scan_topics()
        self.tell_later(0, _Tick(retry=True))
        self.retry_scheduled = True
        self.tell_later(PING_INTERVAL, _Tick())
        self.tell_later(WATCH_INTERVAL, _Watch())

    def on_stop(self) -> None:
        self._close()  # (nsqd does not UNREGISTER at shutdown: the daemon sees the EOF)

    def _scan_topics(self) -> None:
        """Fill the set from the topics themselves (a restarted gateway lost it)."""
        endpoint_nodes = [n for n in Placement(self.options.workers or 1).nodes
                          if n != GATEWAY]
        try:
            names: list[str] = []
            for node in endpoint_nodes:
                names.extend(a["name"] for a in current_endpoint().ask_node(
                    node, ListActors("topic:"), 5.0))
            replies = self.ask_many([(n, TopicStats(False, existing_only=True))
                                     for n in names], 10.0)
        except Exception as e:  # (workers still starting: their topics announce themselves)
            log.info("%s: could not list the topics yet (%s)", self.name, e)
            return
        for reply in replies:
            if isinstance(reply, dict):
                self.topics.setdefault(reply["topic_name"], set()).update(
                    c["channel_name"] for c in reply.get("channels", ()))

    # -- messages -----------------------------------------------------------------

    def on_receive(self, msg: Any) -> Any:
        reply = None
        match msg:
            case Announce(topic=topic, channel=channel, gone=gone):
                self._change(topic, channel, gone)
            case _Tick(retry=retry):
                self._tick(retry)
            case _Watch():
                self.tell_later(WATCH_INTERVAL, _Watch())
                if self.sock is not None and _closed_by_peer(self.sock):
                    log.warning("%s: the lookup daemon closed the connection; reconnecting",
                                self.name)
                    self._close()
                    self._connect()
            case ChannelsOf(topic=topic):
                reply = self._channels_of(topic)
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        # nothing queued behind (or a long run gathered): send what gathered, at once
        if self.pending and (self.actor_inbox.qsize() == 0 or len(self.pending) >= 1000):
            commands, self.pending = self.pending, []
            self._exchange(commands)
        return reply

    def _change(self, topic: str, channel: str, gone: bool) -> None:
        channels = self.topics.get(topic)
        if gone:
            if channel:
                if channels is not None:
                    channels.discard(channel)
                command: Register | Unregister = Unregister(topic, channel)
            else:
                self.topics.pop(topic, None)
                command = Unregister(topic)
        else:
            self.topics.setdefault(topic, set())
            if channel:
                self.topics[topic].add(channel)
            command = Register(topic, channel)
        if self.sock is not None:  # (else announced in full at the next connect)
            self.pending.append(command)

    def _tick(self, retry: bool) -> None:
        if retry:
            self.retry_scheduled = False
            if self.sock is None:
                self._connect()
            return
        self.tell_later(PING_INTERVAL, _Tick())
        if self.sock is None:
            self._connect()
        else:
            self._exchange([Ping()])

    # -- the connection -------------------------------------------------------------

    def _identify(self) -> Identify:
        o = self.options
        ports: dict[str, int] = {}
        for protocol in ("tcp", "http", "zmq"):
            info = self.ask(f"listener:{protocol}", ListenerInfo(), 5.0)
            address = str(info.get("address") or "")
            ports[protocol] = int(info.get("port") or address.rpartition(":")[2] or 0)
        return Identify(
            broadcast_address=str(o.broadcast_address), hostname=socket.gethostname(),
            tcp_port=o.broadcast_tcp_port or ports["tcp"],
            http_port=o.broadcast_http_port or ports["http"], version=__version__,
            extra={"zmq_port": ports["zmq"]} if ports["zmq"] else {})

    def _connect(self) -> None:
        try:
            hello = self._identify()
        except Exception as e:  # (listeners not up yet)
            log.info("%s: not ready to identify (%s)", self.name, e)
            self._retry_later()
            return
        commands: list[Any] = [hello]
        for topic, channels in sorted(self.topics.items()):
            if channels:
                commands.extend(Register(topic, c) for c in sorted(channels))
            else:
                commands.append(Register(topic))
        self.codec = LookupClientConnection()
        try:
            self.sock = self.blocking(_dial, self.address)
        except OSError as e:
            log.warning("%s: cannot connect (%s); retrying in %.1fs", self.name, e,
                        self.retry_in)
            self._retry_later()
            return
        answers = self._exchange(commands)
        if answers:
            try:
                reply = answers[0].json()
                self.http_address = f"{reply['broadcast_address']}:{int(reply['http_port'])}"
            except (ValueError, KeyError, TypeError):
                log.warning("%s: IDENTIFY answered %r", self.name, answers[0].data[:200])
                self.http_address = ""
            log.info("%s: connected; announced %d topics", self.name, len(self.topics))
            self.retry_in = _FIRST_RETRY

    def _exchange(self, commands: list[Any]) -> list[Answer]:
        """Send `commands` in one write and read their answers; on any failure, close
        and retry later (an empty list)."""
        sock = self.sock
        if sock is None:
            return []
        data = b"".join(self.codec.send(c) for c in commands)
        try:
            answers = self.blocking(_send_and_read, sock, self.codec, data, len(commands))
        except OSError as e:
            log.warning("%s: %s failed (%s); reconnecting", self.name,
                        type(commands[0]).__name__.upper(), e)
            self._close()
            self._retry_later()
            return []
        refused = [a for a in answers if not a.ok]
        if refused:
            log.warning("%s: lookup daemon answered %s; reconnecting", self.name,
                        refused[0].data[:200])
            self._close()
            self._retry_later()
            return []
        return answers

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.pending = []

    def _retry_later(self) -> None:
        if not self.retry_scheduled:
            self.retry_scheduled = True
            self.tell_later(self.retry_in, _Tick(retry=True))
            self.retry_in = min(self.retry_in * 2, PING_INTERVAL)

    # -- channels elsewhere -----------------------------------------------------------

    def _channels_of(self, topic: str) -> list[str]:
        if not self.http_address:
            return []
        url = (f"http://{self.http_address}/channels?topic="
               f"{urllib.parse.quote(topic, safe='')}")
        try:
            body = self.blocking(_http_get, url)
            return [str(c) for c in json.loads(body).get("channels", ())]
        except (OSError, ValueError, AttributeError) as e:
            log.warning("%s: GET %s failed: %s", self.name, url, e)
            return []


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` (or it failed), without blocking."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _dial(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=IO_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _send_and_read(sock: socket.socket, codec: LookupClientConnection, data: bytes,
                   count: int) -> list[Answer]:
    """Write `data`, then read `count` answers within the deadline (OSError if not)."""
    sock.sendall(data)
    answers: list[Answer] = []
    deadline = time.monotonic() + IO_TIMEOUT * max(1, count // 1000 + 1)
    while len(answers) < count:
        event = codec.next_event()
        if isinstance(event, Answer):
            answers.append(event)
            continue
        if event is CLOSED:
            raise ConnectionError("the lookup daemon closed the connection")
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the lookup daemon closed the connection")
        codec.receive_data(chunk)
    return answers


def _http_get(url: str) -> bytes:
    # (always http://, built from the daemon's IDENTIFY answer)
    import urllib.request  # noqa: PLC0415 - with lookup daemons only, not in every start

    request = urllib.request.Request(  # noqa: S310
        url, headers={"Accept": "application/vnd.nsq; version=1.0"})
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:  # noqa: S310
        return response.read()


