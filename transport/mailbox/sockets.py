"""ZeroMQ sockets for actor mailboxes: PULL sockets per node, PUSH sockets per sending thread.

Theory of operation
-------------------
Every node (a process hosting actors, or an external endpoint such as a test
or a CLI) binds a PULL socket at ``ipc://<run_dir>/<node>.sock`` (and one for
the replies to its asks, see the runtime's endpoint).  Anyone who wants to
reach an actor on that node sends encoded envelopes
(:mod:`transport.mailbox.envelope`) to that address through a PUSH socket.

ZeroMQ sockets must not be shared between threads, and a process sends from
several threads (its dispatcher threads, socket loops, the caller's threads).
:class:`Outbox` therefore keeps one PUSH socket *per (thread, destination
node)* in a ``threading.local``: a bounded number, since the threads are.
ZeroMQ preserves order on one socket, and one sending thread uses exactly one
socket per destination, so messages from one sender to one receiver arrive in
the order they were sent - with no lock on the send path.

Backpressure: each PUSH has a send high-water mark (``sndhwm`` envelopes) and
a send timeout.  When the receiver stops reading (its actors are slow) the
queues fill up, ``send`` blocks for at most ``send_timeout`` and then raises
``zmq.Again``; the actor layer turns that into ``MailboxFull``.  While a
destination node is down its PUSH queue keeps up to ``sndhwm`` envelopes and
flushes them when the node rebinds the same address (ZeroMQ reconnects every
``RECONNECT_IVL``, backing off to ``RECONNECT_IVL_MAX``).

All sockets are created with ``linger=0`` and recorded, so :meth:`Outbox.close`
can close every one of them before the context is terminated.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import zmq

__all__ = [
    "MAX_IPC_PATH", "Outbox", "bind_inbox", "close_and_unlink", "ipc_address", "recv_timeout",
]

MAX_IPC_PATH = 100
"""Unix socket paths are limited to ~107 bytes; we keep a margin."""

RECONNECT_IVL_MS = 5
RECONNECT_IVL_MAX_MS = 50
"""A PUSH retries a peer that is not there yet after 5 ms, then backs off to every
50 ms: a node that has just bound its socket is reached at once (the supervisor's
first ping of a starting node), and 50 ms bounds the delay after a node restart."""


def ipc_address(run_dir: str | os.PathLike[str], node: str) -> str:
    """Return the ipc:// endpoint of ``node`` inside ``run_dir``."""
    path = os.path.join(os.fspath(run_dir), f"{node}.sock")
    if len(path) > MAX_IPC_PATH:
        msg = f"ipc path too long ({len(path)} > {MAX_IPC_PATH}): {path}; use a shorter run_dir"
        raise ValueError(msg)
    return f"ipc://{path}"


def bind_inbox(ctx: zmq.Context[zmq.Socket[bytes]], address: str, rcvhwm: int) -> zmq.Socket[bytes]:
    """Bind the node's PULL socket (removing a stale socket file of a dead predecessor)."""
    path = address.removeprefix("ipc://")
    if path != address and os.path.exists(path):
        os.unlink(path)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.bind(address)
    return sock


def recv_timeout(sock: zmq.Socket[bytes], timeout: float) -> bytes | None:
    """Receive one frame, or return None after ``timeout`` seconds."""
    if sock.poll(int(timeout * 1000), zmq.POLLIN):
        return sock.recv()
    return None


class Outbox:
    """Per-thread PUSH sockets keyed by destination node.

    ``address_of`` maps a node name to its endpoint.  ``send`` may be called
    from any thread; each thread lazily gets its own sockets.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address_of: Callable[[str], str],
        sndhwm: int,
        send_timeout: float,
    ) -> None:
        self._ctx = ctx
        self._address_of = address_of
        self._sndhwm = sndhwm
        self._sndtimeo = max(0, int(send_timeout * 1000))
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _all, touched only on socket creation/close
        self._all: list[zmq.Socket[bytes]] = []
        self._closed = False

    def _socket(self, node: str) -> zmq.Socket[bytes]:
        sockets: dict[str, zmq.Socket[bytes]] | None = getattr(self._local, "sockets", None)
        if sockets is None:
            sockets = self._local.sockets = {}
        sock = sockets.get(node)
        if sock is None:
            with self._lock:
                if self._closed:
                    msg = "outbox is closed"
                    raise zmq.ZMQError(zmq.ETERM, msg)
                sock = self._ctx.socket(zmq.PUSH)
                self._all.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.SNDTIMEO, self._sndtimeo)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sock.connect(self._address_of(node))
            sockets[node] = sock
        return sock

    def send(self, node: str, data: bytes) -> None:
        """Queue one encoded envelope for ``node``.

        Raises ``zmq.Again`` when the destination's queue stayed full for the
        whole send timeout.
        """
        sockets = getattr(self._local, "sockets", None)
        sock = sockets.get(node) if sockets is not None else None
        if sock is None:
            sock = self._socket(node)
        sock.send(data, copy=len(data) < 65536)

    def forget(self, node: str) -> None:
        """Close this thread's socket to ``node`` (e.g. a one-shot reply address)."""
        sockets = getattr(self._local, "sockets", None)
        if sockets and node in sockets:
            self._close_one(sockets.pop(node))

    def close_thread(self) -> None:
        """Close the calling thread's sockets (call when the thread ends)."""
        sockets = getattr(self._local, "sockets", None) or {}
        for sock in sockets.values():
            self._close_one(sock)
        sockets.clear()

    def _close_one(self, sock: zmq.Socket[bytes]) -> None:
        with self._lock:
            if sock in self._all:
                self._all.remove(sock)
        sock.close(linger=0)

    def close(self) -> None:
        """Close every socket of every thread; only when no thread still sends."""
        with self._lock:
            self._closed = True
            socks, self._all = self._all, []
        for sock in socks:
            sock.close(linger=0)


def close_and_unlink(sock: zmq.Socket[bytes], address: str) -> None:
    """Close a bound socket and remove its ipc file."""
    sock.close(linger=0)
    path = address.removeprefix("ipc://")
    if path != address:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
