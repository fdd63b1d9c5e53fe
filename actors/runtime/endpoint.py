"""A process's messaging hub: tell/ask by name, the socket reader, the table of pending asks.

Theory of operation
-------------------
Every process that takes part in the runtime owns exactly one
:class:`Endpoint`, named like its node (``gateway``, ``worker-3``,
``supervisor`` or ``ext-<pid>-<n>`` for external clients).  It binds the
node's PULL socket (``ipc://<run_dir>/<node>.sock``) and sends through an
:class:`~transport.mailbox.sockets.Outbox` (one PUSH per sending thread and
destination node).  Actors do not have threads of their own: the threads
that send are the node's few dispatcher threads, its socket loops and the
reader, so a process has O(threads x nodes) sockets whatever its number of
actors.  An actor is pinned to one dispatcher thread, so its messages to one
node all leave through one socket: FIFO per sender -> receiver pair.

Sending: ``tell_many(name, msgs)`` resolves ``name`` with the
:class:`~actors.runtime.placement.Placement`.  If this process hosts the actor, the
batch goes straight into the actor's inbox (no ZeroMQ, no encoding);
otherwise one envelope carrying the whole batch is encoded and sent.

Receiving: one reader thread reads envelopes in arrival order and hands
them to the *host* (the node, see :mod:`actors.runtime.node`): a TELL becomes one
pykka envelope with a :class:`~actors.runtime.inbox.Batch`; an ASK becomes a pykka
envelope whose ``reply_to`` is a :class:`RemoteReply` - a future-like object
whose ``set``/``set_exception`` encode a reply envelope and send it from the
answering actor's thread to the asker's node.

Asking across processes: the ASK names this endpoint's node and a request
id; the reply comes back on the node's reply socket (``<node>~r``, one per
node).  An actor that asks parks (its dispatcher thread runs the others) and
the reader completes its :class:`~actors.runtime.future.Future`; any other
thread blocks, and reads the reply socket itself when nobody else does, so
ZeroMQ wakes it directly rather than the reader waking it (one thread hop
and one GIL handover less per ask; :class:`Replies`).  A reply that comes
after its ask timed out finds no entry and is dropped; a dead or restarting
target yields
:class:`~actors.runtime.errors.AskTimeout`, never a hang.  A request queued
while the target node was down is still delivered when it rebinds.  Asks
between actors of the same process use the same future, without ZeroMQ.

Backpressure: the reader blocks while a target inbox is full.  It then
stops reading its socket, the ZeroMQ queues fill to their high-water marks
and remote senders block for at most ``send_timeout`` before
:class:`~actors.runtime.errors.MailboxFull`; local senders get the same error from
the inbox itself.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq
from pykka import Timeout
from pykka._envelope import Envelope as PykkaEnvelope

from actors.runtime.dispatcher import Dispatcher, in_actor
from actors.runtime.errors import (
    ActorsError,
    AskTimeout,
    DebugHooksDisabled,
    MailboxFull,
    RemoteActorError,
    RuntimeNotRunning,
    UnknownActor,
)
from actors.runtime.future import CallbackFuture, Future
from actors.runtime.inbox import Batch
from actors.runtime.options import RuntimeOptions
from actors.runtime.placement import Placement
from actors.runtime.system import SYSTEM
from transport.mailbox.envelope import (
    ASK,
    REPLY_ERROR,
    REPLY_OK,
    TELL,
    CodecError,
    Envelope,
    registry,
)
from transport.mailbox.sockets import Outbox, bind_inbox, close_and_unlink, ipc_address

__all__ = ["Endpoint", "Host", "RemoteReply"]

logger = logging.getLogger(__name__)

_POLL_MS = 100
_RETRY_DELIVERY = 0.1
_COALESCE_MAX = 1000
_REPLY_CHECK = 32
REPLY_SUFFIX = "~r"
"""A node's reply socket is ``<node>~r.sock``, beside its inbox ``<node>.sock``."""
_KNOWN_ERRORS: dict[str, type[ActorsError]] = {
    cls.__name__: cls
    for cls in (UnknownActor, DebugHooksDisabled, MailboxFull, AskTimeout, RuntimeNotRunning)
}
_ext_counter = itertools.count()


class Host(Protocol):
    """What an endpoint needs from the node that hosts actors."""

    def deliver(self, name: str, envelope: PykkaEnvelope[Any], timeout: float | None) -> None:
        """Put ``envelope`` in actor ``name``'s inbox; raise UnknownActor or MailboxFull."""

    def system(self, request: Any) -> Any:
        """Answer a system request (see :mod:`actors.runtime.system`)."""


class RemoteReply:
    """Stands in for a pykka Future in an envelope that came from another process."""

    __slots__ = ("_endpoint", "_node", "_request_id")

    def __init__(self, endpoint: Endpoint, node: str, request_id: int) -> None:
        self._endpoint = endpoint
        self._node = node
        self._request_id = request_id

    def set(self, value: Any = None) -> None:
        self._endpoint.reply(self._node, self._request_id, value)

    def set_exception(self, exc_info: Any = None) -> None:
        exc = (exc_info or sys.exc_info())[1]
        self._endpoint.reply_error(self._node, self._request_id, exc)


_MAILBOX, _PLAIN = "mailbox", "plain"


class _Wait:
    """One plain thread's ask waiting in :class:`Replies`."""

    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.reply: tuple[int, Sequence[Any]] | None = None
        self.event: threading.Event | None = None  # made when the thread first follows


class Replies:
    """A node's reply socket and the asks waiting for it, read by whoever waits.

    Exactly one reader at a time (``owner``) may touch the socket:

    * the node's **reader** thread (``mailbox``), for actors: an actor that
      asks parks, so its reply must be read by a thread that does not wait
      for it.  The reader polls the socket beside its inbox while it owns it;
    * a **plain thread** that asks (``plain``): it blocks anyway, so it reads
      the replies itself (the leader/follower pattern).  The first asking
      thread that finds the socket without a reader leads: it polls until its
      own reply is in, completing the other asks (followers, blocked on an
      event each; actors, through their futures) as their replies come; then
      it steps down and wakes one follower still waiting, which leads next.
      With one plain thread asking at a time -- HTTP ``/pub``, the
      supervisor, a CLI -- ZeroMQ wakes the asker directly: no reader thread,
      event or GIL handover in between;
    * nobody (``None``), when no ask waits.

    Handovers: a plain thread that finds the reader owning the socket asks it
    to let go (it follows meanwhile; the reader may still answer it); an actor
    that asks while nobody reads gives the socket to the reader.  Either rings
    the reader's doorbell (an eventfd in its poller, one per node), so the
    reader, blocked in its poll, adds or drops the socket.  A ZeroMQ socket may
    be used by one thread after another across a lock handover; only the owner
    touches this one.  A plain leader polls in slices of ``_POLL_MS`` so that
    :meth:`close` is noticed.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._reader_poll = zmq.Poller()  # the reader's (mailbox) zero-timeout checks
        self._reader_poll.register(sock, zmq.POLLIN)
        self._leader_poll = zmq.Poller()  # a plain leader's
        self._leader_poll.register(sock, zmq.POLLIN)
        self._mutex = threading.Lock()
        self.owner: str | None = None
        self._handover = False  # a plain thread asked the reader to let go
        self._closed = False
        self._futures: dict[int, Future] = {}  # actors' asks
        self._waits: dict[int, _Wait] = {}  # plain threads' asks
        self._followers: dict[_Wait, None] = {}  # blocked on their event, in arrival order

    # -- registering asks (before they are sent: a reply may come before the wait) --------

    def expect_future(self, request_id: int, future: Future) -> None:
        """An actor's ask: its future is completed by whoever reads the reply."""
        with self._mutex:
            self._futures[request_id] = future
            if self.owner is None:
                self.owner = _MAILBOX
                self._ring()

    def expect(self, request_id: int) -> None:
        """A plain thread's ask: it waits with :meth:`wait`."""
        with self._mutex:
            self._waits[request_id] = _Wait()

    def done(self, request_id: int) -> None:
        """Forget an ask (answered, timed out, or never sent): a later reply is dropped."""
        with self._mutex:
            self._futures.pop(request_id, None)
            self._waits.pop(request_id, None)

    # -- a plain thread waits ------------------------------------------------------------

    def wait(self, request_id: int, timeout: float) -> tuple[int, Sequence[Any]] | None:
        """The reply ``(kind, payload)`` to an expected ask, or None after ``timeout``."""
        wait = self._waits[request_id]
        deadline = time.monotonic() + timeout
        while True:
            with self._mutex:
                remaining = deadline - time.monotonic()
                if wait.reply is not None or self._closed or remaining <= 0:
                    if self.owner is None:  # leaving: the next one's turn may have come
                        self._pass_on()
                    leave = True
                else:
                    leave = False
                    lead = self.owner is None
                    if lead:
                        self.owner = _PLAIN
                    else:
                        if self.owner == _MAILBOX and not self._handover:
                            self._handover = True
                            self._ring()
                        event = wait.event
                        if event is None:
                            event = wait.event = threading.Event()
                        else:
                            event.clear()
                        self._followers[wait] = None
            if leave:
                if wait.reply is not None:
                    return wait.reply
                if self._closed:
                    msg = "endpoint closed while asking"
                    raise RuntimeNotRunning(msg)
                return None
            if lead:
                try:
                    self._lead(wait, deadline)
                finally:
                    self._step_down()
            else:
                event.wait(remaining)
                with self._mutex:
                    self._followers.pop(wait, None)

    def _lead(self, wait: _Wait, deadline: float) -> None:
        """Read replies until ``wait``'s is in, the deadline passes or the socket closes."""
        sock = self.sock
        poll = self._leader_poll.poll
        while wait.reply is None and not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if poll(min(_POLL_MS, int(remaining * 1000) + 1)):
                self._complete(sock.recv())

    def _step_down(self) -> None:
        with self._mutex:
            self.owner = None
            self._pass_on()

    def _pass_on(self, *, ring: bool = True) -> None:
        """Nobody reads (mutex held): wake a follower to lead, else give the socket to the
        reader if actors wait (ringing its doorbell unless ``ring`` is False)."""
        for wait in self._followers:
            if wait.reply is None:
                assert wait.event is not None
                wait.event.set()
                return
        if self._futures and not self._closed:
            self.owner = _MAILBOX
            if ring:
                self._ring()

    # -- the reader (mailbox thread) -------------------------------------------------------

    def answer_doorbell(self) -> None:
        """The doorbell rang: let go of the socket if a plain thread asked for it."""
        with contextlib.suppress(OSError):  # drained already (or closed at shutdown)
            os.eventfd_read(self.doorbell)
        with self._mutex:
            if not self._handover:
                return
            self._handover = False
            if self.owner == _MAILBOX:
                self.owner = None
                self._pass_on(ring=False)  # (the reader is this thread)

    def read_available(self) -> None:
        """Complete the asks whose replies have arrived, if the reader owns the socket."""
        if self.owner != _MAILBOX:
            return
        sock = self.sock
        poll = self._reader_poll.poll
        while poll(0):
            self._complete(sock.recv())

    # -- both ------------------------------------------------------------------------------

    def _complete(self, data: bytes) -> None:
        try:
            reply = registry.decode(data)
        except CodecError as e:
            logger.error("dropped an undecodable reply: %s", e)
            return
        value = (reply.kind, reply.messages)
        with self._mutex:
            future = self._futures.pop(reply.request_id, None)
            wait = None if future is not None else self._waits.get(reply.request_id)
            if wait is not None:
                wait.reply = value
                if wait.event is not None:
                    wait.event.set()
        if future is not None:
            future.set(value)
        elif wait is None:
            logger.debug("dropped a reply that came after its ask timed out")

    def _ring(self) -> None:
        """Wake the reader (mutex held: the doorbell is closed under it)."""
        if self.doorbell >= 0:
            os.eventfd_write(self.doorbell, 1)

    def wake(self) -> None:
        """Wake the reader from its poll (to see that intake is closing)."""
        with self._mutex:
            self._ring()

    def close(self, address: str, timeout: float = 2 * _POLL_MS / 1000) -> None:
        """Fail the plain threads' waits (RuntimeNotRunning); close the socket once unread.

        Call after the reader thread has stopped."""
        with self._mutex:
            self._closed = True
            for wait in self._followers:
                assert wait.event is not None
                wait.event.set()
            os.close(self.doorbell)
            self.doorbell = -1
        deadline = time.monotonic() + timeout
        while self.owner == _PLAIN and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.owner == _PLAIN:
            logger.warning("a thread still reads the reply socket %s; left open", address)
            return
        close_and_unlink(self.sock, address)


def _result(kind: int, payload: Sequence[Any]) -> Any:
    """Turn a reply envelope's payload into the value, or raise the remote error."""
    if kind == REPLY_OK:
        return payload[0]
    type_name, text = payload
    known = _KNOWN_ERRORS.get(type_name)
    raise known(text) if known is not None else RemoteActorError(type_name, text)


class Endpoint:
    """Messaging for one process; ``host`` is None for endpoints that host no actors."""

    def __init__(
        self,
        node: str,
        run_dir: str | os.PathLike[str],
        placement: Placement,
        options: RuntimeOptions,
        host: Host | None = None,
        *,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self.node = node
        self.dispatcher = dispatcher
        """The node's dispatcher (None for endpoints that host no actors)."""
        self.run_dir = os.fspath(run_dir)
        self.placement = placement
        self.options = options
        self.host = host
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._inbox = bind_inbox(self._ctx, ipc_address(self.run_dir, node), options.hwm)
        self._reply_node = node + REPLY_SUFFIX
        self._replies = Replies(
            bind_inbox(self._ctx, ipc_address(self.run_dir, self._reply_node), 0))
        self.outbox = Outbox(self._ctx, self.address_of, options.hwm, options.send_timeout)
        self._ids = itertools.count(1)
        self._coalesce_max = min(_COALESCE_MAX, options.mailbox_size)
        self._stopping = threading.Event()  # set: the dispatcher stops reading (intake closed)
        self._closed = False
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name=f"mailbox:{node}", daemon=True
        )
        self._dispatcher.start()

    @classmethod
    def external(
        cls, run_dir: str | os.PathLike[str], placement: Placement, options: RuntimeOptions
    ) -> Endpoint:
        """An endpoint for a process that only sends (tests, benchmarks, CLIs)."""
        return cls(f"ext-{os.getpid()}-{next(_ext_counter)}", run_dir, placement, options)

    def address_of(self, node: str) -> str:
        return ipc_address(self.run_dir, node)

    # -- sending ----------------------------------------------------------------

    def tell(self, name: str, message: Any) -> None:
        """Send one message to actor ``name``; MailboxFull if it cannot be queued in time."""
        self.tell_many(name, (message,))

    def tell_many(self, name: str, messages: Sequence[Any]) -> None:
        """Send a batch to actor ``name`` as one envelope (one inbox entry locally)."""
        if not messages:
            return
        node = self.placement.node_for(name)
        if node == self.node and self.host is not None:
            message = messages[0] if len(messages) == 1 else Batch(messages)
            self.host.deliver(name, PykkaEnvelope(message), self.options.send_timeout)
            return
        self._send(node, registry.encode(TELL, name, self.node, messages))

    def ask(self, name: str, message: Any, timeout: float | None = None) -> Any:
        """Send ``message`` to ``name`` and return its reply.

        Raises AskTimeout after ``timeout`` (default ``options.ask_timeout``)
        seconds, RemoteActorError if the actor raised, UnknownActor if no
        factory knows the name.
        """
        node = self.placement.node_for(name)
        return self._ask(node, name, message, timeout)

    def ask_many(self, requests: Sequence[tuple[str, Any]],
                 timeout: float | None = None) -> list[Any]:
        """Send every ``(name, message)`` ask at once, then collect the replies.

        One round trip for the lot instead of one each: the answers come back
        in the order asked, an exception (AskTimeout, RemoteActorError, ...) in
        place of each reply that failed.  ``timeout`` bounds the whole call.
        """
        return self._ask_all([(self.placement.node_for(name), name, message)
                              for name, message in requests], timeout)

    def ask_nodes(self, requests: Sequence[tuple[str, Any]],
                  timeout: float | None = None) -> list[Any]:
        """:meth:`ask_many` of ``(node, system request)`` pairs: every node asked at
        once, so silent ones cost one ``timeout`` in all, not one each."""
        return self._ask_all([(node, SYSTEM, request) for node, request in requests], timeout)

    def _ask_all(self, requests: Sequence[tuple[str, str, Any]],
                 timeout: float | None) -> list[Any]:
        if timeout is None:
            timeout = self.options.ask_timeout
        deadline = time.monotonic() + timeout
        plain = not in_actor()  # a plain thread waits in Replies.wait, an actor parks
        replies = self._replies
        waits: list[tuple[str, Future | None, int, Any]] = []
        for node, name, message in requests:
            request_id = 0
            try:
                if node == self.node and self.host is not None:
                    future = Future()
                    if name == SYSTEM:  # (answered here and now, as ask_node does)
                        future.set(self.host.system(message))
                    else:
                        self.host.deliver(name, PykkaEnvelope(message, reply_to=future),
                                          timeout)
                    waits.append((name, future, 0, None))
                    continue
                request_id = next(self._ids)
                if plain:
                    future = None
                    replies.expect(request_id)
                else:
                    future = Future()
                    replies.expect_future(request_id, future)
                self._send(node, registry.encode(ASK, name, self.node, (message,),
                                                 reply_to=self._reply_node,
                                                 request_id=request_id))
                waits.append((name, future, request_id, None))
            except Exception as e:  # the caller gets it in its place
                if request_id:
                    replies.done(request_id)
                waits.append((name, None, 0, e))
        results: list[Any] = []
        for name, future, request_id, error in waits:
            if error is not None:
                results.append(error)
                continue
            remaining = max(0.0, deadline - time.monotonic())
            try:
                if future is None:  # a plain thread's remote ask
                    reply = replies.wait(request_id, remaining)
                    if reply is None:
                        raise Timeout(remaining)
                    results.append(_result(*reply))
                else:
                    value = future.get(timeout=remaining)
                    results.append(_result(*value) if request_id else value)
            except Timeout:
                results.append(AskTimeout(f"no reply from {name} within {timeout}s"))
            except Exception as e:
                results.append(e)
            finally:
                if request_id:
                    replies.done(request_id)
        return results

    def ask_node(self, node: str, request: Any, timeout: float | None = None) -> Any:
        """Send a system request to ``node`` and return the reply."""
        return self._ask(node, SYSTEM, request, timeout)

    def tell_node(self, node: str, request: Any) -> None:
        """Send a system request to ``node`` without waiting for a reply."""
        self._send(node, registry.encode(TELL, SYSTEM, self.node, (request,)))

    def _ask(self, node: str, name: str, message: Any, timeout: float | None) -> Any:
        if timeout is None:
            timeout = self.options.ask_timeout
        if node == self.node and self.host is not None:
            if name == SYSTEM:
                return self.host.system(message)
            future = Future()
            self.host.deliver(name, PykkaEnvelope(message, reply_to=future), timeout)
            try:
                return future.get(timeout=timeout)
            except Timeout as e:
                msg = f"no reply from {name} within {timeout}s"
                raise AskTimeout(msg) from e
        return self._ask_remote(node, name, message, timeout)

    def ask_local(self, name: str, message: Any,
                  on_done: Callable[[Any, BaseException | None], None]) -> None:
        """Ask an actor of this process without waiting: ``on_done(reply, None)`` or
        ``on_done(None, exception)`` is called on the thread that answers (an actor's
        dispatcher thread: keep it short).  For an event loop, which must not block on
        a future: it hands the answer over with ``call_soon_threadsafe``.  The caller
        bounds the wait itself.  ValueError for a name this process does not host."""
        if self.placement.node_for(name) != self.node or self.host is None:
            msg = f"{name} is not hosted by this process ({self.node})"
            raise ValueError(msg)
        self.host.deliver(name, PykkaEnvelope(message, reply_to=CallbackFuture(on_done)),
                          self.options.send_timeout)

    def _ask_remote(self, node: str, name: str, message: Any, timeout: float) -> Any:
        """Send an ASK naming this node and a request id, then wait for the reply.

        An actor parks on a future that the reply socket's reader completes; a
        plain thread waits in :meth:`Replies.wait` (reading the socket itself
        when nobody else does)."""
        request_id = next(self._ids)
        data = registry.encode(
            ASK, name, self.node, (message,), reply_to=self._reply_node, request_id=request_id
        )
        replies = self._replies
        try:
            if not in_actor():
                replies.expect(request_id)
                self._send(node, data)
                reply = replies.wait(request_id, timeout)
                if reply is None:
                    raise Timeout(timeout)
                return _result(*reply)
            future = Future()
            replies.expect_future(request_id, future)
            self._send(node, data)
            return _result(*future.get(timeout=timeout))
        except Timeout:
            msg = f"no reply from {name} on {node} within {timeout}s"
            raise AskTimeout(msg) from None
        finally:
            replies.done(request_id)

    def _send(self, node: str, data: bytes) -> None:
        if self._closed:
            msg = f"endpoint {self.node} is closed"
            raise RuntimeNotRunning(msg)
        try:
            self.outbox.send(node, data)
        except zmq.Again as e:
            msg = f"mailbox of node {node} stayed full for {self.options.send_timeout}s"
            raise MailboxFull(msg) from e

    def reply(self, node: str, request_id: int, value: Any) -> None:
        """Send the value an actor returned for a remote ask (called on the actor's thread)."""
        try:
            data = registry.encode(REPLY_OK, "", self.node, (value,), request_id=request_id)
        except (TypeError, ValueError) as e:
            self.reply_error(node, request_id, e)
            return
        self._send_reply(node, data)

    def reply_error(self, node: str, request_id: int, exc: BaseException | None) -> None:
        """Send an exception raised by an asked actor back to the asker."""
        pair = (type(exc).__name__, str(exc))
        data = registry.encode(REPLY_ERROR, "", self.node, pair, request_id=request_id)
        self._send_reply(node, data)

    def _send_reply(self, node: str, data: bytes) -> None:
        try:
            self.outbox.send(node, data)
        except (zmq.Again, zmq.ZMQError):
            logger.warning("dropped a reply to %s: its mailbox is full or closed", node)

    # -- receiving ------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        """Read envelopes in arrival order and hand them to the host.

        Told messages are *coalesced*: while more envelopes are waiting on the
        socket, messages for the same actor accumulate (up to
        ``_COALESCE_MAX``) and enter its inbox as one batch, so a burst of
        small tells costs one inbox operation and one thread wake-up instead
        of one each.  Order per destination is preserved: pending tells for an
        actor are flushed before an ask to it is delivered.

        Replies arrive on a socket of their own, which this thread reads while
        it owns it (:class:`Replies`: while actors wait and no plain thread
        reads it) between envelopes (every ``_REPLY_CHECK`` envelopes and
        whenever the inbox is idle) and while the reader waits for room in a
        full inbox: an actor that waits for a reply while its own inbox fills
        up is answered all the same.  The doorbell says the owner changed.
        """
        sock = self._inbox
        replies = self._replies
        doorbell = replies.doorbell
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(doorbell, zmq.POLLIN)
        polls_replies = False
        decode = registry.decode
        stopping = self._stopping
        pending: dict[str, list[Any]] = {}
        held = 0
        count = 0
        try:
            while not stopping.is_set():
                count += 1
                if count >= _REPLY_CHECK:
                    count = 0
                    replies.read_available()
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    if pending:
                        self._flush(pending)
                        held = 0
                    replies.read_available()
                    if (replies.owner == _MAILBOX) != polls_replies:
                        polls_replies = not polls_replies
                        if polls_replies:
                            poller.register(replies.sock, zmq.POLLIN)
                        else:
                            poller.unregister(replies.sock)
                    for fd, _ in poller.poll(_POLL_MS):
                        if fd == doorbell:
                            replies.answer_doorbell()
                    continue
                try:
                    envelope = decode(data)
                except CodecError as e:
                    self._reject(e)
                    continue
                try:
                    held = self._route(envelope, pending, held)
                except Exception:
                    # A bug must not leave the node deaf: log it and keep reading.
                    logger.exception("%s: failed to dispatch an envelope", self.node)
        finally:
            self.close_thread()

    def _route(self, envelope: Envelope, pending: dict[str, list[Any]], held: int) -> int:
        """Route one decoded envelope; returns the number of told messages still held."""
        kind = envelope.kind
        dest = envelope.dest
        if kind == TELL:
            batch = pending.get(dest)
            if batch is None:
                pending[dest] = list(envelope.messages)
            else:
                batch.extend(envelope.messages)
            held += len(envelope.messages)
            if held >= self._coalesce_max:
                self._flush(pending)
                return 0
            return held
        if kind == ASK:
            if dest in pending:
                messages = pending.pop(dest)
                held -= len(messages)
                self._dispatch_tell(dest, messages)
            self._dispatch_ask(dest, envelope.messages[0], envelope.reply_to, envelope.request_id)
        else:
            logger.warning("%s: dropped a reply sent to the inbox, not the reply socket", self.node)
        return held

    def _flush(self, pending: dict[str, list[Any]]) -> None:
        for dest, messages in pending.items():
            self._dispatch_tell(dest, messages)
        pending.clear()

    def _reject(self, error: CodecError) -> None:
        header = error.envelope
        if header is not None and header.kind == ASK and header.reply_to is not None:
            self.reply_error(header.reply_to, header.request_id, error)
        logger.error("%s: dropped an undecodable envelope: %s", self.node, error)

    def _dispatch_tell(self, name: str, messages: Sequence[Any]) -> None:
        host = self.host
        if host is None:
            logger.warning("%s hosts no actors; dropped a message for %s", self.node, name)
            return
        if name == SYSTEM:
            for request in messages:
                try:
                    host.system(request)
                except Exception:
                    logger.exception("%s: system request %r failed", self.node, request)
            return
        message = messages[0] if len(messages) == 1 else Batch(messages)
        self._deliver_blocking(name, PykkaEnvelope(message))

    def _dispatch_ask(self, name: str, message: Any, reply_to: str | None, rid: int) -> None:
        assert reply_to is not None
        reply = RemoteReply(self, reply_to, rid)
        if self.host is None:
            reply.set_exception((None, UnknownActor(f"{self.node} hosts no actors"), None))
            return
        if name == SYSTEM:
            try:
                reply.set(self.host.system(message))
            except Exception as e:
                reply.set_exception((type(e), e, None))
            return
        self._deliver_blocking(name, PykkaEnvelope(message, reply_to=reply))

    def _deliver_blocking(self, name: str, envelope: PykkaEnvelope[Any]) -> None:
        """Wait (not forever: until shutdown) for room in the target's inbox."""
        assert self.host is not None
        while not self._stopping.is_set():
            try:
                self.host.deliver(name, envelope, _RETRY_DELIVERY)
            except MailboxFull:
                self._replies.read_available()
                continue
            except (UnknownActor, RuntimeNotRunning) as e:
                if envelope.reply_to is not None:
                    envelope.reply_to.set_exception((type(e), e, None))
                else:
                    logger.warning("%s: dropped a message for %s: %s", self.node, name, e)
            return

    # -- lifecycle ------------------------------------------------------------

    def close_thread(self) -> None:
        """Release the calling thread's sockets (for a thread that sent and now ends)."""
        self.outbox.close_thread()

    def close_intake(self, timeout: float = 2.0) -> None:
        """Stop reading the inbox socket; sending (e.g. from ``on_stop``) still works."""
        self._stopping.set()
        self._replies.wake()
        if self._dispatcher is not threading.current_thread():
            self._dispatcher.join(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the dispatcher, close every socket and terminate the context."""
        if self._closed:
            return
        self.close_intake(timeout)
        self._closed = True
        self._inbox.close(linger=0)
        self._replies.close(ipc_address(self.run_dir, self._reply_node))
        self.outbox.close()
        terminator = threading.Thread(target=self._ctx.term, name="zmq-term", daemon=True)
        terminator.start()
        terminator.join(timeout)
        if terminator.is_alive():
            logger.warning("%s: zmq context did not terminate within %.1fs", self.node, timeout)
