"""NSQ AUTH (``--auth-http-address``): an auth server the test runs decides what each
secret may do; the same answers as nsqd 1.3 (run beside ours), with pynsq, TTL expiry
and revocation, TLS common names, and ZeroMQ clients refused while AUTH is on."""

# ruff: noqa: S105, S106 - the secrets here are the test auth server's own
from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from tests.broker.test_broker_actors import wait_for
from tests.broker.tls_kit import Client, pynsq_roundtrip
from transport.client import BrokerRefused, Consumer, Producer
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(120)

READER = {"topic": "^orders$", "channels": ["^billing$"], "permissions": ["subscribe"]}
WRITER = {"topic": "^orders", "channels": [".*"], "permissions": ["publish"]}


class AuthServer:
    """An auth server: ``secrets`` maps a secret to its answer (absent: 403); every
    request's fields are kept in ``asked``."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, Any]] = {}
        self.asked: list[dict[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, fields: dict[str, str]) -> None:
                outer.asked.append(fields)
                answer = outer.secrets.get(fields.get("secret", ""))
                body = json.dumps(answer or {"message": "NOT_AUTHORIZED"}).encode()
                self.send_response(200 if answer is not None else 403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query, keep_blank_values=True)
                self._answer({k: v[0] for k, v in query.items()})

            def do_POST(self) -> None:
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._answer({k: v[0] for k, v in data.items()} | {"method": "post"})

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def grant(self, secret: str, *auths: dict[str, Any], ttl: int = 3600) -> None:
        self.secrets[secret] = {"ttl": ttl, "identity": f"id-{secret}",
                                "identity_url": f"https://people/{secret}",
                                "authorizations": list(auths)}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def authd() -> Iterator[AuthServer]:
    server = AuthServer()
    server.grant("writer", WRITER)
    server.grant("reader", READER)
    server.grant("nobody")
    yield server
    server.close()


def _error(c: Client) -> str:
    (frame,) = c.frames(1)
    assert isinstance(frame, ErrorFrame), frame
    return str(frame.error)


def _authed(c: Client, secret: str) -> dict[str, Any]:
    c.send(pc.Auth(secret.encode()))
    (frame,) = c.frames(1)
    assert isinstance(frame, Response), frame
    return json.loads(frame.data)


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_auth_answers_and_permissions_are_nsqds(start, authd, kind):
    t = start(kind, "false", extra=(f"--auth-http-address={authd.address}",))
    c = Client(t.tcp)
    try:
        assert c.identify()["auth_required"] is True
        c.send(pc.Pub("orders", b"x"))
        assert _error(c) == "E_AUTH_FIRST AUTH required before PUB"
        assert c.closed_by_peer()
    finally:
        c.close()

    c = Client(t.tcp)
    try:
        c.identify(user_agent="auth-test")
        assert _authed(c, "writer") == {"identity": "id-writer",
                                        "identity_url": "https://people/writer",
                                        "permission_count": 1}
        c.send(pc.Pub("orders", b"x"))
        c.send(pc.Mpub("orders_eu", (b"y", b"z")))
        assert c.frames(2) == [Response(b"OK"), Response(b"OK")]
        c.send(pc.Auth(b"writer"))
        assert _error(c) == "E_INVALID AUTH already set"
    finally:
        c.close()
    assert authd.asked[-1]["secret"] == "writer"
    assert authd.asked[-1]["remote_ip"] == "127.0.0.1"
    assert authd.asked[-1]["tls"] == "false"

    c = Client(t.tcp)
    try:
        _authed(c, "writer")
        c.send(pc.Dpub("payments", 10, b"x"))
        assert _error(c) == 'E_UNAUTHORIZED AUTH failed for DPUB on "payments" ""'
    finally:
        c.close()

    for channel, answer in (("billing", "OK"), ("audit", None)):
        c = Client(t.tcp)
        try:
            _authed(c, "reader")
            c.send(pc.Sub("orders", channel))
            if answer:
                assert c.frames(1) == [Response(b"OK")]
            else:
                assert _error(c) == 'E_UNAUTHORIZED AUTH failed for SUB on "orders" "audit"'
        finally:
            c.close()

    for secret, error in (("stolen", "E_AUTH_FAILED AUTH failed"),
                          ("nobody", "E_UNAUTHORIZED AUTH no authorizations found")):
        c = Client(t.tcp)
        try:
            c.send(pc.Auth(secret.encode()))
            assert _error(c) == error
            assert c.closed_by_peer()
        finally:
            c.close()


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_after_the_ttl_the_server_is_asked_again_and_a_revoked_secret_stops(start, authd,
                                                                            kind):
    t = start(kind, "false", extra=(f"--auth-http-address={authd.address}",))
    authd.grant("short", WRITER, ttl=1)
    c = Client(t.tcp)
    try:
        _authed(c, "short")
        c.send(pc.Pub("orders", b"1"))
        assert c.frames(1) == [Response(b"OK")]
        asked = len(authd.asked)
        time.sleep(1.2)  # (the TTL is whole seconds, on the broker's own clock)
        c.send(pc.Pub("orders", b"2"))  # asked again, still granted
        assert c.frames(1) == [Response(b"OK")]
        assert len(authd.asked) == asked + 1
        del authd.secrets["short"]  # revoked
        time.sleep(1.2)
        c.send(pc.Pub("orders", b"3"))
        assert _error(c) == "E_AUTH_FAILED AUTH failed"
    finally:
        c.close()


def test_commands_sent_while_the_server_is_asked_wait_for_its_answer(start, authd):
    t = start("ours", "false", extra=(f"--auth-http-address={authd.address}",))
    c = Client(t.tcp)
    try:
        # AUTH and two PUBs in one write: the PUBs run after the answer, in order
        c.sock.sendall(c.codec.send(pc.Auth(b"writer")) + c.codec.send(pc.Pub("orders", b"a"))
                       + c.codec.send(pc.Pub("orders", b"b")))
        reply, ok1, ok2 = c.frames(3)
        assert json.loads(reply.data)["identity"] == "id-writer"
        assert (ok1, ok2) == (Response(b"OK"), Response(b"OK"))
    finally:
        c.close()


def test_post_and_a_second_server_when_the_first_is_down(start, authd):
    dead = "127.0.0.1:1"  # nothing listens there
    t = start("ours", "false", extra=(f"--auth-http-address={dead}",
                                      f"--auth-http-address={authd.address}",
                                      "--auth-http-request-method=post"))
    for _ in range(3):  # whichever the random order asks first
        c = Client(t.tcp)
        try:
            assert _authed(c, "writer")["identity"] == "id-writer"
        finally:
            c.close()
    assert authd.asked[-1]["method"] == "post"


def test_the_auth_server_hears_the_tls_client_certificates_common_name(start, authd, pki):
    t = start("ours", "true", "require-verify",
              extra=(f"--auth-http-address={authd.address}",))
    c = Client(t.tcp)
    try:
        c.identify(tls_v1=True)
        assert c.upgrade(pki.client_context(with_cert=pki.client_cert))
        _authed(c, "writer")
    finally:
        c.close()
    assert (authd.asked[-1]["tls"], authd.asked[-1]["common_name"]) == ("true", "reader-7")


def test_zeromq_clients_authenticate_with_the_same_servers_and_rules(start, authd):
    authd.grant("zmq", WRITER, {**READER, "channels": [".*"]})
    t = start("ours", "false", extra=(f"--auth-http-address={authd.address}",))
    with Producer(t.zmq, timeout=5, max_attempts=1) as p, \
            pytest.raises(BrokerRefused, match="E_AUTH_FIRST AUTH required before PUB"):
        p.publish("orders", b"x")
    with Producer(t.zmq, timeout=5, max_attempts=1, auth_secret="stolen") as p, \
            pytest.raises(BrokerRefused, match="E_AUTH_FAILED AUTH failed"):
        p.publish("orders", b"x")
    with Producer(t.zmq, timeout=5, max_attempts=1, auth_secret="zmq") as p:
        p.publish("orders", b"one")
        p.multi_publish("orders", [b"two", b"three"])
        with pytest.raises(BrokerRefused, match='AUTH failed for PUB on "payments" ""'):
            p.publish("payments", b"x")
        p.publish("orders", b"four")  # a new session, authenticated again
    assert authd.asked[-1]["secret"] == "zmq"
    got: list[bytes] = []
    done = threading.Event()

    def handler(m) -> None:
        got.append(m.body)
        if len(got) == 4:
            done.set()

    c = Consumer("orders", "billing", handler, t.zmq, auth_secret=b"zmq").start()
    try:
        assert done.wait(20)
    finally:
        c.close()
    assert sorted(got) == [b"four", b"one", b"three", b"two"]


def _stats(t: Any) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", t.http_port, timeout=10)
    try:
        conn.request("GET", "/stats?format=json&include_clients=true")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_a_producer_idle_past_its_sessions_end_authenticates_again(start, authd):
    # Given a broker that drops a session silent for two heartbeat intervals (2 s), and a
    # producer with a secret (a producer never answers HEARTBEATs)
    authd.grant("zmq", WRITER)
    t = start("ours", "false", extra=(f"--auth-http-address={authd.address}",
                                      "--client-timeout=2s"))
    with Producer(t.zmq, timeout=5, max_attempts=1, auth_secret="zmq") as p:
        p.publish("orders", b"one")
        # When its session is gone (no producer left in the stats)
        wait_for(lambda: _stats(t)["producers"] is None, timeout=20,
                 what="the idle session dropped")
        # Then its next publish goes on a new session, authenticated first (it was
        # refused with E_AUTH_FIRST)
        p.publish("orders", b"two")


def test_the_real_pynsq_authenticates_with_its_auth_secret(start, authd):
    pytest.importorskip("nsq")
    authd.grant("pynsq", WRITER, {**READER, "channels": [".*"]})
    t = start("ours", "false", extra=(f"--auth-http-address={authd.address}",))
    pynsq_roundtrip(t.tcp, "orders", 'auth_secret=b"pynsq"', [b"hi"])


def _post(port: int, path: str, secret: str | None = None, *, ctx: Any = None
          ) -> tuple[int, dict[str, str], bytes]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ctx)
            if ctx is not None else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        conn.request("POST", path, body=b"hello", headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_http_writes_need_a_secret_the_auth_server_allows_and_reads_stay_open(start, authd,
                                                                              pki):
    authd.grant("admin", WRITER, {**READER, "channels": [".*"]})
    t = start("ours", "false", extra=(f"--auth-http-address={authd.address}",))
    status, headers, body = _post(t.http_port, "/pub?topic=orders")
    assert (status, json.loads(body)) == (401, {"message": "AUTH_REQUIRED"})
    assert headers["www-authenticate"].startswith("Bearer")
    assert _post(t.http_port, "/pub?topic=orders", "stolen")[:3:2] == \
        (403, b'{"message":"AUTH_FAILED"}')
    assert _post(t.http_port, "/pub?topic=payments", "writer")[:3:2] == \
        (403, b'{"message":"UNAUTHORIZED"}')
    assert _post(t.http_port, "/pub?topic=orders", "writer")[:3:2] == (200, b"OK")
    asked = len(authd.asked)
    assert _post(t.http_port, "/mpub?topic=orders", "writer")[0] == 200
    assert len(authd.asked) == asked  # (kept for its TTL)
    # a channel action needs subscribe on it; the reader may not empty "audit"
    assert _post(t.http_port, "/channel/create?topic=orders&channel=audit", "reader")[0] == 403
    assert _post(t.http_port, "/channel/create?topic=orders&channel=audit", "admin")[0] == 200
    assert _post(t.http_port, "/topic/pause?topic=orders", "reader")[0] == 403
    # reads stay open
    conn = http.client.HTTPConnection("127.0.0.1", t.http_port, timeout=10)
    conn.request("GET", "/stats?format=json&topic=orders")
    r = conn.getresponse()
    assert r.status == 200
    assert json.loads(r.read())["topics"][0]["message_count"] == 2
    conn.close()
    # over HTTPS the auth server hears tls=true
    assert _post(t.https_port, "/pub?topic=orders", "admin", ctx=pki.client_context())[0] == 200
    assert authd.asked[-1]["tls"] == "true"
