"""Brokers join a cluster: ours registers with lookup daemons (ours and the real
nsqlookupd), follows every change, takes the channels the cluster knows for a topic it
creates, and announces everything again after its lookup daemon comes back."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from typing import Any

import pytest

from actors import cli
from actors.admin.admin import Admin
from actors.admin.options import AdminOptions
from actors.broker import Broker
from actors.lookupd import Lookupd
from tests.broker.conftest import broker_options
from tests.lookupd.conftest import Http, free_port, nsq_binary, wait_until
from tests.power.rig import Tcp
from transport.nsq.client_codec import Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(90)


def _broker(tmp_path: Any, *lookupds: str, name: str = "data") -> Broker:
    return Broker(broker_options(tmp_path / name, lookupd_tcp_address=tuple(lookupds),
                                 broadcast_address="127.0.0.1")).start()


def _producers(web: Http, topic: str) -> list[dict[str, Any]]:
    status, _, body = web.call("GET", f"/lookup?topic={topic}")
    if status != 200:
        return []
    return json.loads(body)["producers"]


def _node_topics(web: Http) -> list[list[str]]:
    return sorted(sorted(n["topics"]) for n in web.json("/nodes")["producers"])


def test_our_broker_registers_what_it_has_and_follows_every_change(
        lookupd: Lookupd, tmp_path) -> None:
    web = Http(lookupd.http_address)
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        # When a topic and a channel are created
        b.topic_command("orders", "hello")
        b.topic_command("orders", "create_channel", "archive")
        # Then the lookup finds the broker with its bound ports (and its ZeroMQ port)
        (found,) = wait_until(lambda: _producers(web, "orders"), what="the registration")
        assert found["tcp_port"] == int(b.tcp_address.rpartition(":")[2])
        assert found["http_port"] == b.http_port
        assert found["zmq_port"] == int(b.zmq_endpoint.rpartition(":")[2])
        assert found["broadcast_address"] == "127.0.0.1"
        wait_until(lambda: web.json("/channels?topic=orders")["channels"] == ["archive"],
                   what="the channel")
        # An ephemeral channel comes and goes with its consumer (an NSQ TCP one: its
        # disconnect is seen at once)
        consumer = Tcp(int(b.tcp_address.rpartition(":")[2]))
        consumer.send(pc.Sub("orders", "tail#ephemeral"))
        assert next(consumer.events()) == Response(b"OK")
        wait_until(lambda: "tail#ephemeral" in web.json("/channels?topic=orders")["channels"],
                   what="the ephemeral channel")
        consumer.sock.close()
        wait_until(lambda: "tail#ephemeral" not in
                   web.json("/channels?topic=orders")["channels"],
                   what="the ephemeral channel to go")
        # And a deleted topic leaves the broker's list
        b.topic_command("orders", "delete")
        wait_until(lambda: _node_topics(web) == [[]], what="the topic to be withdrawn")
    finally:
        b.stop()
    # A stopped broker leaves every lookup
    wait_until(lambda: web.json("/nodes")["producers"] == [], what="the broker to leave")


def test_a_topic_restored_at_start_is_registered(lookupd: Lookupd, tmp_path) -> None:
    web = Http(lookupd.http_address)
    b = Broker(broker_options(tmp_path / "data")).start()  # (no lookupd yet)
    try:
        b.topic_command("kept", "hello")
        b.topic_command("kept", "create_channel", "c")
    finally:
        b.stop()
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        wait_until(lambda: _producers(web, "kept"), what="the restored topic")
        assert web.json("/channels?topic=kept") == {"channels": ["c"]}
    finally:
        b.stop()


def test_a_new_topic_takes_the_channels_the_cluster_knows_before_its_first_message(
        lookupd: Lookupd, tmp_path) -> None:
    web = Http(lookupd.http_address)
    # Given a channel that consumers of another broker read
    assert web.call("POST", "/channel/create?topic=events&channel=billing")[0] == 200
    assert web.call("POST", "/channel/create?topic=events&channel=tmp%23ephemeral")[0] == 200
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        wait_until(lambda: web.json("/nodes")["producers"], what="the broker to identify")
        # When the first message creates the topic here
        b.publish("events", [b"first"])
        # Then it went to that channel (the ephemeral one was not created)
        stats = b.topic_stats("events")
        assert [(c["channel_name"], c["depth"]) for c in stats["channels"]] == [("billing", 1)]
    finally:
        b.stop()


def test_the_broker_announces_everything_again_when_its_lookup_daemon_comes_back(
        lookupd: Lookupd, tmp_path) -> None:
    web = Http(lookupd.http_address)
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        b.topic_command("a", "hello")
        b.topic_command("a", "create_channel", "c")
        wait_until(lambda: _producers(web, "a"), what="the registration")
        # When the lookup daemon's process is killed -9 (and comes back empty)
        assert lookupd.supervisor is not None
        (gateway,) = [p for p in lookupd.supervisor.ps() if p.name == "gateway"]
        os.kill(gateway.pid, signal.SIGKILL)
        wait_until(web.up, timeout=30, what="the lookup daemon again")
        # Then the broker's next change finds the connection dead, reconnects and
        # announces everything it has
        b.topic_command("b", "hello")
        wait_until(lambda: _producers(web, "a") and _producers(web, "b"), timeout=30,
                   what="both topics again")
        assert web.json("/channels?topic=a") == {"channels": ["c"]}
    finally:
        b.stop()



def test_our_broker_registers_with_the_real_nsqlookupd(tmp_path, processes) -> None:
    binary = nsq_binary("nsqlookupd")
    tcp, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    processes([binary, f"--tcp-address={tcp}", f"--http-address={http}",
               "--broadcast-address=127.0.0.1"], tmp_path / "nsqlookupd.log")
    web = Http(http)
    wait_until(web.up, what="nsqlookupd")
    assert web.call("POST", "/channel/create?topic=t&channel=known")[0] == 200
    b = _broker(tmp_path, tcp)
    try:
        wait_until(lambda: web.json("/nodes")["producers"], what="the broker to identify")
        b.publish("t", [b"m"])
        b.topic_command("t", "create_channel", "mine")
        found = wait_until(lambda: _producers(web, "t"), what="the registration")
        assert found[0]["http_port"] == b.http_port
        wait_until(lambda: sorted(web.json("/channels?topic=t")["channels"]) ==
                   ["known", "mine"], what="both channels")
        stats = b.topic_stats("t")
        assert {c["channel_name"]: c["depth"] for c in stats["channels"]} == \
            {"known": 1, "mine": 0}
    finally:
        b.stop()


def test_the_real_nsqadmin_shows_and_deletes_through_our_lookupd_and_broker(
        lookupd: Lookupd, tmp_path, processes) -> None:
    binary = nsq_binary("nsqadmin")
    web = Http(lookupd.http_address)
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        b.publish("shown", [b"a", b"b"])
        b.topic_command("shown", "create_channel", "c")
        wait_until(lambda: _producers(web, "shown"), what="the registration")
        admin_port = free_port()
        processes([binary, f"--http-address=127.0.0.1:{admin_port}",
                   f"--lookupd-http-address={lookupd.http_address}"], tmp_path / "admin.log")
        admin = Http(f"127.0.0.1:{admin_port}")
        wait_until(admin.up, what="nsqadmin")
        # nsqadmin lists our broker and its topic, and reads the topic's stats from it
        nodes = admin.json("/api/nodes")["nodes"]
        assert [(n["broadcast_address"], n["http_port"]) for n in nodes] == \
            [("127.0.0.1", b.http_port)]
        assert admin.json("/api/topics")["topics"] == ["shown"]
        topic = admin.json("/api/topics/shown")
        assert topic["message_count"] == 2
        assert [(c["channel_name"], c["depth"]) for c in topic["channels"]] == [("c", 2)]
        # and its delete goes to the broker and to the lookup daemon
        assert admin.call("DELETE", "/api/topics/shown")[0] == 200
        wait_until(lambda: web.json("/topics") == {"topics": []}, what="lookupd's delete")
        wait_until(lambda: not _topic_exists(b, "shown"), what="the broker's delete")
    finally:
        b.stop()


def _topic_exists(b: Broker, topic: str) -> bool:
    _, _, body = Http(f"127.0.0.1:{b.http_port}").call(
        "GET", f"/stats?format=json&topic={topic}")
    return bool(json.loads(body).get("topics"))


def test_the_tools_find_our_brokers_through_our_lookupd(lookupd: Lookupd, tmp_path,
                                                        processes) -> None:
    """The real nsq_stat, `zmqnsq tail` and `zmqnsq stat`, and our console, all through
    our lookup daemon (#20)."""
    web = Http(lookupd.http_address)
    b = _broker(tmp_path, lookupd.tcp_address)
    try:
        b.topic_command("found", "hello")
        b.topic_command("found", "create_channel", "c")
        b.publish("found", [b"x", b"y"])
        wait_until(lambda: _producers(web, "found"), what="the registration")
        # zmqnsq tail finds the broker through the lookup daemon
        out = io.BytesIO()
        args = cli._parser().parse_args(["tail", "--topic", "found", "--channel", "c", "-n",
                                         "2", "--lookupd-http-address", lookupd.http_address])
        assert cli.tail(args, out) == 0
        assert out.getvalue() == b"x\ny\n"
        text = io.StringIO()
        args = cli._parser().parse_args(["stat", "--topic", "found", "--channel", "c",
                                         "--count", "1", "--interval", "100ms",
                                         "--lookupd-http-address", lookupd.http_address])
        assert cli.stat(args, text) == 0
        assert text.getvalue().splitlines()[2].split()[-2:] == ["2", "0"]  # msgs, clients
        # the real nsq_stat reads our lookup daemon and broker
        nsq_stat = nsq_binary("nsq_stat")
        p = subprocess.run([nsq_stat, f"--lookupd-http-address={lookupd.http_address}",
                            "--topic=found", "--channel=c", "--count=1", "--interval=500ms"],
                           capture_output=True, text=True, timeout=30, check=False)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[2].split()[-2:] == ["2", "0"]
        # and so does our console
        with Admin(AdminOptions(http_address="127.0.0.1:0",
                                lookupd_http_address=(lookupd.http_address,))) as admin:
            console = Http(admin.http_address)
            assert [t["topic"] for t in console.json("/api/overview")["topics"]] == ["found"]
            (node,) = console.json("/api/lookupds")[0]["nodes"]
            assert node["node"] == f"127.0.0.1:{b.http_port}"
            assert node["topics"] == ["found"]
    finally:
        b.stop()
