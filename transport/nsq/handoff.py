"""Handing a live NSQ TCP connection to another process: the socket and its state.

Theory of operation
-------------------
A consumer's connection is accepted by the gateway, which holds every
client socket; once it subscribes, what it carries (deliveries one way,
FIN/RDY the other) concerns one channel, which lives on one worker.  The
gateway then hands the connection over: the socket itself travels as
ancillary data (``SCM_RIGHTS``) in one datagram over a Unix socket, with
the connection's state beside it (msgpack: the negotiated IDENTIFY
settings, what the client said of itself, the SUB, and the bytes already
read but not yet parsed).  The receiving process adopts the socket into its
own loop and carries on from exactly where the gateway stopped; the client
sees nothing but a faster broker.

Datagrams on a Unix socket are reliable and keep their boundaries, so one
``sendmsg`` is one hand-off; a receiver that is not there (its worker is
restarting) makes the send fail at once, and the gateway keeps serving the
connection itself.  The send never blocks the gateway's loop: a receiver
whose queue is full (its worker is busy) answers :data:`BUSY`, and the loop
tries again a little later.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
from typing import Any

import msgpack

log = logging.getLogger(__name__)

MAX_STATE = 1 << 20
"""Largest state datagram (the unparsed bytes are at most one read's worth, 256 KiB
in asyncio, plus a command: a publisher's pipelined PUBs, or IDENTIFY and SUB lines
and a few RDYs).  A datagram cannot be larger than its socket's send buffer, which
the sender asks to be twice this (Linux grants up to twice ``net.core.wmem_max``,
425,984 bytes by default); a state that does not fit fails, and the connection
stays where it is."""

SENT, BUSY, FAILED = "sent", "busy", "failed"
"""What :meth:`Sender.send` says: handed over; the receiver's queue is full (try
again); cannot be sent (serve the connection here)."""


def socket_path(run_dir: str, index: int) -> str:
    """Where worker ``index`` receives connections."""
    return os.path.join(run_dir, f"handoff-{index}.sock")


class Sender:
    """The gateway's end: one unbound datagram socket for every receiver."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)  # (it runs on the gateway's loop)
        # (the default, 208 KiB, is less than a read of a pipelining publisher)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_STATE)

    def send(self, index: int, fd: int, state: dict[str, Any]) -> str:
        """Hand socket ``fd`` (a duplicate is sent; the caller keeps and closes its own)
        to receiver ``index``: :data:`SENT`, :data:`BUSY` or :data:`FAILED`."""
        data = msgpack.packb(state, use_bin_type=True)
        if len(data) > MAX_STATE or not 0 <= index < len(self.paths):
            return FAILED
        try:
            # (socket.send_fds ignores its address in Python 3.11: sendmsg itself)
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fd]))], 0, self.paths[index])
        except BlockingIOError:
            return BUSY
        except OSError as e:  # not there (restarting), too large, or gone
            log.info("hand-off to %s failed: %s", self.paths[index], e)
            return FAILED
        return SENT

    def close(self) -> None:
        self.sock.close()


class Receiver:
    """A worker's end: a bound datagram socket; :meth:`receive` takes what arrived."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a worker that was killed
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self) -> list[tuple[socket.socket, dict[str, Any]]]:
        """Every connection waiting (non-blocking): ``(socket, state)`` pairs."""
        out = []
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_STATE, 4)
            except (BlockingIOError, InterruptedError):
                return out
            socks = [socket.socket(fileno=fd) for fd in fds]
            if len(socks) != 1:  # not ours: close whatever came
                for s in socks:
                    s.close()
                continue
            try:
                state = msgpack.unpackb(data, raw=False)
            except Exception:
                socks[0].close()
                log.warning("hand-off with an unreadable state dropped")
                continue
            out.append((socks[0], state))

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
