"""Fixtures for the actor runtime tests: short run dirs, runtimes, leak checks."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from typing import Any

import psutil
import pytest

from actors.runtime import Supervisor
from tests.runtime.helpers import FACTORIES

# Threads the runtime starts; none may survive a test.
RUNTIME_THREAD_PREFIXES = ("dispatcher:", "mailbox:", "blocking:", "supervisor-monitor",
                           "control-server")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0,
               what: str | Callable[[], str] = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (`what`
    names it in the failure; a callable is asked then, to say how far it got)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for "
                        f"{what() if callable(what) else what}")
        time.sleep(0.02)


def _runtime_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(RUNTIME_THREAD_PREFIXES)]


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves child processes, runtime threads or file descriptors behind."""
    # Nodes are forked by multiprocessing's fork server, which lives (with a
    # resource-tracker process) as long as this interpreter: in the baseline.
    forkserver.ensure_running()
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    fds_before = me.num_fds()
    yield

    def settled() -> bool:
        children = {p.pid for p in me.children(recursive=True) if p.is_running()}
        zombies_gone = children <= children_before
        return zombies_gone and not _runtime_threads() and me.num_fds() <= fds_before

    deadline = time.monotonic() + 10
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.05)
    leaked = {p.pid for p in me.children(recursive=True)} - children_before
    assert not leaked, f"leaked child processes: {leaked}"
    assert not _runtime_threads(), f"leaked runtime threads: {_runtime_threads()}"
    assert me.num_fds() <= fds_before, f"leaked fds: {fds_before} -> {me.num_fds()}"


@pytest.fixture
def run_dir() -> Iterator[str]:
    """A short directory for ipc sockets (unix socket paths are limited to ~100 chars)."""
    path = tempfile.mkdtemp(prefix="act", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_runtime(run_dir: str) -> Iterator[Callable[..., Supervisor]]:
    """Start a Supervisor with the test factories; it is stopped after the test."""
    started: list[Supervisor] = []

    def start(**options: Any) -> Supervisor:
        options.setdefault("workers", 2)
        options.setdefault("shutdown_timeout", 5.0)
        supervisor = Supervisor(run_dir, FACTORIES, **options)
        started.append(supervisor)
        return supervisor.start()

    yield start
    for supervisor in started:
        assert supervisor.stop(), "runtime did not shut down cleanly"
