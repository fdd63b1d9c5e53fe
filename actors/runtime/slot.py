"""Actor slots: one named place on a node, with its mailbox, thread and restart policy.

Theory of operation
-------------------
A *slot* is what a name resolves to on its node.  It owns the actor's
:class:`~actors.runtime.actor.Mailbox` and the OS thread the actor runs on, and it
outlives the actor instances that occupy it:

1. the slot thread calls ``factory(name)`` (the mailbox is handed to the new
   instance through pykka's ``_create_actor_inbox`` seam), registers it with
   pykka's registry and runs pykka's own loop pieces: ``_actor_loop_setup``
   (``on_start``) and ``_actor_loop_running``;
2. if the loop ended because a stop was requested, pykka's teardown runs
   (pending asks get ``ActorDeadError``) and the thread ends;
3. otherwise the actor crashed (``on_start`` or a told message raised).  If
   :class:`RestartIntensity` allows it, the slot counts a restart and goes
   back to 1 *on the same thread and the same mailbox*: queued messages -
   including the unprocessed tail of the batch that crashed - are handled by
   the fresh instance in their original order.  If the intensity is exceeded
   the slot calls ``escalate(name)``; the node then exits with
   ``EXIT_ESCALATED`` and the supervisor restarts the whole process.

``RestartIntensity`` is a pure class (time is passed in).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from pykka import ActorRegistry
from pykka._envelope import Envelope
from pykka.messages import _ActorStop

from actors.runtime.actor import Actor, construct_on
from actors.runtime.inbox import Batch, CrashRequest, Mailbox

__all__ = ["ActorSlot", "RestartIntensity"]

logger = logging.getLogger(__name__)

Factory = Callable[[str], Actor]


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
    """A named actor on this node: mailbox + thread + restart loop."""

    def __init__(
        self,
        name: str,
        factory: Factory,
        mailbox_size: int,
        *,
        intensity: RestartIntensity,
        escalate: Callable[[str], None],
        on_thread_exit: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.mailbox = Mailbox(mailbox_size)
        self.restarts = 0
        self._factory = factory
        self._intensity = intensity
        self._escalate = escalate
        self._on_thread_exit = on_thread_exit
        self._clock = clock
        self._handled_before = 0
        self._actor: Actor | None = None
        self._thread = threading.Thread(target=self._run, name=f"actor:{name}", daemon=True)

    @property
    def handled(self) -> int:
        """Messages handled by every instance that occupied this slot."""
        actor = self._actor
        return self._handled_before + (actor.handled if actor is not None else 0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the actor to stop after the messages already queued (never blocks)."""
        self.mailbox.put_force(Envelope(_ActorStop()))

    def request_crash(self) -> None:
        """Debug hook: make the actor raise when it reaches this request."""
        self.mailbox.put_force(Envelope(CrashRequest()))

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "depth": self.mailbox.depth,
            "handled": self.handled,
            "restarts": self.restarts,
            "alive": self.alive,
        }

    def _run(self) -> None:
        unprocessed: tuple[Any, ...] = ()
        try:
            while True:
                actor = self._construct()
                if actor is not None:
                    actor.restart_count = self.restarts
                    if unprocessed:
                        self.mailbox.put_front(Envelope(Batch(unprocessed)))
                    stopped, unprocessed = self._run_instance(actor)
                    if stopped:
                        return
                if not self._intensity.allow(self._clock()):
                    logger.error("actor %s exceeded its restart intensity", self.name)
                    self._escalate(self.name)
                    return
                self.restarts += 1
                logger.warning("restarting actor %s (restart %d)", self.name, self.restarts)
        finally:
            self._on_thread_exit()

    def _construct(self) -> Actor | None:
        try:
            return construct_on(self.mailbox, self._factory, self.name)
        except Exception:
            logger.exception("factory for actor %s failed", self.name)
            return None

    def _run_instance(self, actor: Actor) -> tuple[bool, tuple[Any, ...]]:
        """Run one instance to its end; return (stopped on request, unprocessed tail)."""
        self._actor = actor
        ActorRegistry.register(actor.actor_ref)
        try:
            actor._actor_loop_setup()
            actor._actor_loop_running()
            if actor._stop_requested:
                actor._actor_loop_teardown()
                return True, ()
            return False, tuple(actor._unprocessed)
        finally:
            ActorRegistry.unregister(actor.actor_ref)
            handled = actor.handled
            self._actor = None
            self._handled_before += handled
