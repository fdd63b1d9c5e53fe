"""The power-cut rig shared by ``tests/power`` and ``bench/power_bench.py`` (#22).

* :class:`VolatileMount` mounts a backing directory through
  :mod:`tests.power.volatile_fs`; :meth:`VolatileMount.cut` unmounts it, which
  drops what a power cut may drop, and :meth:`VolatileMount.up` mounts it again.
  With ``journal=True`` it is a laxer variant: any fsync also makes every
  directory change durable, as a journal commit does in practice on ext4 or
  XFS (POSIX does not promise it).
* :class:`BrokerProcess` starts our broker or nsqd in durable mode
  (``--mem-queue-size 0 --sync-every 1``, small chunk files), waits for
  ``/ping``, creates topics and channels over HTTP, and kills the process tree
  with SIGKILL.
* :class:`Tcp`, :func:`produce` and :func:`consume` speak NSQ TCP V2 with our
  sans-IO codec: a producer publishes numbered MPUBs of 10 and notes each batch
  once it is OK; a consumer FINs everything delivered.

``python -m tests.power.rig [--journal] BACKING MOUNTPOINT`` serves the file
system in the foreground, as ``python -m tests.power.volatile_fs`` does.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psutil

from tests.ports import free_port
from transport.nsq.client_codec import ClientConnection, Message, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc

ROOT = Path(__file__).resolve().parents[2]
"""The project's root (where ``python -m tests.power...`` resolves)."""


def fuse_problem() -> str | None:
    """Why the volatile file system cannot run here, or None."""
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed"
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        return "FUSE is not available (/dev/fuse, fusermount3 from Debian's fuse3)"
    return None


class MountError(RuntimeError):
    """The volatile file system did not mount (FUSE refused, or its process exited)."""


class VolatileMount:
    """`backing` mounted at `mount` through the volatile file system; `cut()` unmounts."""

    def __init__(self, tmp: Path, *, journal: bool = False) -> None:
        self.backing = tmp / "backing"
        self.mount = tmp / "mnt"
        self.backing.mkdir()
        self.mount.mkdir()
        self.journal = journal
        self.proc: subprocess.Popen[bytes] | None = None

    def up(self) -> None:
        module = ["tests.power.rig", "--journal"] if self.journal else ["tests.power.volatile_fs"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *module, str(self.backing), str(self.mount)],
            stderr=subprocess.PIPE, cwd=ROOT)
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise MountError(f"cannot mount FUSE here: {err.strip()[-300:]}")
            time.sleep(0.02)

    def cut(self) -> None:
        """The power cut: unmounting drops every change not yet durable.

        Retried while the mount is busy: a process killed -9 a moment ago may not
        have let go of its files yet."""
        deadline = time.monotonic() + 15
        while True:
            done = subprocess.run(["fusermount3", "-u", str(self.mount)], check=False,
                                  capture_output=True, timeout=30)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                msg = f"cannot unmount {self.mount}: {done.stderr.decode().strip()}"
                raise RuntimeError(msg)
            time.sleep(0.1)
        assert self.proc is not None
        self.proc.wait(30)

    def durable_dir(self, name: str) -> Path:
        """`mount/name`, created and made durable (its parent fsynced): a provisioned disk."""
        path = self.mount / name
        path.mkdir(exist_ok=True)
        fd = os.open(self.mount, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return path


class BrokerProcess:
    """Our broker (``nsqd=None``) or nsqd (the binary's path), durable, on `data`."""

    def __init__(self, data: Path, *, nsqd: str | None = None,
                 max_bytes_per_file: int = 20000, log: IO[bytes] | None = None) -> None:
        self.data = data
        self.nsqd = nsqd
        self.max_bytes_per_file = max_bytes_per_file
        self.log = log
        self.tcp, self.http, self.zmq = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return "nsqd" if self.nsqd else "ours"

    def command(self) -> list[str]:
        listen = [f"--tcp-address=127.0.0.1:{self.tcp}", f"--http-address=127.0.0.1:{self.http}"]
        durable = ["--mem-queue-size=0", "--sync-every=1",
                   f"--max-bytes-per-file={self.max_bytes_per_file}", "--log-level=warn"]
        if self.nsqd:
            return [self.nsqd, f"--data-path={self.data}", *listen, *durable]
        return [sys.executable, "-m", "actors.broker", f"--data-path={self.data}", *listen,
                f"--zmq-address=tcp://127.0.0.1:{self.zmq}", *durable, "--workers=1"]

    def start(self, timeout: float = 60) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=self.log, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=2)
                conn.request("GET", "/ping")
                if conn.getresponse().read().startswith(b"OK"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited while starting "
                                   f"(status {self.proc.returncode})")
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not answer /ping")

    def post(self, path: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=10)
        conn.request("POST", path)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{self.name}: POST {path}: {response.status} {response.read()!r}")

    def create(self, topics: tuple[str, ...], channels: tuple[str, ...]) -> None:
        """Every topic and every channel of each (``/topic/create``, ``/channel/create``)."""
        for topic in topics:
            self.post(f"/topic/create?topic={topic}")
            for channel in channels:
                self.post(f"/channel/create?topic={topic}&channel={channel}")

    def kill9(self) -> None:
        """SIGKILL to the broker and every process under it, and wait for them."""
        assert self.proc is not None
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(10)


class Tcp:
    """One NSQ TCP V2 connection (our sans-IO codec); heartbeats are answered."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.codec = ClientConnection()

    def send(self, *commands: pc.Command) -> None:
        self.sock.sendall(b"".join(self.codec.send(c) for c in commands))

    def events(self) -> Iterator[object]:
        while True:
            event = self.codec.next_event()
            if event is NEED_DATA:
                data = self.sock.recv(65536)
                if not data:
                    return
                self.codec.receive_data(data)
            elif event is CLOSED:
                return
            elif isinstance(event, pc.Heartbeat):
                self.send(pc.Nop())
            else:
                yield event


def produce(port: int, topic: str, prefix: str, acked: set[bytes], stop: threading.Event,
            *, sent: set[bytes] | None = None) -> None:
    """Publish numbered MPUBs of 10 one after another; note each batch once it is OK.

    Bodies are ``<prefix>-<topic>-<n>``, n counting up from 0; with `sent`, every
    body written to the socket is noted there first (acknowledged or not).
    """
    with contextlib.suppress(OSError):
        c = Tcp(port)
        events = c.events()
        n = 0
        while not stop.is_set():
            bodies = tuple(b"%s-%s-%d" % (prefix.encode(), topic.encode(), n + i)
                           for i in range(10))
            n += 10
            if sent is not None:
                sent.update(bodies)
            c.send(pc.Mpub(topic, bodies))
            if next(events, None) != Response(b"OK"):
                return  # the broker died first: not acknowledged
            acked.update(bodies)


def consume(port: int, topic: str, channel: str, deliver: Callable[[bytes], Any],
            stop: threading.Event, *, idle: float | None = None) -> None:
    """FIN everything delivered (each body passed to `deliver` first).

    With `idle`, return after that long without a message.
    """
    with contextlib.suppress(OSError):
        c = Tcp(port)
        c.send(pc.Sub(topic, channel), pc.Rdy(50))
        c.sock.settimeout(idle if idle else 0.5)
        events = c.events()
        while not stop.is_set():
            try:
                event = next(events)
            except TimeoutError:
                if idle:
                    return
                continue
            except StopIteration:
                return
            if isinstance(event, Message):
                deliver(event.body)
                c.send(pc.Fin((event.id,)))


def _serve(argv: list[str]) -> int:
    """``[--journal] BACKING MOUNTPOINT``: the volatile file system, in the foreground."""
    import logging

    import mfusepy as fuse

    from tests.power.volatile_fs import VolatileFS

    class JournalledFS(VolatileFS):
        """An fsync commits every directory change too (ext4 / XFS journal commits)."""

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            super().fsync(path, datasync, fh)
            with self._mutex:
                self.dirlog.clear()
            return 0

    journal = argv[:1] == ["--journal"]
    backing, mountpoint = argv[1:] if journal else argv
    logging.basicConfig(level=logging.WARNING, format="volatile_fs: %(message)s")
    ops = (JournalledFS if journal else VolatileFS)(backing)
    fuse.FUSE(ops, mountpoint, foreground=True, nothreads=False,
              allow_other=False, default_permissions=False)
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
