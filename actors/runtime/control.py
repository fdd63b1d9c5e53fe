"""Control channel of the supervisor: introspection and debug hooks for operators and tests.

Theory of operation
-------------------
The supervisor binds a ROUTER socket at ``ipc://<run_dir>/control.sock`` and
serves it from one thread.  A request is one msgpack frame
``[request_id, command, argument]``; the reply is
``[request_id, ok, value]`` where ``value`` is the result or, when ``ok`` is
false, ``[error type name, text]``.  Commands:

``ps``             processes: name, role, pid, restarts, alive
``actors``         actors: name, node, mailbox depth, messages handled, restarts
``spawn NAME``     create an actor now and after every restart of its node
``crash NAME``     make an actor raise (refused unless ``debug_hooks``)

:class:`ControlClient` is the Python API used by ``python -m actors.ctl``; it
uses a DEALER socket with ``linger=0`` and a timeout, and discards replies
to earlier requests that timed out.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import asdict
from typing import Any, Protocol

import msgpack
import zmq

from actors.runtime.errors import ActorsError, AskTimeout, DebugHooksDisabled, UnknownActor
from transport.mailbox.envelope import frozen
from transport.mailbox.sockets import ipc_address

__all__ = ["ActorInfo", "ControlClient", "ControlServer", "ProcessInfo"]

logger = logging.getLogger(__name__)

CONTROL_NODE = "control"
_ERRORS: dict[str, type[ActorsError]] = {
    c.__name__: c for c in (DebugHooksDisabled, UnknownActor, AskTimeout)
}


@frozen
class ProcessInfo:
    """One process of the runtime."""

    name: str
    """``supervisor``, ``gateway`` or ``worker-<i>``."""
    role: str
    """``supervisor``, ``gateway`` or ``worker``."""
    pid: int | None
    """OS process id (None while the node is being restarted)."""
    restarts: int
    """How many times the supervisor restarted this node."""
    alive: bool
    """Whether the process is running right now."""


@frozen
class ActorInfo:
    """One actor slot on a node."""

    name: str
    """The actor's name."""
    node: str
    """The node hosting it."""
    depth: int
    """Messages waiting in its mailbox."""
    handled: int
    """Messages handled since the slot was created (across restarts)."""
    restarts: int
    """Restarts of the actor by its node (reset when the node restarts)."""
    alive: bool
    """Whether the slot's thread is running."""


class Controlled(Protocol):
    """What the control server serves (the supervisor implements it)."""

    def ps(self) -> list[ProcessInfo]: ...

    def actors(self) -> list[ActorInfo]: ...

    def spawn(self, name: str) -> bool: ...

    def crash(self, name: str) -> None: ...


class ControlServer:
    """Serves control requests for a :class:`~actors.runtime.supervisor.Supervisor` on a thread."""

    def __init__(self, run_dir: str, supervisor: Controlled) -> None:
        self._supervisor = supervisor
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = ipc_address(run_dir, CONTROL_NODE)
        path = address.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)
        self._sock.bind(address)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # close() wakes the poll at once
        self._thread = threading.Thread(target=self._serve, name="control-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            if sock not in dict(poller.poll()):
                continue
            identity, payload = sock.recv_multipart()
            try:
                request_id, command, argument = msgpack.unpackb(payload)
            except (ValueError, TypeError, msgpack.UnpackException):
                logger.warning("control: dropped a malformed request")
                continue
            try:
                reply = [request_id, True, self._handle(command, argument)]
            except Exception as e:
                reply = [request_id, False, [type(e).__name__, str(e)]]
            sock.send_multipart([identity, msgpack.packb(reply)])

    def _handle(self, command: str, argument: Any) -> Any:
        sup = self._supervisor
        match command:
            case "ps":
                return [asdict(p) for p in sup.ps()]
            case "actors":
                return [asdict(a) for a in sup.actors()]
            case "spawn":
                return sup.spawn(str(argument))
            case "crash":
                sup.crash(str(argument))
                return True
            case _:
                msg = f"unknown control command {command!r}"
                raise ValueError(msg)

    def close(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)


class ControlClient:
    """Talks to a running supervisor's control socket."""

    def __init__(self, run_dir: str | os.PathLike[str], timeout: float = 5.0) -> None:
        self.timeout = timeout
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(ipc_address(os.fspath(run_dir), CONTROL_NODE))
        self._ids = itertools.count(1)

    def call(self, command: str, argument: Any = None) -> Any:
        """Send one request and return its value; raises the remote error or AskTimeout."""
        request_id = next(self._ids)
        self._sock.send(msgpack.packb([request_id, command, argument]))
        deadline = time.monotonic() + self.timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(remaining * 1000) + 1):
                break
            reply_id, ok, value = msgpack.unpackb(self._sock.recv())
            if reply_id != request_id:
                continue  # a late reply to a request that timed out
            if ok:
                return value
            type_name, text = value
            raise _ERRORS.get(type_name, ActorsError)(f"{type_name}: {text}")
        msg = f"supervisor did not answer {command!r} within {self.timeout}s"
        raise AskTimeout(msg)

    def ps(self) -> list[ProcessInfo]:
        return [ProcessInfo(**row) for row in self.call("ps")]

    def actors(self) -> list[ActorInfo]:
        return [ActorInfo(**row) for row in self.call("actors")]

    def spawn(self, name: str) -> bool:
        return bool(self.call("spawn", name))

    def crash(self, name: str) -> None:
        self.call("crash", name)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
