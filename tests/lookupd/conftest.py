"""Fixtures of the lookup daemon's tests: a daemon on free ports, a broker-side V1
connection, HTTP calls, and NSQ's own binaries where they are (skipped, saying why,
where they are not)."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.lookupd import Lookupd, LookupdOptions
from tests.ports import free_port
from tests.runtime.conftest import wait_until  # noqa: F401 - the lookupd tests take it from here
from transport.nsq.lookup_codec import NEED_DATA, Answer, LookupClientConnection

ROOT = Path(__file__).resolve().parents[2]


def nsq_binary(name: str) -> str:
    """`../shared/nsq/bin/<name>` (NSQ v1.3.0), else PATH; the test is skipped without."""
    shared = ROOT.parent / "shared" / "nsq" / "bin" / name
    found = str(shared) if shared.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} (NSQ v1.3.0) is not in ../shared/nsq/bin or on PATH")
    return found


NSQJS = Path(__file__).parent / "nsqjs"
"""nsqjs, installed by tests/deps.sh, with the scripts the nsqjs tests run."""


def nsqjs_node() -> str:
    """The ``node`` to run the nsqjs scripts with; skips the test where node or nsqjs
    is missing (tests/deps.sh installs nsqjs where npm is; CI has both)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    if not (NSQJS / "node_modules" / "nsqjs").is_dir():
        pytest.skip("nsqjs is not installed: run tests/deps.sh (needs npm)")
    return node


class Http:
    """Plain HTTP calls to one address: ``(status, headers, body)``."""

    def __init__(self, address: str) -> None:
        self.host, _, port = address.rpartition(":")
        self.port = int(port)

    def call(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def up(self) -> bool:
        """Whether ``/ping`` answers 200 (False while nothing listens yet)."""
        try:
            return self.call("GET", "/ping")[0] == 200
        except OSError:
            return False

    def json(self, path: str, method: str = "GET") -> Any:
        status, _, body = self.call(method, path)
        assert status == 200, (path, status, body)
        return json.loads(body)


class Peer:
    """A broker's V1 connection (our client codec over a blocking socket)."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.codec = LookupClientConnection()

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, command: Any) -> None:
        self.sock.sendall(self.codec.send(command))

    def answer(self) -> Answer | None:
        """The next answer; None once the daemon closed the connection."""
        while True:
            event = self.codec.next_event()
            if isinstance(event, Answer):
                return event
            if event is not NEED_DATA:
                return None
            self.codec.receive_data(self.sock.recv(65536))

    def ask(self, command: Any) -> Answer | None:
        self.send(command)
        return self.answer()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def lookupd() -> Iterator[Lookupd]:
    """A lookup daemon on free ports (fixed: a restarted process binds them again),
    broadcasting 127.0.0.1, debug hooks on."""
    daemon = Lookupd(LookupdOptions(tcp_address=f"127.0.0.1:{free_port()}",
                                    http_address=f"127.0.0.1:{free_port()}",
                                    broadcast_address="127.0.0.1", debug_hooks=True,
                                    log_level="warn"))
    daemon.start()
    yield daemon
    assert daemon.stop(), "the lookup daemon did not stop cleanly"


class Process:
    """A binary of NSQ's run for a test, stopped (by its PID) at the end."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def processes() -> Iterator[Callable[[list[str], Path], Process]]:
    started: list[Process] = []

    def start(args: list[str], log: Path) -> Process:
        p = Process(args, log)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
