"""tell / ask by name within and across processes, FIFO per pair, errors."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from actors.runtime import AskTimeout, RemoteActorError, Supervisor, UnknownActor, connect, message
from actors.runtime.placement import Placement
from tests.runtime.conftest import wait_until
from tests.runtime.helpers import (
    AskAll,
    AskLocal,
    Boom,
    Forward,
    GetLog,
    Relay,
    Seq,
    Whoami,
    ask_all,
)

StartRuntime = Callable[..., Supervisor]


def pids(rt: Supervisor) -> dict[str, int | None]:
    return {p.name: p.pid for p in rt.ps()}


def same_node_names(rt: Supervisor, count: int) -> list[str]:
    """``count`` rec:* names placed on the same worker."""
    by_node: dict[str, list[str]] = {}
    for i in range(1000):
        name = f"rec:{i}"
        names = by_node.setdefault(rt.placement.node_for(name), [])
        names.append(name)
        if len(names) == count:
            return names
    raise AssertionError("unreachable")


def test_tell_and_ask_reach_actors_in_other_processes(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    # Given actors on a worker and on the gateway
    rt.tell("rec:a", Seq(1))
    rt.tell("client:7", Seq(2))
    # When asked, Then each answers from the process placement chose
    name, pid, _ = rt.ask("rec:a", Whoami(), timeout=5)
    assert (name, pid) == ("rec:a", pids(rt)[rt.placement.node_for("rec:a")])
    assert pid != os.getpid()
    assert rt.ask("client:7", Whoami(), timeout=5)[1] == pids(rt)["gateway"]
    # And the earlier tells were handled before the asks (same sender, same actor)
    assert rt.ask("rec:a", GetLog(), timeout=5) == (1,)
    assert rt.ask("client:7", GetLog(), timeout=5) == (2,)


def test_an_actor_asks_actors_in_its_own_and_in_another_process(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    first, second = same_node_names(rt, 2)
    node_pid = pids(rt)[rt.placement.node_for(first)]
    assert rt.ask(first, Forward(second), timeout=5)[:2] == (second, node_pid)
    assert rt.ask(first, Forward("client:1"), timeout=5)[:2] == ("client:1", pids(rt)["gateway"])


def test_ask_many_sends_every_ask_at_once_and_answers_in_order_with_errors_in_place(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    first, second = same_node_names(rt, 2)
    other = next(f"rec:{i}" for i in range(1000)
                 if rt.placement.node_for(f"rec:{i}") != rt.placement.node_for(first))
    ids = pids(rt)
    targets = (second, other, "client:1", "rec:bad", "nobody:1")
    expected = ((second, ids[rt.placement.node_for(second)]),
                (other, ids[rt.placement.node_for(other)]),
                ("client:1", ids["gateway"]), "RemoteActorError", "UnknownActor")
    # From inside an actor (in-process and remote asks, one park for all the replies)
    assert rt.ask(first, AskAll(targets, boom=("rec:bad",)), timeout=10) == expected
    # And from a plain thread
    endpoint = connect(rt.run_dir)
    try:
        assert ask_all(endpoint, AskAll(targets, boom=("rec:bad",))) == expected
        assert endpoint.ask_many([]) == []
    finally:
        endpoint.close()


def test_ten_thousand_tells_arrive_in_the_order_sent(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    for i in range(10_000):
        rt.tell("rec:fifo", Seq(i))
    assert rt.ask("rec:fifo", GetLog(), timeout=20) == tuple(range(10_000))


def test_batches_and_single_tells_interleave_in_order(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    expected = []
    for b in range(100):
        batch = [Seq(b * 101 + i) for i in range(100)]
        rt.tell_many("rec:mixed", batch)
        rt.tell("rec:mixed", Seq(b * 101 + 100))
        expected += [m.n for m in batch] + [b * 101 + 100]
    assert rt.ask("rec:mixed", GetLog(), timeout=20) == tuple(expected)


def test_actor_to_actor_tells_across_processes_keep_their_order(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    # Given a sender on a worker and a receiver on the gateway
    assert rt.ask("rec:sender", Relay("client:sink", 10_000), timeout=20) == 10_000
    # Then the receiver eventually holds all 10,000 numbers in order
    log = wait_until(
        lambda: (lg := rt.ask("client:sink", GetLog())) and len(lg) == 10_000 and lg,
        timeout=20,
        what="10,000 relayed messages",
    )
    assert log == tuple(range(10_000))


def test_an_actor_that_raises_on_ask_returns_the_error_and_keeps_running(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    rt.tell("rec:e", Seq(1))
    with pytest.raises(RemoteActorError, match="RuntimeError: boom"):
        rt.ask("rec:e", Boom(), timeout=5)
    assert rt.ask("rec:e", GetLog(), timeout=5) == (1,)
    (info,) = [a for a in rt.actors() if a.name == "rec:e"]
    assert info.restarts == 0


def test_a_name_without_a_factory_is_an_unknown_actor(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    with pytest.raises(UnknownActor, match="nofactory"):
        rt.ask("nofactory:x", Whoami(), timeout=5)


def test_introspection_lists_processes_and_actors(start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    rt.spawn("rec:listed")
    for i in range(5):
        rt.tell("rec:listed", Seq(i))
    rt.ask("rec:listed", GetLog(), timeout=5)
    roles = {(p.name, p.role, p.alive) for p in rt.ps()}
    assert roles == {
        ("supervisor", "supervisor", True),
        ("gateway", "gateway", True),
        ("worker-0", "worker", True),
        ("worker-1", "worker", True),
    }
    (info,) = [a for a in rt.actors() if a.name == "rec:listed"]
    assert (info.node, info.depth, info.handled, info.restarts) == (
        rt.placement.node_for("rec:listed"),
        0,
        6,
        0,
    )


def test_an_external_process_endpoint_talks_to_a_running_runtime(
    start_runtime: StartRuntime, run_dir: str
) -> None:
    rt = start_runtime()
    client = connect(run_dir)
    try:
        client.tell_many("rec:ext", [Seq(1), Seq(2)])
        assert client.ask("rec:ext", GetLog(), timeout=5) == (1, 2)
    finally:
        client.close()
    assert rt.ask("rec:ext", GetLog(), timeout=5) == (1, 2)


def test_ask_to_a_node_that_does_not_exist_times_out(
    start_runtime: StartRuntime, run_dir: str
) -> None:
    # Given an endpoint that believes in more workers than the runtime has
    rt = start_runtime(workers=1)
    client = connect(run_dir)
    client.placement = Placement(workers=4)
    names = (f"rec:{i}" for i in range(100))
    name = next(n for n in names if client.placement.node_for(n) == "worker-3")
    try:
        # When it asks an actor on the missing worker, Then it gets a clean timeout
        with pytest.raises(AskTimeout, match="worker-3"):
            client.ask(name, Whoami(), timeout=0.3)
    finally:
        client.close()
    assert rt.ask("rec:still-fine", GetLog(), timeout=5) == ()


@message
@dataclass(frozen=True)
class OnlyInTheTestProcess:
    """Registered here only: node processes never import this test module."""


def test_an_ask_the_receiver_cannot_decode_fails_fast_instead_of_timing_out(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    started = time.monotonic()
    with pytest.raises(RemoteActorError, match="unknown message tag"):
        rt.ask("rec:x", OnlyInTheTestProcess(), timeout=10)
    assert time.monotonic() - started < 5


def test_an_actor_can_answer_an_ask_later_with_a_deferred_reply(
        start_runtime: StartRuntime) -> None:
    import threading

    from tests.runtime.helpers import Later, Release

    rt = start_runtime()
    answers: list[int] = []
    asked = threading.Thread(target=lambda: answers.append(rt.ask("defer:x", Later(), 10)))
    asked.start()
    # The ask is not answered by on_receive's return...
    wait_until(lambda: any(a.name == "defer:x" and a.handled >= 1 for a in rt.actors()),
               what="the ask to be handled")
    assert answers == []
    # ...but when the actor sets the reply it kept.
    rt.tell("defer:x", Release(7))
    asked.join(10)
    assert answers == [7]


def test_many_plain_threads_asking_at_once_each_get_their_own_answers(
    start_runtime: StartRuntime,
) -> None:
    # Given a runtime, and threads of the supervisor's process (plain threads: they read
    # the node's one reply socket in turn) asking beside actors that ask (whose replies
    # the mailbox thread reads), with asks timing out and answered late among them
    import random
    import threading

    from tests.runtime.helpers import Later, Release

    rt = start_runtime()
    names = [f"rec:{i}" for i in range(6)] + ["client:1"]
    for name in names:
        rt.ask(name, Whoami(), timeout=5)
    errors: list[object] = []
    timeouts = [0]

    def asker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(150):
            name, other = rnd.sample(names, 2)
            try:
                r = rnd.random()
                if r < 0.05:  # answered only after it gave up: the late reply is dropped
                    with pytest.raises(AskTimeout):
                        rt.ask("defer:1", Later(), timeout=0.01)
                    timeouts[0] += 1
                elif r < 0.3:  # an actor's ask, answered to its own node (never in a
                    # cycle: an actor parked on an ask answers no other ask meanwhile)
                    rec = rnd.choice(names[:-1])
                    assert rt.ask(rec, Forward("client:1"), timeout=10)[0] == "client:1"
                elif r < 0.5:
                    got = rt._require_endpoint().ask_many(
                        [(n, Whoami()) for n in (name, other)], timeout=10)
                    assert [g[0] for g in got] == [name, other]
                else:
                    assert rt.ask(name, Whoami(), timeout=10)[0] == name
            except BaseException as e:
                errors.append(e)

    # When twelve of them ask at once
    threads = [threading.Thread(target=asker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    rt.tell("defer:1", Release(0))
    # Then every answer went to its own asker, and none hung
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert timeouts[0] > 0


def test_ask_local_calls_back_with_the_answer_without_blocking_the_asker(
        start_runtime: StartRuntime) -> None:
    rt = start_runtime()
    # Given two actors of one process (topic-keyed: the same topic, the same worker)
    asker, target = "topic:local", "channel:local/c"
    pid = rt.ask(target, Whoami(), timeout=5)[1]
    # When one asks the other with ask_local (the answer is a callback, not a wait)
    assert rt.ask(asker, AskLocal(target), timeout=5) == "sent"
    # Then the callback brings the answer back as a message
    wait_until(lambda: rt.ask(asker, GetLog(), timeout=5) == (pid,), what="the callback")
    # And a name of another process is refused at once
    other = next(f"rec:{i}" for i in range(100)
                 if rt.placement.node_for(f"rec:{i}") != rt.placement.node_for(asker))
    assert "is not hosted by this process" in rt.ask(asker, AskLocal(other), timeout=5)
