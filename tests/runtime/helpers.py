"""Actors and messages used by the runtime tests (importable by spawned nodes)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from actors.runtime import Actor, message
from actors.runtime.actor import current_endpoint


@message
@dataclass(frozen=True)
class Seq:
    """A numbered message."""

    n: int
    """Sequence number."""


@message
@dataclass(frozen=True)
class GetLog:
    """Ask for the list of sequence numbers received so far."""


@message
@dataclass(frozen=True)
class Boom:
    """Make the receiving actor raise."""


@message
@dataclass(frozen=True)
class Whoami:
    """Ask for ``(name, pid, instance id)``."""


@message
@dataclass(frozen=True)
class Forward:
    """Ask the receiver to ask ``target`` for ``Whoami`` and return the answer."""

    target: str
    """The actor to ask."""


@message
@dataclass(frozen=True)
class Relay:
    """Tell ``target`` the numbers ``0..count-1`` as ``Seq``, then return ``count``."""

    target: str
    """Destination actor."""
    count: int
    """How many messages to send."""


@message
@dataclass(frozen=True)
class AskAll:
    """Ask every target at once (``Endpoint.ask_many``): ``Whoami`` each, ``Boom`` the
    ones in ``boom``; return ``(name, pid)`` per answer, the error's type name per failure."""

    targets: tuple[str, ...]
    boom: tuple[str, ...] = ()


def ask_all(asker: Any, msg: AskAll) -> tuple[Any, ...]:
    replies = asker.ask_many([(t, Boom() if t in msg.boom else Whoami()) for t in msg.targets],
                             timeout=5)
    return tuple(type(r).__name__ if isinstance(r, Exception) else tuple(r[:2])
                 for r in replies)


class Recorder(Actor):
    """Records every Seq; answers GetLog, Whoami, Forward and Relay; raises on Boom."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.log: list[int] = []

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Seq(n=n):
                self.log.append(n)
                return None
            case GetLog():
                return tuple(self.log)
            case Boom():
                raise RuntimeError("boom")
            case Whoami():
                return (self.name, os.getpid(), id(self))
            case Forward(target=target):
                return self.ask(target, Whoami(), timeout=5)
            case AskAll():
                return ask_all(self, msg)
            case Relay(target=target, count=count):
                for i in range(count):
                    self.tell(target, Seq(i))
                return count
            case AskLocal(target=target):
                # (the answer comes back as a Seq of the answerer's pid, -1 on an error)
                try:
                    current_endpoint().ask_local(
                        target, Whoami(),
                        lambda v, e: self.tell(self.name, Seq(-1 if e else v[1])))
                except ValueError as e:
                    return str(e)
                return "sent"
        return None


@message
@dataclass(frozen=True)
class AskLocal:
    """Ask ``target`` for Whoami with ``Endpoint.ask_local``; its pid arrives as a Seq."""

    target: str


@message
@dataclass(frozen=True)
class Later:
    """Ask: answered only when a ``Release`` arrives (a deferred reply)."""


@message
@dataclass(frozen=True)
class Release:
    """Answer every pending ``Later`` with ``value``."""

    value: int
    """The answer."""


class Deferrer(Actor):
    """Keeps the replies to ``Later`` asks and answers them on ``Release``."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.waiting: list[Any] = []

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Later():
                self.waiting.append(self.defer_reply())
            case Release(value=value):
                for handle in self.waiting:
                    handle.set(value)
                self.waiting.clear()
        return None


class StopMarker(Actor):
    """Writes ``<ACTORS_TEST_MARKERS>/<name>.stopped`` in on_stop (storage closed)."""

    def on_receive(self, msg: Any) -> Any:
        return "ok"

    def on_stop(self) -> None:
        directory = os.environ["ACTORS_TEST_MARKERS"]
        path = os.path.join(directory, self.name.replace(":", "_") + ".stopped")
        with open(path, "w", encoding="utf-8") as f:
            f.write("stopped\n")


class SlowStop(Actor):
    """Its on_stop never finishes in time: the shutdown deadline must kill its node."""

    def on_receive(self, msg: Any) -> Any:
        return "ok"

    def on_stop(self) -> None:
        threading.Event().wait(60)


FACTORIES = {
    "rec": Recorder,
    "topic": Recorder,
    "channel": Recorder,
    "client": Recorder,
    "marker": StopMarker,
    "defer": Deferrer,
    "slowstop": SlowStop,
}
"""Factories by name prefix used by the runtime tests."""
