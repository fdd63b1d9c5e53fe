"""Nodes come from a fork server (actors/runtime/forkserver.py): what that must not change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from multiprocessing import forkserver as mp_forkserver

import pytest

from actors.runtime import forkserver
from actors.runtime.inbox import Mailbox
from tests.runtime.conftest import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The fork server starts while stderr is one file (a pipe), the supervisor starts its
# nodes after stderr became another: an actor that raises logs its crash to the second.
_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    from actors.runtime import forkserver
    from actors.runtime.supervisor import Supervisor
    from tests.runtime.helpers import FACTORIES, Boom, Whoami

    if __name__ == "__main__":
        forkserver.start(["tests.runtime.helpers"])
        later = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(later, 2)
        with Supervisor(tempfile.mkdtemp(prefix="fs"), FACTORIES, workers=1) as rt:
            rt.tell("rec:a", Boom())  # (logged by the node, which restarts the actor)
            name, pid, _ = rt.ask("rec:a", Whoami(), timeout=10)
            print(pid, flush=True)
""")


@pytest.mark.timeout(60)
def test_a_node_writes_to_the_stderr_its_supervisor_had_when_it_started_the_node(
        tmp_path) -> None:
    later = tmp_path / "later.log"
    # Given a supervisor whose stderr changed after its fork server started
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(later)], cwd=ROOT,
                          capture_output=True, text=True, timeout=50, check=True)
    # When an actor on a node raises, then the traceback is in the later stderr
    node_pid = int(done.stdout.split()[-1])
    assert node_pid != os.getpid()
    assert "RuntimeError: boom" in later.read_text()
    # and not in the one the fork server inherited
    assert "boom" not in done.stderr


# The fork server is killed under a running runtime (its nodes keep running: they watch
# the supervisor, not the server): the supervisor can no longer see them exit.
_KILL_SERVER = textwrap.dedent("""
    import json, os, signal, tempfile, time
    import psutil
    from multiprocessing import forkserver as mp_forkserver
    from actors.runtime import forkserver
    from actors.runtime.supervisor import Supervisor
    from tests.runtime.helpers import FACTORIES, Seq, GetLog, Whoami
    from tests.runtime.test_forkserver import blocked_signals

    def nodes(rt):
        return {p.name: p for p in rt.ps() if p.role != "supervisor"}

    if __name__ == "__main__":
        forkserver.start(["tests.runtime.helpers"])
        with Supervisor(tempfile.mkdtemp(prefix="fs"), FACTORIES, workers=1) as rt:
            rt.tell("rec:a", Seq(1))
            before = {n: p.pid for n, p in nodes(rt).items()}
            os.kill(mp_forkserver._forkserver._forkserver_pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not all(p.restarts and p.alive for p in nodes(rt).values()):
                assert time.monotonic() < deadline, rt.ps()
                time.sleep(0.02)
            after = {n: p.pid for n, p in nodes(rt).items()}
            # (a zombie has exited: reparented, it waits for a reaper that may not come)
            gone = [pid for pid in before.values()
                    if not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"]
            _, pid, _ = rt.ask("rec:a", Whoami(), timeout=10)
            # (and the gateway answers: its node is made after it unblocks the signals,
            # so the masks read below are no longer those of a node still starting)
            rt.ask("client:a", Whoami(), timeout=10)
            server = mp_forkserver._forkserver._forkserver_pid
            blocked = {n: blocked_signals(p) for n, p in [("server", server), *after.items()]}
            print(json.dumps({"before": before, "after": after, "gone": gone, "pid": pid,
                              "blocked": blocked}))
""")


@pytest.mark.timeout(60)
def test_when_the_fork_server_dies_each_node_is_stopped_before_a_new_one_starts(tmp_path):
    # Given a runtime whose fork server is killed -9 (its nodes still running)
    done = subprocess.run([sys.executable, "-c", _KILL_SERVER], cwd=ROOT, capture_output=True,
                          text=True, timeout=50, check=True)
    seen = json.loads(done.stdout.splitlines()[-1])
    # Then every node was restarted by a new server, each old process gone first (never
    # two of a node at once, on the same sockets and files)
    assert set(seen["before"]) == set(seen["after"]) == {"gateway", "worker-0"}
    assert not set(seen["before"].values()) & set(seen["after"].values())
    assert sorted(seen["gone"]) == sorted(seen["before"].values())
    assert "the fork server is gone" in done.stderr
    # and messaging works again (on a new process)
    assert seen["pid"] == seen["after"]["worker-0"]
    # and the new server, too, keeps SIGTERM and SIGINT blocked (a SIGTERM to the
    # process group is not its end), while its nodes have unblocked them
    term_int = [signal.SIGTERM, signal.SIGINT]
    assert set(term_int) <= set(seen["blocked"]["server"])
    assert not set(term_int) & {s for n in ("gateway", "worker-0") for s in seen["blocked"][n]}


@pytest.mark.timeout(60)
def test_a_spawned_server_keeps_sigterm_and_sigint_blocked() -> None:
    # Given a process that starts the fork server itself, spawned (as a test session or
    # an embedding program does), its resource tracker started on the way
    script = textwrap.dedent("""
        import json
        from multiprocessing import forkserver as mp_forkserver
        from actors.runtime import forkserver
        from tests.runtime.test_forkserver import blocked_signals
        forkserver.ensure_running()
        print(json.dumps(blocked_signals(mp_forkserver._forkserver._forkserver_pid)))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=50, check=True)
    # Then the server blocks both (a SIGTERM to the process group is not its end)
    assert {signal.SIGTERM, signal.SIGINT} <= set(json.loads(done.stdout))


def blocked_signals(pid: int) -> list[int]:
    """The signals process `pid`'s main thread blocks (``SigBlk`` in /proc)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return [n for n in range(1, 65) if mask >> (n - 1) & 1]


@pytest.mark.timeout(10)
def test_a_sigterm_that_comes_while_the_server_is_ensured_reaches_the_handler(
        monkeypatch) -> None:
    # Given a daemon's SIGTERM handler, and a SIGTERM that comes while the fork server is
    # being ensured (started, or found running)
    got: list[int] = []
    monkeypatch.setattr(mp_forkserver, "ensure_running",
                        lambda: os.kill(os.getpid(), signal.SIGTERM))
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        forkserver.ensure_running()
        # Then the handler has it once the call returns (it was once ignored there, and
        # lost: a daemon signalled while starting ran on).  (Another thread may have
        # taken it: the main thread runs the handler at its next bytecodes.)
        wait_until(lambda: got, 5, "the SIGTERM handler")
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.mark.timeout(10)
def test_joining_a_mailbox_wakes_when_it_closes_and_times_out_when_it_does_not() -> None:
    box = Mailbox(10)
    # Given a thread waiting for the mailbox to close
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(box.wait_closed(30)))
    waiter.start()
    # When it closes
    box.close()
    waiter.join(5)
    # Then the waiter returned True, long before its 30 s
    assert woke == [True]
    # and a closed mailbox answers at once; an open one after the timeout, False
    assert box.wait_closed(0)
    assert not Mailbox(10).wait_closed(0.01)
    emptied = Mailbox(10)
    assert emptied.close_if_empty()
    assert emptied.wait_closed(0)
