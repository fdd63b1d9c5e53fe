"""The supervisor: starts the gateway and worker processes, restarts them, shuts them down.

Theory of operation
-------------------
:class:`Supervisor` lives in the main process (the broker's, or a test's).
``start()`` creates the run directory, its own endpoint (named
``supervisor``, so the main process can ``tell``/``ask`` actors), one child
process per node (``gateway``, ``worker-0`` ..), forked by the fork server of
:mod:`actors.runtime.forkserver` (safe with ZeroMQ: no context is ever forked;
the nodes' imports are done once, before), waits until every node answers a
ping, then starts two threads:

* the **monitor** blocks in ``multiprocessing.connection.wait`` on the
  children's sentinels plus a wake-up pipe, so a child's death - SIGKILL
  included - is seen at once.  The node is restarted immediately (a node that
  keeps dying within a second of its start backs off exponentially, capped at
  2 s), rebinding the same ipc address, and every actor spawned on it through
  :meth:`spawn` is re-created by replaying a ``Spawn`` request (the request
  is queued by ZeroMQ until the new process binds);
* the **control server** (:mod:`actors.runtime.control`) answers ``ps``, ``actors``,
  ``spawn`` and ``crash`` on ``ipc://<run_dir>/control.sock``.

``stop()`` is the orderly shutdown: the monitor stops restarting, the gateway
(intake) receives SIGTERM first and gets up to half of ``shutdown_timeout``,
then the workers; each node stops its actors after their queued messages so
``on_stop`` can flush storage.  Whatever is still alive at the deadline is
SIGKILLed.  ``stop()`` returns True when every node exited 0 in time.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

from actors.runtime import forkserver
from actors.runtime.actor import Actor
from actors.runtime.control import ActorInfo, ControlServer, ProcessInfo
from actors.runtime.endpoint import Endpoint
from actors.runtime.errors import AskTimeout, DebugHooksDisabled, RuntimeNotRunning
from actors.runtime.node import NodeSpec, SharedFd, node_main, stdio_fds
from actors.runtime.options import RuntimeOptions
from actors.runtime.placement import GATEWAY, Placement
from actors.runtime.system import Crash, ListActors, Ping, Spawn

__all__ = ["RUNTIME_FILE", "Supervisor"]

logger = logging.getLogger(__name__)

RUNTIME_FILE = "runtime.json"
"""Written into the run directory: topology and options, for external clients."""

_SERVER_LOST = 255
"""The exit code multiprocessing reports for a node when its fork server is gone."""

_QUICK_DEATH = 1.0
_MAX_BACKOFF = 2.0


def _stop_orphan(node: str, pid: int, deadline: float) -> None:
    """Stop `pid`, a node whose fork server died (it can no longer say when the node
    exits): SIGTERM, so it flushes, then wait for it; SIGKILL at `deadline`."""
    logger.error("the fork server is gone; node %s (pid %s) is stopped before a new one "
                 "starts", node, pid)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # (no pidfds: a kernel before 5.3, or a seccomp filter)
        _stop_by_pid(node, pid, deadline)
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGTERM)
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            logger.error("node %s (pid %s) missed the deadline: killing it", node, pid)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            poller.poll(5000)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def _stop_by_pid(node: str, pid: int, deadline: float) -> None:
    """`_stop_orphan` without a pidfd: signals by pid, and a 10 ms poll of its life."""
    sig = signal.SIGTERM
    try:
        os.kill(pid, sig)
        while True:
            time.sleep(0.01)
            os.kill(pid, 0)
            if sig == signal.SIGTERM and time.monotonic() > deadline:
                logger.error("node %s (pid %s) missed the deadline: killing it", node, pid)
                sig = signal.SIGKILL
                os.kill(pid, sig)
    except ProcessLookupError:
        pass


@dataclass
class _Child:
    node: str
    process: BaseProcess | None = None
    restarts: int = 0
    started_at: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None
    last_exitcode: int | None = None
    spawned: set[str] = field(default_factory=set)

    @property
    def role(self) -> str:
        return "gateway" if self.node == GATEWAY else "worker"


class Supervisor:
    """Owns the process pool; also a client handle (``tell``/``ask``) for the main process.

    ``factories`` maps a name prefix (``kind`` of ``kind:key``, or ``"*"``) to
    a callable ``factory(name) -> actors.Actor``.  They are pickled into the
    spawned nodes, so they must be module-level classes or functions (or
    ``functools.partial`` of them).  ``boot``, if given, is called in every
    node at start and after every restart (see ``NodeSpec.boot``); it is
    pickled too.  ``shared_fds`` are passed to every node, which keeps them open
    for its life (the broker's data-directory lock, so it is held until the
    last process exits).  ``preload`` names the modules the nodes run, for the
    fork server to import once (see :mod:`actors.runtime.forkserver`).
    ``overrides`` replace fields of ``options``
    (``Supervisor(d, f, workers=2, debug_hooks=True)``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        factories: Mapping[str, Callable[[str], Actor]] | None = None,
        options: RuntimeOptions | None = None,
        *,
        log_level: int = logging.WARNING,
        boot: Callable[[str, Placement], list[str]] | None = None,
        shared_fds: Sequence[int] = (),
        preload: Sequence[str] = (),
        **overrides: Any,
    ) -> None:
        self.run_dir = os.fspath(run_dir)
        self._boot = boot
        self._shared_fds = tuple(SharedFd(fd) for fd in shared_fds)
        self.options = replace(options or RuntimeOptions(), **overrides)
        self.placement = Placement(self.options.workers)
        self._factories = dict(factories or {})
        self._log_level = log_level
        self._mp = forkserver.context(preload)
        self._children = {node: _Child(node) for node in self.placement.nodes}
        self._lock = threading.Lock()
        self._stopping = False
        self._started = False
        self._endpoint: Endpoint | None = None
        self._monitor: threading.Thread | None = None
        self._control: ControlServer | None = None
        self._wake_r, self._wake_w = -1, -1

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> Supervisor:
        """Start every node and wait until all answer; returns self."""
        if self._started:
            msg = "supervisor already started"
            raise RuntimeError(msg)
        self._started = True
        # The nodes' mailboxes and the control socket are unix sockets in the run
        # directory: only this user may reach them, whatever the listeners bind to.
        os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        self._endpoint = Endpoint("supervisor", self.run_dir, self.placement, self.options)
        self._wake_r, self._wake_w = os.pipe()
        try:
            for child in self._children.values():
                self._start_child(child)
            self._wait_ready(time.monotonic() + self.options.start_timeout)
            self._write_runtime_file()
            self._monitor = threading.Thread(target=self._monitor_loop, name="supervisor-monitor")
            self._monitor.start()
            self._control = ControlServer(self.run_dir, self)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> bool:
        """Orderly shutdown within ``shutdown_timeout``; True if every node exited 0."""
        with self._lock:
            if self._stopping:
                return True
            self._stopping = True
        deadline = time.monotonic() + self.options.shutdown_timeout
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        # (a SIGTERM raises wherever start() is, actors.runtime.daemon: the monitor may
        # have been made and not started, and joining that thread raises; one that
        # starts after this sees _stopping and returns)
        if self._monitor is not None and self._monitor.is_alive():
            self._monitor.join()
        if self._control is not None:
            self._control.close()
        gateway = [self._children[GATEWAY]]
        workers = [c for c in self._children.values() if c.node != GATEWAY]
        half = time.monotonic() + self.options.shutdown_timeout / 2
        clean = self._terminate(gateway, min(deadline, half))
        clean = self._terminate(workers, deadline) and clean
        if self._endpoint is not None:
            self._endpoint.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        return clean

    def __enter__(self) -> Supervisor:
        return self.start() if not self._started else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_child(self, child: _Child) -> None:
        # (a server that died is started again here, not by process.start(), which
        # would leave it open to a SIGTERM to the process group: see there)
        forkserver.ensure_running()
        spec = NodeSpec(child.node, self.run_dir, self.options, self._factories, self._log_level,
                        self._boot, self._shared_fds, stdio_fds())
        process = self._mp.Process(target=node_main, args=(spec,), name=child.node, daemon=True)
        process.start()
        child.process = process
        child.started_at = time.monotonic()
        child.restart_at = None

    def _wait_ready(self, deadline: float) -> None:
        endpoint = self._require_endpoint()
        for node, child in self._children.items():
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    msg = f"node {node} did not start within {self.options.start_timeout}s"
                    raise AskTimeout(msg)
                try:
                    endpoint.ask_node(node, Ping(), timeout=min(0.5, remaining))
                    break
                except AskTimeout:
                    process = child.process
                    if process is not None and not process.is_alive():
                        msg = f"node {node} exited with {process.exitcode} while starting"
                        raise RuntimeError(msg) from None

    def _terminate(self, children: Sequence[_Child], deadline: float) -> bool:
        procs = [c.process for c in children if c.process is not None]
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode == _SERVER_LOST and p.pid is not None:  # (see _on_exit)
                _stop_orphan(p.name, p.pid, deadline)
        clean = True
        for p in procs:
            if p.is_alive():
                logger.error("node %s missed the shutdown deadline: killing it", p.name)
                p.kill()
                p.join()
                clean = False
            elif p.exitcode != 0:
                logger.error("node %s exited with %s on shutdown", p.name, p.exitcode)
                clean = False
            p.close()
        for c in children:
            c.process = None
        return clean

    def _write_runtime_file(self) -> None:
        info = {"pid": os.getpid(), "nodes": list(self.placement.nodes)}
        info["options"] = asdict(self.options)
        tmp = os.path.join(self.run_dir, RUNTIME_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(self.run_dir, RUNTIME_FILE))

    # -- monitoring -----------------------------------------------------------------

    def _monitor_loop(self) -> None:
        while not self._stopping:
            with self._lock:
                watched = {c.process.sentinel: c for c in self._children.values() if c.process}
                due = [c.restart_at for c in self._children.values() if c.restart_at is not None]
            timeout = max(0.0, min(due) - time.monotonic()) if due else None
            ready = wait([*watched, self._wake_r], timeout)
            if self._stopping:
                return
            for sentinel in ready:
                if sentinel == self._wake_r:
                    os.read(self._wake_r, 64)
                else:
                    self._on_exit(watched[sentinel])  # type: ignore[index]
            self._restart_due()

    def _on_exit(self, child: _Child) -> None:
        assert child.process is not None
        child.process.join()
        if child.process.exitcode == _SERVER_LOST and child.process.pid is not None:
            # The fork server died (killed by hand?): it can no longer say when its nodes
            # exit, and this one may still run.  Never two of a node at once: stop it
            # (as on SIGTERM, so it flushes) before it is started again.
            _stop_orphan(child.node, child.process.pid,
                         time.monotonic() + self.options.shutdown_timeout)
        child.last_exitcode = child.process.exitcode
        lived = time.monotonic() - child.started_at
        child.quick_deaths = child.quick_deaths + 1 if lived < _QUICK_DEATH else 0
        delay = 0.0 if child.quick_deaths <= 1 else min(_MAX_BACKOFF, 0.1 * 2**child.quick_deaths)
        logger.warning(
            "node %s (pid %s) exited with %s after %.1fs; restarting in %.2fs",
            child.node,
            child.process.pid,
            child.last_exitcode,
            lived,
            delay,
        )
        with self._lock:
            child.process.close()
            child.process = None
            child.restart_at = time.monotonic() + delay

    def _restart_due(self) -> None:
        now = time.monotonic()
        for child in self._children.values():
            if child.restart_at is not None and child.restart_at <= now and not self._stopping:
                with self._lock:
                    self._start_child(child)
                    child.restarts += 1
                    names = sorted(child.spawned)
                for name in names:
                    self._require_endpoint().tell_node(child.node, Spawn(name))

    # -- client handle ----------------------------------------------------------------

    def _require_endpoint(self) -> Endpoint:
        if self._endpoint is None or self._stopping:
            msg = "the runtime is not running"
            raise RuntimeNotRunning(msg)
        return self._endpoint

    def tell(self, name: str, message: Any) -> None:
        """Send ``message`` to actor ``name``."""
        self._require_endpoint().tell(name, message)

    def tell_many(self, name: str, messages: Sequence[Any]) -> None:
        """Send a batch to actor ``name`` in one envelope."""
        self._require_endpoint().tell_many(name, messages)

    def ask(self, name: str, message: Any, timeout: float | None = None) -> Any:
        """Ask actor ``name``; AskTimeout if no reply within ``timeout``."""
        return self._require_endpoint().ask(name, message, timeout)

    def spawn(self, name: str, timeout: float | None = None) -> bool:
        """Create actor ``name`` now and re-create it whenever its node restarts.

        Returns True if the actor was created, False if it already existed.
        """
        node = self.placement.node_for(name)
        with self._lock:
            self._children[node].spawned.add(name)
        return bool(self._require_endpoint().ask_node(node, Spawn(name), timeout))

    def crash(self, name: str, timeout: float | None = None) -> None:
        """Debug hook: make actor ``name`` raise (refused unless ``debug_hooks``)."""
        if not self.options.debug_hooks:
            msg = "crash is a debug hook: start the runtime with debug_hooks=True"
            raise DebugHooksDisabled(msg)
        self._require_endpoint().ask_node(self.placement.node_for(name), Crash(name), timeout)

    # -- introspection ----------------------------------------------------------------

    def ps(self) -> list[ProcessInfo]:
        """The supervisor and every node: role, pid, restarts, alive."""
        rows = [ProcessInfo("supervisor", "supervisor", os.getpid(), 0, True)]
        with self._lock:
            for c in self._children.values():
                alive = c.process is not None and c.process.is_alive()
                pid = c.process.pid if c.process is not None else None
                rows.append(ProcessInfo(c.node, c.role, pid, c.restarts, alive))
        return rows

    def actors(self, timeout: float = 1.0) -> list[ActorInfo]:
        """Every actor on every reachable node (a node being restarted is skipped)."""
        endpoint = self._require_endpoint()
        rows: list[ActorInfo] = []
        for node in self.placement.nodes:
            try:
                slots = endpoint.ask_node(node, ListActors(), timeout=timeout)
            except AskTimeout:
                continue
            rows.extend(ActorInfo(node=node, **slot) for slot in slots)
        return rows
