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
side by side on two cores, and :func:`exit_now` ends both at its stop.  The
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
import sys
import threading
from collections.abc import Sequence
from multiprocessing import forkserver
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


def start(preload: Sequence[str]) -> None:
    """Start the fork server now (if it is not running), importing `preload`; returns at
    once: the server imports while the caller goes on."""
    context(preload)
    ensure_running()


def ensure_running() -> None:
    """Start the server if it is not running (again, if it died), ignoring SIGTERM (the
    disposition survives its exec): a SIGTERM to the whole process group (systemd's
    stop, ``kill -TERM -<pgid>``) must stop the supervisor and its nodes in order, not
    kill the server they came from, which would leave the supervisor unable to see
    how its nodes exit.  The server ends with its supervisor's process (or
    :func:`exit_now`); nodes set their own SIGTERM handler.  (Only the main thread may
    set a signal's disposition: a server started from another thread takes SIGTERM.)"""
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)


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
