"""What the TLS and compression tests share: a throwaway PKI (``trustme``), a blocking
NSQ V2 client that can switch to TLS and compression after IDENTIFY, HTTP(S) calls,
and a starter for our broker or the real nsqd with the same ``--tls-*`` flags."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import trustme

from actors.broker import Broker
from actors.broker.options import parse_options
from tests.broker.conftest import broker_options
from tests.lookupd.conftest import free_port, nsq_binary
from transport.nsq.client_codec import ClientConnection, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc


@dataclass
class Pki:
    ca: trustme.CA
    ca_file: str
    cert: str
    key: str
    client_cert: str  # the client's certificate and key, one PEM file
    stranger_cert: str  # a client certificate from another CA

    def client_context(self, *, with_cert: str | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if with_cert is not None:
            ctx.load_cert_chain(with_cert)
        return ctx


def make_pki(d) -> Pki:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.pem"))
    client = ca.issue_cert("client@example.com", common_name="reader-7")
    client.private_key_and_cert_chain_pem.write_to_path(str(d / "client.pem"))
    stranger = trustme.CA().issue_cert("stranger@example.com")
    stranger.private_key_and_cert_chain_pem.write_to_path(str(d / "stranger.pem"))
    return Pki(ca, str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"),
               str(d / "client.pem"), str(d / "stranger.pem"))


class Client:
    """A blocking NSQ V2 client on our codec, which can upgrade to TLS after IDENTIFY."""

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.sock: socket.socket = socket.create_connection((host, int(port)), timeout=10)
        self.codec = ClientConnection()
        self.out: Callable[[bytes], bytes] = bytes  # (compression, once negotiated)
        self.inn: Callable[[bytes], bytes] = bytes

    def send(self, command: pc.Command) -> None:
        self.sock.sendall(self.out(self.codec.send(command)))

    def frames(self, n: int = 1) -> list:
        out: list = []
        while len(out) < n:
            event = self.codec.next_event()
            if event is CLOSED:
                break
            if event is NEED_DATA:
                data = self.sock.recv(65536)
                if not data:
                    break
                inflated = self.inn(data)
                if inflated:  # (b"" would say the broker closed; a flush marker inflates to it)
                    self.codec.receive_data(inflated)
                continue
            if not isinstance(event, pc.Heartbeat):
                out.append(event)
        return out

    def identify(self, **features: object) -> dict:
        """IDENTIFY, reading exactly its answer: what follows may be compressed."""
        self.send(pc.Identify({"feature_negotiation": True, **features}))
        size, kind = struct.unpack(">ii", self._exactly(8))
        body = self._exactly(size - 4)
        assert kind == 0, body
        return json.loads(body)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            assert more, "closed"
            data += more
        return data

    def upgrade(self, ctx: ssl.SSLContext) -> bool:
        """Whether the TLS handshake, then nsqd's ``OK`` inside TLS, succeed."""
        try:
            self.sock = ctx.wrap_socket(self.sock, server_hostname="127.0.0.1")
            # (TLS 1.3: a refused client certificate is heard of on the first read)
            return self.frames(1) == [Response(b"OK")]
        except (ssl.SSLError, ConnectionError):
            return False

    def closed_by_peer(self) -> bool:
        """Whether the broker closes the connection (what it writes before is skipped)."""
        try:
            while self.sock.recv(65536):
                pass
        except (ConnectionResetError, ssl.SSLError):
            pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


def https(port: int, ctx: ssl.SSLContext | None, method: str, path: str
          ) -> tuple[int, dict[str, str], bytes]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
            if ctx is not None else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        conn.request(method, path, body=b"hi" if method == "POST" else None)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@dataclass
class Target:
    name: str
    tcp: str
    http_port: int
    https_port: int
    zmq: str = ""  # (ours)


def tls_flags(pki: Pki, required: str, policy: str = "") -> list[str]:
    flags = [f"--tls-cert={pki.cert}", f"--tls-key={pki.key}",
             f"--tls-root-ca-file={pki.ca_file}", f"--tls-required={required}"]
    return flags + ([f"--tls-client-auth-policy={policy}"] if policy else [])


def starter(pki: Pki, tmp_path, stops: list) -> Callable[..., Target]:
    """start(kind, required, policy, extra=flags) -> a running ``ours`` or ``nsqd`` with
    TLS (stopped by the callables left in `stops`)."""

    def _start(kind: str, required: str = "true", policy: str = "", *,
               extra: tuple[str, ...] = ()) -> Target:
        flags = [*tls_flags(pki, required, policy), *extra]
        if kind == "ours":
            o = parse_options([*flags, "--https-address=127.0.0.1:0"])
            b = Broker(broker_options(
                tmp_path / f"data{len(stops)}", https_address=o.https_address,
                tls_cert=o.tls_cert, tls_key=o.tls_key, tls_root_ca_file=o.tls_root_ca_file,
                tls_required=o.tls_required, tls_client_auth_policy=o.tls_client_auth_policy,
                deflate=o.deflate, snappy=o.snappy, max_deflate_level=o.max_deflate_level,
                auth_http_address=o.auth_http_address,
                auth_http_request_method=o.auth_http_request_method,
                client_timeout=o.client_timeout)).start()
            stops.append(b.stop)
            return Target("ours", b.tcp_address, b.http_port, b.https_port, b.zmq_endpoint)
        tcp, http_port, https_port = free_port(), free_port(), free_port()
        data = tmp_path / f"nsqd{len(stops)}"
        data.mkdir()
        proc = subprocess.Popen(
            [nsq_binary("nsqd"), f"--data-path={data}", f"--tcp-address=127.0.0.1:{tcp}",
             f"--http-address=127.0.0.1:{http_port}",
             f"--https-address=127.0.0.1:{https_port}", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stops.append(lambda: (proc.terminate(), proc.wait(10)))
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", tcp), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nsqd did not start"
                time.sleep(0.02)
        return Target("nsqd", f"127.0.0.1:{tcp}", http_port, https_port)

    return _start


_PYNSQ = """
import sys, ssl, nsq, tornado.ioloop
loop = tornado.ioloop.IOLoop.current()
expected, got, acks = {bodies!r}, [], []
def handler(m):
    got.append(m.body)
    if len(got) == len(expected):
        loop.stop()
    return True
r = nsq.Reader(topic={topic!r}, channel="c", message_handler=handler,
               nsqd_tcp_addresses=[{address!r}], max_in_flight=10, {options})
w = nsq.Writer([{address!r}], {options})
loop.call_later(1.0, lambda: w.mpub({topic!r}, expected,
                                    callback=lambda conn, data: acks.append(data)))
loop.call_later(30.0, loop.stop)
loop.start()
print(sorted(got), acks)
sys.exit(0 if sorted(got) == sorted(expected) and acks[:1] == [b"OK"] else 1)
"""


def pynsq_roundtrip(address: str, topic: str, options: str, bodies: list[bytes]) -> None:
    """pynsq's Writer publishes `bodies` and its Reader reads them back, both made with
    `options` (Python keyword arguments, e.g. ``"snappy=True"``), in a fresh interpreter
    (tornado's loop and pynsq's clients are per-process)."""
    script = _PYNSQ.format(bodies=bodies, topic=topic, address=address, options=options)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
