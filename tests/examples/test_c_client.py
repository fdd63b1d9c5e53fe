"""examples/c: a client in C (libzmq) written from docs/PROTOCOL.md, built and run here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import zmq

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from transport.zmq import curve

pytestmark = pytest.mark.timeout(120)

SOURCE = Path(__file__).resolve().parents[2] / "examples" / "c" / "zmqnsq_client.c"


def build(tmp_path: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (gcc)"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "libzmq"], capture_output=True,
                           text=True, check=False)
    assert flags.returncode == 0, (
        "libzmq's headers are missing: apt-get install libzmq3-dev pkg-config "
        "(the README's test command installs them)")
    binary = tmp_path / "zmqnsq_client"
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(SOURCE),
                    *flags.stdout.split()], check=True, capture_output=True, timeout=60)
    return binary


def test_the_c_client_publishes_and_consumes_through_a_running_broker(tmp_path):
    binary = build(tmp_path)
    with Broker(broker_options(tmp_path / "data")) as broker:
        out = subprocess.run([str(binary), broker.zmq_endpoint, "c_topic", "c_channel", "50"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        assert "published 50" in out.stdout
        assert "received 50" in out.stdout
        stats = broker.topic_stats("c_topic")
        assert stats["message_count"] == 50
        wait_for(lambda: broker.topic_stats("c_topic")["channels"][0]["in_flight_count"] == 0,
                 what="the C client's FIN to land")
        assert broker.topic_stats("c_topic")["channels"][0]["depth"] == 0


def test_the_c_client_speaks_curve_to_a_broker_that_lets_in_only_its_key(tmp_path):
    binary = build(tmp_path)
    public, secret = zmq.curve_keypair()
    allowed = tmp_path / "allowed.txt"
    allowed.write_text(public.decode() + "\n")
    key_file = tmp_path / "server.key_secret"
    server_public, _ = curve.load_or_create_keys(str(key_file))
    options = broker_options(tmp_path / "data", zmq_curve_secret_key=str(key_file),
                             zmq_curve_allow=str(allowed))
    with Broker(options) as broker:
        env = {**os.environ, "ZMQNSQ_CURVE_SERVERKEY": server_public.decode(),
               "ZMQNSQ_CURVE_PUBLICKEY": public.decode(),
               "ZMQNSQ_CURVE_SECRETKEY": secret.decode()}
        out = subprocess.run([str(binary), broker.zmq_endpoint, "c_curve", "c_channel", "20"],
                             capture_output=True, text=True, timeout=60, check=False, env=env)
        assert out.returncode == 0, out.stderr
        assert "received 20" in out.stdout
        # without the keys the same client never gets an answer
        out = subprocess.run([str(binary), broker.zmq_endpoint, "c_curve", "c_channel", "1"],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode != 0
        assert broker.topic_stats("c_curve")["message_count"] == 20
