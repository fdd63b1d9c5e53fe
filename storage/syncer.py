"""One background thread per process that fsyncs queues `sync_timeout` after a write.

go-diskqueue gives every queue a goroutine with a sync ticker; a thread per
queue would be too heavy for thousands of queues, so queues register a
deadline here when they go from clean to dirty, and a single daemon thread
calls their `_timed_sync()` when the deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class _Syncable(Protocol):
    def _timed_sync(self) -> None: ...


class Syncer:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, weakref.ref[_Syncable]]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, queue: _Syncable, delay: float) -> None:
        """Call `queue._timed_sync()` about `delay` seconds from now."""
        deadline = self._clock() + delay
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._seq), weakref.ref(queue)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="storage-syncer",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0][0] == deadline:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, _, ref = self._heap[0]
                wait = deadline - self._clock()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
            queue = ref()
            if queue is None:
                continue
            try:
                queue._timed_sync()
            except Exception:  # a failing queue must not stop syncing of the others
                log.exception("background sync failed")


SYNCER = Syncer()
