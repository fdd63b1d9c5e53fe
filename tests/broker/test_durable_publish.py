"""With --mem-queue-size=0 a publish is answered only once it is on disk (issue 6, part 1).

* the answer waits for every channel's disk-queue actor to confirm the write;
* with --sync-every=1 the write is also fsynced, and concurrent publishes share
  fsyncs (group commit);
* a full disk answers E_PUB_FAILED, loses nothing acknowledged, and publishing
  works again once space returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from actors.broker import Broker
from actors.broker.diskqueue import DqStats
from actors.runtime.errors import AskTimeout
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from transport.client import Producer

pytestmark = pytest.mark.timeout(120)


def _channel_depth(b: Broker, topic: str, channel: str) -> int:
    """The channel's depth; -1 while it (or its worker, restarting) does not answer."""
    try:
        stats = b.topic_stats(topic, timeout=2)
    except AskTimeout:  # an ask sent while the worker was down is lost with it
        return -1
    found = [c for c in stats["channels"] if c["channel_name"] == channel]
    return found[0]["depth"] if found else -1


def test_an_acknowledged_publish_survives_kill_9_of_its_worker_at_once(tmp_path):
    with Broker(broker_options(tmp_path / "data", mem_queue_size=0)) as b:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        wait_for(lambda: _channel_depth(b, "t", "c") == 0, what="channel")
        b.publish("t", [b"m%d" % i for i in range(100)])
        worker = next(p for p in b.supervisor.ps() if p.name == "worker-0")
        os.kill(worker.pid, signal.SIGKILL)  # right after the OK: nothing may be lost
        wait_for(lambda: _channel_depth(b, "t", "c") == 100, timeout=30,
                 what="every acknowledged message after the restart")


def test_with_sync_every_1_concurrent_publishes_share_fsyncs(tmp_path):
    with Broker(broker_options(tmp_path / "data", mem_queue_size=0, sync_every=1)) as b:
        b.topic_command("gc", "hello")
        b.topic_command("gc", "create_channel", "c")
        wait_for(lambda: _channel_depth(b, "gc", "c") == 0, what="channel")
        errors: list[Exception] = []

        def publisher() -> None:
            try:
                with Producer(b.zmq_endpoint, timeout=20) as p:
                    for i in range(25):
                        p.publish("gc", b"x%d" % i)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=publisher) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert _channel_depth(b, "gc", "c") == 300
        stats = b.supervisor.ask("diskqueue:gc/c", DqStats(), 10)
        # Every publish was fsynced before its OK, and fsyncs were shared.
        assert 1 <= stats["group_commits"] < 300
        assert stats["syncs"] >= stats["group_commits"]


def _ping(b: Broker) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{b.http_port}/ping",
                                    timeout=10) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        return e.read().decode()


def _metrics(b: Broker) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _http_pub(b: Broker, topic: str, body: bytes) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{b.http_port}/pub?topic={topic}",
                                 data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def small_disk(tmp_path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root (CI runs as root)")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_answers_pub_failed_and_publishing_resumes_when_space_returns(small_disk):
    data = small_disk / "data"
    with Broker(broker_options(data, mem_queue_size=0, max_bytes_per_file=64 * 1024)) as b:
        b.topic_command("full", "hello")
        b.topic_command("full", "create_channel", "c")
        wait_for(lambda: _channel_depth(b, "full", "c") == 0, what="channel")
        # Given a disk with little room left
        filler = small_disk / "filler"
        free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
        filler.write_bytes(b"\0" * max(0, free - 160 * 1024))
        # When publishing until the disk is full
        accepted, status = 0, 200
        for _ in range(1000):
            status = _http_pub(b, "full", b"y" * 1000)
            if status != 200:
                break
            accepted += 1
        assert status == 507  # Insufficient Storage, {"message":"DISK_FULL","detail":...}
        assert accepted > 0
        # Then /ping and /metrics say so, nothing acknowledged is lost, and publishing
        # works once space returns
        assert "disk full" in _ping(b)
        assert "\nnsq_disk_full 1\n" in _metrics(b)
        assert _channel_depth(b, "full", "c") == accepted
        filler.unlink()
        b.publish("full", [b"after"])  # through the broker's Python API, not the gateway
        assert _http_pub(b, "full", b"again") == 200
        assert _ping(b) == "OK"
        assert "\nnsq_disk_full 0\n" in _metrics(b)
        assert _channel_depth(b, "full", "c") == accepted + 2


def test_a_corrupt_chunk_found_at_start_is_skipped_and_the_rest_is_served(tmp_path):
    data = tmp_path / "data"
    opts = {"mem_queue_size": 0, "max_bytes_per_file": 4096}
    # Given a channel whose queue spans several chunk files
    with Broker(broker_options(data, **opts)) as b:
        b.topic_command("bad", "hello")
        b.topic_command("bad", "create_channel", "c")
        wait_for(lambda: _channel_depth(b, "bad", "c") == 0, what="channel")
        for i in range(60):
            b.publish("bad", [b"%03d" % i + b"." * 100])
    chunks = sorted(data.glob("bad:c.diskqueue.0*.dat"))
    assert len(chunks) >= 3
    # When a byte in the middle of the first chunk is flipped while the broker is down
    raw = bytearray(chunks[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunks[0].write_bytes(bytes(raw))
    # Then the broker starts, counts the damage, and serves every intact message
    with Broker(broker_options(data, **opts)) as b:
        got: set[bytes] = set()
        lock = threading.Lock()

        def handler(m) -> None:
            with lock:
                got.add(m.body)

        from transport.client import Consumer

        with Consumer("bad", "c", handler, b.zmq_endpoint, max_in_flight=100):
            wait_for(lambda: _channel_depth(b, "bad", "c") == 0 and len(got) > 0, timeout=30,
                     what="the intact messages")
            wait_for(lambda: b.topic_stats("bad")["channels"][0]["in_flight_count"] == 0,
                     what="all finished")
        stats = b.supervisor.ask("diskqueue:bad/c", DqStats(), 10)
        assert stats["corruptions"] >= 1
        lost = 60 - len(got)
        assert 0 < lost < 60
        assert got <= {b"%03d" % i + b"." * 100 for i in range(60)}
        assert {b"%03d" % i + b"." * 100 for i in range(45, 60)} <= got  # later chunks intact


@pytest.mark.parametrize("mem_queue_size", [0, 10_000])
def test_a_dpub_to_a_topic_without_channels_keeps_its_due_time_across_a_clean_restart(
        tmp_path, mem_queue_size):
    data = tmp_path / "data"
    opts = {"mem_queue_size": mem_queue_size}
    # Given a DPUB of an hour to a topic that has no channel yet
    with Broker(broker_options(data, **opts)) as b:
        b.publish("later", [b"in an hour"], defer_ms=3_600_000)
        assert b.topic_stats("later")["deferred_count"] == 1
    # When the broker restarts cleanly and a channel appears
    with Broker(broker_options(data, **opts)) as b:
        assert b.topic_stats("later")["deferred_count"] == 1
        b.topic_command("later", "create_channel", "c")
        # Then the channel holds it deferred (not ready), and the topic no more
        wait_for(lambda: b.topic_stats("later")["channels"]
                 and b.topic_stats("later")["channels"][0]["deferred_count"] == 1,
                 what="the deferred message on the channel")
        stats = b.topic_stats("later")
        assert stats["deferred_count"] == 0
        assert stats["channels"][0]["depth"] == 0
    # And after another restart it is the channel's, once (the topic let it go)
    with Broker(broker_options(data, **opts)) as b:
        stats = b.topic_stats("later")
        assert stats["deferred_count"] == 0
        assert [c["deferred_count"] for c in stats["channels"]] == [1]


def test_a_topic_created_after_start_flushes_its_memory_at_a_clean_stop(tmp_path):
    # (its disk-queue actor is created by the flush itself, while the node stops)
    data = tmp_path / "data"
    with Broker(broker_options(data)) as b:
        b.publish("fresh", [b"a", b"b"])
        assert b.topic_stats("fresh")["depth"] == 2
    with Broker(broker_options(data)) as b:
        assert b.topic_stats("fresh")["depth"] == 2
