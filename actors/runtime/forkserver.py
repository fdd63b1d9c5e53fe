"""Where node processes come from: forks of a fork server that has imported their code.

Theory of operation
-------------------
A node must not be a plain ``fork`` of the supervisor's process: that process
has a ZeroMQ context and threads (the monitor, the control server, a test's
own), and a fork copies their locks in whatever state they are in.  ``spawn``
is safe but makes every node a new interpreter that imports the broker again:
about half a second of CPU each, three at once on two cores, at every start and
every restart.

So nodes come from :mod:`multiprocessing`'s *forkserver*: one process per
supervising process, started by exec (no context, no threads), which imports
the modules named as ``preload`` once and then forks a node for each request
in milliseconds, its imports already done.  The server lives as long as the
process that started it (a test session serves every broker of the session
from one); when that process dies the server exits, and so do the nodes, which
watch the same pipe (``multiprocessing.parent_process().sentinel``).

:func:`start` starts the server ahead of need: a daemon's ``__main__`` calls it
before its own imports, so that the server's imports and the supervisor's run
side by side on two cores, and :func:`exit_now` ends both at its stop.  There,
with nothing but the main thread running yet, the server and multiprocessing's
resource tracker are *forks* of the daemon's process (``start(fork=True)``)
rather than new interpreters: multiprocessing's own server protocol, minus
two interpreter starts on the start's critical path.  A test session's server,
started from a process that may have threads, is spawned.  The
preload is fixed when the server starts (later calls cannot add to it); a node
whose code was not preloaded imports it after the fork, as ``spawn`` would.

A node runs the top level of the supervisor's main script again, as
``__mp_main__`` (as with ``spawn``; a script needs its ``if __name__ ==
"__main__":`` guard).  With ``python -m ...`` nothing is run.  With a script
path, what the script imports costs a node nothing if the server has it: the
pytest plugin preloads ``pytest`` for the ``pytest`` command, whose script
imports it.  (Python 3.11 ignores ``"__main__"`` in a fork server's preload:
it looks for a preparation key that is never set.)

Each node writes to the stdout and stderr its supervisor had when it started
it (passed along, see ``NodeSpec.stdio``), not to the server's: pytest
captures a test's output by pointing those at a file while the test runs.
Unlike ``spawn``'s, a node's environment is the server's, as it was when the
server started: a later change to ``os.environ`` in the supervisor's process
does not reach nodes (the broker's read none).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from multiprocessing import connection, forkserver, resource_tracker
from multiprocessing.context import ForkServerContext
from typing import NoReturn

__all__ = ["context", "ensure_running", "exit_now", "start"]


def context(preload: Sequence[str] = ()) -> ForkServerContext:
    """The forkserver context, asking the server to import `preload` if it has not started."""
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    if preload and not _running():
        ctx.set_forkserver_preload(list(preload))
    return ctx


def start(preload: Sequence[str], *, fork: bool = False) -> None:
    """Start the fork server now (if it is not running), importing `preload`; returns at
    once: the server imports while the caller goes on.

    With `fork` (a daemon's ``__main__``, first thing) the server and
    multiprocessing's resource tracker are forks of this process instead of new
    interpreters: two interpreter starts (~50 ms of CPU each here) fewer at every
    start, on the start's critical path.  Only a process that has no thread but
    its main one and no ZeroMQ context yet (whose I/O threads ``threading`` cannot
    see) may fork: the fork copies every lock as it is.  Otherwise (a test
    session's plugin) the server is spawned as multiprocessing spawns it."""
    context(preload)
    if fork and not _running() and _may_fork():
        _fork_tracker()
        _fork_server(preload)
    ensure_running()


def _may_fork() -> bool:
    return (threading.active_count() == 1 and "zmq" not in sys.modules
            and threading.current_thread() is threading.main_thread())


_IGNORED = (signal.SIGINT, signal.SIGTERM)
"""Blocked in the fork server for its whole life (see `ensure_running`), so in each
node until it has set its own handlers (``node_main`` then unblocks them: one sent
before is delivered then, not lost), and across the fork of the tracker, which
ignores both."""


def _fork_tracker() -> None:
    """multiprocessing's resource tracker (semaphores, shared memory: nodes are passed
    its pipe), forked.  It reads its pipe until every holder of the write end has
    closed it, then cleans up what was left registered."""
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        return
    r, w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
    try:
        pid = os.fork()
        if pid == 0:  # (main() ignores the two signals, then unblocks them)
            code = 1
            try:
                _close_inherited(keep=(r,))
                resource_tracker.main(r)
                code = 0
            finally:
                os._exit(code)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
    os.close(r)
    tracker._fd, tracker._pid = w, pid


def _close_inherited(keep: Sequence[int]) -> None:
    """In a forked server or tracker: close every descriptor but stdio and `keep`.  What
    the daemon was launched with (a harness's pipe, a shell's redirection) would
    otherwise stay open in every node until the broker stops, as no spawned server
    (multiprocessing passes it only what it needs) keeps it."""
    try:
        fds: Sequence[int] = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:  # (no /proc: up to the soft limit, at most 65,536)
        fds = range(3, min(os.sysconf("SC_OPEN_MAX"), 65_536))
    for fd in fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fork_server(preload: Sequence[str]) -> None:
    """The fork server, forked: what ``ForkServer.ensure_running`` sets up, with a fork
    where it spawns ``forkserver.main`` in a new interpreter.  The server imports
    `preload` (this process goes on with its own imports on the other core), then
    serves requests exactly as a spawned one does."""
    server = forkserver._forkserver
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # every process the server forks holds the write end of the "alive" pipe;
        # the server ends when the read end sees all of them gone
        alive_r, alive_w = os.pipe()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
        try:
            pid = os.fork()
            if pid == 0:  # (the two stay blocked: see _IGNORED)
                code = 1
                try:
                    # (alive_w and the tracker's pipe too: the tracker's goes to each
                    # node with its request, not from here)
                    _close_inherited(keep=(listener.fileno(), alive_r))
                    resource_tracker._resource_tracker._fd = None
                    forkserver.main(listener.fileno(), alive_r, list(preload))
                except SystemExit as e:  # (its end: every client has gone)
                    code = e.code if isinstance(e.code, int) else 0
                finally:
                    os._exit(code)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def ensure_running() -> None:
    """Start the server if it is not running (again, if it died), with SIGTERM and
    SIGINT blocked (the mask survives its exec, and it never unblocks them): a
    SIGTERM to the whole process group (systemd's stop, ``kill -TERM -<pgid>``) must
    stop the supervisor and its nodes in order, not kill the server they came from,
    which would leave the supervisor unable to see how its nodes exit.  The server
    ends with its supervisor's process (or :func:`exit_now`).

    Blocked in the calling thread only, the signals still reach this process: another
    thread takes them, or they wait until the mask is restored.  (Ignoring them here
    instead would lose a SIGTERM that came meanwhile, and the daemon would run on.)"""
    resource_tracker.ensure_running()  # (first: starting it unblocks the two)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def exit_now(code: int) -> NoReturn:
    """A daemon's last step, once its nodes have stopped: end this process and the
    fork server without tearing their interpreters down (~50 ms and ~100 ms of
    freeing modules that nothing needs; the server holds no data)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (closed, None, or a broken pipe)
            stream.flush()
    pid = forkserver._forkserver._forkserver_pid  # (no public accessor)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    os._exit(code)


def _running() -> bool:
    return forkserver._forkserver._forkserver_pid is not None  # (no public query)
