"""TLS on NSQ TCP and HTTPS, nsqd 1.3's flags: the upgrade after IDENTIFY, TLS required,
client certificates, garbage handshakes, and the same answers as the real nsqd.

Certificates come from ``trustme`` (a throwaway CA, a server certificate for
127.0.0.1 and a client certificate), written to the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import ssl
import stat
import time

import pytest

from actors.broker import Broker
from actors.broker.options import OptionsError, parse_options, run_dir_for
from tests.broker.conftest import broker_options
from tests.broker.tls_kit import Client, https, pynsq_roundtrip, tls_flags
from transport.nsq import server as nsq_server
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc
from transport.protocol.validation import Limits
from transport.tls import server_context

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_tls_required_refuses_plain_commands_and_http_and_serves_them_over_tls(start, pki,
                                                                               kind):
    t = start(kind, "true")
    plain = Client(t.tcp)
    try:
        plain.send(pc.Pub("tls_t", b"x"))
        (err,) = plain.frames(1)
        assert isinstance(err, ErrorFrame)
        assert str(err.error) == "E_INVALID cannot PUB in current state (TLS required)"
        assert plain.closed_by_peer()
    finally:
        plain.close()
    status, headers, body = https(t.http_port, None, "POST", "/pub?topic=tls_t")
    assert status == 403
    assert json.loads(body) == {"message": "TLS_REQUIRED", "https_port": t.https_port}
    assert headers["x-nsq-content-type"] == "nsq; version=1.0"

    c = Client(t.tcp)
    try:
        reply = c.identify(tls_v1=True, user_agent="tls-test")
        assert reply["tls_v1"] is True
        assert c.upgrade(pki.client_context())
        c.send(pc.Pub("tls_t", b"over tls"))
        assert c.frames(1) == [Response(b"OK")]
    finally:
        c.close()
    status, _, body = https(t.https_port, pki.client_context(), "POST", "/pub?topic=tls_t")
    assert (status, body) == (200, b"OK")
    status, _, body = https(t.https_port, pki.client_context(), "GET",
                            "/stats?format=json&topic=tls_t")
    assert status == 200
    assert json.loads(body)["topics"][0]["message_count"] == 2


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_tcp_https_requires_tls_on_tcp_only(start, kind):
    t = start(kind, "tcp-https")
    status, _, body = https(t.http_port, None, "POST", "/pub?topic=mixed")
    assert (status, body) == (200, b"OK")
    c = Client(t.tcp)
    try:
        c.send(pc.Sub("mixed", "c"))
        (err,) = c.frames(1)
        assert str(err.error) == "E_INVALID cannot SUB in current state (TLS required)"
    finally:
        c.close()


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_a_client_that_does_not_ask_for_tls_keeps_plain_text_when_tls_is_optional(
        start, kind):
    t = start(kind, "false")
    c = Client(t.tcp)
    try:
        assert c.identify(tls_v1=False)["tls_v1"] is False
        c.send(pc.Pub("optional", b"x"))
        assert c.frames(1) == [Response(b"OK")]
    finally:
        c.close()


def test_stats_show_the_tls_connection_and_the_real_pynsq_works_over_tls(start, pki):
    pytest.importorskip("nsq")
    t = start("ours", "true")
    sub = Client(t.tcp)
    try:
        sub.identify(tls_v1=True)
        assert sub.upgrade(pki.client_context())
        sub.send(pc.Sub("pynsq_tls", "c"))
        assert sub.frames(1) == [Response(b"OK")]
        _, _, body = https(t.https_port, pki.client_context(), "GET",
                           "/stats?format=json&topic=pynsq_tls")
        (client,) = json.loads(body)["topics"][0]["channels"][0]["clients"]
        assert client["tls"] is True
        assert client["tls_version"] in {"TLS1.2", "TLS1.3"}
        assert client["tls_cipher_suite"]
    finally:
        sub.close()
    opts = ('tls_v1=True, tls_options={"cert_reqs": ssl.CERT_REQUIRED, '
            f'"ca_certs": {pki.ca_file!r}}}')
    pynsq_roundtrip(t.tcp, "pynsq_tls", opts, [b"a", b"b"])


@pytest.mark.parametrize("kind", ["ours", "nsqd"])
def test_require_verify_takes_only_certificates_of_the_ca(start, pki, kind):
    t = start(kind, "true", "require-verify")
    for cert, accepted in ((None, False), (pki.stranger_cert, False), (pki.client_cert, True)):
        c = Client(t.tcp)
        try:
            c.identify(tls_v1=True)
            assert c.upgrade(pki.client_context(with_cert=cert)) is accepted, cert
            if accepted:
                c.send(pc.Pub("mtls", b"x"))
                assert c.frames(1) == [Response(b"OK")]
        finally:
            c.close()
    with pytest.raises((ssl.SSLError, ConnectionError)):  # (TLS 1.3: heard on the read)
        https(t.https_port, pki.client_context(), "GET", "/ping")
    status, _, body = https(t.https_port, pki.client_context(with_cert=pki.client_cert),
                            "GET", "/ping")
    assert (status, body) == (200, b"OK")


def test_garbage_handshakes_are_closed_and_cost_a_healthy_tls_client_nothing(start, pki):
    t = start("ours", "true")
    healthy = Client(t.tcp)
    healthy.identify(tls_v1=True)
    assert healthy.upgrade(pki.client_context())
    try:
        # random bytes where the ClientHello should be
        g = Client(t.tcp)
        g.identify(tls_v1=True)
        g.sock.sendall(os.urandom(512))
        assert g.closed_by_peer()
        g.close()
        # plain text inside what should be TLS
        p = Client(t.tcp)
        p.identify(tls_v1=True)
        p.sock.sendall(b"PUB plain\n\x00\x00\x00\x01x")
        assert p.closed_by_peer()
        p.close()
        # garbage at the HTTPS port
        raw = socket.create_connection(("127.0.0.1", t.https_port), timeout=10)
        raw.sendall(os.urandom(300))
        with contextlib.suppress(OSError):  # (an alert, a reset or a close: any will do)
            raw.recv(100)
        raw.close()
        healthy.send(pc.Pub("healthy", b"still here"))
        assert healthy.frames(1) == [Response(b"OK")]
    finally:
        healthy.close()


class _Handler:
    def __init__(self) -> None:
        self.commands: list = []
        self.closed: list[str] = []

    def on_command(self, session, corr, command) -> None:
        self.commands.append(command)

    def on_close(self, session) -> None:
        self.closed.append(session)

    def on_heartbeat(self, session) -> None:
        pass


def test_a_stalled_handshake_is_closed_after_the_handshake_timeout(pki, monkeypatch):
    monkeypatch.setattr(nsq_server, "HANDSHAKE_TIMEOUT", 0.3)
    handler = _Handler()
    server = nsq_server.TcpServer("127.0.0.1", 0, handler, limits=Limits(),
                                  info=nsq_server.ServerInfo(tls_v1=True),
                                  ssl_context=server_context(pki.cert, pki.key),
                                  tls_required=True)
    port = server.start()
    try:
        c = Client(f"127.0.0.1:{port}")
        c.identify(tls_v1=True)
        started = time.monotonic()
        assert c.closed_by_peer()  # no ClientHello ever sent
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 5
        while not handler.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(handler.closed) == 1
        assert server.sessions() == 0
        c.close()
    finally:
        server.stop()


@pytest.mark.parametrize(("flags", "error"), [
    (["--tls-required=true"], "cannot require TLS client connections without --tls-cert"),
    (["--tls-client-auth-policy=require-verify"], "cannot require TLS client connections"),
    (["--https-address=127.0.0.1:0"], "https_address: needs --tls-cert"),
    (["--tls-cert=a.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert=a", "--tls-key=b", "--tls-required=maybe"], "must be true, false or tcp-https"),
    (["--tls-cert=a", "--tls-key=b", "--tls-min-version=ssl3.0"], "--tls-min-version must be"),
    (["--tls-cert=a", "--tls-key=b", "--tls-client-auth-policy=require"],
     "require needs --tls-root-ca-file"),
])
def test_flags_that_cannot_work_together_are_refused_with_a_sentence(flags, error):
    with pytest.raises(OptionsError, match=re.escape(error)):
        parse_options(flags)


def test_an_unreadable_certificate_fails_the_start_saying_which_listener(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    b = Broker(broker_options(tmp_path / "data", tls_cert=str(bad), tls_key=str(bad)))
    with pytest.raises(RuntimeError, match="listen"):
        b.start()


def test_client_auth_policy_alone_makes_tls_required(pki):
    o = parse_options(tls_flags(pki, "false", "require-verify"))
    assert o.tls_mode == "true"



def test_mailboxes_and_the_control_socket_are_this_users_only(tmp_path):
    """Whatever the listeners bind to, the nodes' mailboxes and the control socket (and
    with it --debug-hooks' crash) are unix sockets in a directory only this user can
    enter."""
    b = Broker(broker_options(tmp_path / "data")).start()
    try:
        run_dir = run_dir_for(str(tmp_path / "data"))
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert any(name.endswith(".sock") for name in os.listdir(run_dir))
    finally:
        b.stop()
