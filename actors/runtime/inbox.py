"""An actor's inbox: bounded in messages, batches as single entries, and it schedules its actor.

Theory of operation
-------------------
A :class:`Batch` is what one ZeroMQ envelope or one ``tell_many`` carries: it
enters the :class:`Mailbox` as one entry, so the lock is taken once per
batch, while the bound counts the messages inside it.

The mailbox is also the actor's *scheduling state* (see
:mod:`actors.runtime.dispatcher`): ``scheduled`` is True while the actor is
queued, running or parked.  A put into the mailbox of an idle actor sets it
and calls ``on_ready`` (the slot puts itself in its dispatcher thread's run
queue); puts into the mailbox of a scheduled actor only append.  At the end of
a batch the slot calls :meth:`Mailbox.end_batch`: True means messages are
still waiting and the actor must be queued again (at the back: fairness).
Both happen under the mailbox's lock, so an actor is never queued twice and
never left idle with messages.

A sender that finds the mailbox full waits for room with a
:class:`~actors.runtime.dispatcher.Waiter`: an actor sender parks (its thread
runs the others, the receiver among them), a plain thread blocks.  ``put``
raises ``queue.Full`` when no room came within the timeout.  ``put_front`` and
``put_force`` ignore the bound: the runtime uses them for a crashed batch's
tail and for stop and crash requests, which must never be refused.  A closed
mailbox (its actor stopped) refuses puts with pykka's ``ActorDeadError``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pykka import ActorDeadError
from pykka._envelope import Envelope

from actors.runtime.dispatcher import Waiter

__all__ = ["DEFAULT_MAILBOX_SIZE", "Batch", "CrashRequest", "Mailbox"]

DEFAULT_MAILBOX_SIZE = 10_000


class Batch:
    """Several messages delivered as one inbox entry (internal, never on the wire)."""

    __slots__ = ("messages",)

    def __init__(self, messages: Sequence[Any]) -> None:
        self.messages = messages

    def __repr__(self) -> str:
        return f"Batch({len(self.messages)} messages)"


class CrashRequest:
    """Debug hook: the actor raises :class:`DebugCrash` when it handles this."""

    __slots__ = ()


def size_of(envelope: Envelope[Any]) -> int:
    """Messages an inbox entry carries."""
    message = envelope.message
    return len(message.messages) if type(message) is Batch else 1


class Mailbox:
    """A deque of envelopes bounded by the number of *messages* it holds."""

    def __init__(self, maxsize: int, on_ready: Callable[[], None] | None = None) -> None:
        self.maxsize = maxsize
        self.queue: deque[Envelope[Any]] = deque()
        self.depth = 0
        self.current: Envelope[Any] | None = None  # read by Actor.defer_reply
        self.scheduled = False
        self.closed = False
        self.on_ready = on_ready
        self._lock = threading.Lock()
        self._room: list[Waiter] = []
        self._on_close: list[threading.Event] = []  # threads in wait_closed

    # -- pykka's inbox interface (ActorRef.tell / ask, teardown) ---------------------

    def qsize(self) -> int:
        return self.depth

    def empty(self) -> bool:
        return not self.queue

    def get(self, block: bool = True, timeout: float | None = None) -> Envelope[Any]:
        """Take the next entry; never blocks (``queue.Empty`` when there is none)."""
        entry = self.pop()
        if entry is None:
            raise queue.Empty
        return entry[0]

    def put(self, item: Envelope[Any], block: bool = True, timeout: float | None = None) -> None:
        """Append ``item``; wait up to ``timeout`` for room (``queue.Full`` if none came)."""
        n = size_of(item)
        deadline = None
        while True:
            with self._lock:
                if self.closed:
                    raise ActorDeadError("the actor has stopped")
                if self.depth < self.maxsize:
                    self.queue.append(item)
                    self.depth += n
                    if self.scheduled:
                        return
                    self.scheduled = True
                    break
                if not block:
                    raise queue.Full
                waiter = Waiter()
                self._room.append(waiter)
            if timeout is not None:
                if deadline is None:
                    deadline = time.monotonic() + timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not waiter.wait(remaining)[0]:
                    with self._lock:
                        if waiter in self._room:
                            self._room.remove(waiter)
                    if remaining <= 0 or self.depth >= self.maxsize:
                        raise queue.Full
            else:
                waiter.wait(None)
        if self.on_ready is not None:
            self.on_ready()

    def put_front(self, item: Envelope[Any]) -> None:
        """Insert ``item`` at the head, ignoring the bound."""
        self._put_unbounded(item, front=True)

    def put_force(self, item: Envelope[Any]) -> None:
        """Append ``item`` at the tail, ignoring the bound."""
        self._put_unbounded(item, front=False)

    def _put_unbounded(self, item: Envelope[Any], *, front: bool) -> None:
        with self._lock:
            if self.closed:  # a stop or crash request, or a timer, for an actor that has gone
                return
            if front:
                self.queue.appendleft(item)
            else:
                self.queue.append(item)
            self.depth += size_of(item)
            if self.scheduled:
                return
            self.scheduled = True
        if self.on_ready is not None:
            self.on_ready()

    # -- the slot's side ---------------------------------------------------------------

    def pop(self) -> tuple[Envelope[Any], int] | None:
        """Take the next entry and the messages it carries (None if empty); wake senders
        waiting for room."""
        with self._lock:
            if not self.queue:
                return None
            envelope = self.queue.popleft()
            n = size_of(envelope)
            self.depth -= n
            room = self._room
            if room and self.depth < self.maxsize:
                waiters, self._room = room, []
            else:
                waiters = None
        if waiters:
            for waiter in waiters:
                waiter.wake()
        self.current = envelope
        return envelope, n

    def end_batch(self) -> bool:
        """The actor finished a batch: True if it must be queued again (messages wait)."""
        with self._lock:
            if self.queue and not self.closed:
                return True
            self.scheduled = False
            return False

    def close_if_empty(self) -> bool:
        """Refuse further puts if nothing is queued (atomically); True if closed."""
        with self._lock:
            if self.queue or self.closed:
                return False
            self.closed = True
            closing, self._on_close = self._on_close, []
        for event in closing:
            event.set()
        return True

    def close(self) -> list[Envelope[Any]]:
        """Refuse further puts; return what was still queued (to fail its asks)."""
        with self._lock:
            self.closed = True
            left = list(self.queue)
            self.queue.clear()
            self.depth = 0
            waiters, self._room = self._room, []
            closing, self._on_close = self._on_close, []
        for waiter in waiters:
            waiter.wake()
        for event in closing:
            event.set()
        return left

    def wait_closed(self, timeout: float) -> bool:
        """Block until the mailbox is closed (its actor stopped); True if it was in time."""
        with self._lock:
            if self.closed:
                return True
            event = threading.Event()
            self._on_close.append(event)
        return event.wait(timeout)
