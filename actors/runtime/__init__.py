"""The actor runtime: pykka actors on a process pool with ZeroMQ mailboxes.

Quick start::

    from actors.runtime import Actor, Supervisor, message

    @message
    class Add:
        n: int  # amount to add

    class Counter(Actor):
        def __init__(self, name):
            super().__init__(name)
            self.total = 0

        def on_receive(self, msg):
            if isinstance(msg, Add):
                self.total += msg.n
            return self.total

    with Supervisor("/tmp/rt", {"counter": Counter}, workers=2) as rt:
        rt.tell("counter:a", Add(2))
        assert rt.ask("counter:a", Add(1), timeout=5) == 3

See ``docs/ACTORS.md``.
"""

from typing import TYPE_CHECKING

from actors.runtime.lazy import attributes

if TYPE_CHECKING:
    from actors.runtime.actor import Actor, no_spawn
    from actors.runtime.control import ActorInfo, ControlClient, ProcessInfo
    from actors.runtime.errors import (
        ActorsError,
        AskTimeout,
        DebugHooksDisabled,
        MailboxFull,
        RemoteActorError,
        RuntimeNotRunning,
        UnknownActor,
    )
    from actors.runtime.main import connect
    from actors.runtime.options import EXIT_ESCALATED, RuntimeOptions
    from actors.runtime.placement import Placement
    from actors.runtime.supervisor import Supervisor
    from transport.mailbox.envelope import message

# Imported on first use (PEP 562): a daemon's ``__main__`` starts the fork server
# (actors.runtime.forkserver) before it imports the rest of the runtime.
_LAZY = {
    "Actor": "actors.runtime.actor", "no_spawn": "actors.runtime.actor",
    "ActorInfo": "actors.runtime.control", "ControlClient": "actors.runtime.control",
    "ProcessInfo": "actors.runtime.control",
    **dict.fromkeys(("ActorsError", "AskTimeout", "DebugHooksDisabled", "MailboxFull",
                     "RemoteActorError", "RuntimeNotRunning", "UnknownActor"),
                    "actors.runtime.errors"),
    "connect": "actors.runtime.main",
    "EXIT_ESCALATED": "actors.runtime.options", "RuntimeOptions": "actors.runtime.options",
    "Placement": "actors.runtime.placement",
    "Supervisor": "actors.runtime.supervisor",
    "message": "transport.mailbox.envelope",
}

__getattr__ = attributes(__name__, _LAZY)


__all__ = [
    "EXIT_ESCALATED",
    "Actor",
    "ActorInfo",
    "ActorsError",
    "AskTimeout",
    "ControlClient",
    "DebugHooksDisabled",
    "MailboxFull",
    "Placement",
    "ProcessInfo",
    "RemoteActorError",
    "RuntimeNotRunning",
    "RuntimeOptions",
    "Supervisor",
    "UnknownActor",
    "connect",
    "message",
    "no_spawn",
]
