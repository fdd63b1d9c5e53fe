"""`zmqnsq` (#20): NSQ's tools in one command, against our broker and the real nsqd."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from actors import cli
from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.lookupd.conftest import Http, free_port, nsq_binary, processes  # noqa: F401
from tests.runtime.conftest import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path_factory.mktemp("cli") / "data", workers=1)).start()
    yield b
    b.stop()


def run(argv: list[str], stdin: bytes = b"", tty: bool = False) -> tuple[int, bytes, str]:
    """`zmqnsq <argv>` in this process: (status, stdout bytes, stderr text)."""
    out, err = io.BytesIO(), _Err(tty)
    args = cli._parser().parse_args(argv)
    try:
        if args.command == "tail":
            status = cli.tail(args, out)
        elif args.command == "pub":
            status = cli.pub(args, io.BytesIO(stdin), err)
        else:
            text = io.StringIO()
            status = cli.stat(args, text)
            out.write(text.getvalue().encode())
    except cli.Fail as e:
        return 1, out.getvalue(), str(e)
    return status, out.getvalue(), err.getvalue()


class _Err(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_pub_then_tail_over_nsq_tcp_and_zeromq(broker):
    tcp = ["--nsqd-tcp-address", broker.tcp_address]
    zmq = ["--zmq-address", broker.zmq_endpoint]
    assert run(["pub", "--topic", "cli", *tcp], b"one\n\ntwo\r\nthree")[0] == 0
    # the topic's first channel gets what it held (nsqd's rule); empty lines are skipped
    status, out, _ = run(["tail", "--topic", "cli", "--channel", "c", "-n", "3", *tcp])
    assert (status, out) == (0, b"one\ntwo\nthree\n")
    broker.topic_command("cli", "create_channel", "kept")
    status, _, err = run(["pub", "--topic", "cli", *zmq, "--batch-size", "2"],
                         b"".join(b"m%d\n" % i for i in range(5)), tty=True)
    assert status == 0
    assert "5 messages in" in err  # the progress line's last word, on a terminal
    status, out, _ = run(["tail", "--topic", "cli", "--channel", "kept", "-n", "5", *tcp])
    assert (status, out.split()) == (0, [b"m%d" % i for i in range(5)])
    wait_for(lambda: _channel(broker, "cli", "kept")["in_flight_count"] == 0, what="FINed")
    assert _channel(broker, "cli", "kept")["depth"] == 0
    # ZeroMQ tail
    broker.publish("cli", [b"z1", b"z2"])
    status, out, _ = run(["tail", "--topic", "cli", "--channel", "kept", "-n", "2", *zmq])
    assert sorted(out.split()) == [b"z1", b"z2"]


def test_pub_tags_its_messages_over_zeromq_and_refuses_a_tag_it_cannot_send(broker):
    broker.topic_command("clitags", "hello")
    broker.channel_tags("clitags", "reds", ["red"], create=True)
    zmq = ["--zmq-address", broker.zmq_endpoint]
    assert run(["pub", "--topic", "clitags", *zmq, "--tag", "red"], b"r1\nr2\n")[0] == 0
    assert run(["pub", "--topic", "clitags", *zmq], b"plain\n")[0] == 0
    assert _channel(broker, "clitags", "reds")["depth"] == 2
    status, _, err = run(["pub", "--topic", "clitags", "--nsqd-tcp-address",
                          broker.tcp_address, "--tag", "red"], b"x\n")
    assert (status, "--tag needs --zmq-address" in err) == (1, True)
    status, _, err = run(["pub", "--topic", "clitags", *zmq, "--tag", "a b"], b"x\n")
    assert (status, "bad --tag 'a b'" in err) == (1, True)
    assert _channel(broker, "clitags", "reds")["depth"] == 2


def _channel(broker: Broker, topic: str, name: str) -> dict:
    (c,) = [c for c in broker.topic_stats(topic)["channels"] if c["channel_name"] == name]
    return c


def test_pub_at_a_rate_is_paced(broker):
    started = time.monotonic()
    assert run(["pub", "--topic", "paced", "--rate", "50", "--nsqd-tcp-address",
                broker.tcp_address], b"x\n" * 10)[0] == 0
    assert time.monotonic() - started >= 9 / 50  # the 10th went no sooner than 9/rate


def test_stat_prints_nsq_stats_rows(broker):
    broker.topic_command("st", "hello")
    broker.topic_command("st", "create_channel", "c")
    broker.publish("st", [b"a", b"b"])
    status, out, _ = run(["stat", "--topic", "st", "--channel", "c", "--count", "1",
                          "--interval", "100ms", "--nsqd-http-address",
                          f"127.0.0.1:{broker.http_port}"])
    lines = out.decode().splitlines()
    assert status == 0
    assert lines[1].split() == ["ingress", "egress", "|", "total", "mem", "disk", "inflt",
                                "def", "|", "req", "t-o", "msgs", "clients"]
    assert lines[2].split() == ["0", "0", "|", "2", "2", "0", "0", "0", "|", "0", "0", "2",
                                "0"]


def test_bad_flags_and_unreachable_brokers_are_one_line_and_a_failure(broker):
    assert run(["tail", "--topic", "x", "--nsqd-tcp-address", "127.0.0.1:1"])[::2] == \
        (1, "cannot subscribe at 127.0.0.1:1: [Errno 111] Connection refused")
    assert run(["stat", "--topic", "x", "--nsqd-http-address", "127.0.0.1:1"])[2] == \
        "cannot reach 127.0.0.1:1: [Errno 111] Connection refused"
    assert run(["stat", "--topic", "x"])[2] == \
        "use --nsqd-http-address or --lookupd-http-address (one of them)"
    status, _, err = run(["tail", "--topic", "bad!", "--nsqd-tcp-address", broker.tcp_address])
    assert status == 1
    assert "E_BAD_TOPIC" in err
    # the installed console script: usage errors are argparse's (status 2)
    p = subprocess.run([sys.executable, "-m", "actors.cli", "pub", "--topic", "t"],
                       capture_output=True, text=True, timeout=30, check=False)
    assert (p.returncode, p.stderr.strip()) == (
        1, "zmqnsq pub: --nsqd-tcp-address, --zmq-address or --lookupd-http-address required")
    p = subprocess.run([sys.executable, "-m", "actors.cli", "stat", "--topic", "t",
                        "--interval", "soon"], capture_output=True, text=True, timeout=30,
                       check=False)
    assert p.returncode == 2
    assert "not a duration" in p.stderr


def test_against_the_real_nsqd(tmp_path, processes):  # noqa: F811 - the fixture
    nsqd = nsq_binary("nsqd")
    tcp, http = free_port(), free_port()
    processes([nsqd, f"--data-path={tmp_path}", f"--tcp-address=127.0.0.1:{tcp}",
               f"--http-address=127.0.0.1:{http}"], tmp_path / "nsqd.log")
    wait_until(lambda: Http(f"127.0.0.1:{http}").up(), what="nsqd")
    Http(f"127.0.0.1:{http}").call("POST", "/topic/create?topic=t")
    Http(f"127.0.0.1:{http}").call("POST", "/channel/create?topic=t&channel=c")
    assert run(["pub", "--topic", "t", "--nsqd-tcp-address", f"127.0.0.1:{tcp}"],
               b"a\nb\nc\n")[0] == 0
    status, out, _ = run(["tail", "--topic", "t", "--channel", "c", "-n", "3",
                          "--nsqd-tcp-address", f"127.0.0.1:{tcp}"])
    assert (status, out) == (0, b"a\nb\nc\n")
    status, out, _ = run(["stat", "--topic", "t", "--channel", "c", "--count", "1",
                          "--interval", "100ms", "--nsqd-http-address", f"127.0.0.1:{http}"])
    assert status == 0
    assert out.decode().splitlines()[2].split()[-2:] == ["3", "0"]  # msgs, clients



def test_to_file_fins_only_what_is_on_disk_and_rotates(broker, tmp_path):
    import gzip
    import signal

    out = tmp_path / "archive"
    broker.topic_command("arch", "hello")
    broker.topic_command("arch", "create_channel", "nsq_to_file")
    p = subprocess.Popen([sys.executable, "-m", "actors.cli", "to-file", "--topic", "arch",
                          "--nsqd-tcp-address", broker.tcp_address, "--output-dir", str(out),
                          "--gzip", "--rotate-size", "40", "--sync-interval", "60s"],
                         stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _channel(broker, "arch", "nsq_to_file")["client_count"] == 1,
                 what="to-file subscribed")
        broker.publish("arch", [b"line%02d" % i for i in range(10)])
        # Given ten messages taken and written, with a sync not due for a minute,
        # then nothing is FINed yet: they are in flight
        wait_for(lambda: _channel(broker, "arch", "nsq_to_file")["in_flight_count"] == 10,
                 what="in flight")
        assert _channel(broker, "arch", "nsq_to_file")["depth"] == 0
    finally:
        p.send_signal(signal.SIGTERM)  # When it stops, it syncs, FINs and closes its files
        _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    wait_for(lambda: _channel(broker, "arch", "nsq_to_file")["in_flight_count"] == 0,
             what="all FINed")
    assert _channel(broker, "arch", "nsq_to_file")["depth"] == 0
    files = sorted(out.iterdir())
    assert all(f.name.startswith("arch.") and f.name.endswith(".log.gz") for f in files)
    lines = b"".join(gzip.decompress(f.read_bytes()) for f in files).split()
    assert sorted(lines) == [b"line%02d" % i for i in range(10)]


def test_archive_files_rotate_by_size_interval_and_datetime(tmp_path):
    args = cli._parser().parse_args([
        "to-file", "--topic", "t", "--nsqd-tcp-address", "x:1", "--output-dir", str(tmp_path),
        "--filename-format", "<TOPIC><REV>.<DATETIME>.log", "--datetime-format", "%H",
        "--rotate-size", "10", "--rotate-interval", "60s"])
    now = [3600.0 * 5]  # 05:00 UTC
    archive = cli.Archive(args, clock=lambda: now[0])
    archive.write([b"12345678"])  # 9 bytes: under the size
    archive.write([b"a"])  # 11 bytes now: the next write rotates
    archive.write([b"b"])
    now[0] += 61  # past the interval
    archive.write([b"c"])
    now[0] += 3600  # a new hour: a new <DATETIME>
    archive.write([b"d"])
    archive.sync()
    archive.close()
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ["t-1.05.log", "t-2.05.log", "t.05.log", "t.06.log"]
    assert (tmp_path / "t.05.log").read_bytes() == b"12345678\na\n"
    assert (tmp_path / "t-1.05.log").read_bytes() == b"b\n"
    assert (tmp_path / "t-2.05.log").read_bytes() == b"c\n"
    assert (tmp_path / "t.06.log").read_bytes() == b"d\n"


def test_ctl_is_actors_ctl(broker, capsys):
    assert cli.main(["ctl", "--data-path", broker.options.data_path, "ps"]) == 0
    out = capsys.readouterr().out
    assert "gateway" in out
    assert "worker-0" in out
