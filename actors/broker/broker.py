"""`python -m actors.broker`: the broker process (nsqd's role), and `Broker` for embedding.

The broker is the actor runtime (`actors.runtime.supervisor`) with the broker's actor
factories:

=================  ==========================================  ====================
name               actor                                       process
=================  ==========================================  ====================
``topic:T``        `actors.broker.topic.TopicActor`            ``crc32(T) % N``
``channel:T/C``    `actors.broker.channel.ChannelActor`        its topic's worker
``diskqueue:*``    `actors.broker.diskqueue.DiskQueueActor`    its owner's worker
``scanner:i``      `actors.broker.scanner.ScannerActor`        worker ``i``
``handoff:i``      `actors.broker.gateway.HandoffListener`     worker ``i``
``client:id``      `actors.broker.client.ClientActor`          gateway
``client:wi.id``   the same, for a connection handed over      worker ``i``
``listener:p``     `actors.broker.gateway` (``http`` ...)      gateway
``statsd:push``    `actors.broker.statsd.StatsdActor`          gateway
=================  ==========================================  ====================

Every node, when it starts and after every restart, creates its scanner and
the topics whose metadata files in ``--data-path`` hash to it (the boot
hook); topics re-create their channels, and every actor recovers its state
from storage in ``on_start``.  An orderly shutdown stops clients first, then
topics, then channels, then the rest, so memory buffers reach the disk-queue
actors before those close their files.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from typing import Any

from actors.broker.channel import ChannelActor
from actors.broker.client import ClientActor
from actors.broker.diskqueue import DiskQueueActor
from actors.broker.errors import BrokerError, from_wire
from actors.broker.gateway import HandoffListener, ListenerInfo, listener
from actors.broker.lookup import LookupActor, lookup_names
from actors.broker.messages import (
    ChannelRewind,
    ChannelTags,
    Publish,
    TopicCommand,
    TopicFind,
    TopicStats,
)
from actors.broker.nodes import NODE_MODULES
from actors.broker.options import BrokerOptions, parse_options, run_dir_for
from actors.broker.scanner import ScannerActor
from actors.broker.statsd import StatsdActor, statsd_names
from actors.broker.topic import TopicActor, topics_on_disk
from actors.runtime.daemon import log_level, serve
from actors.runtime.placement import GATEWAY, Placement
from actors.runtime.supervisor import Supervisor
from storage.dirlock import DirLock
from storage.errors import StorageError

log = logging.getLogger("actors.broker")

STOP_ORDER = ("listener", "handoff", "client", "topic", "channel", "scanner")
LISTENERS = ("tcp", "zmq", "http")
"""In the order the gateway starts them (one after the other, on its dispatcher
thread): HTTP last, so that once ``/ping`` answers every protocol does."""


def boot_names(options: BrokerOptions, node: str, placement: Placement) -> list[str]:
    """The actors `node` must run from the start: its scanner and its topics on disk."""
    if node == GATEWAY:
        return [*(f"listener:{p}" for p in LISTENERS), *lookup_names(options),
                *statsd_names(options)]
    index = node.rpartition("-")[2]
    topics = [f"topic:{t}" for t in topics_on_disk(options.data_path)
              if placement.node_for(f"topic:{t}") == node]
    return [f"scanner:{index}", f"handoff:{index}", *topics]


def factories(options: BrokerOptions) -> dict[str, Any]:
    return {
        "topic": partial(TopicActor, options=options),
        "channel": partial(ChannelActor, options=options),
        "diskqueue": partial(DiskQueueActor, options=options),
        "scanner": partial(ScannerActor, options=options),
        "client": partial(ClientActor, options=options),
        "listener": partial(listener, options=options),
        "handoff": partial(HandoffListener, options=options),
        "lookup": partial(LookupActor, options=options),
        "statsd": partial(StatsdActor, options=options),
    }


class Broker:
    """A running broker: start, talk to its topics, stop.

    ``with Broker(BrokerOptions(data_path="data").resolved()) as b:
    b.publish("orders", [b"hello"])``.
    """

    def __init__(self, options: BrokerOptions) -> None:
        self.options = options.resolved()
        self.lock = DirLock(self.options.data_path)
        self.supervisor: Supervisor | None = None

    def start(self) -> Broker:
        """Lock the data directory, then start every process.

        Raises `DirLockedError` (another broker owns the directory: nothing in it
        was touched), `StorageError` (it cannot be created or written), or
        RuntimeError (after stopping) if a listener cannot bind.
        """
        o = self.options
        # The children of a broker whose supervisor was killed hold the lock for the
        # second they take to stop: wait for them rather than fail.
        self.lock.acquire(wait=o.shutdown_timeout + 2)
        try:
            self.supervisor = Supervisor(
                run_dir_for(o.data_path), factories(o), workers=o.workers,
                shutdown_timeout=o.shutdown_timeout, debug_hooks=o.debug_hooks,
                stop_order=STOP_ORDER, boot=partial(boot_names, o),
                log_level=log_level(o.log_level),
                shared_fds=(self.lock.fd,), preload=NODE_MODULES)
            self.supervisor.start()
            self.listeners = {p: self.supervisor.ask(f"listener:{p}", ListenerInfo(), 30)
                              for p in LISTENERS}
            failed = [info["error"] for info in self.listeners.values() if info["error"]]
            if failed:
                raise RuntimeError("; ".join(failed))
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def zmq_endpoint(self) -> str:
        """The ZeroMQ protocol's bound endpoint (a real port when asked for port 0)."""
        return str(self.listeners["zmq"]["address"])

    @property
    def tcp_address(self) -> str:
        """The NSQ TCP protocol's bound ``host:port``."""
        return str(self.listeners["tcp"]["address"])

    @property
    def http_port(self) -> int:
        """The HTTP API's port (the bound one when ``--http-address`` asked for port 0)."""
        return int(self.listeners["http"]["port"])

    @property
    def https_port(self) -> int:
        """The HTTPS API's port (0 without ``--https-address``)."""
        return int(self.listeners["http"].get("https_port") or 0)

    def stop(self) -> bool:
        """Orderly shutdown; True if every process exited cleanly.  Releases the lock."""
        try:
            return self.supervisor.stop() if self.supervisor is not None else True
        finally:
            self.lock.release()

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- conveniences for embedders and tests (the protocols use the same messages) --

    def publish(self, topic: str, bodies: Sequence[bytes], defer_ms: int = 0,
                timeout: float = 10.0, tag: str = "") -> None:
        """PUB / MPUB / DPUB (with `tag`, tagged); raises `BrokerError` with nsqd's code
        on bad input."""
        _raise(self.supervisor.ask(f"topic:{topic}", Publish(list(bodies), defer_ms, tag=tag),
                                   timeout))

    def channel_tags(self, topic: str, channel: str, tags: Sequence[str] | None = None,
                     create: bool = False, timeout: float = 10.0) -> list[str]:
        """Set (or, `tags` None, read) a channel's tag filter; returns it."""
        reply = self.supervisor.ask(
            f"topic:{topic}",
            ChannelTags(channel, tuple(tags) if tags is not None else None, create), timeout)
        if isinstance(reply, tuple):
            _raise(reply)
        return list(reply["tags"])

    def topic_command(self, topic: str, command: str, arg: str = "",
                      timeout: float = 10.0) -> None:
        _raise(self.supervisor.ask(f"topic:{topic}", TopicCommand(command, arg), timeout))

    def channel_rewind(self, topic: str, channel: str, since_ns: int = 0,
                       message_id: str = "", timeout: float = 60.0) -> int:
        """Queue again on `channel` every retained message published at or after
        `since_ns` (or from `message_id` on); returns how many (#21)."""
        reply = self.supervisor.ask(f"topic:{topic}",
                                    ChannelRewind(channel, since_ns, message_id), timeout)
        if isinstance(reply, tuple):
            _raise(reply)
        return int(reply["messages"])

    def message(self, topic: str, message_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """Where the message `message_id` is, as ``GET /message`` answers it (``body`` as
        bytes); raises `BrokerError` ``E_TOPIC_NOT_FOUND`` / ``E_MESSAGE_NOT_FOUND`` (#21)."""
        reply = self.supervisor.ask(f"topic:{topic}", TopicFind(message_id.encode("ascii")),
                                    timeout)
        if isinstance(reply, tuple):
            _raise(reply)
        return dict(reply)

    def topic_stats(self, topic: str, include_clients: bool = True,
                    timeout: float = 10.0) -> dict[str, Any]:
        return self.supervisor.ask(f"topic:{topic}", TopicStats(include_clients), timeout)


def _raise(reply: Any) -> None:
    if reply is not None:
        raise from_wire(reply)


def main(argv: Sequence[str] | None = None) -> int:
    return serve(argv, parse_options, _starting, log, start_errors=(RuntimeError, StorageError),
                 running=lambda broker: f"broker running (pid {os.getpid()}, HTTP on port "
                                        f"{broker.http_port})",
                 stopping="stopping: flushing memory to disk")


def _starting(options: BrokerOptions) -> Broker:
    broker = Broker(options)
    log.info("starting broker: data path %s, %d workers, node id %d",
             os.path.abspath(options.data_path), broker.options.workers,
             broker.options.node_id)
    return broker


__all__ = ["Broker", "BrokerError", "boot_names", "factories", "main"]
