"""The scanner actor: nsqd's queueScanLoop, as messages (`scanner:<worker index>`).

One scanner runs on every worker and sweeps the channels hosted there that
have work to expire.  A channel registers (``ScanRegister``) when it first
has a message in flight or deferred, and leaves the sweep by answering a
``Scan`` with ``idle`` once it has neither -- so 10,000 idle channels cost
the scanner nothing, a broker's boot sends it nothing, and a busy channel is
never diluted by idle ones in the random selection (nsqd samples every
channel, idle or not).
Every ``--queue-scan-interval`` (``Tick``, a timer on the actor's own
dispatcher thread) it picks up to ``--queue-scan-selection-count`` random
channels and sends each ``Scan(now)``; a channel processes its in-flight and
deferred queues for ``now`` and answers ``ScanDone(dirty, idle)``.  If more
than ``--queue-scan-dirty-percent`` of the selection had expired work,
another round starts at once; otherwise the scanner waits for the next tick.

The *pool* follows nsqd: at most ``clamp(channels / 4, 1,
--queue-scan-worker-pool-max)`` scans are outstanding at a time -- channels
are actors, so that many sweep in parallel.  The round logic is the pure
class :class:`ScanRound` (rng and time passed in); the actor adds the timer.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from typing import Any

from actors.broker import health
from actors.broker.messages import (
    Alive,
    Scan,
    ScanDone,
    ScanRegister,
    ScanUnregister,
    Swept,
    Tick,
)
from actors.broker.options import BrokerOptions
from actors.runtime.actor import Actor

log = logging.getLogger(__name__)


def pool_size(channels: int, pool_max: int) -> int:
    """nsqd's resizePool: a quarter of the channels, at least 1, at most `pool_max`."""
    return max(1, min(pool_max, channels // 4))


class ScanRound:
    """One sweep: which channels to ask, how many at once, whether to loop again."""

    def __init__(self, channels: list[str], *, selection_count: int, pool_max: int,
                 rng: random.Random) -> None:
        chosen = rng.sample(channels, min(selection_count, len(channels)))
        self.pending: deque[str] = deque(chosen)
        self.selected = len(chosen)
        self.outstanding: set[str] = set()
        self.dirty = 0
        self.pool = pool_size(len(channels), pool_max)

    def next_to_send(self) -> list[str]:
        """Channels to send `Scan` to now (keeps `pool` outstanding)."""
        out = []
        while self.pending and len(self.outstanding) < self.pool:
            channel = self.pending.popleft()
            self.outstanding.add(channel)
            out.append(channel)
        return out

    def done(self, channel: str, dirty: bool) -> None:
        if channel in self.outstanding:
            self.outstanding.discard(channel)
            self.dirty += dirty

    def forget(self, channel: str) -> None:
        """A channel went away mid-round: stop waiting for it."""
        self.outstanding.discard(channel)
        if channel in self.pending:
            self.pending.remove(channel)

    @property
    def finished(self) -> bool:
        return not self.pending and not self.outstanding

    def loop_again(self, dirty_percent: float) -> bool:
        return self.selected > 0 and self.dirty / self.selected > dirty_percent


_epochs = itertools.count(1)


class ScannerActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions, clock: Any = time.time_ns) -> None:
        super().__init__(name)
        self.options = options
        self.clock = clock
        self.channels: set[str] = set()
        self.round: ScanRound | None = None
        self.round_started = 0.0
        self.rng = random.Random()
        self.rounds = 0
        # A restarted instance keeps the mailbox, and with it the last instance's
        # pending tick: ticks carry the instance's epoch, so only one chain runs.
        self.epoch = next(_epochs)

    def on_start(self) -> None:
        self.tell_later(self.options.queue_scan_interval, Tick(self.epoch))

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Alive():
                return health.failed_queues(), health.last_publish()
            case Swept():
                return sorted(self.channels)
            case ScanRegister(channel=channel):
                self.channels.add(channel)
            case ScanUnregister(channel=channel):
                self._forget(channel)
            case Tick(epoch=epoch):
                if epoch != self.epoch:
                    return None
                self.tell_later(self.options.queue_scan_interval, Tick(self.epoch))
                if self.round is None:
                    self._start_round()
                elif time.monotonic() - self.round_started > 10 * max(
                        self.options.queue_scan_interval, 0.1):
                    log.warning("%s: a sweep has waited too long for %s; starting afresh",
                                self.name, sorted(self.round.outstanding))
                    self._start_round()
            case ScanDone(channel=channel, dirty=dirty, idle=idle):
                if idle:  # nothing in flight or deferred: out of the sweep until it registers
                    self.channels.discard(channel)
                if self.round is not None:
                    self.round.done(channel, dirty)
                    self._send()
                    self._maybe_finish()
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None

    def _forget(self, channel: str) -> None:
        self.channels.discard(channel)
        if self.round is not None:
            self.round.forget(channel)
            self._maybe_finish()

    def _start_round(self) -> None:
        if not self.channels:
            self.round = None
            return
        o = self.options
        self.round = ScanRound(sorted(self.channels), selection_count=o.queue_scan_selection_count,
                               pool_max=o.queue_scan_worker_pool_max, rng=self.rng)
        self.round_started = time.monotonic()
        self.rounds += 1
        self._send()

    def _send(self) -> None:
        assert self.round is not None
        now = self.clock()
        for channel in self.round.next_to_send():
            self.tell(f"channel:{channel}", Scan(now, self.name))

    def _maybe_finish(self) -> None:
        r = self.round
        if r is None or not r.finished:
            return
        self.round = None
        if r.loop_again(self.options.queue_scan_dirty_percent):
            self._start_round()
