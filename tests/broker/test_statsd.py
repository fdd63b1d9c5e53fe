"""nsqd's statsd push (#20): the same names and types as the real nsqd 1.3 sends for the
same traffic, counters as increases, lines packed into datagrams of the asked size."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from actors.broker import Broker
from actors.broker.options import OptionsError, parse_options
from actors.runtime.placement import Placement
from tests.broker.conftest import broker_options
from tests.broker.test_http_broker import call
from tests.lookupd.conftest import Http, free_port, nsq_binary, processes  # noqa: F401
from tests.procs import frozen
from tests.runtime.conftest import wait_until
from transport.statsd import Batch, host_key, prefix_for

pytestmark = pytest.mark.timeout(90)


class Statsd:
    """A UDP socket standing in for a statsd daemon.  A push names each stat once
    (nsqd spreads one over its interval less a second), so a push ends where a stat
    comes again."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.packets: list[bytes] = []

    def push(self, prefix: str, until: str, seconds: float = 20) -> dict[str, str]:
        """The first whole push that has the line `until`: its ``stat -> value|type``."""
        deadline = time.monotonic() + seconds
        current: dict[str, str] = {}
        packets: list[bytes] = []
        while time.monotonic() < deadline:
            try:
                packet = self.sock.recv(65536)
            except TimeoutError:
                continue
            for line in packet.decode().splitlines():
                assert line.startswith(prefix), line
                stat, _, value = line.removeprefix(prefix).partition(":")
                if stat in current:  # the next push has begun: the last one is whole
                    if current.get(until.partition(":")[0]) == until.partition(":")[2]:
                        self.packets = packets
                        return current
                    current, packets = {}, []
                current[stat] = value
            packets.append(packet)
        raise AssertionError(f"no push with {until}")

    def close(self) -> None:
        self.sock.close()


def _traffic(post) -> None:
    assert post("/topic/create?topic=t") == 200
    assert post("/channel/create?topic=t&channel=c") == 200
    for body in (b"a", b"bb", b"ccc"):
        assert post("/pub?topic=t", body) == 200


def test_a_push_has_nsqds_names_and_types_for_the_same_traffic(tmp_path, processes):  # noqa: F811
    nsqd = nsq_binary("nsqd")
    theirs_sink, ours_sink = Statsd(), Statsd()
    try:
        http_port = free_port()
        processes([nsqd, f"--data-path={tmp_path}", "--tcp-address=127.0.0.1:0",
                   f"--http-address=127.0.0.1:{http_port}", "--broadcast-address=127.0.0.1",
                   f"--statsd-address={theirs_sink.address}", "--statsd-interval=3s"],
                  tmp_path / "nsqd.log")
        web = Http(f"127.0.0.1:{http_port}")
        wait_until(web.up, what="nsqd")
        _traffic(lambda path, body=b"": _post(http_port, path, body))
        theirs = theirs_sink.push(f"nsq.127_0_0_1_{http_port}.", "topic.t.message_count:3|c")
        opts = broker_options(tmp_path / "ours", statsd_address=ours_sink.address,
                              statsd_interval=1.0, broadcast_address="127.0.0.1")
        with Broker(opts) as b:
            _traffic(lambda path, body=b"": call(b, "POST", path, body or None)[0])
            prefix = f"nsq.127_0_0_1_{b.http_port}."
            ours = ours_sink.push(prefix, "topic.t.message_count:3|c")
            # counters are increases: the next push says 0 more, gauges stay
            again = ours_sink.push(prefix, "topic.t.message_count:0|c")
            assert again["topic.t.channel.c.depth"] == "3|g"
            assert all(len(p) <= 508 for p in ours_sink.packets)
    finally:
        theirs_sink.close()
        ours_sink.close()
    assert sorted(ours) == sorted(theirs)
    for stat, value in theirs.items():
        assert value.rpartition("|")[2] == ours[stat].rpartition("|")[2], stat  # the type
        if not stat.startswith("mem."):
            assert ours[stat] == value, stat


def test_lines_are_packed_whole_into_packets_of_the_asked_size():
    batch = Batch("nsq.h_1.", 64)
    for i in range(10):
        batch.gauge(f"topic.t{i}.depth", i)
    batch.incr("x" * 100, 1)  # longer than a packet: goes alone
    packets = batch.finish()
    lines = [line for p in packets for line in p.decode().splitlines()]
    assert lines[:2] == ["nsq.h_1.topic.t0.depth:0|g", "nsq.h_1.topic.t1.depth:1|g"]
    assert lines[-1] == "nsq.h_1." + "x" * 100 + ":1|c"
    assert all(len(p) <= 64 for p in packets[:-1])
    assert all(p.endswith(b"\n") for p in packets)


def test_the_prefix_is_nsqds():
    assert host_key("10.0.0.1:4151") == "10_0_0_1_4151"
    assert prefix_for("nsq.%s", "vm", 4151) == "nsq.vm_4151."
    assert prefix_for("app.%s.broker.", "10.1.2.3", 80) == "app.10_1_2_3_80.broker."
    assert prefix_for("", "vm", 4151) == ""


def _post(port: int, path: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback only
        return r.status



@pytest.mark.parametrize(("flags", "error"), [
    (["--statsd-address=nohost"], "statsd_address"),
    (["--statsd-interval=0s"], "must be a positive duration"),
    (["--statsd-udp-packet-size=10"], "must be at least 64"),
])
def test_bad_statsd_flags_are_refused_with_a_sentence(flags, error):
    with pytest.raises(OptionsError, match=error):
        parse_options(flags)


def test_counters_go_on_from_their_last_figures_after_a_worker_was_silent(tmp_path):
    # Given a broker pushing to statsd every second, a topic on each worker, three
    # messages on worker-1's
    sink = Statsd()
    placement = Placement(2)
    on = {placement.node_for(f"topic:t{i}"): f"t{i}" for i in range(100)}
    quiet, stopped = on["worker-0"], on["worker-1"]
    opts = broker_options(tmp_path / "data", workers=2, statsd_address=sink.address,
                          statsd_interval=1.0, broadcast_address="127.0.0.1")
    try:
        with Broker(opts) as b:
            b.publish(quiet, [b"q"])
            b.publish(stopped, [b"a", b"b", b"c"])
            prefix = f"nsq.127_0_0_1_{b.http_port}."
            counter = f"topic.{stopped}.message_count"
            sink.push(prefix, f"{counter}:3|c")
            # When worker-1 is frozen for a push or more (its topics are left out)
            (worker,) = [p for p in b.supervisor.ps() if p.name == "worker-1"]
            with frozen(worker.pid):
                for _ in range(10):
                    if counter not in sink.push(prefix, f"topic.{quiet}.message_count:0|c"):
                        break
                else:
                    raise AssertionError("every push had the frozen worker's topic")
            # Then the first push that has its topic again says 0 more, not all 3 again
            for _ in range(10):
                push = sink.push(prefix, f"topic.{quiet}.message_count:0|c")
                if counter in push:
                    assert push[counter] == "0|c"
                    break
            else:
                raise AssertionError("no push had the topic again")
    finally:
        sink.close()
