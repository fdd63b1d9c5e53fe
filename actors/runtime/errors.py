"""Exceptions of the actor runtime; everything derives from :class:`ActorsError`."""

from __future__ import annotations

__all__ = [
    "ActorsError",
    "AskTimeout",
    "DebugHooksDisabled",
    "MailboxFull",
    "RemoteActorError",
    "RuntimeNotRunning",
    "UnknownActor",
]


class ActorsError(Exception):
    """Root of the runtime's exceptions."""


class MailboxFull(ActorsError):
    """A mailbox (local inbox or the ZeroMQ queue to a node) stayed full for ``send_timeout``.

    The message was *not* delivered; the sender may retry, shed load or fail.
    """


class AskTimeout(ActorsError, TimeoutError):
    """No reply arrived within the ask timeout (target slow, dead or restarting)."""


class RemoteActorError(ActorsError):
    """The asked actor raised; carries the remote exception's type name and text."""

    def __init__(self, type_name: str, text: str) -> None:
        super().__init__(f"{type_name}: {text}")
        self.type_name = type_name
        self.text = text


class UnknownActor(ActorsError):
    """No actor with that name exists and no factory handles its prefix."""


class DebugHooksDisabled(ActorsError):
    """A debug-only operation (e.g. ``crash``) was refused: start with ``debug_hooks=True``."""


class RuntimeNotRunning(ActorsError):
    """The runtime (or this endpoint) was stopped or never started."""


class DebugCrash(RuntimeError):
    """Raised inside an actor by the debug ``crash`` hook."""
