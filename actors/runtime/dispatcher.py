"""The dispatcher: many actors on a few threads, and waiting that parks an actor, not a thread.

Theory of operation
-------------------
A process's actors share a :class:`Dispatcher` of ``threads`` OS threads.
Each thread owns a *run queue* of things to run and a heap of timers.  An
actor (its slot, :mod:`actors.runtime.slot`) is pinned to one thread when it
is created and is, at any moment, in exactly one state:

``idle``     empty mailbox; it holds no thread and no stack;
``queued``   in its thread's run queue, once (the mailbox schedules it when a
             message arrives for an idle actor);
``running``  handling a batch of at most ``throughput`` messages on its thread;
             after the batch it goes to the back of the run queue if more
             messages wait (fairness: a flooded actor cannot starve the rest),
             else back to idle;
``parked``   waiting inside a handler (an ``ask``, a blocking call offloaded to
             the I/O pool, room in a full mailbox): its stack is kept in a
             greenlet, its thread runs other actors, and the event it waits for
             puts it back in the run queue, where it continues where it stopped.

Each thread runs an asyncio event loop, and its run queue is drained by that
loop, a turn at a time between its I/O: socket servers an actor starts on
the thread (:class:`transport.nsq.server.LoopServer` with no listening
address, which serves the connections handed to a worker) share the loop, so
a connection's reads, its actors and its writes run on one thread, with no
wake-up or GIL hand-over between a socket thread and an actor thread (PUB
and SUB on one worker with NSQ's bench clients: 1.17x-1.35x, BENCHMARKS.md).
Batches run inside greenlets (the ``greenlet`` package: no monkey patching;
the loop knows nothing of them).  A thread's main greenlet is its scheduler
(the loop); it
switches into a *runner* greenlet to run a batch, and the runner switches
back when the batch is done (the runner is then reused: creating a greenlet
costs ~8 us, a switch ~0.2 us) or when the handler parks (the runner then
belongs to the parked actor until it is resumed, and the scheduler takes
another runner).  A greenlet can only resume on the thread that created it,
which is why actors are pinned.

Waiting is the :class:`Waiter`: ``wait(timeout)`` parks the calling actor
when called on a dispatcher thread inside a batch, and blocks the calling
thread otherwise (tests, the supervisor, other threads' socket loops).  On a
dispatcher thread outside any batch (a socket callback of its loop waiting
for room in a full mailbox) blocking would stop the very actors it waits
for, so the wait runs the thread's queued actors until it is woken or its
timeout passes.  ``wake(value)`` may
be called from any thread, exactly once wins (a timeout racing a reply
cannot resume an actor twice).

Blocking work (fsync, SQLite, file I/O) goes to a small I/O pool with
:meth:`Dispatcher.blocking`: the actor parks until the call returns, and its
dispatcher thread keeps running the others.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import greenlet

__all__ = ["Dispatcher", "Runnable", "Timer", "Waiter", "call_later", "current_runnable",
           "in_actor"]

logger = logging.getLogger(__name__)

_DONE = object()
_PARKED = object()
_STOP = object()
_NOTHING = object()  # queued only to have the loop come back for what is left
# Seconds of actors' batches a loop turn runs before the loop polls its sockets again
# (the interpreter's switch interval, as two threads sharing the GIL would take turns)
_TURN = 0.005


class Timer(Protocol):
    """What a worker's timer heap holds: something to expire at its deadline."""

    def expire(self) -> None:
        """The deadline passed (called on the worker's thread, between batches)."""


class Runnable(Protocol):
    """What a dispatcher thread runs: an actor slot."""

    name: str
    """For logs and thread-dump readers."""

    def run_batch(self) -> None:
        """Handle up to the throughput bound of messages; may park inside."""


class _Worker:
    """One dispatcher thread: its event loop, run queue, timers and idle runner greenlets."""

    def __init__(self, dispatcher: Dispatcher, index: int) -> None:
        self.dispatcher = dispatcher
        self.index = index
        self.loop = asyncio.new_event_loop()
        self.runq: collections.deque[Any] = collections.deque()
        self.timers: list[tuple[float, int, Timer]] = []
        self.hub: greenlet.greenlet | None = None
        self.idle_runners: list[greenlet.greenlet] = []
        self.current: Runnable | None = None
        self.ident: int | None = None  # the thread's, once it runs
        self._lock = threading.Lock()
        self._turn_due = False  # a drain of the run queue is scheduled on the loop
        self._stopped = False  # the stop was taken: nothing more runs
        self._alarm: asyncio.TimerHandle | None = None  # the loop's timer for the heap's first
        self._waits = 0  # run_until calls under way on this thread
        self._woken = threading.Event()  # set by put() and wakes while a run_until waits
        self.thread = threading.Thread(
            target=self._main, name=f"dispatcher:{dispatcher.name}/{index}", daemon=True
        )

    def put(self, item: Any) -> None:
        """Queue ``item`` (a runnable, a resume, or the stop) from any thread."""
        self.runq.append(item)
        if self._waits:  # a socket callback of the loop waits in run_until: not the loop
            self._woken.set()
        with self._lock:
            if self._turn_due:
                return
            self._turn_due = True
        try:
            if threading.get_ident() == self.ident:
                self.loop.call_soon(self._turn)
            else:
                self.loop.call_soon_threadsafe(self._turn)
        except RuntimeError:  # the loop is closed: the dispatcher has stopped
            pass

    # -- the scheduler (the thread's main greenlet, in its loop) --------------------------

    def _main(self) -> None:
        _local.worker = self
        self.hub = greenlet.getcurrent()
        self.ident = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            _close_loop(self.loop)
            _local.worker = None

    def _turn(self) -> None:
        """Run what is queued for up to a time slice, then let the loop do its I/O."""
        with self._lock:
            self._turn_due = False
        runq = self.runq
        until = time.monotonic() + _TURN
        while runq and not self._stopped:
            item = runq.popleft()
            if item is _STOP:
                self._stopped = True  # (what is queued behind the stop is dropped)
                self.loop.stop()
                return
            self._run(item)
            if time.monotonic() >= until:
                if runq:
                    self.put(_NOTHING)
                return

    def _run(self, item: Any) -> None:
        if item is _NOTHING:
            return
        if type(item) is _Resume:
            runner, self.current, value = item.runner, item.runnable, item.value
        else:
            runner = self.idle_runners.pop() if self.idle_runners else greenlet.greenlet(
                _runner_main, parent=self.hub)
            self.current = value = item
        try:
            result = runner.switch(value)
        finally:
            self.current = None
        if result is _DONE:
            self.idle_runners.append(runner)
        # else _PARKED: the runner now belongs to the parked runnable's Waiter

    # -- timers ------------------------------------------------------------------

    def _fire_timers(self) -> None:
        now = time.monotonic()
        timers = self.timers
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            try:
                timer.expire()
            except BaseException:  # as a batch's: one must not end the thread and its timers
                logger.exception("dispatcher: timer %r raised", timer)

    def add_timer(self, deadline: float, timer: Timer) -> None:
        """Call ``timer.expire()`` at ``deadline`` (called on this worker's own thread only)."""
        heapq.heappush(self.timers, (deadline, next(_timer_seq), timer))
        self._arm()

    def _arm(self) -> None:
        """One loop timer, at the heap's first deadline (the loop's clock is monotonic)."""
        if not self.timers:
            return
        first = self.timers[0][0]
        alarm = self._alarm
        if alarm is not None:
            if alarm.when() <= first:
                return
            alarm.cancel()
        self._alarm = self.loop.call_at(first, self._on_alarm)

    def _on_alarm(self) -> None:
        self._alarm = None
        self._fire_timers()
        self._arm()

    # -- waiting on this thread outside a batch --------------------------------------

    def run_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Run queued actors and due timers until ``done()`` or `timeout` passes (a socket
        callback of this loop waiting for room: see the module docstring).  The loop does
        no I/O meanwhile, so the timeout holds however much there is to run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        runq, woken = self.runq, self._woken
        self._waits += 1
        try:
            while not done():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if self.timers and self.timers[0][0] <= now:
                    self._fire_timers()
                    continue
                if self._has_runnable():
                    self._run(runq.popleft())
                    continue
                woken.clear()
                if done() or self._has_runnable():
                    continue  # (it came between the checks and the clear)
                # nothing of this thread's to run: what it waits for comes from elsewhere
                wait = None if deadline is None else deadline - now
                if self.timers:
                    due = self.timers[0][0] - now
                    wait = due if wait is None else min(wait, due)
                woken.wait(wait)
            return True
        finally:
            self._waits -= 1

    def _has_runnable(self) -> bool:
        """Something queued that may run now (after a stop nothing runs: the loop ends
        once the wait is over)."""
        runq = self.runq
        return bool(runq) and runq[0] is not _STOP and not self._stopped


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """After a stopped loop: let what its servers scheduled as they closed run, end
    its tasks, and release its selector and self-pipe."""
    try:
        loop.run_until_complete(asyncio.sleep(0))  # (callbacks and tasks already due)
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.wait(tasks, timeout=1.0) if tasks
                                else asyncio.sleep(0))
    except Exception:
        logger.exception("dispatcher: closing its loop")
    finally:
        loop.close()


def _runner_main(runnable: Runnable) -> None:
    """A runner greenlet: run batches until the thread stops (reused between batches)."""
    worker: _Worker = _local.worker
    hub = worker.hub
    assert hub is not None
    while True:
        try:
            runnable.run_batch()
        except greenlet.GreenletExit:  # a parked runner collected at shutdown: let it end
            raise
        except BaseException:  # a slot must never let one escape; keep the thread alive
            logger.exception("dispatcher: %s raised out of its batch", runnable.name)
        runnable = hub.switch(_DONE)


class _Resume:
    """Run queue entry: continue a parked runnable's runner with ``value``."""

    __slots__ = ("runnable", "runner", "value")

    def __init__(self, runnable: Runnable, runner: greenlet.greenlet, value: Any) -> None:
        self.runnable = runnable
        self.runner = runner
        self.value = value


_local = threading.local()
_timer_seq = itertools.count()


def call_later(delay: float, timer: Timer) -> None:
    """Expire ``timer`` after ``delay`` seconds, on this dispatcher thread (inside an actor)."""
    worker: _Worker | None = getattr(_local, "worker", None)
    if worker is None or worker.current is None:
        msg = "call_later works inside an actor running on a dispatcher"
        raise RuntimeError(msg)
    worker.add_timer(time.monotonic() + delay, timer)


def in_actor() -> bool:
    """True on a dispatcher thread inside an actor's batch (waiting parks the actor)."""
    worker: _Worker | None = getattr(_local, "worker", None)
    return worker is not None and worker.current is not None


def current_runnable() -> Runnable | None:
    """The runnable whose batch is running on this thread, if any."""
    worker: _Worker | None = getattr(_local, "worker", None)
    return worker.current if worker is not None else None


_PENDING, _WOKEN, _EXPIRED = 0, 1, 2


class Waiter:
    """One wait for one event: parks an actor, or blocks a plain thread.

    ``wake(value)`` (any thread) and the timeout compete under the waiter's
    lock; the first wins and the other is a no-op, so a parked actor is
    resumed exactly once.  ``wait(timeout)`` returns ``(True, value)`` when
    woken and ``(False, None)`` when the timeout passed first.
    """

    __slots__ = ("_event", "_lock", "_runnable", "_runner", "_state", "_value", "_worker")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: Any = None
        self._worker: _Worker | None = None
        self._runner: greenlet.greenlet | None = None
        self._runnable: Runnable | None = None
        self._event: threading.Event | None = None

    @property
    def done(self) -> bool:
        return self._state != _PENDING

    def _is_woken(self) -> bool:
        return self._state == _WOKEN

    def wait(self, timeout: float | None) -> tuple[bool, Any]:
        worker: _Worker | None = getattr(_local, "worker", None)
        if worker is not None and worker.current is not None:
            return self._park(worker, timeout)
        with self._lock:
            if self._state == _WOKEN:
                return True, self._value
            # (on a dispatcher thread outside a batch: its worker's event, which its
            # run queue sets too, so the wait runs what is queued meanwhile)
            event = self._event = threading.Event() if worker is None else worker._woken
        if event.wait(timeout) if worker is None else worker.run_until(self._is_woken, timeout):
            return True, self._value
        with self._lock:
            if self._state == _WOKEN:
                return True, self._value
            self._state = _EXPIRED
        return False, None

    def _park(self, worker: _Worker, timeout: float | None) -> tuple[bool, Any]:
        with self._lock:
            if self._state == _WOKEN:
                return True, self._value
            self._worker = worker
            self._runnable = worker.current
            self._runner = greenlet.getcurrent()
        if timeout is not None:
            worker.add_timer(time.monotonic() + timeout, self)
        hub = worker.hub
        assert hub is not None
        result: tuple[bool, Any] = hub.switch(_PARKED)
        return result

    def wake(self, value: Any = None) -> bool:
        """Resolve the wait with ``value`` (any thread); False if it was already resolved."""
        with self._lock:
            if self._state != _PENDING:
                return False
            self._state = _WOKEN
            self._value = value
            runner, self._runner = self._runner, None
            event = self._event
        if runner is not None:
            self._resume(runner, (True, value))
        elif event is not None:
            event.set()
        return True

    def expire(self) -> None:
        """The timeout passed (called by the parked actor's worker)."""
        with self._lock:
            if self._state != _PENDING:
                return
            self._state = _EXPIRED
            runner, self._runner = self._runner, None
        if runner is not None:
            self._resume(runner, (False, None))

    def _resume(self, runner: greenlet.greenlet, result: tuple[bool, Any]) -> None:
        worker, runnable = self._worker, self._runnable
        assert worker is not None
        assert runnable is not None
        worker.put(_Resume(runnable, runner, result))


class Dispatcher:
    """``threads`` scheduler threads and an I/O pool for one process's actors."""

    def __init__(self, name: str, threads: int = 2, io_threads: int = 4) -> None:
        self.name = name
        self._workers = [_Worker(self, i) for i in range(max(1, threads))]
        self._next = itertools.count()
        self._io = ThreadPoolExecutor(max_workers=max(1, io_threads),
                                      thread_name_prefix=f"blocking:{name}")
        self._started = False
        self._lock = threading.Lock()

    @property
    def threads(self) -> int:
        return len(self._workers)

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            for worker in self._workers:
                worker.thread.start()

    def assign(self) -> int:
        """The worker index a new runnable is pinned to (round robin)."""
        return next(self._next) % len(self._workers)

    def schedule(self, worker_index: int, runnable: Runnable) -> None:
        """Put ``runnable`` at the back of its worker's run queue (any thread)."""
        self._workers[worker_index].put(runnable)

    def blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` where it cannot stall the dispatcher; returns its result.

        Inside an actor the actor parks until the call is done and its
        thread runs other actors meanwhile; elsewhere the call runs inline.
        """
        if not in_actor():
            return fn(*args)
        waiter = Waiter()
        future = self._io.submit(fn, *args)
        future.add_done_callback(waiter.wake)
        _, done = waiter.wait(None)
        return done.result()

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop the threads after what they are running; True if all ended in time."""
        for worker in self._workers:
            worker.put(_STOP)
        deadline = time.monotonic() + timeout
        clean = True
        for worker in self._workers:
            if worker.ident is None and not worker.thread.is_alive():
                worker.loop.close()  # (never started: its thread would have closed it)
            elif worker.thread.is_alive() and worker.thread is not threading.current_thread():
                worker.thread.join(max(0.0, deadline - time.monotonic()))
                clean = clean and not worker.thread.is_alive()
        self._io.shutdown(wait=False, cancel_futures=True)
        return clean
