"""System requests a node's dispatcher answers itself (not routed to an actor).

They travel as ordinary envelopes addressed to :data:`SYSTEM`, so the
supervisor, the control CLI and tests use the same wire as actors do.
"""

from __future__ import annotations

from transport.mailbox.envelope import message

__all__ = ["SYSTEM", "ActorSummary", "Crash", "ListActors", "Ping", "Spawn"]

SYSTEM = "$system"
"""Destination name of system requests; never a valid actor name."""


@message
class Ping:
    """Liveness probe; the reply is ``(node name, pid)``."""


@message
class ListActors:
    """Reply: a tuple of dicts (name, depth, handled, restarts, alive), one per slot."""

    prefix: str = ""
    """Only the slots whose name starts with this (``"topic:"``)."""


@message
class ActorSummary:
    """Reply: one dict per kind of actor on the node (``topic``, ``client``, ...): ``kind``,
    ``node``, ``count``, ``alive``, and ``depth``, ``handled``, ``restarts`` summed.

    Bounded whatever the number of actors (``/stats`` and ``/metrics`` use it; the
    per-actor list is ``ListActors``, for ``python -m actors.ctl actors``).
    """


@message
class Spawn:
    """Create actor ``name`` on this node if it does not exist yet; reply True if created."""

    name: str
    """The actor's name; its prefix selects the factory."""


@message
class Crash:
    """Debug hook: make actor ``name`` raise; refused unless debug hooks are on."""

    name: str
    """The actor to crash."""
