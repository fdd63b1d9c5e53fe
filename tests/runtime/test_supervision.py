"""Supervision: actor restarts, node restarts after SIGKILL, dead or frozen nodes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from actors.runtime import EXIT_ESCALATED, AskTimeout, MailboxFull, Supervisor
from tests.procs import frozen
from tests.runtime.conftest import wait_until
from tests.runtime.helpers import FACTORIES, Boom, GetLog, Seq, Whoami

StartRuntime = Callable[..., Supervisor]


def process(rt: Supervisor, node: str):
    (info,) = [p for p in rt.ps() if p.name == node]
    return info


def actor(rt: Supervisor, name: str):
    found = [a for a in rt.actors() if a.name == name]
    return found[0] if found else None


def restarted(rt: Supervisor, node: str, old_pid: int | None, restarts: int) -> bool:
    info = process(rt, node)
    return info.alive and info.pid != old_pid and info.restarts == restarts


def test_an_actor_that_raises_is_restarted_and_the_restart_is_visible(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime()
    # Given an actor with some state
    rt.tell("rec:r", Seq(1))
    before = rt.ask("rec:r", Whoami(), timeout=5)
    # When a told message makes it raise
    rt.tell("rec:r", Boom())
    rt.tell("rec:r", Seq(2))
    # Then a fresh instance (same name, same process) handles what follows
    after = rt.ask("rec:r", Whoami(), timeout=5)
    assert after[:2] == before[:2]
    assert after[2] != before[2]
    assert rt.ask("rec:r", GetLog(), timeout=5) == (2,)
    info = actor(rt, "rec:r")
    assert info is not None
    assert (info.restarts, info.handled) == (1, 6)


def test_the_debug_crash_hook_restarts_a_named_actor(start_runtime: StartRuntime) -> None:
    rt = start_runtime(debug_hooks=True)
    rt.spawn("rec:victim")
    rt.crash("rec:victim")
    rt.crash("rec:victim")
    info = wait_until(
        lambda: (a := actor(rt, "rec:victim")) and a.restarts == 2 and a,
        what="two restarts of rec:victim",
    )
    assert info.alive
    assert rt.ask("rec:victim", GetLog(), timeout=5) == ()


def test_too_many_restarts_escalate_to_a_node_restart(start_runtime: StartRuntime) -> None:
    rt = start_runtime(workers=1, max_restarts=2, restart_window=60.0)
    old = process(rt, "worker-0")
    # When the actor crashes three times within the window
    for _ in range(3):
        rt.tell("rec:fragile", Boom())
    # Then its worker exits and the supervisor starts a new one
    wait_until(lambda: restarted(rt, "worker-0", old.pid, 1), what="worker-0 restart")
    assert rt._children["worker-0"].last_exitcode == EXIT_ESCALATED
    assert rt.ask("rec:fragile", GetLog(), timeout=5) == ()


@pytest.mark.parametrize(
    ("node", "spawned", "on_demand"),
    [
        ("worker-0", "rec:kept", "rec:lazy"),
        ("gateway", "client:kept", "client:lazy"),
    ],
)
def test_a_sigkilled_node_is_restarted_and_messaging_works_again(
    start_runtime: StartRuntime, node: str, spawned: str, on_demand: str
) -> None:
    rt = start_runtime(workers=1)
    # Given a spawned actor and an on-demand actor on the node
    rt.spawn(spawned)
    rt.tell(on_demand, Seq(1))
    assert rt.ask(on_demand, GetLog(), timeout=5) == (1,)
    old = process(rt, node)
    # When the node is killed with SIGKILL
    killed_at = time.monotonic()
    assert old.pid is not None
    os.kill(old.pid, signal.SIGKILL)
    # Then the supervisor restarts it promptly
    wait_until(lambda: restarted(rt, node, old.pid, 1), timeout=10, what=f"{node} restart")
    assert time.monotonic() - killed_at < 5
    # And the spawned actor is re-created without being messaged; the other is not
    wait_until(lambda: actor(rt, spawned), what=f"{spawned} re-created")
    assert actor(rt, on_demand) is None
    # And both can be reached again (the on-demand one is created by the message)
    assert rt.ask(spawned, Whoami(), timeout=5)[1] == process(rt, node).pid
    rt.tell(on_demand, Seq(2))
    assert rt.ask(on_demand, GetLog(), timeout=5) == (2,)


def test_ask_to_an_unresponsive_node_times_out_cleanly(start_runtime: StartRuntime) -> None:
    rt = start_runtime(workers=1)
    rt.ask("rec:slow", GetLog(), timeout=5)
    pid = process(rt, "worker-0").pid
    assert pid is not None
    with frozen(pid):
        started = time.monotonic()
        with pytest.raises(AskTimeout):
            rt.ask("rec:slow", GetLog(), timeout=0.3)
        assert time.monotonic() - started < 2
    assert rt.ask("rec:slow", GetLog(), timeout=5) == ()


def test_tells_to_an_unresponsive_node_fail_with_mailbox_full_in_bounded_time(
    start_runtime: StartRuntime,
) -> None:
    rt = start_runtime(workers=1, hwm=10, send_timeout=0.2)
    rt.ask("rec:stuck", GetLog(), timeout=5)
    pid = process(rt, "worker-0").pid
    assert pid is not None
    batch = [Seq(i) for i in range(100)]
    sent = 0

    def flood() -> None:
        nonlocal sent
        while time.monotonic() - started < 10:
            rt.tell_many("rec:stuck", batch)
            sent += 1

    with frozen(pid):
        # When the node stops reading, Then the sender fails fast once the queues are full
        started = time.monotonic()
        with pytest.raises(MailboxFull):
            flood()
        assert time.monotonic() - started < 10
    # Everything that was accepted is delivered once the node runs again
    log = wait_until(
        lambda: (lg := rt.ask("rec:stuck", GetLog(), timeout=5)) and len(lg) == sent * 100 and lg,
        timeout=20,
        what="accepted batches delivered",
    )
    assert log == tuple(range(100)) * sent


def test_a_runtime_with_no_workers_hosts_every_actor_on_its_gateway_and_restarts_it(
        start_runtime: StartRuntime) -> None:
    # Given a runtime of one process (the lookup daemon's shape)
    rt = start_runtime(workers=0)
    assert [p.name for p in rt.ps()] == ["supervisor", "gateway"]
    gateway = process(rt, "gateway")
    # Then actors of any kind live there
    assert rt.ask("rec:r", Whoami(), timeout=5)[1] == gateway.pid
    assert rt.ask("topic:t", Whoami(), timeout=5)[1] == gateway.pid
    # And a SIGKILLed gateway is restarted, its actors with it
    os.kill(gateway.pid, signal.SIGKILL)
    wait_until(lambda: restarted(rt, "gateway", gateway.pid, 1), what="gateway restart")
    assert rt.ask("rec:r", Whoami(), timeout=10)[1] == process(rt, "gateway").pid


def test_a_signal_while_starting_stops_every_node_even_before_the_monitor_runs(
        run_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM while starting raises in the main thread wherever start() is
    (actors.runtime.daemon), and /ping can answer before the supervisor's start()
    returns: a harness that stops the broker as soon as it answers lands there.  One
    that lands between the monitor thread's creation and its start used to make stop()
    raise (joining a thread never started), leaving every node running."""
    real_start = threading.Thread.start
    supervisor = Supervisor(run_dir, FACTORIES, workers=2, shutdown_timeout=5.0)
    nodes: list[int] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == "supervisor-monitor":
            nodes.extend(c.process.pid for c in supervisor._children.values() if c.process)
            raise KeyboardInterrupt  # (what the signal handler raises, as it lands here)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        supervisor.start()
    assert len(nodes) == 3
    assert not [pid for pid in nodes if psutil.pid_exists(pid)]  # stopped and reaped
