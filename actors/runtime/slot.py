"""Actor slots: one named place on a node, with its mailbox and restart policy, run by a dispatcher.

Theory of operation
-------------------
A *slot* is what a name resolves to on its node.  It owns the actor's
:class:`~actors.runtime.inbox.Mailbox`, is pinned to one thread of the node's
:class:`~actors.runtime.dispatcher.Dispatcher`, and outlives the actor
instances that occupy it.  It holds no thread of its own: the mailbox queues
the slot on its dispatcher thread when a message arrives for an idle actor,
and the thread calls :meth:`ActorSlot.run_batch`, which

1. builds the instance on first use (``factory(name)``; the mailbox is handed
   over through pykka's ``_create_actor_inbox`` seam) and runs ``on_start``;
2. handles up to ``throughput`` *messages* (a ``Batch`` entry counts for its
   length, and one longer than what is left of the quota is split, its rest
   put back at the head of the mailbox) with pykka's per-message semantics:
   the handler's return value or exception goes to an asker's future; a
   *told* message that raises crashes the instance (pykka's
   ``_handle_failure`` and ``on_failure`` run);
3. on a crash, if :class:`RestartIntensity` allows it, counts a restart and
   builds a fresh instance *on the same mailbox*, whose ``on_start`` runs
   first and which then receives the unprocessed tail of the crashed batch
   and everything queued behind it, in order.  If the intensity is exceeded
   the slot calls ``escalate(name)``; the node then exits with
   ``EXIT_ESCALATED`` and the supervisor restarts the whole process;
4. on a stop request (pykka's ``_ActorStop``, queued behind earlier
   messages: the node's shutdown, or the actor's own ``self.stop()``), runs
   ``on_stop``, closes the mailbox, fails the asks still queued with
   ``ActorDeadError`` and tells the node (``on_finish``).  Outside a
   shutdown the node forgets the slot and delivers what was queued behind
   the stop to a fresh actor of the same name (created on demand, as any);
   at a shutdown the asks among it fail with ``ActorDeadError``;
5. ends the batch: queued again at the back of its thread's run queue if
   messages wait, idle otherwise.

Any handler may wait (``ask``, a blocking call offloaded with
``Actor.blocking``, room in a full mailbox): the slot's batch is then parked
and resumes on the same thread; the slot is never run twice at once.

``RestartIntensity`` is a pure class (time is passed in).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pykka import ActorDeadError
from pykka._envelope import Envelope
from pykka.messages import _ActorStop

from actors.runtime.actor import Actor, construct_on
from actors.runtime.dispatcher import Dispatcher
from actors.runtime.inbox import Batch, CrashRequest, Mailbox

__all__ = ["DEFAULT_THROUGHPUT", "ActorSlot", "RestartIntensity"]

logger = logging.getLogger(__name__)

Factory = Callable[[str], Actor]

DEFAULT_THROUGHPUT = 300
"""Messages an actor handles before its thread moves on to the next ready actor."""


class RestartIntensity:
    """Allow at most ``max_restarts`` restarts in any ``window`` seconds (Erlang/OTP style)."""

    def __init__(self, max_restarts: int, window: float) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Record a restart at ``now``; False if it exceeds the intensity."""
        times = self._times
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True


class ActorSlot:
    """A named actor on this node: mailbox + restart policy, run by a dispatcher thread."""

    __slots__ = (
        "_actor",
        "_clock",
        "_dispatcher",
        "_escalate",
        "_factory",
        "_handled_before",
        "_intensity",
        "_on_finish",
        "_owns_dispatcher",
        "_throughput",
        "_worker",
        "mailbox",
        "name",
        "restarts",
    )

    def __init__(
        self,
        name: str,
        factory: Factory,
        mailbox_size: int,
        *,
        intensity: RestartIntensity,
        escalate: Callable[[str], None],
        dispatcher: Dispatcher | None = None,
        throughput: int = DEFAULT_THROUGHPUT,
        on_finish: Callable[[ActorSlot, list[Envelope[Any]]], list[Envelope[Any]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.restarts = 0
        self._factory = factory
        self._intensity = intensity
        self._escalate = escalate
        self._clock = clock
        self._throughput = max(1, throughput)
        self._handled_before = 0
        self._on_finish = on_finish
        self._actor: Actor | None = None
        self._owns_dispatcher = dispatcher is None
        if dispatcher is None:  # a slot on its own (unit tests): a one-thread dispatcher
            dispatcher = Dispatcher(f"slot-{name}", threads=1, io_threads=1)
            dispatcher.start()
        self._dispatcher = dispatcher
        self._worker = dispatcher.assign()
        self.mailbox = Mailbox(mailbox_size, on_ready=self._ready)

    # -- introspection --------------------------------------------------------------

    @property
    def handled(self) -> int:
        """Messages handled by every instance that occupied this slot."""
        actor = self._actor
        return self._handled_before + (actor.handled if actor is not None else 0)

    @property
    def alive(self) -> bool:
        return not self.mailbox.closed

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "depth": self.mailbox.depth,
            "handled": self.handled,
            "restarts": self.restarts,
            "alive": self.alive,
        }

    # -- control ----------------------------------------------------------------------

    def start(self) -> None:
        """Build the actor now (on its dispatcher thread) rather than on its first message."""
        with self.mailbox._lock:
            if self.mailbox.scheduled:
                return
            self.mailbox.scheduled = True
        self._ready()

    def request_stop(self) -> None:
        """Ask the actor to stop after the messages already queued (never blocks)."""
        if not self.mailbox.closed:
            self.mailbox.put_force(Envelope(_ActorStop()))

    def request_crash(self) -> None:
        """Debug hook: make the actor raise when it reaches this request."""
        self.mailbox.put_force(Envelope(CrashRequest()))

    def join(self, timeout: float) -> bool:
        """Wait until the slot has stopped (or escalated); True if it did in time."""
        return self.mailbox.wait_closed(timeout)

    # -- running (on the slot's dispatcher thread) -------------------------------------

    def _ready(self) -> None:
        self._dispatcher.schedule(self._worker, self)

    def run_batch(self) -> None:
        mailbox = self.mailbox
        if mailbox.closed:
            return
        actor = self._actor
        if actor is None:
            actor = self._start_instance() or self._restart()
            if actor is None:
                return
        budget = self._throughput
        pop = mailbox.pop
        while budget > 0:
            entry = pop()
            if entry is None:
                break
            envelope, n = entry
            if n > budget:  # a batch bigger than what is left: the rest waits its turn
                messages = envelope.message.messages
                mailbox.put_front(Envelope(Batch(messages[budget:])))
                envelope = Envelope(Batch(messages[:budget]))
                n = budget
            budget -= n
            actor = self._handle(actor, envelope)
            if actor is None:  # stopped, or escalated
                return
            if actor._stop_if_idle:
                actor._stop_if_idle = False
                if mailbox.close_if_empty():
                    actor._stop()  # on_stop
                    self._teardown(actor)
                    return
        try:
            actor.on_batch_end()
        except Exception:
            actor = self._crashed(actor, *sys.exc_info())
            if actor is None:
                return
        if mailbox.end_batch():
            self._ready()

    def _handle(self, actor: Actor, envelope: Envelope[Any]) -> Actor | None:
        """Handle one inbox entry with pykka's semantics; returns the instance to go on with.

        ``envelope.reply_to`` is read after the handler ran: ``defer_reply``
        takes it away to answer later.
        """
        try:
            response = actor._handle_receive(envelope.message)
        except Exception:
            if envelope.reply_to is not None:
                logger.info("exception returned from %s to its asker", self.name,
                            exc_info=True)
                envelope.reply_to.set_exception()
                return actor
            return self._crashed(actor, *sys.exc_info())
        except BaseException:  # SystemExit, KeyboardInterrupt: this actor crashes, no other
            logger.exception("%s raised a BaseException; treated as a crash", self.name)
            if envelope.reply_to is not None:
                envelope.reply_to.set_exception()
            return self._crashed(actor, *sys.exc_info())
        if envelope.reply_to is not None:
            envelope.reply_to.set(response)
        if actor._stop_requested:
            self._teardown(actor)
            return None
        return actor

    def _crashed(self, actor: Actor, *exc_info: Any) -> Actor | None:
        actor._handle_failure(*exc_info)
        try:
            actor.on_failure(*exc_info)
        except Exception:
            actor._handle_failure(*sys.exc_info())
        if actor._unprocessed:  # the rest of the crashed batch goes first to the next instance
            self.mailbox.put_front(Envelope(Batch(tuple(actor._unprocessed))))
        self._retire(actor)
        return self._restart()

    def _restart(self) -> Actor | None:
        """Build fresh instances until one starts; None when the intensity is exceeded."""
        while True:
            if not self._intensity.allow(self._clock()):
                logger.error("actor %s exceeded its restart intensity", self.name)
                self._finish()
                self._escalate(self.name)
                return None
            self.restarts += 1
            logger.warning("restarting actor %s (restart %d)", self.name, self.restarts)
            actor = self._start_instance()
            if actor is not None:
                return actor

    def _start_instance(self) -> Actor | None:
        """Build an instance and run its ``on_start``; None on failure."""
        try:
            actor = construct_on(self.mailbox, self._factory, self.name)
        except Exception:
            logger.exception("factory for actor %s failed", self.name)
            return None
        actor.restart_count = self.restarts
        self._actor = actor
        try:
            actor.on_start()
        except Exception:
            actor._handle_failure(*sys.exc_info())
            self._retire(actor)
            return None
        return actor

    def _retire(self, actor: Actor) -> None:
        self._handled_before += actor.handled
        self._actor = None

    def _teardown(self, actor: Actor) -> None:
        """After ``on_stop``: refuse new messages, fail the asks still queued."""
        self._retire(actor)
        for envelope in self._finish():
            reply_to = envelope.reply_to
            if reply_to is None:
                continue
            if isinstance(envelope.message, _ActorStop):
                reply_to.set(None)
            else:
                error = ActorDeadError(f"{self.name} stopped before handling the message")
                reply_to.set_exception((ActorDeadError, error, None))

    def _finish(self) -> list[Envelope[Any]]:
        """Close the mailbox; return what is left in it that nobody will handle."""
        left = self.mailbox.close()
        # The mailbox calls back into the slot; break that cycle so a forgotten
        # slot is freed at once, not at the next full collection (churn: 100
        # actors a second, most of them promoted before a gen-2 pass comes).
        self.mailbox.on_ready = None
        if self._on_finish is not None:
            left = self._on_finish(self, left)
        if self._owns_dispatcher:
            self._dispatcher.stop(timeout=0)
        return left
