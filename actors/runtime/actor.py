"""The runtime's actor base class: a pykka actor that costs memory, not a thread.

Theory of operation
-------------------
Runtime actors are pykka actors extended through pykka's seams rather than
by forking its loop:

* ``_create_actor_inbox`` returns the :class:`~actors.runtime.inbox.Mailbox`
  of the actor's *slot* (see :mod:`actors.runtime.slot`).  The slot outlives
  actor instances: when an actor crashes, its fresh replacement is
  constructed on the same mailbox, so the messages queued behind the failing
  one are not lost.  The slot, not a thread of the actor's own, runs the
  actor: batches of messages on a thread of the node's dispatcher
  (:mod:`actors.runtime.dispatcher`).
* ``_create_future`` returns a :class:`~actors.runtime.future.Future` whose
  ``get`` parks the asking actor instead of blocking its thread, so pykka's
  own ``ActorRef.ask`` and proxies work on a dispatcher of two threads.
* ``_handle_receive`` unpacks batches (one inbox entry, many messages),
  counts handled messages for introspection, remembers the unprocessed tail
  of a batch when a message raises (the replacement instance receives it
  first), and turns the debug crash hook into an exception raised on the
  actor's own turn.

Actors talk to other actors by name with :meth:`Actor.tell`,
:meth:`Actor.tell_many` and :meth:`Actor.ask`; the process's
:class:`~actors.runtime.endpoint.Endpoint` decides whether the target is
local (direct inbox put) or remote (ZeroMQ envelope).  Work that blocks goes
through :meth:`Actor.blocking`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pykka
from pykka._envelope import Envelope
from pykka.messages import _ActorStop

from actors.runtime.dispatcher import call_later
from actors.runtime.errors import DebugCrash
from actors.runtime.future import Future
from actors.runtime.inbox import DEFAULT_MAILBOX_SIZE, Batch, CrashRequest, Mailbox

if TYPE_CHECKING:
    from actors.runtime.endpoint import Endpoint

T = TypeVar("T")

__all__ = ["Actor", "bind_endpoint", "construct_on", "current_endpoint", "no_spawn", "spawns"]

NO_SPAWN: set[type] = set()
"""Message classes that never create their receiver (see :func:`no_spawn`)."""


def no_spawn(cls: type[T]) -> type[T]:
    """Mark a message class that never creates the actor it is sent to.

    Actors are created on demand by the first message for their name.  An
    actor that stopped (its client left, its channel was deleted) can still
    be sent a late answer or a sweep that was on its way; such a message,
    marked with this decorator, is dropped instead of bringing the actor
    back with nothing to do (``dead letters``).
    """
    NO_SPAWN.add(cls)
    return cls


def spawns(message: Any) -> bool:
    """Whether ``message`` (or the first of a batch) may create its receiver."""
    first = message.messages[0] if type(message) is Batch else message
    return type(first) not in NO_SPAWN


_constructing = threading.local()
"""Set by the slot while it calls a factory: the mailbox the new actor must use."""


class Actor(pykka.Actor):
    """Base class of actors hosted by the runtime.

    Subclasses take the actor's name as first constructor argument (factories
    are called as ``factory(name)``), implement ``on_receive(message)`` and
    may implement ``on_start`` (recover state; called again after every
    restart, when ``restart_count`` > 0) and ``on_stop`` (flush and close
    storage on orderly shutdown).

    A message that raises while being *told* crashes the actor: the slot
    builds a fresh instance with the same name and arguments.  A message that
    raises while being *asked* is returned to the asker as an error and the
    actor keeps running (pykka's semantics).
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.handled = 0
        self.restart_count = 0  # set by the slot before on_start: 0 on first start
        self._stop_requested = False
        self._stop_if_idle = False
        self._unprocessed: Sequence[Any] = ()

    @staticmethod
    def _create_actor_inbox() -> Mailbox:  # type: ignore[override]  # pykka seam
        mailbox: Mailbox | None = getattr(_constructing, "mailbox", None)
        return mailbox if mailbox is not None else Mailbox(DEFAULT_MAILBOX_SIZE)

    @staticmethod
    def _create_future() -> Future:  # pykka seam
        return Future()

    def _start_actor_loop(self) -> None:  # pykka seam: slots run actors, never Actor.start()
        msg = "runtime actors are started by their node (tell them a message), not start()"
        raise TypeError(msg)

    def _handle_receive(self, message: Any) -> Any:
        if type(message) is Batch:
            messages = iter(message.messages)
            on_receive = self.on_receive
            try:
                for m in messages:
                    on_receive(m)
            except Exception:
                # The iterator already moved past the failing message.
                self._unprocessed = tuple(messages)
                self.handled += len(message.messages) - len(self._unprocessed)
                raise
            self.handled += len(message.messages)
            return None
        self.handled += 1
        if type(message) is CrashRequest:
            msg = f"debug crash requested for {self.name}"
            raise DebugCrash(msg)
        if isinstance(message, _ActorStop):
            self._stop_requested = True
        return super()._handle_receive(message)

    def on_batch_end(self) -> None:
        """Called after each run of messages, before the thread moves on (default: nothing).

        A run is what the slot handles in one turn: up to the throughput bound of
        messages, fewer when the inbox empties first.  An actor that gathers work
        from several messages (a topic joining the publishes that arrived together
        into one fan-out and one disk write) sends it here, so nothing it gathered
        waits for a message that may never come.  Raising here is a crash, as in
        ``on_receive`` of a told message.
        """

    def tell_later(self, delay: float, message: Any) -> None:
        """Tell this actor ``message`` after ``delay`` seconds.

        A timer on the actor's dispatcher thread, not a thread: call it from
        ``on_receive`` / ``on_start``.  Dropped if the actor has stopped by then.
        """
        call_later(delay, _Later(self.actor_inbox, message))

    def stop(self) -> None:
        """Stop after the messages already queued; the node then forgets this actor.

        ``on_stop`` runs; a later message for the name creates a fresh actor
        (unless it is :func:`no_spawn`).  Never blocks, even on a full mailbox.
        """
        self.actor_inbox.put_force(Envelope(_ActorStop()))

    def stop_if_idle(self) -> None:
        """Stop after this message if no other is queued by then (atomically: a message
        that arrives first keeps this instance, and it decides again after it).

        For an actor that only wants to go when nothing wants it (a topic that
        does not exist): unlike `stop`, no message is ever handled by an instance
        already bound to stop.  A later message creates a fresh actor.
        """
        self._stop_if_idle = True

    # -- deferred replies -----------------------------------------------------

    def defer_reply(self) -> Any:
        """Answer the message being handled later: returns its reply handle (or None).

        Call it from ``on_receive`` of an *asked* message; the ask is then not
        answered when ``on_receive`` returns, but when ``handle.set(value)``
        (or ``handle.set_exception(exc_info)``) is called, from this actor's
        thread, once the work the answer depends on is done -- e.g. a topic
        that acknowledges a publish only after the disk-queue actors confirm
        the write.  Returns None for a told message.
        """
        envelope = getattr(self.actor_inbox, "current", None)
        if envelope is None or envelope.reply_to is None:
            return None
        handle, envelope.reply_to = envelope.reply_to, None
        return handle

    # -- messaging by name ----------------------------------------------------

    def tell(self, name: str, message: Any) -> None:
        """Send ``message`` to actor ``name`` (wherever it lives)."""
        _endpoint().tell(name, message)

    def tell_many(self, name: str, messages: Sequence[Any]) -> None:
        """Send a batch to actor ``name`` as one envelope / one inbox entry."""
        _endpoint().tell_many(name, messages)

    def ask(self, name: str, message: Any, timeout: float | None = None) -> Any:
        """Send ``message`` to ``name`` and wait for its reply (never ask yourself).

        The wait parks this actor: its dispatcher thread runs other actors
        meanwhile, and messages to this actor queue up until it resumes.
        """
        return _endpoint().ask(name, message, timeout)

    def ask_many(self, requests: Sequence[tuple[str, Any]],
                 timeout: float | None = None) -> list[Any]:
        """Ask every ``(name, message)`` at once and park once for all the replies;
        an exception stands in place of each reply that failed (`Endpoint.ask_many`)."""
        return _endpoint().ask_many(requests, timeout)

    def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the node's I/O pool (fsync, SQLite, file work) and return it.

        This actor parks until the call is done; its dispatcher thread keeps
        running the others.  Outside a node (a unit test) the call runs inline.
        """
        endpoint = _endpoint_of_process
        dispatcher = endpoint.dispatcher if endpoint is not None else None
        if dispatcher is None:
            return fn(*args)
        return dispatcher.blocking(fn, *args)


class _Later:
    """A timer that puts one message in a mailbox (see :meth:`Actor.tell_later`)."""

    __slots__ = ("mailbox", "message")

    def __init__(self, mailbox: Mailbox, message: Any) -> None:
        self.mailbox = mailbox
        self.message = message

    def expire(self) -> None:
        self.mailbox.put_force(Envelope(self.message))


_endpoint_of_process: Endpoint | None = None


def bind_endpoint(endpoint: Endpoint | None) -> None:
    """Install the process's endpoint (done by the node before any actor starts)."""
    global _endpoint_of_process  # noqa: PLW0603 - one endpoint per process, by design
    _endpoint_of_process = endpoint


def current_endpoint() -> Endpoint:
    """This process's endpoint, usable from any thread (protocol servers use it to ask)."""
    return _endpoint()


def _endpoint() -> Endpoint:
    endpoint = _endpoint_of_process
    if endpoint is None:
        msg = "this process hosts no runtime endpoint"
        raise RuntimeError(msg)
    return endpoint


def construct_on(mailbox: Mailbox, factory: Any, name: str) -> Actor:
    """Call ``factory(name)`` so that the new actor uses ``mailbox`` as its inbox."""
    _constructing.mailbox = mailbox
    try:
        actor = factory(name)
    finally:
        _constructing.mailbox = None
    if not isinstance(actor, Actor) or actor.actor_inbox is not mailbox:
        msg = f"factory for {name!r} must return an actors.Actor, got {type(actor).__name__}"
        raise TypeError(msg)
    return actor
