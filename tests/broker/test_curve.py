"""CURVE on the ZeroMQ listener: encrypted, with the clients let in by their public keys
(pyzmq's ZAP handler), keys made on first start, and refused peers that cost the
broker nothing."""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading

import pytest
import zmq
import zmq.auth

from actors.broker import Broker
from actors.broker.options import OptionsError, parse_options
from tests.broker.conftest import broker_options
from transport.client import Consumer, Producer, PublishError
from transport.protocol.validation import Limits
from transport.zmq import curve
from transport.zmq.server import ZmqServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def keys(tmp_path):
    """The server's secret certificate path, a directory of allowed clients' public
    certificates, and one allowed and one unknown client key pair."""
    allowed_dir = tmp_path / "clients"
    allowed_dir.mkdir()
    zmq.auth.create_certificates(str(allowed_dir), "reader")
    good = zmq.auth.load_certificate(str(allowed_dir / "reader.key_secret"))
    os.unlink(allowed_dir / "reader.key_secret")  # only public certificates stay there
    return tmp_path / "server.key_secret", allowed_dir, good, zmq.curve_keypair()


def test_a_missing_key_is_made_with_its_public_half_beside_it_and_kept(keys, caplog):
    path, _, _, _ = keys
    with caplog.at_level(logging.WARNING):
        public, secret = curve.load_or_create_keys(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert zmq.auth.load_certificate(str(path)[:-len("_secret")]) == (public, None)
    assert public.decode() in caplog.text
    assert curve.load_or_create_keys(str(path)) == (public, secret)  # loaded, not remade


def test_only_listed_clients_get_in_and_traffic_flows_encrypted(keys, tmp_path):
    path, allowed_dir, good, stranger = keys
    server_public, _ = curve.load_or_create_keys(str(path))
    b = Broker(broker_options(tmp_path / "data", zmq_curve_secret_key=str(path),
                              zmq_curve_allow=str(allowed_dir))).start()
    try:
        with Producer(b.zmq_endpoint, curve_server_key=server_public, curve_keypair=good,
                      timeout=5) as p:
            p.publish("secret_t", b"for readers only")
        got: list[bytes] = []
        arrived = threading.Event()

        def handler(m) -> None:
            got.append(m.body)
            arrived.set()

        c = Consumer("secret_t", "c", handler, b.zmq_endpoint, curve_server_key=server_public,
                     curve_keypair=good).start()
        try:
            assert arrived.wait(20)
        finally:
            c.close()
        assert got == [b"for readers only"]
        for who in (stranger, None):  # an unknown key; no CURVE at all
            options = {"curve_server_key": server_public, "curve_keypair": who} if who else {}
            with Producer(b.zmq_endpoint, timeout=1, max_attempts=1, **options) as p, \
                    pytest.raises(PublishError):
                p.publish("secret_t", b"let me in")
        assert b.topic_stats("secret_t")["message_count"] == 1
        # a healthy client is unaffected by the refused ones
        with Producer(b.zmq_endpoint, curve_server_key=server_public, curve_keypair=good,
                      timeout=5) as p:
            p.publish("secret_t", b"again")
    finally:
        b.stop()


def test_without_an_allow_list_any_key_that_knows_the_server_gets_in(keys, tmp_path):
    path, _, _, _stranger = keys
    server_public, _ = curve.load_or_create_keys(str(path))
    b = Broker(broker_options(tmp_path / "data", zmq_curve_secret_key=str(path))).start()
    try:
        with Producer(b.zmq_endpoint, curve_server_key=server_public.decode(),
                      timeout=5) as p:  # (a fresh key pair of its own)
            p.publish("open_t", b"x")
        with Producer(b.zmq_endpoint, timeout=1, max_attempts=1) as p, \
                pytest.raises(PublishError):
            p.publish("open_t", b"plain text is not CURVE")
    finally:
        b.stop()


def test_a_refused_key_is_logged_once_and_garbage_handshakes_cost_nothing(keys, caplog):
    path, allowed_dir, _good, stranger = keys
    server_keys = curve.load_or_create_keys(str(path))

    class Handler:
        def on_command(self, *a) -> None: ...
        def on_close(self, *a) -> None: ...
        def on_heartbeat(self, *a) -> None: ...

    server = ZmqServer("tcp://127.0.0.1:0", Handler(), limits=Limits(), curve=server_keys,
                       curve_allowed=curve.load_allowed(str(allowed_dir)))
    endpoint = server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="transport.zmq.curve"):
            for _ in range(3):
                with Producer(endpoint, curve_server_key=server_keys[0],
                              curve_keypair=stranger, timeout=0.5, max_attempts=1) as p, \
                        pytest.raises(PublishError):
                    p.publish("t", b"x")
        assert caplog.text.count(stranger[0].decode()) == 1
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=5)
        raw.sendall(os.urandom(4096))
        raw.close()
        assert server._sessions == {}  # (no session for a peer that never got in)
    finally:
        server.stop()


def test_a_key_file_lists_z85_keys_and_a_bad_line_is_named(tmp_path, keys):
    _, _, good, _ = keys
    listed = tmp_path / "allowed.txt"
    listed.write_text(f"# readers\n{good[0].decode()}  reader-1\n\n#\n")
    assert curve.load_allowed(str(listed)) == frozenset({good[0]})
    listed.write_text("not-a-key\n")
    with pytest.raises(ValueError, match=r"allowed.txt:1: a Z85 public key has 40"):
        curve.load_allowed(str(listed))
    with pytest.raises(OptionsError, match="zmq_curve_allow: needs --zmq-curve-secret-key"):
        parse_options([f"--zmq-curve-allow={listed}"])
