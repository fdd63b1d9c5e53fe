"""A node: one child process (gateway or worker) hosting many actors.

Theory of operation
-------------------
The supervisor starts each node with ``multiprocessing``'s fork server (a
fork of a single-threaded process that holds no ZeroMQ context, its imports
done: :mod:`actors.runtime.forkserver`) and passes a picklable
:class:`NodeSpec`.  :func:`node_main` then

1. ignores SIGINT (the supervisor orchestrates shutdown) and turns SIGTERM
   into an orderly stop, then unblocks the two (the fork server keeps them
   blocked: a SIGTERM that came before the handler is delivered now);
2. creates the :class:`Node`, its :class:`~actors.runtime.dispatcher.Dispatcher`
   (the few threads every actor of the node runs on) and its
   :class:`~actors.runtime.endpoint.Endpoint`, binding
   ``ipc://<run_dir>/<node>.sock`` (replacing the dead predecessor's socket
   file after a restart);
3. waits for SIGTERM, then shuts down: stop intake (the dispatcher stops
   reading), ask every actor to stop *after* the messages already in its
   inbox (so ``on_stop`` can flush and close storage), wait for them until
   the deadline, stop the dispatcher, close sockets, exit 0.

Actors are created in two ways, both through the per-prefix ``factories``
(``{"topic": TopicActor, ...}``, each called as ``factory(name)``):

* on demand, when a message arrives for a name this node does not host yet;
* by an explicit :class:`~actors.runtime.system.Spawn` request, which the supervisor
  records and replays after the node restarts (so actors that must run
  without being messaged, e.g. one recovering a queue, come back).

An actor exceeding its restart intensity makes the node exit with
:data:`~actors.runtime.options.EXIT_ESCALATED`; the supervisor restarts the node.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field
from multiprocessing import reduction
from multiprocessing.connection import wait
from typing import Any

from pykka import ActorDeadError
from pykka._envelope import Envelope as PykkaEnvelope
from pykka.messages import _ActorStop

from actors.runtime.actor import Actor, bind_endpoint, spawns
from actors.runtime.dispatcher import Dispatcher
from actors.runtime.endpoint import Endpoint
from actors.runtime.errors import DebugHooksDisabled, MailboxFull, RuntimeNotRunning, UnknownActor
from actors.runtime.inbox import Batch
from actors.runtime.options import EXIT_ESCALATED, LOG_FORMAT, RuntimeOptions
from actors.runtime.placement import Placement, split_name
from actors.runtime.slot import ActorSlot, RestartIntensity
from actors.runtime.system import ActorSummary, Crash, ListActors, Ping, Spawn
from transport.mailbox.envelope import frozen

__all__ = ["Node", "NodeSpec", "node_main", "stdio_fds"]

logger = logging.getLogger(__name__)

Factories = Mapping[str, Callable[[str], Actor]]

_GC_THRESHOLDS = (20_000, 20, 20)
"""Messages are acyclic and short-lived; collecting generation 0 every 700
allocations (the default) costs a measurable share of a busy node's CPU."""


@frozen
class NodeSpec:
    """Everything a node process needs; pickled into the child."""

    node: str
    """Node name (``gateway`` or ``worker-<i>``); also its socket's file name."""
    run_dir: str
    """Directory of the ipc sockets."""
    options: RuntimeOptions
    """Runtime options (the worker count fixes placement)."""
    factories: Factories = field(default_factory=dict)
    """Actor factories by name prefix (``kind`` of ``kind:key``); ``*`` matches any."""
    log_level: int = logging.WARNING
    """Logging level of the child process."""
    boot: Callable[[str, Placement], list[str]] | None = None
    """Called as ``boot(node, placement)`` when the node starts (and after every
    restart): the names it returns are created at once.  The broker uses it to
    bring back the topics and scanner that live on this node from its data
    directory, which survives the supervisor too."""
    shared_fds: tuple[SharedFd, ...] = ()
    """File descriptors the node holds open for its whole life (the data
    directory's lock: held until the last process of the runtime exits)."""
    stdio: tuple[SharedFd | None, SharedFd | None] = (None, None)
    """The supervisor's stdout and stderr when it started the node: the node
    writes there, not to those of the fork server it came from (which was
    started earlier, e.g. while pytest was not capturing)."""


class SharedFd:
    """A file descriptor handed to a node process: pickled by the fork server's Popen,
    which passes the descriptor itself to the child (as multiprocessing does for pipes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_shared_fd, (reduction.DupFd(self.fd),))


def _shared_fd(dup: Any) -> SharedFd:
    return SharedFd(dup.detach())


def stdio_fds() -> tuple[SharedFd | None, SharedFd | None]:
    """This process's stdout and stderr, to hand to a node (None for a closed one)."""

    def shared(fd: int) -> SharedFd | None:
        try:
            os.fstat(fd)
        except OSError:
            return None
        return SharedFd(fd)

    return shared(1), shared(2)


class Node:
    """Hosts actor slots and answers system requests; implements the endpoint's Host."""

    def __init__(self, spec: NodeSpec, escalate: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.options = spec.options
        self._factories = dict(spec.factories)
        self._slots: dict[str, ActorSlot] = {}
        self._lock = threading.Lock()  # taken only to create slots, never per message
        self._stopping = False
        # During a shutdown, the stop-order phase under way: an actor of a kind that
        # stops later may still be created (a topic flushing its memory at stop
        # creates its disk-queue actor), one of this kind or an earlier one may not.
        self._phase = -1
        self._stop_order = {kind: i for i, kind in enumerate(self.options.stop_order)}
        self._escalate = escalate or _exit_escalated
        self.placement = Placement(spec.options.workers)
        self.dispatcher = Dispatcher(spec.node, threads=spec.options.dispatcher_threads,
                                     io_threads=spec.options.io_threads)
        self.dispatcher.start()
        self.endpoint = Endpoint(spec.node, spec.run_dir, self.placement, spec.options, host=self,
                                 dispatcher=self.dispatcher)
        bind_endpoint(self.endpoint)

    def boot(self) -> None:
        """Create the actors named by the spec's boot hook (logged, never fatal)."""
        if self.spec.boot is None:
            return
        try:
            names = self.spec.boot(self.spec.node, self.placement)
        except Exception:
            logger.exception("%s: boot hook failed", self.spec.node)
            return
        for name in names:
            try:
                self._slots.get(name) or self._create(name)
            except Exception:
                logger.exception("%s: could not create %s at boot", self.spec.node, name)

    # -- Host -------------------------------------------------------------------

    def deliver(self, name: str, envelope: PykkaEnvelope[Any], timeout: float | None) -> None:
        slot = self._slots.get(name)
        if slot is None or slot.mailbox.closed:
            if not spawns(envelope.message) or (self._stopping and not self._may_create(name)):
                self._dead_letter(name, envelope, slot)
                return
            slot = self._create(name)
        try:
            slot.mailbox.put(envelope, timeout=timeout)
        except queue.Full as e:
            msg = f"mailbox of {name} stayed full for {timeout}s"
            raise MailboxFull(msg) from e
        except ActorDeadError:  # it stopped between the lookup and the put
            if self._stopping or not spawns(envelope.message):
                self._dead_letter(name, envelope, slot)
                return
            self.deliver(name, envelope, timeout)  # (the closed slot makes way for a new one)

    def _dead_letter(self, name: str, envelope: PykkaEnvelope[Any], slot: ActorSlot | None) -> None:
        """A message for an actor that has stopped, or that a late message may not create.

        An ask learns it (``ActorDeadError`` / ``UnknownActor``); a tell is
        dropped, as a message to any stopped actor is.
        """
        if envelope.reply_to is not None:
            error: Exception = (ActorDeadError(f"{name} has stopped") if slot is not None
                                else UnknownActor(f"no actor {name!r} on {self.spec.node}"))
            envelope.reply_to.set_exception((type(error), error, None))
            return
        logger.debug("%s: dropped a message for %s, which has stopped", self.spec.node, name)
        # A message may say whom to tell that its receiver is gone (`bounce(name)` ->
        # (actor, message)): a channel delivering to a client whose gateway restarted
        # learns it at once instead of at the client's lease expiry.
        message = envelope.message
        for m in message.messages if type(message) is Batch else (message,):
            bounce = getattr(m, "bounce", None)
            if bounce is not None and not self._stopping:
                try:
                    self.endpoint.tell(*bounce(name))
                except Exception:
                    logger.debug("%s: could not bounce a message for %s", self.spec.node, name)

    def system(self, request: Any) -> Any:
        match request:
            case Ping():
                return (self.spec.node, os.getpid())
            case ListActors(prefix=prefix):
                return tuple(slot.info() for name, slot in list(self._slots.items())
                             if name.startswith(prefix))
            case ActorSummary():
                kinds: dict[str, dict[str, Any]] = {}
                for slot in list(self._slots.values()):
                    kind = split_name(slot.name)[0]
                    row = kinds.get(kind)
                    if row is None:
                        row = kinds[kind] = {"kind": kind, "node": self.spec.node, "count": 0,
                                             "alive": 0, "depth": 0, "handled": 0,
                                             "restarts": 0}
                    row["count"] += 1
                    row["alive"] += slot.alive
                    row["depth"] += slot.mailbox.depth
                    row["handled"] += slot.handled
                    row["restarts"] += slot.restarts
                return tuple(kinds[k] for k in sorted(kinds))
            case Spawn(name=name):
                created = name not in self._slots
                self._slots.get(name) or self._create(name)
                return created
            case Crash(name=name):
                if not self.options.debug_hooks:
                    msg = "crash is a debug hook: start the runtime with debug_hooks=True"
                    raise DebugHooksDisabled(msg)
                slot = self._slots.get(name)
                if slot is None:
                    msg = f"no actor {name!r} on {self.spec.node}"
                    raise UnknownActor(msg)
                slot.request_crash()
                return True
            case _:
                msg = f"unknown system request {request!r}"
                raise ValueError(msg)

    # -- slots ------------------------------------------------------------------

    def _factory_for(self, name: str) -> Callable[[str], Actor]:
        kind = split_name(name)[0]
        factory = self._factories.get(kind) or self._factories.get("*")
        if factory is None:
            msg = f"no actor {name!r} and no factory for prefix {kind!r} on {self.spec.node}"
            raise UnknownActor(msg)
        return factory

    def _create(self, name: str) -> ActorSlot:
        with self._lock:
            slot = self._slots.get(name)
            if slot is not None and not slot.mailbox.closed:
                return slot
            if self._stopping and not self._may_create(name):
                msg = f"{self.spec.node} is shutting down"
                raise RuntimeNotRunning(msg)
            slot = ActorSlot(
                name,
                self._factory_for(name),
                self.options.mailbox_size,
                intensity=RestartIntensity(self.options.max_restarts, self.options.restart_window),
                escalate=self._escalate,
                dispatcher=self.dispatcher,
                throughput=self.options.throughput,
                on_finish=self._forget,
            )
            self._slots[name] = slot
        slot.start()
        return slot

    def _phase_of(self, name: str) -> int:
        return self._stop_order.get(split_name(name)[0], len(self._stop_order))

    def _may_create(self, name: str) -> bool:
        """At a shutdown: whether `name`'s kind has yet to stop (its phase is to come)."""
        return self._phase_of(name) > self._phase

    def _forget(self, slot: ActorSlot, left: list[PykkaEnvelope[Any]]
                ) -> list[PykkaEnvelope[Any]]:
        """A slot whose actor stopped by itself goes; what was queued behind goes on.

        Outside a shutdown the name is free again, and the messages that were
        queued behind the stop are delivered anew: the first that may create
        an actor creates a fresh one.  At a shutdown the slot stays (for the
        joins) and the leftovers are returned, to fail.
        """
        with self._lock:
            if self._stopping:
                return left
            if self._slots.get(slot.name) is slot:
                del self._slots[slot.name]
        for envelope in left:
            if isinstance(envelope.message, _ActorStop):
                continue  # a second stop request: the actor it was for is gone
            try:
                self.deliver(slot.name, envelope, self.options.send_timeout)
            except Exception as e:
                if envelope.reply_to is not None:
                    envelope.reply_to.set_exception((type(e), e, None))
                else:
                    logger.warning("%s: dropped a message for %s: %s", self.spec.node,
                                   slot.name, e)
        return []

    # -- shutdown -----------------------------------------------------------------

    def shutdown(self, deadline: float) -> bool:
        """Stop intake, stop every actor after its queued messages, wait until ``deadline``.

        Kinds listed in ``options.stop_order`` stop first, one kind at a time;
        the rest stop together at the end.  Returns True if every actor
        thread finished in time.
        """
        with self._lock:
            self._stopping = True
        self.endpoint.close_intake()
        clean = True
        for phase in range(len(self._stop_order) + 1):
            with self._lock:  # (kinds of later phases may have been created meanwhile)
                self._phase = phase
                group = [s for s in self._slots.values() if self._phase_of(s.name) == phase]
            for slot in group:
                slot.request_stop()
            for slot in group:  # join every one, even after a straggler
                clean = slot.join(max(0.0, deadline - time.monotonic())) and clean
        slots = list(self._slots.values())
        if not clean:
            late = [s.name for s in slots if s.alive]
            logger.warning("%s: actors still running at the deadline: %s", self.spec.node, late)
        clean = self.dispatcher.stop(timeout=max(0.1, deadline - time.monotonic())) and clean
        self.endpoint.close(timeout=max(0.1, deadline - time.monotonic()))
        bind_endpoint(None)
        return clean


def _exit_escalated(name: str) -> None:
    logger.error("actor %s exceeded its restart intensity: restarting the node", name)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_ESCALATED)


def node_main(spec: NodeSpec) -> None:
    """Entry point of a node process (the target of ``multiprocessing.Process``)."""
    for target, stream, shared in ((1, sys.stdout, spec.stdio[0]), (2, sys.stderr, spec.stdio[1])):
        if shared is not None:
            stream.flush()
            os.dup2(shared.fd, target)
            os.close(shared.fd)
    logging.basicConfig(level=spec.log_level, format=LOG_FORMAT.format(node=spec.node))
    stop = threading.Event()
    # SIGTERM wakes the wait below through a pipe at once (a timed poll made every stop
    # wait up to its period: half a second a node, the gateway's and the workers' in turn)
    wake_r, wake_w = os.pipe()

    def on_sigterm(_sig: int, _frame: Any) -> None:
        stop.set()
        with contextlib.suppress(OSError):
            os.write(wake_w, b"x")

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
    node = Node(spec)
    node.boot()
    gc.freeze()  # objects of the startup phase are never garbage: stop rescanning them
    gc.set_threshold(*_GC_THRESHOLDS)
    # A node outlives its supervisor by a second at most: a supervisor killed -9
    # (an operator, a process manager without cgroups) must not leave its nodes
    # holding the ports and the data directory.  They stop as on SIGTERM.
    parent = multiprocessing.parent_process()
    watched: list[Any] = [wake_r] if parent is None else [wake_r, parent.sentinel]
    while not stop.is_set():
        ready = wait(watched)
        if parent is not None and parent.sentinel in ready:
            logger.warning("%s: the supervisor (pid %s) is gone; stopping", spec.node,
                           parent.pid)
            break
    deadline = time.monotonic() + spec.options.shutdown_timeout
    clean = node.shutdown(deadline)
    logging.shutdown()
    # Daemon actor threads that missed the deadline must not keep us alive.
    os._exit(0 if clean else 1)
