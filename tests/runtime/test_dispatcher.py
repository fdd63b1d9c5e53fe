"""The dispatcher: many actors on a few threads, parked waits, fairness, blocking offload.

These run a :class:`Node` in the test's own process, so its threads can be
counted and its actors held at barriers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest

from actors.runtime import Actor, RuntimeOptions, message, no_spawn
from actors.runtime import dispatcher as dispatcher_module
from actors.runtime.dispatcher import Dispatcher, Waiter, call_later
from actors.runtime.node import Node, NodeSpec
from tests.runtime.conftest import wait_until
from tests.runtime.helpers import Seq


@message
@dataclass(frozen=True)
class AskOther:
    """Ask ``target`` for ``Seq(n)`` and return the answer (parks while waiting)."""

    target: str
    """Who to ask."""
    n: int
    """What to ask for."""


@message
@dataclass(frozen=True)
class Hold:
    """Block on the I/O pool (``Actor.blocking``) until the test releases it; answer its thread."""


class Echo(Actor):
    """Answers ``Seq(n)`` with ``n``; records which thread ran it and overlaps."""

    running: set[str] = set()  # noqa: RUF012 - shared by the test on purpose
    overlaps: list[str] = []  # noqa: RUF012
    order: list[tuple[str, int]] = []  # noqa: RUF012
    gate: threading.Event | None = None

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Seq(n=n):
                if self.name in Echo.running:
                    Echo.overlaps.append(self.name)
                Echo.running.add(self.name)
                try:
                    Echo.order.append((self.name, n))
                    if Echo.gate is not None and n < 0:
                        Echo.gate.wait(10)
                    time.sleep(0)  # give another thread the GIL mid-message
                finally:
                    Echo.running.discard(self.name)
                return n
            case AskOther(target=target, n=n):
                return self.ask(target, Seq(n), timeout=10)
            case Hold():
                return self.blocking(_held)
        return None


HELD = threading.Event()
RELEASE = threading.Event()


def _held() -> str:
    HELD.set()
    RELEASE.wait(10)
    return threading.current_thread().name


@pytest.fixture
def node(run_dir: str) -> Iterator[Node]:
    Echo.running, Echo.overlaps, Echo.order, Echo.gate = set(), [], [], None
    options = RuntimeOptions(workers=1, dispatcher_threads=1, throughput=100,
                             io_threads=2, ask_timeout=10)
    node = Node(NodeSpec("worker-0", run_dir, options, {"echo": Echo}))
    yield node
    if Echo.gate is not None:
        Echo.gate.set()
    assert node.shutdown(time.monotonic() + 10)


def _threads_of(node: Node) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dispatcher:worker-0")]


def test_ten_thousand_actors_run_on_the_dispatchers_threads_alone(node: Node) -> None:
    # Given 10,000 actors, each sent one message
    endpoint = node.endpoint
    for i in range(10_000):
        endpoint.tell(f"echo:{i}", Seq(i))
    # When the last one answers (each actor's messages are handled in order)
    assert endpoint.ask("echo:9999", Seq(-9999), timeout=30) == -9999
    # Then they all ran, on the one dispatcher thread, and no thread was added per actor
    assert len(node._slots) == 10_000
    assert _threads_of(node) == ["dispatcher:worker-0/0"]
    assert len({name for name, _ in Echo.order}) == 10_000


def test_an_actor_never_runs_on_two_threads_at_once(run_dir: str) -> None:
    # Given a dispatcher of four threads and a few actors flooded from several threads
    Echo.running, Echo.overlaps, Echo.order, Echo.gate = set(), [], [], None
    options = RuntimeOptions(workers=1, dispatcher_threads=4, throughput=7)
    node = Node(NodeSpec("worker-0", run_dir, options, {"echo": Echo}))
    try:
        def flood(k: int) -> None:
            for i in range(2_000):
                node.endpoint.tell(f"echo:{i % 5}", Seq(k * 10_000 + i))

        senders = [threading.Thread(target=flood, args=(k,)) for k in range(3)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
        # When every actor has handled everything (an ask is queued behind it all)
        for i in range(5):
            assert node.endpoint.ask(f"echo:{i}", Seq(-1), timeout=30) == -1
        # Then no actor was ever inside on_receive twice at once, and each kept
        # every sender's order
        assert Echo.overlaps == []
        for i in range(5):
            seen = [n for name, n in Echo.order if name == f"echo:{i}" and n >= 0]
            assert len(seen) == 1_200
            for k in range(3):
                mine = [n for n in seen if n // 10_000 == k]
                assert mine == sorted(mine)
    finally:
        assert node.shutdown(time.monotonic() + 10)


def test_a_flooded_actor_does_not_starve_the_others(node: Node) -> None:
    # Given one actor with 20,000 messages queued, and then 100 others with one each
    endpoint = node.endpoint
    endpoint.tell_many("echo:flood", [Seq(i) for i in range(20_000)])
    for i in range(100):
        endpoint.tell(f"echo:other{i}", Seq(i))
    # When the last of the others has answered
    assert endpoint.ask("echo:other99", Seq(-1), timeout=30) == -1
    # Then the others ran long before the flood was done: the flooded actor
    # yielded its thread after every batch of `throughput` messages
    last_other = max(i for i, (name, _) in enumerate(Echo.order) if name.startswith("echo:oth"))
    flood_before = sum(1 for name, _ in Echo.order[:last_other] if name == "echo:flood")
    assert flood_before < 5_000
    assert endpoint.ask("echo:flood", Seq(-2), timeout=30) == -2


def test_asks_from_inside_actors_park_them_and_do_not_hold_the_thread(node: Node) -> None:
    # Given one dispatcher thread and 1,000 actors that each ask another actor
    endpoint = node.endpoint
    answers: list[Any] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        value = endpoint.ask(f"echo:asker{i}", AskOther(f"echo:target{i}", i), timeout=30)
        with lock:
            answers.append(value)

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(1_000)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(60)
    # Then every in-actor ask was answered: a waiting actor parked, and the
    # only thread ran the targets meanwhile
    assert sorted(answers) == list(range(1_000))
    assert _threads_of(node) == ["dispatcher:worker-0/0"]


def test_an_in_actor_ask_times_out_without_holding_the_thread(node: Node) -> None:
    # Given an actor that asks one that never answers (a deferred reply nobody sends)
    from tests.runtime.helpers import Deferrer, Later

    node._factories["defer"] = Deferrer
    endpoint = node.endpoint

    class Asker(Actor):
        def on_receive(self, msg: Any) -> Any:
            started = time.monotonic()
            try:
                self.ask("defer:x", Later(), timeout=0.3)
            except Exception as e:
                return type(e).__name__, time.monotonic() - started
            return "answered", 0.0

    node._factories["asker"] = Asker
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(endpoint.ask("asker:a", 1, timeout=10)))
    t.start()
    # While the asker is parked, its thread still serves others
    assert endpoint.ask("echo:free", Seq(5), timeout=5) == 5
    t.join(10)
    (name, waited), = result
    assert name == "AskTimeout"
    assert 0.3 <= waited < 5


def test_blocking_work_runs_on_the_io_pool_while_the_thread_serves_others(node: Node) -> None:
    # Given an actor held inside a blocking call
    HELD.clear()
    RELEASE.clear()
    endpoint = node.endpoint
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(endpoint.ask("echo:io", Hold(), 10)))
    t.start()
    assert HELD.wait(5)
    try:
        # When another actor on the only dispatcher thread is asked meanwhile
        # Then it answers while the call is still held
        assert endpoint.ask("echo:quick", Seq(1), timeout=5) == 1
    finally:
        RELEASE.set()
    t.join(10)
    # And the blocking call ran on an I/O thread
    assert result
    assert result[0].startswith("blocking:worker-0")


def test_a_waiter_is_resumed_once_when_a_wake_races_its_timeout() -> None:
    # Given many waits whose wake and timeout come at the same moment
    woken = 0
    for _ in range(2_000):
        waiter = Waiter()
        t = threading.Thread(target=waiter.wake, args=(1,))
        t.start()
        ok, value = waiter.wait(0.0001)
        t.join()
        # Then each wait ends exactly one way, and a late wake is refused
        assert (ok, value) in {(True, 1), (False, None)}
        assert waiter.wake(2) is False
        woken += ok
    assert 0 <= woken <= 2_000


def test_a_dispatcher_runs_inline_what_is_not_inside_an_actor() -> None:
    dispatcher = Dispatcher("unit", threads=1)
    dispatcher.start()
    try:
        assert dispatcher.blocking(lambda x: x + 1, 1) == 2
    finally:
        assert dispatcher.stop(5)


def test_a_wait_in_a_loop_callback_ends_at_its_timeout_while_actors_keep_coming() -> None:
    # Given an actor of the thread that queues itself again forever
    dispatcher = Dispatcher("unit", threads=1)
    dispatcher.start()
    stop = threading.Event()

    class Requeues:
        name = "requeues"

        def run_batch(self) -> None:
            if not stop.is_set():
                dispatcher.schedule(0, self)

    answer: Future[tuple[bool, Any]] = Future()

    def callback() -> None:
        dispatcher.schedule(0, Requeues())
        answer.set_result(Waiter().wait(0.05))  # nobody wakes it

    try:
        dispatcher._workers[0].loop.call_soon_threadsafe(callback)
        # Then the wait still ends, by its timeout (it used to run whatever was runnable
        # until nothing was, with the loop's sockets frozen meanwhile)
        assert answer.result(10) == (False, None)
    finally:
        stop.set()
        assert dispatcher.stop(5)


def test_nothing_queued_behind_the_stop_runs() -> None:
    # Given a dispatcher thread held by a batch, and the stop queued, then an actor
    dispatcher = Dispatcher("unit", threads=1)
    dispatcher.start()
    worker = dispatcher._workers[0]
    entered, hold = threading.Event(), threading.Event()
    ran: list[str] = []

    class Holds:
        name = "holds"

        def run_batch(self) -> None:
            entered.set()
            hold.wait(10)

    class Late:
        name = "late"

        def run_batch(self) -> None:
            ran.append(self.name)

    dispatcher.schedule(0, Holds())
    assert entered.wait(10)
    worker.put(dispatcher_module._STOP)
    dispatcher.schedule(0, Late())
    # When the batch ends and the thread takes the stop
    hold.set()
    assert dispatcher.stop(5)
    # Then what came after the stop never ran (not even as the loop closed)
    assert ran == []
    assert worker.loop.is_closed()


def test_a_dispatcher_stopped_before_it_started_releases_its_loops() -> None:
    dispatcher = Dispatcher("unit", threads=2)
    assert dispatcher.stop(1)
    assert all(worker.loop.is_closed() for worker in dispatcher._workers)


def test_a_wait_in_a_callback_of_a_dispatcher_threads_loop_runs_the_actors_it_waits_for(
) -> None:
    # Given a dispatcher thread's loop, and a callback of it (as a socket loop's read
    # is, outside any actor) that waits for something an actor of that thread does
    dispatcher = Dispatcher("unit", threads=1)
    dispatcher.start()
    try:
        waiter = Waiter()
        ran_on: list[str] = []

        class Wakes:
            name = "wakes"

            def run_batch(self) -> None:
                ran_on.append(threading.current_thread().name)
                waiter.wake("room")

        answer: Future[tuple[tuple[bool, Any], tuple[bool, Any], str]] = Future()

        def callback() -> None:
            dispatcher.schedule(0, Wakes())  # queued behind this very callback
            woken = waiter.wait(10)
            unwoken = Waiter().wait(0.01)  # nobody wakes this one: its timeout ends it
            answer.set_result((woken, unwoken, threading.current_thread().name))

        dispatcher._workers[0].loop.call_soon_threadsafe(callback)
        woken, unwoken, thread = answer.result(10)
        # Then the wait ran the queued actor on the same thread instead of blocking it
        assert woken == (True, "room")
        assert ran_on == [thread]
        assert thread.startswith("dispatcher:unit")
        assert unwoken == (False, None)
    finally:
        assert dispatcher.stop(5)


@no_spawn
@message
@dataclass(frozen=True)
class LateAnswer:
    """A message that never creates its receiver (dropped if the actor has gone)."""


class Quitter(Actor):
    """Stops itself on ``Seq(-1)`` (telling itself ``Seq(99)``) and ``Seq(-2)``."""

    instances = 0

    def __init__(self, name: str) -> None:
        super().__init__(name)
        Quitter.instances += 1
        self.seen: list[int] = []

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Seq(n=-1):
                self.stop()
                self.tell(self.name, Seq(99))  # queued behind the stop
            case Seq(n=-2):
                self.stop()
            case Seq(n=n):
                self.seen.append(n)
            case "seen":
                return (Quitter.instances, tuple(self.seen))
        return None


def test_an_actor_that_stops_itself_is_forgotten_and_its_name_starts_afresh(node: Node) -> None:
    Quitter.instances = 0
    node._factories["quit"] = Quitter
    endpoint = node.endpoint
    # Given an actor that handles a message, then stops itself with one more queued behind
    endpoint.tell_many("quit:a", [Seq(1), Seq(-1)])
    # Then what was queued behind the stop reaches a fresh instance
    deadline = time.monotonic() + 5
    while Quitter.instances < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endpoint.ask("quit:a", "seen", timeout=5) == (2, (99,))
    # When it stops again and only a no-spawn message follows
    endpoint.tell("quit:a", Seq(-2))
    endpoint.tell("quit:a", LateAnswer())
    deadline = time.monotonic() + 5
    while "quit:a" in node._slots and time.monotonic() < deadline:
        time.sleep(0.01)
    # Then the node forgot it and the late message did not bring it back
    assert "quit:a" not in node._slots
    assert Quitter.instances == 2


class Alarm(Actor):
    """On ``Seq(n)`` sets an alarm n ms ahead; records how late each went off."""

    rang: list[tuple[int, float]] = []  # noqa: RUF012
    set_by: list[str] = []  # noqa: RUF012 - (the actors that set one: if some never ring)

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Seq(n=n) if n >= 0:
                Alarm.set_by.append(self.name)
                self.tell_later(n / 1000, ("ring", n, time.monotonic()))
            case ("ring", n, set_at):
                Alarm.rang.append((n, time.monotonic() - set_at))
        return None


def test_tell_later_is_a_timer_on_the_dispatcher_not_a_thread(node: Node) -> None:
    Alarm.rang, Alarm.set_by = [], []
    node._factories["alarm"] = Alarm
    threads_before = threading.active_count()
    # Given 1,000 actors each setting an alarm, the later ones sooner
    for i in range(1_000):
        node.endpoint.tell(f"alarm:{i}", Seq(300 - i % 300))
    # (it failed once in CI, unexplained: what it waited for says which step lost them)
    wait_until(lambda: len(Alarm.rang) >= 1_000, 10, lambda: (
        f"1,000 alarms: {len(Alarm.set_by)} set, {len(Alarm.rang)} rang; "
        f"{len(set(Alarm.set_by))} actors set one; dispatcher threads alive: "
        f"{sorted(t.name for t in threading.enumerate() if t.name.startswith('dispatcher'))}"))
    # Then every alarm went off, none before its time, and no thread was started for them
    assert len(Alarm.rang) == 1_000
    assert all(waited >= n / 1000 for n, waited in Alarm.rang)
    assert threading.active_count() <= threads_before + 2  # the I/O pool may grow, not per timer


class _Failing:
    """A timer whose expiry raises."""

    def expire(self) -> None:
        raise RuntimeError("this timer fails")


class AfterAFailure(Actor):
    """On ``Seq``: a timer that raises, then an alarm after it."""

    rang = threading.Event()

    def on_receive(self, msg: Any) -> Any:
        match msg:
            case Seq():
                call_later(0.001, _Failing())
                self.tell_later(0.05, "ring")
            case "ring":
                AfterAFailure.rang.set()
        return None


def test_a_timer_that_raises_leaves_the_thread_and_its_later_timers(node: Node) -> None:
    AfterAFailure.rang = threading.Event()
    node._factories["after"] = AfterAFailure
    node.endpoint.tell("after:a", Seq(1))
    assert AfterAFailure.rang.wait(10)
    assert node.endpoint.ask("after:a", Seq(2), timeout=10) is None  # (the thread serves)


class Lingerer(Actor):
    """Counts what it handles; after every message it asks to go if nothing is queued."""

    instances = 0

    def __init__(self, name: str) -> None:
        super().__init__(name)
        Lingerer.instances += 1
        self.count = 0

    def on_receive(self, msg: Any) -> Any:
        self.count += 1
        if isinstance(msg, Hold):  # a gate: the messages sent meanwhile queue up
            assert Echo.gate is not None
            Echo.gate.wait(10)
        self.stop_if_idle()
        return self.count


def test_stop_if_idle_goes_only_when_nothing_is_queued(run_dir: str) -> None:
    Echo.gate, Lingerer.instances = threading.Event(), 0
    node = Node(NodeSpec("worker-0", run_dir, RuntimeOptions(workers=1, dispatcher_threads=2),
                         {"linger": Lingerer}))
    try:
        # An idle actor that asks to go is gone (its name starts afresh)
        assert node.endpoint.ask("linger:a", Seq(1), timeout=10) == 1
        wait_until(lambda: "linger:a" not in node._slots, 10, "the idle actor to go")
        assert node.endpoint.ask("linger:a", Seq(2), timeout=10) == 1  # a fresh instance
        # One with messages queued behind stays, and the same instance handles them all
        Echo.gate.clear()
        node.endpoint.tell("linger:b", Hold())
        for i in range(50):
            node.endpoint.tell("linger:b", Seq(i))
        Echo.gate.set()
        assert node.endpoint.ask("linger:b", Seq(-1), timeout=10) == 52
        assert Lingerer.instances == 3
    finally:
        Echo.gate.set()
        assert node.shutdown(time.monotonic() + 10)
