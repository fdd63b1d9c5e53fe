"""An actor's inbox: bounded in messages, with batches as single entries.

A :class:`Batch` is what one ZeroMQ envelope or one ``tell_many`` carries: it
enters the :class:`Mailbox` as one entry, so queue locking is paid once per
batch, while the bound counts the messages inside it.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Sequence
from typing import Any

from pykka._envelope import Envelope

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


def _size(envelope: Envelope[Any]) -> int:
    message = envelope.message
    return len(message.messages) if type(message) is Batch else 1


class Mailbox(queue.Queue[Envelope[Any]]):
    """A ``queue.Queue`` bounded by the number of *messages* it holds.

    ``put`` blocks while ``depth >= maxsize`` (so a batch may overshoot the
    bound once, by less than its own length).  ``put_front`` and
    ``put_force`` ignore the bound; the runtime uses them for a crashed
    batch's tail and for stop requests, which must never be refused.
    """

    def _init(self, maxsize: int) -> None:
        self.queue: deque[Envelope[Any]] = deque()
        self.depth = 0
        self.current: Envelope[Any] | None = None

    def _qsize(self) -> int:
        return self.depth

    def _put(self, item: Envelope[Any]) -> None:
        self.queue.append(item)
        self.depth += _size(item)

    def _get(self) -> Envelope[Any]:
        item = self.queue.popleft()
        self.depth -= _size(item)
        self.current = item  # read by Actor.defer_reply, on the same (actor's) thread
        return item

    def put_front(self, item: Envelope[Any]) -> None:
        """Insert ``item`` at the head, ignoring the bound."""
        with self.mutex:
            self.queue.appendleft(item)
            self.depth += _size(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()

    def put_force(self, item: Envelope[Any]) -> None:
        """Append ``item`` at the tail, ignoring the bound."""
        with self.mutex:
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()
