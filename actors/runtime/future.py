"""A pykka future whose ``get`` parks an actor instead of blocking its dispatcher thread.

pykka hands every ask a future through the actor's ``_create_future`` seam
and completes it with ``set`` / ``set_exception`` from the answering actor's
thread.  :class:`Future` keeps pykka's contract (``get`` may be called again,
raises the answer's exception with its traceback, ``pykka.Timeout`` after the
timeout) and waits with a :class:`~actors.runtime.dispatcher.Waiter`: inside
an actor the actor parks and its thread runs the others; on any other thread
the thread blocks, as a ``ThreadingFuture`` would.
"""

from __future__ import annotations

import sys
from typing import Any

import pykka

from actors.runtime.dispatcher import Waiter

__all__ = ["CallbackFuture", "Future"]

_UNSET = object()


class Future(pykka.Future[Any]):
    """Completed once, from any thread; waited on from an actor or a plain thread."""

    def __init__(self) -> None:
        super().__init__()
        self._waiter = Waiter()
        self._value: Any = _UNSET
        self._exc_info: Any = None

    def get(self, *, timeout: float | None = None) -> Any:
        if self._get_hook is not None:
            return super().get(timeout=timeout)
        if self._value is _UNSET:
            waiter = self._waiter
            if waiter.done:  # an earlier get timed out: wait afresh
                waiter = self._waiter = Waiter()
            if self._value is _UNSET and not waiter.wait(timeout)[0]:
                msg = f"{timeout} seconds"
                raise pykka.Timeout(msg)
        if self._exc_info is not None:
            _, exc, tb = self._exc_info
            raise exc.with_traceback(tb)
        return self._value

    def set(self, value: Any = None) -> None:
        if self._value is not _UNSET:
            msg = "future already completed"
            raise RuntimeError(msg)
        self._value = value
        self._waiter.wake()

    def set_exception(self, exc_info: Any = None) -> None:
        if self._value is not _UNSET:
            msg = "future already completed"
            raise RuntimeError(msg)
        self._exc_info = exc_info or sys.exc_info()
        self._value = None
        self._waiter.wake()


class CallbackFuture(Future):
    """A future that also calls ``on_done(value, exc)`` once completed (on the
    completing thread): how a thread that must not block (an event loop) asks."""

    def __init__(self, on_done: Any) -> None:
        super().__init__()
        self._on_done = on_done

    def set(self, value: Any = None) -> None:
        super().set(value)
        self._on_done(value, None)

    def set_exception(self, exc_info: Any = None) -> None:
        super().set_exception(exc_info)
        self._on_done(None, self._exc_info[1])
