"""examples/c: a client in C (libzmq) written from docs/PROTOCOL.md, built and run here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for

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
