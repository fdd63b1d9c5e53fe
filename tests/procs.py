"""Freezing a node's process for a test: SIGSTOP, and waiting until it took effect."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from tests.runtime.conftest import wait_until


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is in state T (stopped)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state == "T" for state in states)


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP a node for the duration of the block: alive but unresponsive.

    SIGSTOP is asynchronous: the kernel wakes one thread, which stops the others when
    it next runs, and until then (milliseconds under load) the node still answers.  So
    the block starts once every thread of the node is stopped."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: all_threads_stopped(pid), what=f"pid {pid} stopped")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
