"""The gateway's side of the client protocols: the broker facade and the listener actors.

The protocol servers in `transport/` know nothing of actors (layering): they
take a *facade* with plain methods (`publish`, `topic_command`, `stats`,
`health`, `info`) and call it from their own threads.  `GatewayFacade`
implements it with asks to the broker's actors, through the process's
endpoint (thread-safe: every thread has its own sockets).

Listeners are actors named ``listener:<protocol>`` that live on the gateway
(placement) and are created by the gateway's boot hook; a listener starts
its server in ``on_start`` and stops it in ``on_stop``.  A listener that
cannot bind its address logs the error and reports it through
``ListenerInfo`` (the broker's ``start()`` refuses to come up, as nsqd exits
when a listen fails) instead of crashing in a restart loop.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import asdict, is_dataclass, replace
from typing import Any

from actors import __version__
from actors.broker import connections, health
from actors.broker.client import (
    ClientAdopted,
    ClientClose,
    ClientFin,
    ClientGone,
    ClientHandoff,
    ClientIdentify,
    ClientProducer,
    ClientPub,
    ClientRdy,
    ClientReq,
    ClientRewind,
    ClientSub,
    ClientTick,
    ClientTouch,
)
from actors.broker.messages import (
    FIND_TIMEOUT,
    Alive,
    ChannelRewind,
    ChannelTags,
    Publish,
    TopicCommand,
    TopicConfig,
    TopicFind,
    TopicStats,
)
from actors.broker.options import BrokerOptions, run_dir_for
from actors.runtime.actor import Actor, current_endpoint
from actors.runtime.control import ControlClient
from actors.runtime.errors import AskTimeout
from actors.runtime.placement import GATEWAY, Placement
from actors.runtime.system import ActorSummary, ListActors
from transport import tls
from transport.auth import AuthServers
from transport.mailbox.envelope import message
from transport.nsq import codec as nsq_codec
from transport.nsq import handoff
from transport.protocol import commands as pc
from transport.protocol.identify import ServerInfo
from transport.protocol.validation import DISK_FAILED, Limits, ProtocolError
from transport.zmq import codec as zmq_codec

REWIND_TIMEOUT = 60.0
"""How long an HTTP rewind waits for its messages to be queued (the rewind goes on
past it: it is kept in the topic's metadata)."""

log = logging.getLogger(__name__)

_COMMANDS = {
    "create": "hello", "delete": "delete", "empty": "empty", "pause": "pause",
    "unpause": "unpause", "create_channel": "create_channel",
    "delete_channel": "delete_channel", "empty_channel": "empty_channel",
    "pause_channel": "pause_channel", "unpause_channel": "unpause_channel",
}


@message
class ListenerInfo:
    """Ask a listener: `{"protocol", "host", "port", "error"}`."""


def _raise(reply: Any) -> None:
    if reply is not None:
        code, text, fatal = reply
        raise ProtocolError(code, text, fatal=fatal)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


HEALTH_TIMEOUT = 1.0
"""Seconds `/ping` waits for every worker to answer."""
LIST_TIMEOUT = 2.0
"""Seconds `/stats` waits for a worker to list its topics (its endpoint answers, not
an actor, so a busy worker answers at once): one restarting or frozen leaves its
topics out of the answer, which says so, rather than holding it back for the ask
timeout and failing it."""


class GatewayFacade:
    """What the protocol servers call; every call is an ask to an actor."""

    def __init__(self, options: BrokerOptions, timeout: float = 10.0) -> None:
        self.options = options
        self.timeout = timeout
        self.placement = Placement(options.workers or 1)
        self.start_time = int(time.time())
        self.ports: dict[str, int] = {}

    def _ask(self, name: str, msg: Any) -> Any:
        return current_endpoint().ask(name, msg, self.timeout)

    def publish(self, topic: str, bodies: list[bytes], defer_ms: int = 0, tag: str = "") -> None:
        reply = self._ask(f"topic:{topic}", Publish(list(bodies), defer_ms, tag=tag))
        health.record_publish(reply)
        _raise(reply)

    def topic_command(self, topic: str, command: str, channel: str = "") -> None:
        if command not in _COMMANDS:
            raise ProtocolError("E_INVALID", f"unknown topic command {command}")
        _raise(self._ask(f"topic:{topic}", TopicCommand(_COMMANDS[command], channel)))

    def channel_tags(self, topic: str, channel: str, tags: list[str] | None,
                     create: bool = False) -> dict[str, Any]:
        reply = self._ask(f"topic:{topic}",
                          ChannelTags(channel, tuple(tags) if tags is not None else None, create))
        if isinstance(reply, tuple):
            _raise(reply)
        return {**reply, "tags": list(reply["tags"])}

    def channel_rewind(self, topic: str, channel: str, since_ns: int = 0,
                       message_id: str = "", *, create: bool = False,
                       tags: list[str] | None = None) -> dict[str, Any]:
        # (a long rewind may outlast an answer: it goes on, kept in the topic's metadata)
        reply = current_endpoint().ask(
            f"topic:{topic}", ChannelRewind(channel, since_ns, message_id, create,
                                            tuple(tags) if tags is not None else None),
            REWIND_TIMEOUT)
        if isinstance(reply, tuple):
            _raise(reply)
        return dict(reply)

    def message(self, topic: str, message_id: str) -> dict[str, Any]:
        reply = current_endpoint().ask(f"topic:{topic}", TopicFind(message_id.encode("ascii")),
                                       FIND_TIMEOUT)
        if isinstance(reply, tuple):
            _raise(reply)
        return dict(reply)

    def topic_config(self, topic: str, values: dict[str, Any] | None) -> dict[str, Any]:
        reply = self._ask(f"topic:{topic}", TopicConfig(values))
        if isinstance(reply, tuple):
            _raise(reply)
        return dict(reply)

    def _topic_actors(self) -> tuple[list[str], list[str]]:
        """Names of the topic actors on every worker that answers (some may be names
        only: asked about, never created, or deleted -- their `TopicStats` answer is
        None), and the workers that did not answer within `LIST_TIMEOUT`."""
        workers = [node for node in self.placement.nodes if node != GATEWAY]
        names: list[str] = []
        silent: list[str] = []
        for node, listed in zip(workers, current_endpoint().ask_nodes(
                [(node, ListActors("topic:")) for node in workers], LIST_TIMEOUT), strict=True):
            if isinstance(listed, AskTimeout):
                silent.append(node)
            elif isinstance(listed, Exception):
                raise listed
            else:
                names.extend(a["name"] for a in listed)
        return sorted(names), silent

    def topics(self, topic: str | None, channel: str | None, include_clients: bool,
               include_storage: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
        """Every topic's stats (or `topic`'s; with `channel`, only that channel's), of
        the workers that answer, and the workers that did not (their topics left out;
        a worker that listed its topics, then stopped answering, is one of them)."""
        listed, silent = self._topic_actors()
        names = [n for n in listed if not topic or n == f"topic:{topic}"]
        replies = current_endpoint().ask_many(
            [(n, TopicStats(include_clients, existing_only=True,
                            include_storage=include_storage)) for n in names], self.timeout)
        topics = []
        node_for = self.placement.node_for
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, AskTimeout):
                silent = silent if node_for(name) in silent else [*silent, node_for(name)]
                continue
            if isinstance(reply, Exception):
                raise reply
            if reply is None:
                continue
            stats = dict(reply)
            chans = [dict(c) for c in stats.get("channels", ())]
            if channel:
                chans = [c for c in chans if c.get("channel_name") == channel]
            stats["channels"] = chans
            topics.append((name, stats))
        return [stats for name, stats in topics if node_for(name) not in silent], silent

    def stats(self, topic: str | None, channel: str | None, include_clients: bool,
              include_storage: bool = False) -> dict[str, Any]:
        # (health is the HTTP API's to add: it asks health() itself)
        topics, silent = self.topics(topic, channel, include_clients, include_storage)
        out: dict[str, Any] = {"version": __version__, "start_time": self.start_time,
                               "topics": topics,
                               "producers": self._producers(topic, silent)
                               if include_clients else None}
        if silent:
            out["nodes_silent"] = silent  # (their topics are not in this answer)
        try:
            with ControlClient(run_dir_for(self.options.data_path), timeout=2.0) as ctl:
                out["processes"] = [_with_usage(_plain(p)) for p in ctl.ps()]
        except Exception as e:
            out["processes_error"] = str(e)
        # Per kind of actor and node, not per actor: 10,000 topics are 50,000 actors
        # (`python -m actors.ctl actors` lists them one by one).
        actors: list[dict[str, Any]] = []
        nodes = [node for node in self.placement.nodes if node not in silent]
        if silent:
            out["actors_error"] = f"{', '.join(silent)} did not answer"
        for node, rows in zip(nodes, current_endpoint().ask_nodes(
                [(node, ActorSummary()) for node in nodes], LIST_TIMEOUT), strict=True):
            if isinstance(rows, Exception):
                out.setdefault("actors_error", f"{node}: {rows}")
            else:
                actors.extend(dict(row) for row in rows)
        out["actors"] = actors
        return out

    def _producers(self, topic: str | None, silent: list[str]) -> list[dict[str, Any]] | None:
        """Connections that published (nsqd's producers), with their `pub_counts`
        (only `topic`'s when asked for one topic); None when there are none, as nsqd.
        (Not those of the `silent` workers.)"""
        endpoint = current_endpoint()
        nodes = [node for node in self.placement.nodes if node not in silent]
        names = [a["name"] for listed in endpoint.ask_nodes(  # (handed-over ones: workers)
                 [(node, ListActors("client:")) for node in nodes], LIST_TIMEOUT)
                 if not isinstance(listed, Exception) for a in listed]
        out = []
        for reply in endpoint.ask_many([(n, ClientProducer()) for n in names], self.timeout):
            if reply is None or isinstance(reply, Exception):
                continue  # never published, or gone meanwhile
            entry = dict(reply)
            if topic:
                entry["pub_counts"] = [c for c in entry["pub_counts"] if c["topic"] == topic]
                if not entry["pub_counts"]:
                    continue
            out.append(entry)
        return out or None

    def health(self) -> str | None:
        """None if a publish can be taken: no storage failure since the last good
        publish (in any process), the NSQ TCP and ZeroMQ listeners are listening,
        every worker's actors answer the gateway (a scanner each, through its
        dispatcher) within a second, and no queue has failed (an fsync error); else
        why not.  (The listeners start beside the HTTP one: a /ping answered OK before
        the TCP port was bound sent a client straight into "connection refused".)"""
        listeners = ["listener:tcp", "listener:zmq"]
        scanners = [f"scanner:{i}" for i in range(self.placement.workers)]
        replies = current_endpoint().ask_many(
            [*((name, ListenerInfo()) for name in listeners),
             *((s, Alive()) for s in scanners)], HEALTH_TIMEOUT)
        for name, reply in zip(listeners, replies[:len(listeners)], strict=True):
            if isinstance(reply, Exception):
                return f"{name} does not answer: {reply}"
            if reply.get("error"):
                return str(reply["error"])
        outcomes = [health.last_publish()]
        for name, reply in zip(scanners, replies[len(listeners):], strict=True):
            if isinstance(reply, Exception):
                node = self.placement.node_for(name)
                return f"{node} does not answer: {reply}"
            failed, last_publish = reply
            if failed:  # queues of that worker whose fsync failed: they take no writes
                return "; ".join(f"{queue}: {DISK_FAILED} - {why}"
                                 for queue, why in sorted(failed.items()))
            outcomes.append(tuple(last_publish))
        return health.latest_reason(outcomes)

    def info(self) -> dict[str, Any]:
        o = self.options
        return {"version": __version__, "broadcast_address": o.broadcast_address,
                "hostname": socket.gethostname(),
                "http_port": self.ports.get("http", split_address(o.http_address)[1]),
                "tcp_port": self.ports.get("tcp", split_address(o.tcp_address)[1]),
                "start_time": self.start_time}


def _with_usage(process: dict[str, Any]) -> dict[str, Any]:
    """A process row with what the OS says of it: RSS, CPU seconds, threads, fds."""
    import psutil  # noqa: PLC0415 - 12 ms of every start, for stats only

    pid = process.get("pid")
    if pid and process.get("alive"):
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                cpu = p.cpu_times()
                process.update(rss_bytes=p.memory_info().rss, cpu_seconds=cpu.user + cpu.system,
                               num_threads=p.num_threads(), open_fds=p.num_fds())
        except psutil.Error:
            pass  # gone meanwhile: the row says what the supervisor knew
    return process


def _plain(obj: Any) -> dict[str, Any]:
    return asdict(obj) if is_dataclass(obj) else dict(obj)


def listener(name: str, options: BrokerOptions) -> Actor:
    """Factory of the ``listener`` kind: the key names the protocol."""
    kind = name.partition(":")[2]
    if kind == "http":
        return HttpListener(name, options)
    if kind in {"zmq", "tcp"}:
        return SocketListener(name, options)
    raise ValueError(f"no listener for protocol {kind!r}")


# ------------------------------------------------------- ZeroMQ and NSQ TCP


class _SessionConnection:
    """A session of a socket loop, as a client actor's `Connection` (any thread may write)."""

    def __init__(self, server: Any, session: str) -> None:
        self.server = server
        self.session = session

    def close(self) -> None:
        self.server.drop(self.session)

    def respond_oks(self, corrs: list[bytes | None]) -> None:
        for corr in corrs:
            self.respond(corr, None)

    @property
    def remote_address(self) -> str:
        return str(self.server.peer(self.session))

    @property
    def details(self) -> dict[str, Any]:
        """TLS version, cipher suite, client certificate common name, snappy/deflate:
        what IDENTIFY switched on (empty: nothing)."""
        details = getattr(self.server, "details", None)
        return details(self.session) if details is not None else {}


class ZmqConnection(_SessionConnection):
    """A ZeroMQ session: replies carry the request's correlation frame."""

    def deliver(self, channel: str, messages: list[bytes]) -> None:
        self.server.deliver(self.session, messages)

    def respond(self, corr: bytes | None, error: Any, payload: bytes | None = None) -> None:
        if error is None:
            self.server.send(self.session, zmq_codec.encode_ok(corr, payload))
        else:
            self.server.send(self.session, zmq_codec.encode_error(
                corr, ProtocolError(error[0], error[1], fatal=error[2])))

    def error(self, error: Any) -> None:
        self.respond(None, error)


class TcpConnection(_SessionConnection):
    """An NSQ TCP V2 connection: replies are response or error frames, in order."""

    def deliver(self, channel: str, messages: list[bytes]) -> None:
        self.server.send(self.session, nsq_codec.encode_messages(messages))

    def respond(self, corr: bytes | None, error: Any, payload: bytes | None = None) -> None:
        if error is None:
            self.server.send(self.session, nsq_codec.encode_response(payload or b"OK"))
        else:
            self.error(error)

    def respond_oks(self, corrs: list[bytes | None]) -> None:
        self.server.answer(self.session, nsq_codec.OK_FRAME * len(corrs))

    def error(self, error: Any) -> None:
        self.server.send(self.session, nsq_codec.encode_error(
            ProtocolError(error[0], error[1], fatal=error[2])))

    def hand_off(self, worker: int, state: dict[str, Any]) -> None:
        """Hand the connection (which offered itself at its SUB or first publish) to
        `worker`."""
        self.server.hand_off(self.session, worker, state)


class ProtocolBridge:
    """Turns a session's commands into messages to its `client:<prefix><session>` actor.

    With `placement` (the NSQ TCP listener of a broker with workers), a plain
    connection that subscribes or first publishes is offered to the worker that holds
    that topic (``on_handoff``; docs/ARCHITECTURE.md, "Connections served by their
    topic's worker"), and a worker's bridge takes such connections in (``on_adopt``)."""

    def __init__(self, prefix: str, connection: Any, placement: Placement | None = None) -> None:
        self.prefix = prefix
        self.connection = connection
        self.placement = placement
        self.server: Any = None

    def actor_name(self, session: str) -> str:
        return f"client:{self.prefix}{session}"

    def _registered(self, session: str) -> str:
        name = self.actor_name(session)
        if connections.lookup(name) is None:
            connections.register(name, self.connection(self.server, session))
        return name

    def on_command(self, session: str, corr: bytes | None, command: Any) -> None:
        name = self._registered(session)
        msg = to_client_message(command, corr)
        if msg is not None:
            current_endpoint().tell(name, msg)

    def on_handoff(self, session: str, command: pc.Sub | pc.Pub | pc.Mpub | pc.Dpub) -> bool:
        """A plain connection's SUB or first publish: hand it to the worker of that
        topic (True), through its client actor, which first answers the publishes
        before it (the offered one included)."""
        if self.placement is None:
            return False
        node = self.placement.node_for(f"topic:{command.topic}")
        current_endpoint().tell(self._registered(session),
                                ClientHandoff(int(node.rpartition("-")[2])))
        return True

    def on_adopt(self, session: str, state: dict[str, Any]) -> None:
        """A connection handed over (on a worker), with its SUB if it subscribed."""
        current_endpoint().tell(self._registered(session), ClientAdopted(state))

    def on_close(self, session: str) -> None:
        name = self.actor_name(session)
        if connections.unregister(name) is not None:
            current_endpoint().tell(name, ClientGone())

    def on_heartbeat(self, session: str) -> None:
        """Heartbeats double as the subscription's lease refresh (see `ClientTick`)."""
        name = self.actor_name(session)
        if connections.lookup(name) is not None:
            current_endpoint().tell(name, ClientTick())


def to_client_message(command: Any, corr: bytes | None) -> Any:
    """The client-actor message for a protocol command (None: nothing to forward)."""
    match command:
        case pc.Pub(topic=topic, body=body, tag=tag):
            return ClientPub(topic, [body], 0, corr, tag)
        case pc.Mpub(topic=topic, bodies=bodies, tag=tag):
            return ClientPub(topic, list(bodies), 0, corr, tag)
        case pc.Pubs(topic=topic, bodies=bodies):
            return ClientPub(topic, list(bodies), 0, corr, answers=len(bodies))
        case pc.Dpub(topic=topic, delay_ms=delay_ms, body=body, tag=tag):
            return ClientPub(topic, [body], delay_ms, corr, tag)
        case pc.Sub(topic=topic, channel=channel):
            return ClientSub(topic, channel, corr)
        case pc.Rewind(topic=topic, channel=channel, since_ns=since_ns, message_id=message_id):
            return ClientRewind(topic, channel, since_ns, message_id, corr)
        case pc.Rdy(count=count):
            return ClientRdy(count)
        case pc.Fin(ids=ids):
            return ClientFin(list(ids))
        case pc.Req(id=msg_id, delay_ms=delay_ms):
            return ClientReq(msg_id, delay_ms)
        case pc.Touch(id=msg_id):
            return ClientTouch(msg_id)
        case pc.Identify(settings=settings):
            if settings is None:
                return ClientIdentify()
            return ClientIdentify(settings.msg_timeout, settings.client_id, settings.hostname,
                                  settings.user_agent, settings.sample_rate)
        case pc.Cls():
            return ClientClose()
        case _:
            return None


class SocketListener(Actor):
    """`listener:zmq` (docs/PROTOCOL.md) or `listener:tcp` (NSQ TCP V2): a socket loop
    started in ``on_start`` with a `ProtocolBridge` to the client actors."""

    def __init__(self, name: str, options: BrokerOptions) -> None:
        super().__init__(name)
        self.options = options
        self.protocol = name.partition(":")[2]
        self.server: Any = None
        self.handoff: handoff.Sender | None = None
        self.error: str | None = None
        self.address = (options.zmq_address if self.protocol == "zmq"
                        else options.tcp_address)

    def _make_server(self, bridge: ProtocolBridge) -> Any:
        limits = Limits.from_options(self.options)
        info = ServerInfo(version=__version__)
        if self.protocol == "zmq":
            from transport.zmq import curve  # noqa: PLC0415
            from transport.zmq.server import ZmqServer  # noqa: PLC0415

            o = self.options
            return ZmqServer(o.zmq_address, bridge, limits=limits,
                             server=replace(info, auth_required=bool(o.auth_http_address)),
                             auth=AuthServers(o.auth_http_address, o.auth_http_request_method)
                             if o.auth_http_address else None,
                             curve=curve.load_or_create_keys(o.zmq_curve_secret_key)
                             if o.zmq_curve_secret_key else None,
                             curve_allowed=curve.load_allowed(o.zmq_curve_allow)
                             if o.zmq_curve_allow else None)
        from transport.nsq.server import TcpServer  # noqa: PLC0415

        host, port = split_address(self.options.tcp_address)
        o = self.options
        if bridge.placement is not None:
            run_dir = current_endpoint().run_dir  # (run_dir_for(o.data_path))
            self.handoff = handoff.Sender([handoff.socket_path(run_dir, i)
                                           for i in range(bridge.placement.workers)])
        return TcpServer(host, port, bridge, limits=limits, handoff=self.handoff,
                         auth=AuthServers(o.auth_http_address, o.auth_http_request_method)
                         if o.auth_http_address else None, **tcp_features(o))

    def on_start(self) -> None:
        # Client actor names carry this listener's life (a random token): the sessions
        # of a restarted gateway count afresh (and ZeroMQ's routing ids repeat), so a
        # name must never be one that a channel still holds for a client of the last life.
        life = os.urandom(3).hex()
        zmq = self.protocol == "zmq"
        # An NSQ TCP connection that subscribes or publishes is handed to that topic's
        # worker, where it costs no hop through this process (without AUTH: its checks
        # live here).
        handing = not zmq and bool(self.options.workers) and not self.options.auth_http_address
        bridge = ProtocolBridge(f"z{life}." if zmq else f"t{life}.",
                                ZmqConnection if zmq else TcpConnection,
                                Placement(self.options.workers or 0) if handing else None)
        try:
            self.server = self._make_server(bridge)
            bridge.server = self.server
            bound = self.server.start()
        except Exception as e:  # reported by ListenerInfo: never a crash loop
            self.error = f"listen ({self.address}) failed: {e}"
            log.error("%s", self.error)
            self.server = None
            return
        if self.protocol == "tcp":
            host, _ = split_address(self.address)
            self.address = f"{host}:{bound}"
        else:
            self.address = bound
        log.info("%s protocol listening on %s", self.protocol, self.address)

    def on_stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.handoff is not None:
            self.handoff.close()
            self.handoff = None

    def on_receive(self, msg: Any) -> Any:
        if isinstance(msg, ListenerInfo):
            return {"protocol": self.protocol, "address": self.address, "error": self.error,
                    "sessions": self.server.sessions() if self.server else 0}
        log.warning("%s: unexpected message %r", self.name, msg)
        return None


def tcp_features(o: BrokerOptions) -> dict[str, Any]:
    """What an NSQ TCP loop offers its clients (IDENTIFY's answer, TLS): the same on
    the gateway's and on the workers' loops, so that a connection handed over at its
    first publish, which may still IDENTIFY, is answered as the gateway would."""
    context = tls.context_for(o)
    return {"info": ServerInfo(version=__version__, tls_v1=context is not None,
                               deflate=o.deflate, snappy=o.snappy,
                               max_deflate_level=o.max_deflate_level,
                               auth_required=bool(o.auth_http_address)),
            "ssl_context": context, "tls_required": o.tls_mode != "false"}


class HandoffListener(Actor):
    """`handoff:<i>`, on worker `i`: serves the NSQ TCP connections the gateway hands
    over (transport.nsq.handoff) when they subscribe to, or first publish to, a topic
    of this worker, with client actors on this worker (``client:w<i>.<life>.<session>``)
    beside the topics and channels they use."""

    def __init__(self, name: str, options: BrokerOptions) -> None:
        super().__init__(name)
        self.options = options
        self.index = int(name.partition(":")[2])
        self.server: Any = None

    def on_start(self) -> None:
        from transport.nsq.server import TcpServer  # noqa: PLC0415

        o = self.options
        try:
            features = tcp_features(o)
        except Exception as e:  # (a certificate it cannot read: the gateway's listener
            # fails on it too, and says so; no connection is handed over here)
            log.error("%s: cannot serve connections: %s", self.name, e)
            return
        bridge = ProtocolBridge(f"w{self.index}.{os.urandom(3).hex()}.", TcpConnection)
        server = TcpServer(None, 0, bridge, limits=Limits.from_options(o), **features)
        bridge.server = server
        server.start()
        try:
            receiver = handoff.Receiver(handoff.socket_path(current_endpoint().run_dir,
                                                            self.index))
        except OSError as e:  # the gateway serves every connection itself meanwhile
            log.error("%s: cannot receive connections: %s", self.name, e)
            server.stop()
            return
        server.adopt_from(receiver)
        self.server = server

    def on_stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def on_receive(self, msg: Any) -> Any:
        if isinstance(msg, ListenerInfo):
            return {"protocol": "tcp-handoff", "error": None if self.server else "not serving",
                    "sessions": self.server.sessions() if self.server else 0}
        log.warning("%s: unexpected message %r", self.name, msg)
        return None


class HttpListener(Actor):
    """`listener:http`: nsqd's HTTP API (transport.http.api) on ``--http-address``, and
    over TLS on ``--https-address`` when it is set."""

    def __init__(self, name: str, options: BrokerOptions) -> None:
        super().__init__(name)
        self.options = options
        self.server: Any = None
        self.https: Any = None
        self.error: str | None = None
        self.host, self.port = split_address(options.http_address)
        self.https_port = 0

    def on_start(self) -> None:
        o = self.options
        facade = GatewayFacade(o)
        address = o.http_address
        try:
            from transport.http.api import HttpServer  # noqa: PLC0415

            limits = Limits.from_options(o)
            auth = (o.auth_http_address, o.auth_http_request_method) \
                if o.auth_http_address else None
            if o.https_address:
                address = o.https_address
                host, port = split_address(o.https_address)
                self.https = HttpServer(facade, limits, host, port,
                                        ssl_context=tls.context_for(o), auth=auth).start()
                self.https_port = facade.ports["https"] = self.https.port
                log.info("HTTPS API listening on %s:%d", host, self.https_port)
            address = o.http_address
            self.server = HttpServer(
                facade, limits, self.host, self.port,
                tls_required_https_port=(lambda: self.https_port)
                if o.tls_mode == "true" else None, auth=auth)
            self.server.start()
        except Exception as e:  # reported by ListenerInfo: never a crash loop
            self.error = f"listen ({address}) failed: {e}"
            log.error("%s", self.error)
            self.on_stop()
            return
        self.port = self.server.port
        facade.ports["http"] = self.port
        log.info("HTTP API listening on %s:%d (pid %d)", self.host, self.port, os.getpid())

    def on_stop(self) -> None:
        for server in (self.server, self.https):
            if server is not None:
                server.stop()
        self.server = self.https = None

    def on_receive(self, msg: Any) -> Any:
        if isinstance(msg, ListenerInfo):
            return {"protocol": "http", "host": self.host, "port": self.port,
                    "https_port": self.https_port, "error": self.error}
        log.warning("%s: unexpected message %r", self.name, msg)
        return None
