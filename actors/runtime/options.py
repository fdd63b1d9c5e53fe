"""Options of the actor runtime: one frozen dataclass with documented defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["EXIT_ESCALATED", "LOG_FORMAT", "RuntimeOptions"]

LOG_FORMAT = ("ts=%(asctime)s level=%(levelname)s node={node} pid=%(process)d "
              "logger=%(name)s msg=%(message)r")
"""logfmt-style records (one key=value line each); ``{node}`` is the process's role."""

EXIT_ESCALATED = 75
"""Exit code of a node whose actor exceeded the restart intensity (node restart wanted)."""


def _cpu_count() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class RuntimeOptions:
    """Knobs of the process pool, mailboxes and supervision."""

    workers: int = field(default_factory=_cpu_count)
    """Number of worker processes (topics, channels, diskqueues live there); 0: the
    gateway process hosts every actor."""
    mailbox_size: int = 10_000
    """Bound of each actor's inbox, in messages (a batch may overshoot it once)."""
    hwm: int = 1_000
    """ZeroMQ SNDHWM/RCVHWM in envelopes, per sending thread and per node inbox."""
    dispatcher_threads: int = 1
    """Threads per process that run its actors (however many actors it hosts).  One:
    under the GIL a second thread adds handovers, not parallelism (BENCHMARKS)."""
    throughput: int = 300
    """Messages an actor handles before its thread moves on to the next ready actor."""
    io_threads: int = 4
    """Threads per process for blocking work actors offload (``Actor.blocking``)."""
    send_timeout: float = 5.0
    """Seconds a sender waits on a full mailbox before ``MailboxFull`` is raised."""
    ask_timeout: float = 5.0
    """Default seconds ``ask`` waits for a reply before ``AskTimeout``."""
    max_restarts: int = 5
    """Restart intensity: at most this many actor restarts ..."""
    restart_window: float = 10.0
    """... within this many seconds; one more restarts the whole node."""
    shutdown_timeout: float = 10.0
    """Seconds an orderly shutdown may take before stragglers are killed."""
    debug_hooks: bool = False
    """Enable debug-only operations such as ``crash NAME`` (chaos tests)."""
    start_timeout: float = 30.0
    """Seconds ``start()`` waits for every node to answer a ping."""
    stop_order: tuple[str, ...] = ()
    """Name kinds stopped first, in this order, at an orderly shutdown; each kind's
    actors finish before the next kind is asked to stop, and kinds not listed stop
    last, together.  The broker stops clients, then topics, then channels, so
    each one can still hand its memory to the disk-queue actors below it."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            msg = f"workers must be >= 0, got {self.workers}"
            raise ValueError(msg)
        if min(self.mailbox_size, self.hwm, self.dispatcher_threads, self.throughput,
               self.io_threads) < 1:
            msg = "mailbox_size, hwm, dispatcher_threads, throughput and io_threads must be >= 1"
            raise ValueError(msg)
