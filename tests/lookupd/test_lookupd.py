"""`python -m actors.lookupd` end to end: brokers announce over TCP V1, clients look up
over HTTP, errors close the connection, a crashed registrar and a killed process come
back, and the real nsqd (v1.3.0) registers with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from actors.lookupd import Lookupd
from tests.lookupd.conftest import Http, Peer, free_port, nsq_binary, wait_until
from transport.client import lookup
from transport.nsq.lookup_codec import Identify, Ping, Register, Unregister

pytestmark = pytest.mark.timeout(60)


def identify(peer: Peer, http_port: int = 4151, **extra: object) -> dict[str, object]:
    answer = peer.ask(Identify("127.0.0.1", 4150, http_port, "1.3.0", "brokerhost", extra))
    assert answer is not None
    assert answer.ok
    return answer.json()


def test_a_broker_is_found_once_it_registers_and_gone_once_it_disconnects(
        lookupd: Lookupd) -> None:
    web = Http(lookupd.http_address)
    peer = Peer(lookupd.tcp_address)
    # Given a broker that identifies itself
    hello = identify(peer, zmq_port=4153)
    # Then the daemon answers with its bound ports, as nsqd needs to ask /channels
    assert hello["tcp_port"] == lookupd.tcp_port
    assert hello["http_port"] == lookupd.http_port
    assert hello["broadcast_address"] == "127.0.0.1"
    # When it registers a topic's channel
    assert peer.ask(Register("orders", "archive")).data == b"OK"
    # Then a lookup right after the OK finds it, with our extra field for our clients
    found = web.json("/lookup?topic=orders")
    assert found == {"channels": ["archive"], "producers": [{
        "remote_address": peer.address, "hostname": "brokerhost",
        "broadcast_address": "127.0.0.1", "tcp_port": 4150, "http_port": 4151,
        "version": "1.3.0", "zmq_port": 4153}]}
    assert web.json("/topics") == {"topics": ["orders"]}
    assert web.json("/nodes")["producers"][0]["topics"] == ["orders"]
    assert peer.ask(Ping()).data == b"OK"
    assert peer.ask(Unregister("orders", "archive")).data == b"OK"
    # When its connection closes, it leaves every lookup (the names stay, as in nsqlookupd)
    peer.close()
    wait_until(lambda: web.json("/lookup?topic=orders")["producers"] == [],
               what="the broker to leave /lookup")
    assert web.json("/nodes") == {"producers": []}


def test_a_protocol_error_is_answered_then_the_connection_closes_and_others_go_on(
        lookupd: Lookupd) -> None:
    good, bad = Peer(lookupd.tcp_address), Peer(lookupd.tcp_address)
    identify(good)
    bad.send_raw(b"  V1REGISTER t\n")
    answer = bad.answer()
    assert answer is not None
    assert answer.data == b"E_INVALID client must IDENTIFY"
    assert bad.answer() is None  # closed
    bad2 = Peer(lookupd.tcp_address)
    bad2.send_raw(b"  V1IDENTIFY\n\xff\xff\xff\xff")  # (kills nsqlookupd 1.3)
    assert bad2.answer().data == b"E_BAD_BODY IDENTIFY invalid body size -1"
    assert good.ask(Register("t")).data == b"OK"
    assert Http(lookupd.http_address).json("/topics") == {"topics": ["t"]}


def test_the_http_api_answers_with_nsqlookupds_codes_and_headers(lookupd: Lookupd) -> None:
    web = Http(lookupd.http_address)
    status, headers, body = web.call("GET", "/ping")
    assert (status, body) == (200, b"OK")
    status, headers, body = web.call("GET", "/lookup?topic=nope")
    assert (status, json.loads(body)) == (404, {"message": "TOPIC_NOT_FOUND"})
    assert headers["X-NSQ-Content-Type"] == "nsq; version=1.0"
    for method, path, answer in [
        ("GET", "/lookup", (400, "MISSING_ARG_TOPIC")),
        ("GET", "/channels", (400, "MISSING_ARG_TOPIC")),
        ("POST", "/topic/create", (400, "MISSING_ARG_TOPIC")),
        ("POST", "/topic/create?topic=", (400, "INVALID_ARG_TOPIC")),
        ("POST", "/topic/create?topic=bad!", (400, "INVALID_ARG_TOPIC")),
        ("POST", "/channel/create?topic=t", (400, "MISSING_ARG_CHANNEL")),
        ("POST", "/channel/create?topic=t&channel=bad!", (400, "INVALID_ARG_CHANNEL")),
        ("POST", "/channel/delete?topic=t&channel=c", (404, "CHANNEL_NOT_FOUND")),
        ("POST", "/topic/tombstone?topic=t", (400, "MISSING_ARG_NODE")),
        ("GET", "/topic/create?topic=t", (405, "METHOD_NOT_ALLOWED")),
        ("GET", "/nowhere", (404, "NOT_FOUND")),
    ]:
        status, _, body = web.call(method, path)
        assert (status, json.loads(body)["message"]) == answer, (method, path)
    # creating answers 200 with an empty body, and what was created is listed
    status, headers, body = web.call("POST", "/channel/create?topic=t&channel=c")
    assert (status, body) == (200, b"")
    assert web.json("/lookup?topic=t") == {"channels": ["c"], "producers": []}
    assert web.json("/channels?topic=t") == {"channels": ["c"]}
    assert web.json("/channels?topic=other") == {"channels": []}
    assert web.call("POST", "/topic/tombstone?topic=t&node=x:1")[0] == 200
    assert web.call("POST", "/topic/delete?topic=t")[0] == 200
    assert web.json("/topics") == {"topics": []}
    assert web.json("/info")["version"]


def test_a_crashed_registrar_is_refilled_by_its_peers(lookupd: Lookupd) -> None:
    web = Http(lookupd.http_address)
    peer = Peer(lookupd.tcp_address)
    identify(peer)
    assert peer.ask(Register("t", "c")).data == b"OK"
    assert lookupd.supervisor is not None
    # When the registrar crashes (the debug hook), losing what it held
    lookupd.supervisor.crash("registry:lookup")
    # Then its peers announce again and the lookup finds the broker
    wait_until(lambda: [p["remote_address"] for p in lookup(lookupd.http_address, "t")]
               == [peer.address], what="the registrar to be refilled")
    assert web.json("/channels?topic=t") == {"channels": ["c"]}


def test_a_killed_daemon_process_comes_back_and_brokers_announce_again(
        lookupd: Lookupd) -> None:
    web = Http(lookupd.http_address)
    peer = Peer(lookupd.tcp_address)
    identify(peer)
    assert peer.ask(Register("t")).data == b"OK"
    assert lookupd.supervisor is not None
    (gateway,) = [p for p in lookupd.supervisor.ps() if p.name == "gateway"]
    # When its process is killed -9
    os.kill(gateway.pid, signal.SIGKILL)
    # Then the broker's connection ends; the process is back on the same ports
    assert peer.answer() is None
    wait_until(lambda: _answers(web), timeout=20, what="the HTTP API again")
    again = Peer(lookupd.tcp_address)
    identify(again)
    assert again.ask(Register("t")).data == b"OK"
    assert [p["remote_address"] for p in web.json("/lookup?topic=t")["producers"]] == \
        [again.address]


def _answers(web: Http) -> bool:
    try:
        return web.call("GET", "/ping")[0] == 200
    except OSError:
        return False


def test_the_real_nsqd_registers_with_it_and_creates_the_channels_it_knows(
        lookupd: Lookupd, tmp_path, processes) -> None:
    nsqd = nsq_binary("nsqd")
    web = Http(lookupd.http_address)
    # Given a channel of topic t known to the cluster (another broker has it)
    assert web.call("POST", "/channel/create?topic=t&channel=existing")[0] == 200
    http_port = free_port()
    processes([nsqd, f"--data-path={tmp_path}", "--tcp-address=127.0.0.1:0",
               f"--http-address=127.0.0.1:{http_port}", "--broadcast-address=127.0.0.1",
               f"--lookupd-tcp-address={lookupd.tcp_address}"], tmp_path / "nsqd.log")
    nsqd_web = Http(f"127.0.0.1:{http_port}")
    wait_until(lambda: _answers(nsqd_web), what="nsqd")
    wait_until(lambda: web.json("/nodes")["producers"], what="nsqd to identify")
    # When nsqd creates topic t and a channel of its own
    assert nsqd_web.call("POST", "/topic/create?topic=t")[0] == 200
    assert nsqd_web.call("POST", "/channel/create?topic=t&channel=mine")[0] == 200
    # Then the lookup finds nsqd with both channels, and nsqd created the one it learnt
    found = wait_until(lambda: (f := web.json("/lookup?topic=t"))["producers"]
                       and len(f["channels"]) == 2 and f, what="nsqd's registrations")
    assert sorted(found["channels"]) == ["existing", "mine"]
    assert found["producers"][0]["http_port"] == http_port
    stats = nsqd_web.json("/stats?format=json&topic=t")
    assert sorted(c["channel_name"] for c in stats["topics"][0]["channels"]) == \
        ["existing", "mine"]


def test_python_m_actors_lookupd_serves_and_stops_on_sigterm(tmp_path) -> None:
    tcp, web_port = free_port(), free_port()
    log = tmp_path / "lookupd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "actors.lookupd", f"--tcp-address=127.0.0.1:{tcp}",
             f"--http-address=127.0.0.1:{web_port}", "--log-level=info"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        # The "running" line comes once start() has returned: a SIGTERM before it is
        # a stop while starting, which exits 1 by design (actors.runtime.daemon).
        wait_until(lambda: "lookupd running" in log.read_text() or proc.poll() is not None,
                   timeout=30, what="the daemon's running line")
        assert proc.poll() is None, log.read_text()
        assert _answers(Http(f"127.0.0.1:{web_port}"))
        peer = Peer(f"127.0.0.1:{tcp}")
        identify(peer)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, log.read_text()
        assert peer.answer() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bad_flag_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "actors.lookupd", "--tombstone-lifetime=x"],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2
    assert "--tombstone-lifetime must be a duration" in done.stderr
